"""The llama.cpp study's report: every GGUF file of its runs judged by llama.cpp (its val loss on train.py's
evaluation batches, its size), per size class the lowest file and every other one's paired difference
to it, the share of llama.cpp's imatrix loss each trained file removes (results.json, results.md), and
plots/gguf.png (studies.plots): bits per weight against the val loss over bf16, llama.cpp's quantizer as
one curve, the trained files as points and their lowest at each size as another curve.

A size class is a range of the block Linears' bits per weight (scales included) as measured in the
files; a trained file's reference is llama.cpp's imatrix file of its class nearest its size, and the
loss it "removes" is (L_ref - L_file) / (L_ref - L_bf16), per seed: 1 is the bf16 model's loss at the
reference's size or less, 0 llama.cpp's, below 0 worse than llama.cpp.
"""
import os
import statistics

from studies.definitions import arm_label, run_name
from studies.exports import llama_cpp_files, trained_files
from studies.plots import plot_gguf
from studies.records import check_gguf_files
from studies.report import done_run, results_head, run_figures, write_results
from studies.stats import interval, stats

# (label, lowest bits per weight, up to (not including)): Q8_0; Q4_K_M (5.10 on this model); Q4_0 and the
# other grids of 4.5 bits; Q3_K_M (4.27 on this model: its Q4_K and Q5_K tensors are a larger share of a
# small model than of a large one) with Q3_K (3.44); Q2_K's mix (3.17) with Q2_K itself (2.63)
CLASSES = (("8.5", 7.0, 9.0), ("~5.1", 4.75, 7.0), ("~4.5", 4.4, 4.75), ("~3.4-4.3", 3.3, 4.4), ("~2.6-3.2", 2.5, 3.3))


def size_class(bits):
    """The label of CLASSES that holds `bits` bits per weight, or None."""
    return next((label for label, lo, hi in CLASSES if lo <= bits < hi), None)


def gguf_runs(study, root):
    """{(arm index, seed): figures} of every done run, the finished ones' GGUF files measured ("files":
    {spec: record or why none})."""
    runs = {}
    for i, a in enumerate(study["arms"]):
        for seed in a["seeds"]:
            done, run = done_run(root, a, seed)
            if done is None:
                continue
            fig = run_figures(run, done)
            if done["status"] == "finished":
                run_dir = os.path.join(root, "runs", run_name(a, seed))
                fig["files"] = {**(llama_cpp_files(run_dir, a["llama_cpp"]) if a.get("llama_cpp") else {}),
                                **(trained_files(run_dir, a["gguf"]) if a.get("gguf") else {})}
                check_gguf_files(run_dir, fig["files"], run["config"].get("model_args", {}).get("vocab_size"))
            first = a["overrides"]["pqt_start"] if a.get("trunk") else 0
            fig["trained_steps"] = a["overrides"]["max_iters"] - first
            # its own steps' time: the median logged step time (robust to a runner paused on a shared
            # machine) times its steps, as the deployment study's
            ms = [r["ms_per_iter"] for r in run["logs"] if r["iter"] > first]
            fig["train_min"] = statistics.median(ms) * fig["trained_steps"] / 60e3 if ms else None
            runs[i, seed] = fig
    return runs


def file_row(a, i, spec, trunk, runs):
    """The row of the GGUF file `spec` of arm a (index i): llama.cpp's val loss per seed, its size, its
    increase over the bf16 trunk's val loss of the same seed (train.py's); trunk: the trunk's index."""
    seeds = [s for s in a["seeds"] if runs.get((i, s), {}).get("status") == "finished"]
    done = {s: runs[i, s]["files"][spec] for s in seeds if isinstance(runs[i, s]["files"].get(spec), dict)}
    bf16 = {s: runs[trunk, s]["val_loss"] for s in a["seeds"] if runs.get((trunk, s), {}).get("status") == "finished"}
    llama = bool(a.get("llama_cpp"))
    bits = stats([f["block_bits_per_weight"] for f in done.values()])
    return {"arm": f"llama.cpp {spec}" if llama else a["kind"], "spec": spec, "llama_cpp": llama,
            "imatrix": llama and spec.endswith("+imatrix"), "settings": arm_label(a), "seeds": len(done),
            "seeds_total": len(a["seeds"]), "by_seed": {str(s): f["val_loss_llama_cpp"] for s, f in done.items()},
            "val_loss": stats([f["val_loss_llama_cpp"] for f in done.values()]),
            "bf16_by_seed": {str(s): v for s, v in bf16.items()},
            "increase_pct": stats([100 * (f["val_loss_llama_cpp"] / bf16[s] - 1)
                                   for s, f in done.items() if s in bf16]),
            "bits_per_weight": bits, "bytes": stats([f["bytes"] for f in done.values()]),
            "class": size_class(bits["mean"]) if bits["n"] else None,
            "missing": sorted({runs[i, s]["files"].get(spec) or "not measured" for s in seeds if s not in done}),
            "diverged": [s for s in a["seeds"] if runs.get((i, s), {}).get("status") == "diverged"],
            "trained_steps": None if llama else runs[i, seeds[0]]["trained_steps"] if seeds else None,
            "train_min": stats([] if llama else [runs[i, s]["train_min"] for s in seeds
                                                 if runs[i, s]["train_min"] is not None])}


