"""A study's report from its runs' own files: results.json, results.md (final val loss mean ± std over
seeds, tokens, wall time, b_t, the exported model's val loss where the study exports, each PQT arm
paired by seed with its bf16 run) and plots/ (figures.make_plots: loss.png, bitwidth.png, paired.png).

Every figure is read from a run directory: metrics.jsonl and config.json (train.py's), done.json,
run.json and export.json (the runner's). A run is read only once its done.json says it is done, and
only where its records bear that out (records.read_done).
"""
import collections
import os
import statistics

import figures
from studies.definitions import arm_label, arm_steps, reference_arm, run_name, runs_of
from studies.exports import export_losses
from studies.records import read_done, read_json, write_json, write_text
from studies.stats import stats
from util import machine


def own_step_s(run, first):
    """A phase run's own time a step: the median of the logged step times after step `first` (robust to a
    runner paused on a shared machine, which done.json's wall_s counts), in seconds; None before any log."""
    ms = [r["ms_per_iter"] for r in run["logs"] if r["iter"] > first]
    return statistics.median(ms) / 1e3 if ms else None


def run_figures(run, done):
    """The figures of one run from its records (figures.read_run's, read_done checked) and done.json."""
    last_eval, last_log = run["evals"][-1], (run["logs"][-1] if run["logs"] else {})
    config = run["config"]
    train_s = 0.0  # training time logged by train.py: ms per step times the steps since the previous log line
    prev = 0
    for r in run["logs"]:
        train_s += r["ms_per_iter"] / 1000 * (r["iter"] - prev)
        prev = r["iter"]
    return {
        "status": done["status"], "diverged_at": done.get("step"), "diverged_what": done.get("what"),
        "iter": last_eval["iter"], "tokens": last_eval["iter"] * run["tokens_per_iter"],
        "val_loss": last_eval["val/loss"], "train_loss": last_eval["train/loss"],
        "wall_s": done["wall_s"], "train_s": train_s,
        "b_t": {k: last_log[f"b_t/{k}"] for k in ("mean", "min", "max")} if "b_t/mean" in last_log else None,
        "method": config["method"], "seed": config["seed"], "torch": config.get("versions", {}).get("torch"),
        "machine": machine_of(config.get("versions", {})),
        "device": config.get("device"), "world_size": config.get("world_size"),
    }


def machine_of(versions):
    """The machine a run's config.json records: the CPU's name and cores, with its family, model and
    stepping where recorded (two CPUs of one name may round otherwise: studies/README.md); None if none."""
    m = versions.get("machine")
    return f"{m} ({versions['cpu_id']})" if m and versions.get("cpu_id") else m


def done_run(root, a, seed):
    """(done.json, the run's checked records) of a run of arm a, or (None, None) where it is not done."""
    run_dir = os.path.join(root, "runs", run_name(a, seed))
    done = read_json(os.path.join(run_dir, "done.json"))
    if done is None:
        return None, None
    return done, read_done(run_dir, done, arm_steps(a)[1])


def done_figures(study, root):
    """(arm index, seed, arm, the run's records, its figures) of every done run of the study's arms."""
    for i, a in enumerate(study["arms"]):
        for seed in a["seeds"]:
            done, run = done_run(root, a, seed)
            if done is not None:
                yield i, seed, a, run, run_figures(run, done)


def machines(runs):
    """The machines the runs record (train.py's config.json), each with its count of runs; runs that
    record none (made before train.py recorded it) are said to be so, with the machine writing this."""
    runs = list(runs)
    recorded = collections.Counter(f["machine"] for f in runs if f.get("machine"))
    unrecorded = len(runs) - sum(recorded.values())
    parts = list(recorded)
    if len(recorded) != 1 or unrecorded:
        parts = [f"{m} ({n} run{'s' if n > 1 else ''})" for m, n in sorted(recorded.items())]
    if unrecorded:
        parts.append(f"not recorded by {unrecorded} run{'s' if unrecorded > 1 else ''} (this report was written on "
                     f"{machine()})")
    return "; ".join(parts) or machine()


def commits(root, names):
    """The commits the attempts of the runs `names` ran (run.json)."""
    return sorted({x["commit"] for n in names
                   for x in (read_json(os.path.join(root, "runs", n, "run.json")) or {}).get("attempts", [])})


def results_head(name, study, root, runs):
    """What every study's results.json opens with: the study, the command, machines, torch versions,
    commits and how many of its runs finished (runs: {key: a finished run's figures})."""
    names = [run_name(a, s) for a in study["arms"] for s in a.get("seeds", study["seeds"])]
    return {"study": name, "about": study["about"], "command": f"python -m studies {name}",
            "machine": machines(runs.values()), "torch": sorted({f["torch"] for f in runs.values() if f["torch"]}),
            "commits": commits(root, names), "runs_finished": len(runs), "runs_total": len(runs_of(study))}


