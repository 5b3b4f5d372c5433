"""The paper's comparisons at laptop scale: a named study runs its train.py runs and reports them.

    python study.py fig1b               # run (or continue) the study, then write its tables and plots
    python study.py fig1b --dry_run     # list its runs and the command of each
    python study.py fig1b --nproc=2     # each run on 2 processes (torchrun --standalone); same losses
    python study.py                     # list the studies

A study is a list of arms (a config file and --key=value overrides) times seeds. Each run is one
`python train.py CONFIG --key=value ... --seed=S --out_dir=out/study/runs/NAME`, its NAME made from
the config and the overrides, so an arm that two studies share (the bf16 run of Fig. 1b and of the
3-bit study) is trained once. Runs go one after another. A run is finished when its done.json
exists; train.py writes its checkpoint at every evaluation, and done.json is written only after
train.py exits 0 with its last evaluation at max_iters, so a run that was killed is resumed from
its last checkpoint (--init_from=resume: the same losses as an uninterrupted run), and a finished
one is skipped. A run whose loss turns NaN or Inf is recorded as diverged (at that step), not
retried: the same seed diverges again.

Results go to out/study/<study>/: results.json and results.md (final val loss mean ± std over
seeds, tokens, wall time, b_t, and the exported model's val loss where the study exports) and
plots/ (plot.py's loss.png, bitwidth.png and paired.png). Every figure is read from the runs' own files:
metrics.jsonl, config.json, and the export reports.
"""
import hashlib
import json
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time

import plot
from util import UserError, cli, write_atomic

REPO = os.path.dirname(os.path.abspath(__file__))
GPT2, LLAMA2 = "config/mini_gpt2.py", "config/mini_llama2.py"
HIGH_LR = 1e-2  # 5x the configs' 2e-3; our choice, to strain bf16 as the paper's unstable arm does
# At equal b_t, gaussws' R injects E[R²]/E[U²] times the noise variance of DiffQ's U(-1/2, 1/2)
# (E[U²] = 1/12). From Eq. 10: E[R²] = 4 Pr(|R|=2) + Pr(|R|=1) = 0.29215, 3.506x DiffQ's.
# The noise of Eq. 3 scales as 2^-b_t, its variance as 4^-b_t: DiffQ at b_t - log2(sqrt(3.506))
# = b_t - 0.905 injects the variance of gaussws at b_t.
_P2 = 0.75 * 2**-8  # Pr(|R| = 2), both signs
R_SQUARED = 4 * _P2 + 9 / 32 * (1 - _P2)
NOISE_BITS = round(0.5 * math.log2(R_SQUARED * 12), 3)  # 0.905


def arm(config, **overrides):
    """One setting of a study: a config file and --key=value overrides of it (not the seed)."""
    return {"config": config, "overrides": overrides}


BF16, BF16_HIGH = arm(GPT2, method="bf16"), arm(GPT2, method="bf16", learning_rate=HIGH_LR)
GAUSSWS, GAUSSWS_HIGH = arm(GPT2, method="gaussws[all]"), arm(GPT2, method="gaussws[all]", learning_rate=HIGH_LR)
DIFFQ, DIFFQ_HIGH = arm(GPT2, method="diffq[all]"), arm(GPT2, method="diffq[all]", learning_rate=HIGH_LR)
# The 3-bit regime: b_t = 2 + 4 b_i pulled toward b_target 2 by a b_i decay of 10: AdamW's decay
# alone (b_i *= 1 - lr * 10 a step, learning rates summing to about 0.22 over mini_gpt2.py's 200
# steps) leaves b_i near e^-2.2 = 0.11, b_t near 2.45 (measured: 2.47 [2.3, 2.7] over blocks, the
# loss's own gradient barely pushes back), where auto-int stores every block as int3 (ceil(b_t)).
# (config/cpu/gaussws_3bit.py: the same pull over 400 steps with a decay of 5.) Our choice.
LOW_BITS = dict(b_target=2.0, bitwidth_weight_decay=10.0)