def gguf_rows(study, runs):
    """One row per (arm, GGUF file): llama-quantize's files of the trunk, then each trained arm's."""
    arms = study["arms"]
    index = {id(a): i for i, a in enumerate(arms)}
    rows = []
    for i, a in enumerate(arms):
        trunk = index[id(a["trunk"])] if a.get("trunk") else i
        rows += [file_row(a, i, spec, trunk, runs) for spec in [*a.get("llama_cpp", ()), *a.get("gguf", ())]]
    return rows


def paired(r, best):
    """r's val loss minus best's, paired by seed, with its 95 % interval and what it says."""
    seeds = sorted(set(r["by_seed"]) & set(best["by_seed"]), key=int)
    d = interval([r["by_seed"][s] - best["by_seed"][s] for s in seeds])
    verdict = ("one seed" if d["n"] == 1 else "no common seed" if not d["n"]
               else "inside the noise" if abs(d["mean"]) <= d["ci95"] else "outside the noise")
    return d, verdict


def share_removed(r, ref):
    """The share of ref's (llama.cpp's imatrix file's) loss over bf16 that r removes, per seed (L_ref -
    L_r) / (L_ref - L_bf16), L_bf16 the trunk's val loss of that seed; with its 95 % interval."""
    seeds = sorted(set(r["by_seed"]) & set(ref["by_seed"]) & set(ref["bf16_by_seed"]), key=int)
    return interval([(ref["by_seed"][s] - r["by_seed"][s]) / (ref["by_seed"][s] - ref["bf16_by_seed"][s])
                     for s in seeds])


def reference(r, refs):
    """llama.cpp's imatrix file of r's class nearest r in bits per weight (the larger of two as near): the
    file of llama-quantize that r is judged against."""
    return min(refs, key=lambda q: (abs(q["bits_per_weight"]["mean"] - r["bits_per_weight"]["mean"]),
                                    -q["bits_per_weight"]["mean"]))


def gguf_findings(rows):
    """Per size class (CLASSES' order): its rows by mean val loss, the lowest, each other's paired
    difference to it; and for each trained file llama.cpp's imatrix file of the class nearest its size (its
    reference) and the share of the reference's loss it removes."""
    findings = []
    for label, _, _ in CLASSES:
        rs = sorted((r for r in rows if r["class"] == label and r["seeds"]), key=lambda r: r["val_loss"]["mean"])
        if not rs:
            continue
        refs = [r for r in rs if r["imatrix"]]
        others = []
        for r in rs[1:]:
            d, verdict = paired(r, rs[0])
            others.append({"arm": r["arm"], "spec": r["spec"], "minus_best": d, "verdict": verdict})
        shares = []
        for r in (r for r in rs if refs and not r["llama_cpp"]):
            ref = reference(r, refs)
            shares.append({"arm": r["arm"], "spec": r["spec"], "bits_per_weight": r["bits_per_weight"]["mean"],
                           "reference": {"arm": ref["arm"], "val_loss": ref["val_loss"]["mean"],
                                         "bits_per_weight": ref["bits_per_weight"]["mean"]},
                           "removed": share_removed(r, ref)})
        best = rs[0]
        findings.append({"class": label,
                         "best": {"arm": best["arm"], "spec": best["spec"], "val_loss": best["val_loss"]["mean"],
                                  "bits_per_weight": best["bits_per_weight"]["mean"], "seeds": best["seeds"],
                                  "seeds_total": best["seeds_total"], "increase_pct": best["increase_pct"]["mean"]},
                         "others": others, "shares": shares})
    return findings


def called(arm, spec):
    """How a file is named in the text: llama.cpp's by its spec, a trained arm with its file's format."""
    return arm if arm.startswith("llama.cpp") else f"{arm} ({spec})"


def ci(d, digits=4):
    """A paired mean with its 95 % interval and n, as the text gives it."""
    half = f" ± {d['ci95']:.{digits}f}" if d["ci95"] is not None else ""
    return f"{d['mean']:+.{digits}f}{half} (n={d['n']})"