def write_results(out, results, markdown):
    """results.json and results.md in out (plots/ made for the figures); the two paths."""
    os.makedirs(os.path.join(out, "plots"), exist_ok=True)
    write_json(os.path.join(out, "results.json"), results)
    write_text(os.path.join(out, "results.md"), markdown)
    return [os.path.join(out, "results.json"), os.path.join(out, "results.md")]


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
        if mine is None or mine["status"] != "finished":
            continue
        if ref_name in runs:  # read already: one of this study's runs
            ref_figures = runs[ref_name]
        else:
            done, run = done_run(root, ref, seed)
            ref_figures = run_figures(run, done) if done else None
        if not ref_figures or ref_figures["status"] != "finished":
            continue
        val.append(mine["val_loss"] - ref_figures["val_loss"])
        ref_export = read_json(os.path.join(root, "runs", ref_name, "export.json")) or {}  # export_losses' cache
        for f in exports:
            e, r = mine.get("export", {}).get(f), ref_export.get(f)
            if isinstance(e, dict) and isinstance(r, dict):
                exports[f].append(e["val_loss"] - r["val_loss"])
    entry["vs_bf16"] = {"reference": arm_label(ref), "runs": [run_name(ref, s) for s in study["seeds"]],
                        "val_loss": stats(val), "export": {f: stats(v) for f, v in exports.items()}}


def export_entry(study, ok):
    """An arm's exported val loss per format of the study: over its finished runs `ok` (figures)."""
    out = {}
    for fmt in study["export"]:
        done_ = [f["export"][fmt] for f in ok if isinstance(f["export"][fmt], dict)]
        # the increase over the unquantized loss export.py measured on the same batches
        # (train.py's last evaluation where export.py did not report it)
        increase = [100 * (e["val_loss"] / (e["val_loss_unquantized"] or f["val_loss"]) - 1)
                    for f, e in ((f, f["export"][fmt]) for f in ok) if isinstance(e, dict)]
        bits = [e["bits_per_weight"] for e in done_ if isinstance(e.get("bits_per_weight"), (int, float))]
        why = sorted({f["export"][fmt] for f in ok if not isinstance(f["export"][fmt], dict)})
        out[fmt] = {"val_loss": stats([e["val_loss"] for e in done_]), "increase_pct": stats(increase),
                    "bits_per_weight": stats(bits), "missing": why}
    return out


def arm_entry(a, study, root, runs):
    """results.json's entry of one arm, its runs' figures added to runs ({name: figures})."""
    names = [run_name(a, s) for s in study["seeds"]]
    found = []
    for n, seed in zip(names, study["seeds"]):
        done, run = done_run(root, a, seed)
        if done is None:
            continue
        runs[n] = fig = run_figures(run, done)
        if study["export"] and (fig["method"] != "bf16" or study["export_bf16"]) and done["status"] == "finished":
            run_dir = os.path.join(root, "runs", n)
            fig["export"] = export_losses(run_dir, study["export"])
            histogram = os.path.join(run_dir, "bitwidths.png")  # export.py's figure of a PQT run
            fig["b_t_histogram"] = histogram if os.path.exists(histogram) else None
        found.append(fig)
    ok = [f for f in found if f["status"] == "finished"]
    entry = {"config": a["config"], "overrides": a["overrides"], "runs": names, "finished": len(ok),
             "diverged": [{"seed": f["seed"], "step": f["diverged_at"], "what": f["diverged_what"]}
                          for f in found if f["status"] == "diverged"],
             "val_loss": stats([f["val_loss"] for f in ok]), "train_loss": stats([f["train_loss"] for f in ok]),
             "tokens": sorted({f["tokens"] for f in ok}), "wall_s": stats([f["wall_s"] for f in found]),
             "b_t": {k: stats([f["b_t"][k] for f in ok if f["b_t"]]) for k in ("mean", "min", "max")}}
    if ok and "export" in ok[0]:
        entry["export"] = export_entry(study, ok)
    return entry


def summarize(name, study, root):
    """results.json's content: per run and per arm (mean ± std over seeds), from the runs' files."""
    runs = {}
    arms = [arm_entry(a, study, root, runs) for a in study["arms"]]
    for entry, a in zip(arms, study["arms"]):  # after all arms: a reference's exports are then written
        paired(entry, a, study, root, runs)
    return {"study": name, "about": study["about"], "command": f"python -m studies {name}",
            "seeds": list(study["seeds"]), "machine": machines(runs.values()),
            "torch": sorted({f["torch"] for f in runs.values() if f["torch"]}),
            "devices": sorted({f"{f['device']} x{f['world_size']}" for f in runs.values()}),
            "commits": commits(root, runs), "runs_finished": len(runs), "runs_total": len(runs_of(study)),
            "arms": arms, "runs": runs}