STUDIES = {
    "fig1b": dict(
        about="Fig. 1b at laptop scale: bf16, gaussws[all] and diffq[all] at a comfortable lr (2e-3) and "
              "a high one (1e-2), from the same start (same seed) and the same batches",
        arms=[BF16, GAUSSWS, DIFFQ, BF16_HIGH, GAUSSWS_HIGH, DIFFQ_HIGH],
        seeds=(1, 2, 3), export=("auto", "mxfp6_e3m2"), export_bf16=False),
    "fig3a": dict(
        about="Fig. 3a at laptop scale: gaussws on one kind of layer at a time, b_target 0, at the high lr "
              "(where the paper looked for the source of bf16's instability)",
        arms=[BF16_HIGH] + [arm(GPT2, method=f"gaussws[{p}]", b_target=0.0, learning_rate=HIGH_LR)
                            for p in ("qkv", "out", "up", "down", "od")],
        seeds=(1,), export=("auto", "mxfp6_e3m2"), export_bf16=False),
    "fig3b": dict(
        about="Fig. 3b at laptop scale: Fig. 1b's high-lr arm with Adam-mini in place of AdamW",
        arms=[arm(GPT2, method=m, learning_rate=HIGH_LR, optimizer="adam_mini")
              for m in ("bf16", "gaussws[all]", "diffq[all]")],
        seeds=(1, 2, 3), export=("auto", "mxfp6_e3m2"), export_bf16=False),
    "fig4": dict(
        about="Fig. 4 at laptop scale: a small Llama2 with bf16, diffq[all] and gaussws[all]",
        arms=[arm(LLAMA2, method=m) for m in ("bf16", "diffq[all]", "gaussws[all]")],
        seeds=(1, 2, 3), export=("auto", "mxfp6_e3m2"), export_bf16=False),
    "3bit": dict(
        about="The 3-bit regime (beyond the paper): gaussws[all] and diffq[all] trained toward b_t <= 3, "
              "against the bf16 run quantized after training (PTQ), each exported at auto-int, int3 and mxfp4",
        arms=[BF16, arm(GPT2, method="gaussws[all]", **LOW_BITS), arm(GPT2, method="diffq[all]", **LOW_BITS)],
        seeds=(1, 2, 3), export=("auto-int", "int3", "mxfp4"), export_bf16=True),
    "noise": dict(
        about=f"DiffQ at an equal noise budget: diffq[all] with b_init and b_target lowered by "
              f"log2(sqrt(E[R²] * 12)) = {NOISE_BITS} bit, beside gaussws[all] and diffq[all] at equal b_t",
        arms=[GAUSSWS, DIFFQ, arm(GPT2, method="diffq[all]", b_init=round(6.0 - NOISE_BITS, 3),
                                                 b_target=round(4.0 - NOISE_BITS, 3))],
        seeds=(1, 2, 3), export=("auto", "mxfp6_e3m2"), export_bf16=False),
}

SHORT = {"method": "", "learning_rate": "lr", "optimizer": "", "b_init": "binit", "b_target": "btarget",
         "bitwidth_weight_decay": "bwd"}
DIVERGED = re.compile(r"loss is (nan|inf|-inf) at step (\d+)")  # train.py's message when the loss turns non-finite


class StudyError(UserError):
    """Bad input or a state the runner will not touch; the message is one line."""


def run_name(a, seed):
    """A directory name for one run, readable and unique for (config, overrides, seed)."""
    stem = os.path.basename(a["config"])[:-3].removeprefix("mini_")
    keys = sorted(a["overrides"], key=lambda k: (k != "method", k))
    value = {k: f"{v:g}" if isinstance(v, float) else str(v) for k, v in a["overrides"].items()}
    parts = [stem] + [SHORT.get(k, k) + value[k] for k in keys] + [f"s{seed}"]
    return re.sub(r"[^A-Za-z0-9.=+-]+", "_", "-".join(parts)).strip("_").replace("_-", "-")


def runs_of(study):
    """[(name, arm, seed)] of a study: every arm with every seed, arms first."""
    return [(run_name(a, s), a, s) for a in study["arms"] for s in study["seeds"]]


def train_args(a, seed, out_dir):
    """train.py's arguments for one run (without --init_from)."""
    return [a["config"], *(f"--{k}={v}" for k, v in a["overrides"].items()), f"--seed={seed}", f"--out_dir={out_dir}"]