def findings_markdown(findings):
    lines = []
    for f in findings:
        b = f["best"]
        # a trained arm can finish before its trunk does: then there is no bf16 loss to compare with yet
        over = "no finished bf16 trunk" if b["increase_pct"] is None else f"{b['increase_pct']:+.2f} % over bf16"
        line = (f"- **{f['class']} bits per weight**: {called(b['arm'], b['spec'])} is lowest (llama.cpp val loss "
                f"{b['val_loss']:.4f}, {over}, {b['bits_per_weight']:.4f} bits per weight, {b['seeds']} of "
                f"{b['seeds_total']} seeds)")
        behind = [f"{called(o['arm'], o['spec'])} " + (ci(o["minus_best"]) + f", {o['verdict']}" if o["minus_best"]["n"]
                                                     else "(no common seed)") for o in f["others"]]
        lines.append(line + ("; then " + "; ".join(behind) if behind else "") + ".")
        for ref in dict.fromkeys(s["reference"]["arm"] for s in f["shares"]):
            group = [s for s in f["shares"] if s["reference"]["arm"] == ref]
            bits = group[0]["reference"]["bits_per_weight"]
            shares = [f"{called(s['arm'], s['spec'])} at {s['bits_per_weight']:.4f} bits"
                      + (" (more than llama.cpp's)" if s["bits_per_weight"] > bits + 1e-9 else "") + " "
                      + (ci(s["removed"], 2) if s["removed"]["n"] else "(no common seed)") for s in group]
            lines.append(f"  Share of {ref}'s loss over bf16 ({bits:.4f} bits per weight) removed: "
                         + "; ".join(shares) + ".")
    return lines


def row_markdown(r):
    def cell(s, digits=4, unit=""):
        if not s["n"]:
            return "-"
        return f"{s['mean']:.{digits}f}{unit}" + (f" ± {s['std']:.{digits}f}{unit}" if s["std"] is not None else "")
    seeds = f"{r['seeds']} of {r['seeds_total']}" + (f" (+{len(r['diverged'])} diverged)" if r["diverged"] else "")
    increase = f"{r['increase_pct']['mean']:+.2f} %" if r["increase_pct"]["n"] else "-"
    own = f"{r['train_min']['mean']:.1f} ({r['trained_steps']})" if r["train_min"]["n"] else "-"
    cells = [r["class"] or "-", r["arm"], r["spec"], seeds, cell(r["bits_per_weight"]),
             f"{r['bytes']['mean']:,.0f}" if r["bytes"]["n"] else "-", cell(r["val_loss"]), increase, own,
             "; ".join(r["missing"]) or ""]
    return "| " + " | ".join(cells) + " |"


def gguf_markdown(results):
    lines = [f"# {results['study']}: {results['about']}", "",
             f"Command: `{results['command']}`. Machine: {results['machine']}; torch "
             f"{', '.join(results['torch']) or '-'}; commits {', '.join(results['commits']) or '-'}. Runs finished: "
             f"{results['runs_finished']} of {results['runs_total']}. Every val loss is llama.cpp's, of the GGUF "
             "file, on train.py's fixed evaluation batches (export_gguf.py); bf16 is the trunk's own val loss "
             "(train.py, FP32) of the same seed. Embeddings and head are BF16 in every file, so files differ by "
             "their block Linears; bits/w is theirs, scales included, as measured in the files. ± is the standard "
             "deviation over seeds; the paired differences and shares are means over seeds with their 95 % "
             "interval (Student's t; none for one seed). A trained arm forks from its seed's trunk and trains only "
             "its phase: its time is its own steps times its median logged time a step.", "",
             "## What it says", "",
             "Per size class (bits per weight of the block Linears), the file with the lowest llama.cpp val loss, "
             "then each other file's val loss minus that one's, paired by seed (inside the noise when the 95 % "
             "interval holds 0); and the share of the loss over bf16 of llama.cpp's imatrix file nearest its "
             "size in the class that each trained file removes, (L_llama.cpp - L_file) / (L_llama.cpp - L_bf16) "
             "per seed (1: all of it, 0: none, below 0: worse than llama.cpp):", "", *findings_markdown(results["findings"]), "",
             "## The files", ""]
    head = ["class", "arm", "file", "seeds", "bits/w", "bytes", "llama.cpp val loss", "over bf16",
            "own train min (steps)", "missing"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += [row_markdown(r) for r in results["rows"]]
    lines += ["", "Arms (their train.py overrides of config/mini_gpt2_gguf.py):", ""]
    lines += list(dict.fromkeys(f"- {r['arm'] if not r['llama_cpp'] else 'bf16 trunk'}: `{r['settings']}`"
                                for r in results["rows"]))
    lines += ["", "Plot: plots/gguf.png (llama.cpp val loss over each seed's bf16 model, mean and std over seeds, "
              "against the block Linears' bits per weight: llama.cpp's quantizer with and without the importance "
              "matrix as curves, the trained files as points, and the lowest trained file at each size as a "
              "curve).", ""]
    return "\n".join(lines)


def write_gguf(name, study, root):
    """results.json, results.md and plots/gguf.png of the llama.cpp study under root/name; the paths written."""
    runs = gguf_runs(study, root)
    rows = gguf_rows(study, runs)
    bf16 = stats([f["val_loss"] for (i, _), f in runs.items() if not study["arms"][i].get("trunk")
                  and f["status"] == "finished"])
    results = {**results_head(name, study, root, runs), "bf16": bf16, "rows": rows, "findings": gguf_findings(rows)}
    out = os.path.join(root, name)
    written = write_results(out, results, gguf_markdown(results))
    if any(r["seeds"] for r in rows):
        written.append(plot_gguf(rows, os.path.join(out, "plots", "gguf.png")))
    return written