def fmt_stats(s, digits=4, pct=False, signed=False):
    if not s["n"]:
        return "-"
    unit = " %" if pct else ""
    mean = f"{s['mean']:+.{digits}f}" if pct or signed else f"{s['mean']:.{digits}f}"
    return mean + unit if s["std"] is None else f"{mean} ± {s['std']:.{digits}f}{unit}"


def arm_row(a, export_formats):
    """The cells of one arm in results.md's first table."""
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
    return row


def paired_table(results, export_formats):
    """results.md's second table: each PQT arm minus its bf16 run of the same seed ([] where none)."""
    pairs = [a for a in results["arms"] if a.get("vs_bf16")]
    if not pairs:
        return []
    exported = [f for f in export_formats if any(a["vs_bf16"]["export"].get(f, {}).get("n") for a in pairs)]
    head = ["arm", "paired with", "seeds", "val loss − bf16's"]
    head += [f"exported at {f} − bf16 at {f}" for f in exported]
    lines = ["", "Paired by seed with the bf16 run of the same settings (same initial weights, same batches): "
             "the difference of the final val losses (negative: lower than bf16's), and of the exported "
             "models' (the bf16 run quantized after training), mean ± std over seeds.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for a in pairs:
        v = a["vs_bf16"]
        row = [arm_label(a), v["reference"], str(v["val_loss"]["n"]), fmt_stats(v["val_loss"], signed=True)]
        row += [fmt_stats(v["export"][f], signed=True) if f in v["export"] else "-" for f in exported]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def markdown_head(results, about):
    """A results.md's title and its first paragraph: where its figures come from (results_head's fields, the
    devices where the study records them), then `about`, what its figures mean."""
    devices = f"; device {', '.join(results['devices']) or '-'}" if "devices" in results else ""
    return [f"# {results['study']}: {results['about']}", "",
            f"Command: `{results['command']}`. Machine: {results['machine']}{devices}; torch "
            f"{', '.join(results['torch']) or '-'}; commits {', '.join(results['commits']) or '-'}. Runs finished: "
            f"{results['runs_finished']} of {results['runs_total']}. {about}", ""]


def markdown(results):
    """results.md: the table a README can take whole."""
    lines = markdown_head(results, f"Seeds {results['seeds']}; ± is the standard deviation over seeds (n - 1); "
                                   "losses are the last evaluation's (PQN off).")
    export_formats = list(dict.fromkeys(f for a in results["arms"] for f in a.get("export", {})))
    head = ["arm", "seeds done", "val loss", "train loss", "tokens", "wall min/run", "b_t mean [min, max]"]
    head += [f"val loss at {f} (increase)" for f in export_formats]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(arm_row(a, export_formats)) + " |" for a in results["arms"]]
    lines += paired_table(results, export_formats)
    lines += ["", "b_t: the last log line's mean, min and max over all blocks, averaged over seeds. "
              "Increase: the exported model's val loss over the unquantized checkpoint's on the same batches "
              "(export.py), in %, mean ± std over seeds; bits/w: export.py's bits per quantized weight, scales "
              "included. Plots: plots/loss.png, plots/bitwidth.png, plots/paired.png; the b_t histograms per layer "
              "role of each exported PQT run: runs/<run>/bitwidths.png (export.py).", ""]
    return "\n".join(lines)


def write_report(name, study, root):
    """results.json, results.md and plots/ of a study under root/name; the paths written."""
    results = summarize(name, study, root)
    out = os.path.join(root, name)
    os.makedirs(out, exist_ok=True)
    write_json(os.path.join(out, "results.json"), results)
    write_text(os.path.join(out, "results.md"), markdown(results))
    run_dirs = [os.path.join(root, "runs", n) for n in results["runs"]]
    # the bf16 runs the paired table used that are not this study's (the noise study's are fig1b's)
    twins = sorted({os.path.join(root, "runs", n) for a in results["arms"] if a.get("vs_bf16")
                    for n in a["vs_bf16"]["runs"] if n not in results["runs"]})
    twins = [d for d in twins if (read_json(os.path.join(d, "done.json")) or {}).get("status") == "finished"]
    written = figures.make_plots(run_dirs, os.path.join(out, "plots"), title_prefix=name, twin_dirs=twins) \
        if run_dirs else []
    return [os.path.join(out, "results.json"), os.path.join(out, "results.md"), *written]
