"""The figures of training runs: loss against tokens (the paper's Fig. 1b, 3 and 4 layout), b_t, and
the loss paired with the bf16 run of the same seed; and the reader of a run's records.

    figures.make_plots(["out/run_a", "out/run_b"], "plots")   # what `python plot.py RUN...` draws
    figures.read_run("out/run_a")                              # config.json and metrics.jsonl, read

Each run is a train.py run directory (metrics.jsonl and config.json). Runs whose settings differ only
in their seed are one setting: drawn as the mean over seeds with a band from the lowest to the highest
seed. make_plots writes
    loss.png      train loss (the logged training loss, PQN on) and val loss (eval, PQN off)
                  against tokens, one line per setting, each in view however short its run (the
                  top of the axis may leave out only the first fifth of a line, the warmup's fall),
                  a marker at every evaluation;
    bitwidth.png  b_t mean (line) and min..max over all blocks (band) against tokens, for the
                  settings with PQT layers (not written when there are none);
    paired.png    val loss minus that of the bf16 run with the same settings and seed (the same
                  initial weights and batches, so the seed-to-seed spread cancels), against tokens,
                  for the PQT settings whose bf16 twin is among the runs (not written otherwise).
Legends name each setting's method, learning rate and optimizer (and whatever else differs);
the title names what all settings share. The b_t histograms per layer role of one checkpoint are
export.py's figure, not drawn here.
"""
import json
import math
import os

from checkpoint import METHOD_ONLY, NOT_TRAINING
from util import UserError

FIGSIZE, DPI = (12.0, 4.5), 100  # 1200 x 450 pixels
# Of what is not training (checkpoint.NOT_TRAINING), what still sets runs apart: how long they train
# and how they are evaluated.
MEASURE = {"max_iters", "eval_interval", "eval_iters"}
# config.json keys that do not change what a run computes (or only its seed): runs that differ only
# in these are seeds of one setting. The rest of what is not training (logging, files, where a run
# starts: a phase run forked from its bf16 trunk computes what the whole phase run computes), and
# where and how the same numbers are computed.
NOT_A_SETTING = (set(NOT_TRAINING) - MEASURE) | {"seed", "device", "compile", "parallel", "recompute_w_hat",
                                                 "world_size", "versions"}
# What only a quantized method reads, so that a bf16 run ignores it (checkpoint.METHOD_ONLY: the method,
# b_t's range, the phases, target formats and bit budget, b_i's decay, Eq. 12's lambda), less how w_hat
# is kept, which is not a setting.
PQT_ONLY = frozenset(METHOD_ONLY) - NOT_A_SETTING

NEEDED = ("method", "learning_rate", "optimizer", "b_init", "b_target", "bitwidth_weight_decay", "arch", "n_layer",
          "n_embd", "dataset", "max_iters", "batch_size", "block_size", "gradient_accumulation_steps")


class PlotError(UserError):
    """Bad input; the message is one line."""


def read_metrics(path, whole=False):
    """Eval and log records of a metrics.jsonl, each sorted by iter; for an iter logged twice (a run
    resumed from a checkpoint older than its last log line repeats those steps) the later one wins.
    A last line cut short (a run killed while writing it) is left out, or with whole (the records of a
    run that ended) a PlotError, as is any other line that is not a JSON record with an integer iter."""
    evals, logs = {}, {}
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except UnicodeDecodeError:
        raise PlotError(f"{path} is not a text file of JSON records (damaged?)") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            it = record["iter"]
            if not isinstance(it, int) or isinstance(it, bool):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            if n == len(lines) and not whole:  # a last line cut short by a killed run
                continue
            what = "is cut short" if n == len(lines) else "is not a JSON record with an integer 'iter'"
            raise PlotError(f"{path} line {n} {what}: {line[:80]!r}") from None
        if "val/loss" in record:
            evals[it] = record
        if "loss" in record:
            logs[it] = record
    return [evals[k] for k in sorted(evals)], [logs[k] for k in sorted(logs)]


