"""The figures only the deployment and llama.cpp studies draw, from their reports' rows: the deployment
study's (studies.deploy_report) increase.png, the exported model's loss increase against tokens per
parameter, and pareto.png, the exported val loss against bits per weight; the llama.cpp study's
(studies.gguf_report) gguf.png, llama.cpp's val loss of each GGUF file against its bits per weight."""
import os

from figures import DPI, FIGSIZE, pyplot
from studies.stats import lowest_first

DEPLOY_MARKERS = "osD^vP*Xh<>p"


def deploy_panel(fmt):
    """What a format is deployed as, and the panel of increase.png it is drawn in: its own, or for a
    per-block mix its budget (every mix at one budget is one deployment question, whoever allocated it)."""
    return f"int2/3/4 mix at {fmt.partition('@')[2]} bits" if "@" in fmt else fmt


def plot_deploy(rows, out, longest):
    """The deployment study's two figures from deploy_report.deploy_rows: increase.png, the exported model's
    loss increase (%) against tokens per parameter, one panel per format (the mixes at one budget share
    one), one line per arm (log x, symlog y); pareto.png, at the longest length, exported val loss
    against bits per weight (mean over seeds, ± std as bars; log y, so that int2's PTQ does not
    flatten the rest). An arm has one colour and one marker in every panel of both. Returns the paths
    written."""
    plt = pyplot()
    done = [r for r in rows if r["seeds"]]
    arms = list(dict.fromkeys(r["arm"] for r in done))
    panels = list(dict.fromkeys(deploy_panel(r["format"]) for r in done))
    # tab10's ten distinct colours first (tab20 pairs would put two arms in near shades), Dark2's after
    colour = {a: plt.get_cmap("tab10")(i) if i < 10 else plt.get_cmap("Dark2")((i - 10) % 8)
              for i, a in enumerate(arms)}
    marker = {a: DEPLOY_MARKERS[i % len(DEPLOY_MARKERS)] for i, a in enumerate(arms)}
    lines = {}
    for r in done:
        lines.setdefault((deploy_panel(r["format"]), r["arm"], r["format"]), []).append(r)
    fig, axes = plt.subplots(1, len(panels), figsize=FIGSIZE, dpi=DPI, sharex=True, sharey=True, squeeze=False)
    for (panel, arm, fmt), rs in lines.items():
        rs = sorted(rs, key=lambda r: r["tokens_per_param"])
        label = f"{arm} ({fmt})" if "@" in fmt and " mix " not in arm else arm
        axes[0, panels.index(panel)].errorbar(
            [r["tokens_per_param"] for r in rs], [r["increase_pct"]["mean"] for r in rs],
            yerr=[r["increase_pct"]["std"] or 0 for r in rs], marker=marker[arm], color=colour[arm], ms=4,
            capsize=2, lw=1.2, ls=":" if label != arm else "-", label=label)
    for panel, ax in zip(panels, axes[0]):
        ax.set_xscale("log")
        ax.set_yscale("symlog", linthresh=1.0)  # linear within ±1 %, logarithmic past it: int2's +200 % beside +1 %
        ax.axhline(0.0, color="k", lw=0.8)
        ax.set_xlabel("tokens per parameter", fontsize=8)
        ax.set_title(panel, fontsize=9)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    axes[0, 0].set_ylabel("exported val loss over the bf16 run's (%, symlog)", fontsize=8)
    handles = {}
    for ax in axes[0]:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    fig.legend(handles.values(), handles.keys(), fontsize=7, loc="center right")
    fig.suptitle("deploy: the exported model's loss increase against training length, per format", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.82, 1))
    paths = [os.path.join(out, "increase.png"), os.path.join(out, "pareto.png")]
    fig.savefig(paths[0])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    labelled = set()
    for r in (r for r in done if r["steps"] == longest and r["bits_per_weight"]["n"]):
        ax.errorbar(r["bits_per_weight"]["mean"], r["exported"]["mean"], yerr=r["exported"]["std"] or 0,
                    marker=marker[r["arm"]], color=colour[r["arm"]], ms=6, capsize=2,
                    label=None if r["arm"] in labelled else r["arm"])
        labelled.add(r["arm"])
    ax.set_yscale("log")
    ax.set_xlabel("bits per weight of the quantized Linears (scales included)")
    ax.set_ylabel("exported val loss (log)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(f"deploy at {longest} steps: exported val loss against bits per weight", fontsize=10)
    fig.tight_layout()
    fig.savefig(paths[1])
    plt.close(fig)
    return paths


def gguf_curves(rows):
    """The curves of gguf.png from gguf_report.gguf_rows' files done: {name: [(bits per weight, mean
    increase over the seed's bf16 in %, its std over seeds, label), ...] by size}: llama-quantize with the
    importance matrix, without it, each trained arm kind's files, and "trained files, lowest at each
    size", the trained curve beside llama.cpp's: at each size the trained file whose increase is lowest in
    the mean over the seeds all files of that size have, as the report's tables rank them (a study half done
    has files of one seed beside files of three)."""
    curves, trained = {}, {}
    for r in (r for r in rows if r["increase_pct"]["n"]):  # done, and its seed's trunk too (the curves' zero)
        kind = ("llama-quantize with imatrix" if r["imatrix"] else "llama-quantize without imatrix" if r["llama_cpp"]
                else r["arm"].split(" at ")[0])
        inc = r["increase_pct"]
        point = (r["bits_per_weight"]["mean"], inc["mean"], inc["std"] or 0.0, r["spec"].removesuffix("+imatrix"))
        curves.setdefault(kind, []).append(point)
        if not r["llama_cpp"]:  # a mix lands a little under its budget: one size with the type it matches
            trained.setdefault(round(point[0], 1), []).append((r, point))
    curves = {kind: sorted(points) for kind, points in curves.items()}
    if trained:
        def increases(rp):
            r = rp[0]
            return {s: 100 * (v / r["bf16_by_seed"][s] - 1) for s, v in r["by_seed"].items() if s in r["bf16_by_seed"]}
        curves["trained files, lowest at each size"] = sorted(lowest_first(files, increases)[0][1]
                                                              for files in trained.values())
    return curves


def plot_gguf(rows, path):
    """gguf.png from gguf_report.gguf_rows: llama.cpp's val loss of each file over its seed's bf16 trunk's
    (mean over seeds, ± std as bars; pairing by seed removes the seeds' own spread, which is larger than
    the files' differences) against the bits per weight of its block Linears: gguf_curves' llama-quantize
    curves and trained curve as lines, each trained arm kind as points, each point named by its type or
    format. Returns path."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    curves = gguf_curves(rows)
    # the trained files' labels at one size, stacked in the order of their points: the lowest label lowest
    stack = {}
    for kind, points in curves.items():
        if not kind.startswith(("trained files", "llama-quantize")):
            for xi, yi, _, label in points:
                stack.setdefault(round(xi, 2), []).append((yi, label))
    rank = {(size, label): n - (len(ys) - 1) / 2
            for size, ys in stack.items() for n, (_, label) in enumerate(sorted(ys))}
    for k, (kind, points) in enumerate(curves.items()):
        x, y, err, labels = zip(*points)
        envelope, curve = kind.startswith("trained files"), kind.startswith("llama-quantize")
        ax.errorbar(x, y, yerr=None if envelope else err, marker=None if envelope else DEPLOY_MARKERS[k % 12],
                    color="k" if envelope else plt.get_cmap("tab10")(k % 10), ms=5, capsize=2,
                    lw=1.2 if curve or envelope else 0, ls="--" if "without" in kind else "-", label=kind,
                    alpha=0.6 if envelope else 1.0)
        # llama.cpp's types to the right of their points (the curve without the importance matrix has the
        # same ones), the trained files' to the left, stacked where several share a size
        for xi, yi, label in zip(x, y, labels) if not (envelope or "without" in kind) else ():
            offset = (4, 2) if curve else (-4, -2 + 7 * rank[(round(xi, 2), label)])
            ax.annotate(label, (xi, yi), fontsize=6, xytext=offset, textcoords="offset points",
                        ha="left" if curve else "right")
    ax.axhline(0.0, color="k", lw=0.8, ls=":", label="bf16 (train.py), each seed's own")
    ax.set_xlabel("bits per weight of the block Linears (scales included)")
    ax.set_ylabel("llama.cpp val loss over bf16 (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("gguf: llama.cpp's val loss of each file over its seed's bf16 model, against the file's size",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