def launcher(nproc):
    if nproc == 1:
        return [sys.executable, "train.py"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "train.py"]


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def write_json(path, obj):
    """Written whole or not at all: a reader never sees half a file."""
    write_atomic(path, json.dumps(obj, indent=1))


def file_sha(path):
    with open(os.path.join(REPO, path), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def git_commit():
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha or "unknown") + ("+uncommitted changes" if dirty else "")


def check_run_dir(run_dir, args, config):
    """run.json records what a run directory was made with; refuse one made with other settings."""
    record = read_json(os.path.join(run_dir, "run.json"))
    want = {"args": args, "config_sha": file_sha(config)}
    if record is not None and {k: record.get(k) for k in want} != want:
        what = "its config file has changed" if record.get("args") == args else "other arguments"
        raise StudyError(f"{run_dir} was made with {what} (see its run.json); move it away to run it again")
    return record or {**want, "attempts": []}


def train_one(name, a, seed, root, nproc, echo):
    """Run (or resume) one run to its end. Returns its done.json record, or None if train.py failed
    for another reason than a diverged loss (the run is then tried again on the next call)."""
    run_dir = os.path.join(root, "runs", name)
    args = train_args(a, seed, run_dir)
    os.makedirs(run_dir, exist_ok=True)
    record = check_run_dir(run_dir, args, a["config"])
    resume = os.path.exists(os.path.join(run_dir, "ckpt.pt"))
    if not resume and os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        os.remove(os.path.join(run_dir, "metrics.jsonl"))  # a start killed before its first checkpoint
    cmd = launcher(nproc) + args + [f"--init_from={'resume' if resume else 'scratch'}"]
    attempt = {"command": shlex.join(["python", *cmd[1:]]), "nproc": nproc, "commit": git_commit(),
               "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    t0, tail = time.time(), []
    with open(os.path.join(run_dir, "train.log"), "a") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            for line in proc.stdout:
                log.write(line)
                tail = (tail + [line.rstrip()])[-20:]
                if echo:
                    print("    " + line, end="", flush=True)
            rc = proc.wait()
        except BaseException:  # Ctrl-C or a kill of the runner: stop train.py too, keep the time it ran
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            record["attempts"].append({**attempt, "wall_s": time.time() - t0, "exit": "interrupted"})
            write_json(os.path.join(run_dir, "run.json"), record)
            raise
    record["attempts"].append({**attempt, "wall_s": time.time() - t0, "exit": rc})
    write_json(os.path.join(run_dir, "run.json"), record)
    wall_s = sum(x["wall_s"] for x in record["attempts"])
    diverged = next((m for m in map(DIVERGED.search, tail) if m), None)
    if rc == 0:
        run = plot.read_run(run_dir)
        if not run["evals"] or run["evals"][-1]["iter"] != run["config"]["max_iters"]:
            print(f"  {name}: train.py exited 0 without its evaluation at max_iters; see {run_dir}/train.log")
            return None
        done = {"status": "finished", "wall_s": wall_s}
    elif diverged:
        done = {"status": "diverged", "step": int(diverged.group(2)), "wall_s": wall_s}
    else:
        print(f"  {name}: train.py failed (exit {rc}): {tail[-1] if tail else ''}; see {run_dir}/train.log")
        return None
    write_json(os.path.join(run_dir, "done.json"), done)
    return done


def export_losses(run_dir, formats):
    """{format: val loss of the run's checkpoint exported at that format, or why there is none}.

    The one place that knows export.py's command line: `python export.py --out_dir=RUN
    --format=F1,F2 --json=True --save=False` prints one JSON object whose "exports" hold a record per
    format with its "val_loss" (on train.py's evaluation batches), "val_loss_unquantized" and
    "bits_per_weight". export.py also draws the b_t histograms per layer role of a PQT checkpoint
    (bitwidths.png in the run directory). Records are kept in the run directory (export.json), so
    each format is exported once. Without export.py: "export unavailable".
    """
    cache_path = os.path.join(run_dir, "export.json")
    cache = read_json(cache_path) or {}
    missing = [f for f in formats if f not in cache]
    if missing and not os.path.exists(os.path.join(REPO, "export.py")):
        return {f: cache.get(f, "export unavailable") for f in formats}
    if missing:
        cmd = [sys.executable, "export.py", f"--out_dir={run_dir}", f"--format={','.join(missing)}", "--json=True",
               "--save=False"]
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if r.returncode != 0:
            last = (r.stderr.strip() or r.stdout.strip() or "no output").splitlines()[-1]
            return {f: cache.get(f, f"export failed: {last}") for f in formats}
        try:
            records = {e["format"]: e for e in json.loads(r.stdout)["exports"]}
        except (ValueError, KeyError, TypeError) as e:
            return {f: cache.get(f, f"export.py's output is not the JSON expected ({type(e).__name__})") for f in formats}
        for f in missing:
            if not isinstance(records.get(f, {}).get("val_loss"), (int, float)):
                return {f: cache.get(f, f"export.py reported no val_loss for {f}") for f in formats}
            cache[f] = {k: records[f].get(k) for k in ("val_loss", "val_loss_unquantized", "bits_per_weight")}
        write_json(cache_path, cache)
    return {f: cache[f] for f in formats}


def stats(values):
    """mean, sample standard deviation (n - 1; None for one value), n."""
    n = len(values)
    if not n:
        return {"mean": None, "std": None, "n": 0, "values": []}
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else None
    return {"mean": mean, "std": std, "n": n, "values": values}


def run_figures(run_dir, done):
    """The figures of one run, from its own metrics.jsonl and config.json."""
    run = plot.read_run(run_dir)
    last_eval, last_log = run["evals"][-1], (run["logs"][-1] if run["logs"] else {})
    config = run["config"]
    train_s = 0.0  # training time logged by train.py: ms per step times the steps since the previous log line
    prev = 0
    for r in run["logs"]:
        train_s += r["ms_per_iter"] / 1000 * (r["iter"] - prev)
        prev = r["iter"]
    return {
        "status": done["status"], "diverged_at": done.get("step"),
        "iter": last_eval["iter"], "tokens": last_eval["iter"] * run["tokens_per_iter"],
        "val_loss": last_eval["val/loss"], "train_loss": last_eval["train/loss"],
        "wall_s": done["wall_s"], "train_s": train_s,
        "b_t": {k: last_log[f"b_t/{k}"] for k in ("mean", "min", "max")} if "b_t/mean" in last_log else None,
        "method": config["method"], "seed": config["seed"], "torch": config.get("versions", {}).get("torch"),
        "device": config.get("device"), "world_size": config.get("world_size"),
    }


def machine():
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical cores"


def reference_arm(a):
    """The bf16 arm an arm is paired with: the same config and overrides, method bf16 (None for a
    bf16 arm). With the same seed the two start from the same weights and see the same batches,
    so their difference per seed is free of the seed-to-seed spread."""
    if a["overrides"].get("method", "bf16") == "bf16":
        return None
    return arm(a["config"], **{**{k: v for k, v in a["overrides"].items() if k not in plot.PQT_ONLY}, "method": "bf16"})


def paired(entry, a, study, root, runs):
    """entry["vs_bf16"]: per seed, this arm's val loss (and exported val loss per format) minus its
    reference bf16 run's (exported at the same format: quantized after training), mean ± std over
    the seeds where both finished. The reference run is read from its directory whether or not it is
    one of this study's arms (it then has to have been run, e.g. by the study that has it)."""
    ref = reference_arm(a)
    if ref is None:
        return
    val, exports = [], {f: [] for f in study["export"]}
    for seed in study["seeds"]:
        mine, ref_name = runs.get(run_name(a, seed)), run_name(ref, seed)
        ref_dir = os.path.join(root, "runs", ref_name)
        done = read_json(os.path.join(ref_dir, "done.json"))
        if mine is None or mine["status"] != "finished" or not done or done["status"] != "finished":
            continue
        ref_val = (runs.get(ref_name) or run_figures(ref_dir, done))["val_loss"]  # read already if in this study
        val.append(mine["val_loss"] - ref_val)
        ref_export = read_json(os.path.join(ref_dir, "export.json")) or {}  # export_losses' cache
        for f in exports:
            e, r = mine.get("export", {}).get(f), ref_export.get(f)
            if isinstance(e, dict) and isinstance(r, dict):
                exports[f].append(e["val_loss"] - r["val_loss"])
    entry["vs_bf16"] = {"reference": arm_label(ref), "runs": [run_name(ref, s) for s in study["seeds"]],
                        "val_loss": stats(val), "export": {f: stats(v) for f, v in exports.items()}}


def summarize(name, study, root):
    """results.json's content: per run and per arm (mean ± std over seeds), from the runs' files."""
    runs, arms = {}, []
    for a in study["arms"]:
        names = [run_name(a, s) for s in study["seeds"]]
        figures = []
        for n in names:
            run_dir = os.path.join(root, "runs", n)
            done = read_json(os.path.join(run_dir, "done.json"))
            if done is None:
                continue
            runs[n] = fig = run_figures(run_dir, done)
            if study["export"] and (fig["method"] != "bf16" or study["export_bf16"]) and done["status"] == "finished":
                fig["export"] = export_losses(run_dir, study["export"])
                histogram = os.path.join(run_dir, "bitwidths.png")  # export.py's figure of a PQT run
                fig["b_t_histogram"] = histogram if os.path.exists(histogram) else None
            figures.append(fig)
        ok = [f for f in figures if f["status"] == "finished"]
        entry = {"config": a["config"], "overrides": a["overrides"], "runs": names, "finished": len(ok),
                 "diverged": [{"seed": f["seed"], "step": f["diverged_at"]} for f in figures if f["status"] == "diverged"],
                 "val_loss": stats([f["val_loss"] for f in ok]), "train_loss": stats([f["train_loss"] for f in ok]),
                 "tokens": sorted({f["tokens"] for f in ok}), "wall_s": stats([f["wall_s"] for f in figures]),
                 "b_t": {k: stats([f["b_t"][k] for f in ok if f["b_t"]]) for k in ("mean", "min", "max")}}
        if ok and "export" in ok[0]:
            entry["export"] = {}
            for fmt in study["export"]:
                done_ = [f["export"][fmt] for f in ok if isinstance(f["export"][fmt], dict)]
                # the increase over the unquantized loss export.py measured on the same batches
                # (train.py's last evaluation where export.py did not report it)
                increase = [100 * (e["val_loss"] / (e["val_loss_unquantized"] or f["val_loss"]) - 1)
                            for f, e in ((f, f["export"][fmt]) for f in ok) if isinstance(e, dict)]
                bits = [e["bits_per_weight"] for e in done_ if isinstance(e.get("bits_per_weight"), (int, float))]
                why = sorted({f["export"][fmt] for f in ok if not isinstance(f["export"][fmt], dict)})
                entry["export"][fmt] = {"val_loss": stats([e["val_loss"] for e in done_]),
                                        "increase_pct": stats(increase), "bits_per_weight": stats(bits), "missing": why}
        arms.append(entry)
    for entry, a in zip(arms, study["arms"]):  # after all arms: a reference's exports are then written
        paired(entry, a, study, root, runs)
    return {"study": name, "about": study["about"], "command": f"python study.py {name}", "seeds": list(study["seeds"]),
            "machine": machine(), "torch": sorted({f["torch"] for f in runs.values() if f["torch"]}),
            "devices": sorted({f"{f['device']} x{f['world_size']}" for f in runs.values()}),
            "commits": sorted({x["commit"] for n in runs for x in (read_json(os.path.join(root, "runs", n, "run.json")) or {}).get("attempts", [])}),
            "runs_finished": len(runs), "runs_total": len(runs_of(study)), "arms": arms, "runs": runs}


def fmt_stats(s, digits=4, pct=False, signed=False):
    if not s["n"]:
        return "-"
    unit = " %" if pct else ""
    mean = f"{s['mean']:+.{digits}f}" if pct or signed else f"{s['mean']:.{digits}f}"
    return mean + unit if s["std"] is None else f"{mean} ± {s['std']:.{digits}f}{unit}"


def arm_label(a):
    return " ".join([os.path.basename(a["config"])] + [f"{k}={v}" for k, v in a["overrides"].items()])


def markdown(results):
    """results.md: the table a README can take whole."""
    lines = [f"# {results['study']}: {results['about']}", "",
             f"Command: `{results['command']}`. Machine: {results['machine']}; device {', '.join(results['devices']) or '-'}; "
             f"torch {', '.join(results['torch']) or '-'}; commit {', '.join(results['commits']) or '-'}. "
             f"Runs finished: {results['runs_finished']} of {results['runs_total']}. Seeds {results['seeds']}; "
             f"± is the standard deviation over seeds (n - 1); losses are the last evaluation's (PQN off).", ""]
    export_formats = sorted({f for a in results["arms"] for f in a.get("export", {})},
                            key=lambda f: [f for a in results["arms"] for f in a.get("export", {})].index(f))
    head = ["arm", "seeds done", "val loss", "train loss", "tokens", "wall min/run", "b_t mean [min, max]"]
    head += [f"val loss at {f} (increase)" for f in export_formats]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for a in results["arms"]:
        seeds = f"{a['finished']}" + (f" (+{len(a['diverged'])} diverged at step " +
                                      ", ".join(str(d["step"]) for d in a["diverged"]) + ")" if a["diverged"] else "")
        b = a["b_t"]
        bits = "-" if not b["mean"]["n"] else f"{b['mean']['mean']:.2f} [{b['min']['mean']:.2f}, {b['max']['mean']:.2f}]"
        wall = "-" if not a["wall_s"]["n"] else f"{a['wall_s']['mean'] / 60:.1f}"
        row = [arm_label(a), seeds, fmt_stats(a["val_loss"]), fmt_stats(a["train_loss"]),
               ", ".join(f"{t:,}" for t in a["tokens"]) or "-", wall, bits]
        for f in export_formats:
            e = a.get("export", {}).get(f)
            if e is None:
                row.append("-")
            elif e["val_loss"]["n"]:
                bits = f", {e['bits_per_weight']['mean']:.2f} bits/w" if e["bits_per_weight"]["n"] else ""
                row.append(f"{fmt_stats(e['val_loss'])} ({fmt_stats(e['increase_pct'], 2, pct=True)}{bits})")
            else:
                row.append("; ".join(e["missing"]) or "-")
        lines.append("| " + " | ".join(row) + " |")
    pairs = [a for a in results["arms"] if a.get("vs_bf16")]
    if pairs:
        exported = [f for f in export_formats if any(a["vs_bf16"]["export"].get(f, {}).get("n") for a in pairs)]
        head = ["arm", "paired with", "seeds", "val loss − bf16's"]
        head += [f"exported at {f} − bf16 at {f}" for f in exported]
        lines += ["", "Paired by seed with the bf16 run of the same settings (same initial weights, same batches): "
                  "the difference of the final val losses (negative: lower than bf16's), and of the exported "
                  "models' (the bf16 run quantized after training), mean ± std over seeds.", "",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for a in pairs:
            v = a["vs_bf16"]
            row = [arm_label(a), v["reference"], str(v["val_loss"]["n"]), fmt_stats(v["val_loss"], signed=True)]
            row += [fmt_stats(v["export"][f], signed=True) if f in v["export"] else "-" for f in exported]
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", "b_t: the last log line's mean, min and max over all blocks, averaged over seeds. "
              "Increase: the exported model's val loss over the unquantized checkpoint's on the same batches "
              "(export.py), in %, mean ± std over seeds; bits/w: export.py's bits per quantized weight, scales included. "
              "Plots: plots/loss.png, plots/bitwidth.png, plots/paired.png; the b_t histograms per layer role of each exported PQT "
              "run: runs/<run>/bitwidths.png (export.py).", ""]
    return "\n".join(lines)


def write_results(name, study, root):
    out = os.path.join(root, name)
    os.makedirs(out, exist_ok=True)
    results = summarize(name, study, root)
    write_json(os.path.join(out, "results.json"), results)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(markdown(results))
    run_dirs = [os.path.join(root, "runs", n) for n in results["runs"]]
    # the bf16 runs the paired table used that are not this study's (the noise study's are fig1b's)
    twins = sorted({os.path.join(root, "runs", n) for a in results["arms"] if a.get("vs_bf16")
                    for n in a["vs_bf16"]["runs"] if n not in results["runs"]})
    twins = [d for d in twins if (read_json(os.path.join(d, "done.json")) or {}).get("status") == "finished"]
    written = plot.make_plots(run_dirs, os.path.join(out, "plots"), title_prefix=name, twin_dirs=twins) if run_dirs else []
    return [os.path.join(out, "results.json"), os.path.join(out, "results.md"), *written]


def run_study(name, study, root="out/study", nproc=1, echo=True):
    """Train every run of the study not yet done, then write its results. Returns the number of runs
    that failed (0 when all finished or diverged)."""
    todo = runs_of(study)
    failed, walls = 0, []
    for k, (run, a, seed) in enumerate(todo, 1):
        done = read_json(os.path.join(root, "runs", run, "done.json"))
        if done is not None:
            print(f"[{name}] run {k} of {len(todo)}: {run} already {done['status']}, skipped", flush=True)
            walls.append(done["wall_s"])
            continue
        left = len(todo) - k + 1
        eta = f"ETA {sum(walls) / len(walls) * left / 60:.0f} min" if walls else "ETA after the first run"
        resume = os.path.exists(os.path.join(root, "runs", run, "ckpt.pt"))
        print(f"[{name}] run {k} of {len(todo)}: {run}{' (resumed)' if resume else ''}, {eta}", flush=True)
        done = train_one(run, a, seed, root, nproc, echo)
        if done is None:
            failed += 1
        else:
            walls.append(done["wall_s"])
            print(f"[{name}] run {k} of {len(todo)}: {run} {done['status']} in {done['wall_s'] / 60:.1f} min", flush=True)
    for path in write_results(name, study, root):
        print(f"[{name}] wrote {path}")
    if failed:
        print(f"[{name}] {failed} run(s) failed; run the same command again to retry them")
    return failed


def parse(argv):
    names, opts = [], {"nproc": 1, "dry_run": False, "root": "out/study"}
    for arg in argv:
        if not arg.startswith("--"):
            names.append(arg)
            continue
        key, sep, value = arg[2:].partition("=")
        if key == "dry_run" and value in ("", "True", "False"):
            opts["dry_run"] = value != "False"
        elif key == "nproc" and sep and value.isdigit() and int(value) >= 1:
            opts["nproc"] = int(value)
        elif key == "root" and sep and value:
            opts["root"] = value
        else:
            raise StudyError(f"bad option {arg!r}; accepted: --nproc=N (N >= 1), --dry_run, --root=DIR")
    if len(names) > 1 or names and names[0] not in STUDIES:
        raise StudyError(f"{' '.join(names)!r} is not a study; usage: python study.py STUDY [--nproc=N] [--dry_run] "
                         f"[--root=DIR]; studies: {', '.join(STUDIES)}")
    return (names or [None])[0], opts


def main(argv):
    name, opts = parse(argv)
    if name is None:
        print("usage: python study.py STUDY [--nproc=N] [--dry_run] [--root=DIR]; the studies:")
        for n, study in STUDIES.items():
            print(f"  {n:6s} {len(runs_of(study)):3d} runs  {study['about']}")
        return 0
    study = STUDIES[name]
    # Config paths and train.py's out_dir are the repository's; --root may be given from anywhere.
    root = os.path.abspath(opts["root"])
    os.chdir(REPO)
    opts["root"] = root if os.path.relpath(root).startswith("..") else os.path.relpath(root)
    if opts["dry_run"]:
        todo = runs_of(study)
        print(f"{name}: {study['about']}\n{len(todo)} runs:")
        for k, (run, a, seed) in enumerate(todo, 1):
            run_dir = os.path.join(opts["root"], "runs", run)
            done = read_json(os.path.join(run_dir, "done.json"))
            state = done["status"] if done else "resume" if os.path.exists(os.path.join(run_dir, "ckpt.pt")) else "to run"
            print(f"{k:3d}. [{state}] {shlex.join(['python', *launcher(opts['nproc'])[1:], *train_args(a, seed, run_dir)])}")
        return 0
    return 1 if run_study(name, study, opts["root"], opts["nproc"]) else 0


if __name__ == "__main__":
    try:
        sys.exit(cli(main))
    except KeyboardInterrupt:
        print("\ninterrupted; run the same command again to resume", file=sys.stderr)
        sys.exit(130)