def tokens_per_iter(config):
    """Tokens of one optimizer step: gradient_accumulation_steps counts the micro-steps of all
    processes, so this does not depend on the number of processes."""
    block_size = config.get("model_args", {}).get("block_size") or config["block_size"]
    return config["gradient_accumulation_steps"] * config["batch_size"] * block_size


def read_run(run_dir, whole=False):
    """{"dir", "config", "evals", "logs", "tokens_per_iter"} of a train.py run directory (whole: as
    read_metrics takes it)."""
    metrics, config_path = os.path.join(run_dir, "metrics.jsonl"), os.path.join(run_dir, "config.json")
    if not os.path.isfile(metrics):
        raise PlotError(f"{run_dir} has no metrics.jsonl: not a train.py run directory (or the run has not started)")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise PlotError(f"{config_path} is missing or unreadable ({type(e).__name__}); train.py writes it at the start "
                        f"of a run") from None
    lacking = [k for k in NEEDED if k not in config]
    if lacking:
        raise PlotError(f"{config_path} lacks {', '.join(lacking)}: not a config.json that train.py wrote")
    evals, logs = read_metrics(metrics, whole)
    if not evals and not logs:
        raise PlotError(f"{metrics} holds no records yet")
    return {"dir": run_dir, "config": config, "evals": evals, "logs": logs, "tokens_per_iter": tokens_per_iter(config)}


def setting(config):
    """What a run computes, less its seed: runs with equal settings are seeds of one setting."""
    return json.dumps({k: v for k, v in config.items() if k not in NOT_A_SETTING}, sort_keys=True)


def group_seeds(runs):
    """Runs grouped by setting, in the order the settings first appear."""
    groups = {}
    for run in runs:
        groups.setdefault(setting(run["config"]), []).append(run)
    return list(groups.values())


def describe(config):
    """The fields a reader looks for, as (key, text): method (with its layers), lr, optimizer, ..."""
    m = config.get("model_args", {})
    fields = {"method": config["method"], "learning_rate": f"lr {config['learning_rate']:g}",
              "optimizer": config["optimizer"]}
    if config["method"] != "bf16":
        fields["b"] = f"b_t {config['b_init']:g}→{config['b_target']:g}"
        fields["bitwidth_weight_decay"] = f"b_i decay {config['bitwidth_weight_decay']:g}"
    fields["model"] = (f"{m.get('arch', config['arch'])} {m.get('n_layer', config['n_layer'])} layers "
                       f"x {m.get('n_embd', config['n_embd'])}")
    fields["tokens"] = f"{config['max_iters'] * tokens_per_iter(config) / 1e6:.2f}M tokens"
    fields["dataset"] = os.path.basename(str(config["dataset"]).rstrip("/"))
    return fields


def labels(groups):
    """A legend label per group and a title: method, lr and optimizer always in the legend, with any
    other field that differs between groups; the fields all groups share go to the title."""
    described = [describe(g[0]["config"]) for g in groups]
    keys = list(dict.fromkeys(k for d in described for k in d))
    differ = {k for k in keys if len({d.get(k) for d in described}) > 1} | {"method", "learning_rate", "optimizer"}
    seeds = sorted({len(g) for g in groups})
    title = ", ".join(described[0][k] for k in keys if k not in differ)
    title += f"; {seeds[0]}{'-' + str(seeds[-1]) if len(seeds) > 1 else ''} seed{'s' if seeds != [1] else ''} per line"
    if seeds[-1] > 1:
        title += " (mean, band: min..max)"
    return [", ".join(d[k] for k in keys if k in differ and k in d) for d in described], title


def bf16_twin(config):
    """The setting of the bf16 run a run is paired with: the same, less what only PQT reads."""
    return setting({**{k: v for k, v in config.items() if k not in PQT_ONLY}, "method": "bf16"})


def paired_curves(groups, twin_runs=()):
    """[(group index, [{tokens: val loss - the bf16 twin's} per seed that has a twin])] for the PQT
    groups with at least one twin; points where both runs evaluated. Twins are the bf16 runs among
    the groups and twin_runs (bf16 runs to pair with that are not drawn themselves)."""
    twins = {}  # bf16 twin setting -> {seed: run}
    for group in [*groups, *group_seeds(list(twin_runs))]:
        if group[0]["config"]["method"] == "bf16":
            twins.setdefault(bf16_twin(group[0]["config"]), {}).update({r["config"]["seed"]: r for r in group})
    out = []
    for i, group in enumerate(groups):
        if group[0]["config"]["method"] == "bf16":
            continue
        by_seed = twins.get(bf16_twin(group[0]["config"]), {})
        curves = []
        for run in group:
            twin = by_seed.get(run["config"]["seed"])
            if twin is None:
                continue
            ref = {r["iter"]: r["val/loss"] for r in twin["evals"]}
            curves.append({r["iter"] * run["tokens_per_iter"]: r["val/loss"] - ref[r["iter"]]
                           for r in run["evals"] if r["iter"] in ref})
        if curves:
            out.append((i, curves))
    return out


def mean_band(curves):
    """{x: values} of several seeds -> xs, mean, lo, hi at every x where any seed has a value (a
    seed that stopped early, e.g. diverged, leaves the band where it stops)."""
    xs = sorted({x for c in curves for x in c})
    vals = [[c[x] for c in curves if x in c] for x in xs]
    return (xs, [sum(v) / len(v) for v in vals], [min(v) for v in vals], [max(v) for v in vals])


LINESTYLES = ("-", "--", ":", "-.")


def styles(groups):
    """(color, linestyle) per group: one color per method, one line style per other setting (e.g. the
    learning rate), so the method is read from the color across panels."""
    methods = list(dict.fromkeys(g[0]["config"]["method"] for g in groups))
    rest = [setting({k: v for k, v in g[0]["config"].items() if k != "method"}) for g in groups]
    others = list(dict.fromkeys(rest))
    return [(f"C{methods.index(g[0]['config']['method']) % 10}", LINESTYLES[others.index(r) % len(LINESTYLES)])
            for g, r in zip(groups, rest)]


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend; imported only when a plot is drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _tokens_axis(ax):
    import matplotlib.ticker
    ax.xaxis.set_major_formatter(matplotlib.ticker.EngFormatter())  # 200 k, 1 M
    ax.set_xlabel("tokens")


# What the two loss panels show. PQN (pseudo-quantization noise, Eq. 3) is on while a PQT run trains,
# so its logged training loss is that of the noisy weights w_hat; evaluation turns it off and scores
# the weights w themselves. A bf16 run has no PQN in either.
LOSS_PANELS = (("logs", "loss", "train loss (PQN on)",
                "train loss, PQN on: as logged, noise in the PQT layers' weights"),
               ("evals", "val/loss", "val loss (PQN off)", "val loss, PQN off: the weights w, no noise"))
EARLY = 0.2  # the share of a line's own tokens (the warmup's fall from about ln(vocab)) the y axis may leave out


def loss_ylim(lines):
    """(bottom, top) of a loss panel that shows every line: the top is the highest value of any line
    after the first EARLY of that line's own tokens, so a short run beside a long one stays in view
    (a limit from the longest run's tail would put the short run, still high, above the axes), while
    the first steps' loss (about ln(vocab)) does not flatten the part worth reading. lines: [(xs, ys)]."""
    values = [y for _, ys in lines for y in ys if math.isfinite(y)]
    if not values:
        return 0.0, 1.0
    late = [y for xs, ys in lines for x, y in zip(xs, ys) if x >= EARLY * xs[-1] and math.isfinite(y)]
    lo, hi = min(values), max(late or values)  # late is empty where every late value is NaN (a diverged run)
    pad = 0.06 * (hi - lo) + 1e-3
    return lo - pad, hi + pad


def plot_loss(groups, names, title, path):
    """loss.png: train and val loss against tokens, one line per setting (the mean over its seeds,
    with a band from the lowest to the highest seed). The x axis runs from 0 to the longest run's end,
    the y axis is loss_ylim's; val lines, a few evaluations each, have a marker at every point."""
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=FIGSIZE, dpi=DPI)
    for ax, (kind, key, ylabel, about) in zip(axes, LOSS_PANELS):
        lines = []  # (tokens, mean loss) of every line
        for (color, ls), group, name in zip(styles(groups), groups, names):
            curves = [{r["iter"] * run["tokens_per_iter"]: r[key] for r in run[kind]} for run in group]
            xs, mean, lo, hi = mean_band(curves)
            if not xs:
                continue
            marker = {"marker": "o", "ms": 3} if kind == "evals" else {}
            ax.plot(xs, mean, color=color, ls=ls, label=name, lw=1.4, **marker)
            if len(group) > 1:
                ax.fill_between(xs, lo, hi, color=color, alpha=0.2, lw=0)
            lines.append((xs, mean))
        ax.set_ylim(*loss_ylim(lines))
        ax.set_xlim(0, 1.02 * max((xs[-1] for xs, _ in lines), default=1) or 1)
        _tokens_axis(ax)
        ax.set_ylabel(ylabel)
        ax.set_title(about, fontsize=9)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_bitwidth(groups, names, title, path):
    plt = pyplot()

    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    for (color, ls), group, name in zip(styles(groups), groups, names):
        if not any("b_t/mean" in r for run in group for r in run["logs"]):
            continue
        per_stat = {}
        for stat in ("mean", "min", "max"):
            curves = [{r["iter"] * run["tokens_per_iter"]: r[f"b_t/{stat}"] for r in run["logs"] if f"b_t/{stat}" in r}
                      for run in group]
            per_stat[stat] = mean_band(curves)
        xs, mean, _, _ = per_stat["mean"]
        ax.plot(xs, mean, color=color, ls=ls, label=f"{name}: mean", lw=1.4)
        # the band: the lowest block's b_t (lowest over seeds) to the highest block's (highest over seeds)
        ax.fill_between(per_stat["min"][0], per_stat["min"][2], per_stat["max"][3], color=color, alpha=0.15, lw=0)
    _tokens_axis(ax)
    ax.set_ylabel("b_t (line: mean over blocks; band: min..max)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_paired(groups, pairs, names, title, path):
    """pairs: paired_curves(groups)."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    all_styles = styles(groups)
    for i, curves in pairs:
        (color, ls), n = all_styles[i], len(curves)
        xs, mean, lo, hi = mean_band(curves)
        ax.plot(xs, mean, color=color, ls=ls, lw=1.4, marker="o", ms=3,
                label=f"{names[i]} ({n} seed{'s' if n > 1 else ''})")
        if n > 1:
            ax.fill_between(xs, lo, hi, color=color, alpha=0.15, lw=0)
    ax.axhline(0.0, color="k", lw=0.8)
    _tokens_axis(ax)
    ax.set_ylabel("val loss − bf16's, same seed")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title + "; below 0: lower loss than bf16", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def make_plots(run_dirs, out, title_prefix="", twin_dirs=()):
    """Read the runs and write loss.png (bitwidth.png when a run has PQT, paired.png when a PQT run
    has its bf16 twin among run_dirs or twin_dirs) under `out`.
    Returns the paths written."""
    runs = [read_run(d) for d in run_dirs]
    groups = group_seeds(runs)
    names, title = labels(groups)
    title = f"{title_prefix}: {title}" if title_prefix else title
    os.makedirs(out, exist_ok=True)
    written = [os.path.join(out, "loss.png")]
    plot_loss(groups, names, title, written[0])
    if any("b_t/mean" in r for run in runs for r in run["logs"]):
        written.append(os.path.join(out, "bitwidth.png"))
        plot_bitwidth(groups, names, title, written[-1])
    pairs = paired_curves(groups, [read_run(d) for d in twin_dirs])
    if pairs:
        written.append(os.path.join(out, "paired.png"))
        plot_paired(groups, pairs, names, title, written[-1])
    return written
