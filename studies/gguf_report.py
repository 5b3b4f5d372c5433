"""The llama.cpp study's report: every GGUF file of its runs judged by llama.cpp (its val loss on train.py's
evaluation batches, its size), per size class the lowest file and every other one's paired difference
to it, the share of llama.cpp's imatrix loss each trained file removes (results.json, results.md), and
plots/gguf.png (studies.plots): bits per weight against the val loss over bf16, llama.cpp's quantizer as
one curve, the trained files as points and their lowest at each size as another curve.

A size class is a range of the block Linears' bits per weight (scales included) as measured in the
files. A trained file's reference is the best file a llama.cpp user can make of the same model in no more
bytes: of llama-quantize's files with the importance matrix (Q, K and IQ types and mixes), the one of
the lowest mean llama.cpp val loss among those whose block Linears hold no more bits per weight (the
files differ in their block Linears alone). The loss it "removes" is (L_ref - L_file) / (L_ref - L_F32)
per seed, L_F32 llama.cpp's val loss of the seed's F32 file (the unquantized model as llama.cpp computes
it, the same evaluation as every other figure): 1 is the unquantized model's loss or less, 0 llama.cpp's,
below 0 worse than llama.cpp. The same share over PyTorch's FP32 val loss of the trunk (train.py's) is
given beside it, and the two denominators per seed. "For a user" (for_a_user) puts it as a user decides: per
size, our lowest file against that best llama.cpp file, whether ours removes at least half of its loss (the
interval too), and our lowest file of 2.6-3.2 bits against llama-quantize's Q3_K_M paired by seed; the README
puts the studies' tables side by side (readme_table; `python -m studies --readme_table` prints it). Records
made before the F32 file's loss and each file's per-tensor types were kept (gguf.json) are reported as lacking
them.
"""
import json
import os

from studies.definitions import REPO, arm_label, run_name
from studies.exports import F32_SPEC, llama_cpp_files, sensitivity, trained_files
from studies.gguf_tensors import chosen_markdown, chosen_types, sensitivity_markdown, sensitivity_ranks
from studies.plots import plot_gguf
from studies.records import check_gguf_files
from studies.report import done_figures, markdown_head, own_step_s, results_head, write_results
from studies.stats import interval, lowest_first, paired, stats

# (label, lowest bits per weight, up to (not including)), on the study's GPT2 and Llama: Q8_0; Q5_K_M (5.8) and
# Q6_K (6.56); Q4_K_M (5.10, the Llama's 4.82); Q4_0, IQ4_NL and the other grids of 4.5 bits; IQ4_XS (4.25) with
# Q3_K_M (4.27, the Llama's 3.88: its Q4_K and Q5_K tensors are a larger share of a small model than of a large
# one); Q3_K, IQ3_S (3.44); IQ3_XXS (3.09, 3.02), Q2_K's mix (3.17, 2.94), IQ2_M (2.85, 2.70); Q2_K itself
# (2.63) and IQ2_XS (2.39, 2.34)
CLASSES = (("8.5", 7.0, 9.0), ("~5.5-6.6", 5.3, 7.0), ("~5.1", 4.75, 5.3), ("~4.5", 4.4, 4.75),
           ("~3.9-4.3", 3.7, 4.4), ("~3.4", 3.3, 3.7), ("~2.7-3.2", 2.65, 3.3), ("~2.3-2.6", 2.0, 2.65))


def size_class(bits):
    """The label of CLASSES that holds `bits` bits per weight, or None."""
    return next((label for label, lo, hi in CLASSES if lo <= bits < hi), None)


def gguf_runs(study, root):
    """{(arm index, seed): figures} of every done run, the finished ones' GGUF files measured ("files":
    {spec: record or why none})."""
    runs = {}
    for i, seed, a, run, fig in done_figures(study, root):
        if fig["status"] == "finished":
            run_dir = os.path.join(root, "runs", run_name(a, seed))
            fig["files"] = {**(llama_cpp_files(run_dir, a["llama_cpp"]) if a.get("llama_cpp") else {}),
                            **(trained_files(run_dir, a["gguf"]) if a.get("gguf") else {})}
            check_gguf_files(run_dir, fig["files"], run["config"].get("model_args", {}).get("vocab_size"))
            fig["f32"] = fig["files"].pop(F32_SPEC, None)  # a trunk's F32 file: its record, or why none
            if a.get("sensitivity"):
                fig["sensitivity"] = sensitivity(run_dir, a["sensitivity"]["step"], a["sensitivity"]["types"])
        first = a["overrides"]["pqt_start"] if a.get("trunk") else 0
        fig["trained_steps"] = a["overrides"]["max_iters"] - first
        fig["step_s"] = own_step_s(run, first)  # its own steps' time
        fig["train_min"] = fig["step_s"] * fig["trained_steps"] / 60 if fig["step_s"] is not None else None
        runs[i, seed] = fig
    return runs


def file_row(a, i, spec, trunk, runs):
    """The row of the GGUF file `spec` of arm a (index i): llama.cpp's val loss per seed, its size, its
    increase over the bf16 trunk's val loss of the same seed (train.py's); trunk: the trunk's index."""
    seeds = [s for s in a["seeds"] if runs.get((i, s), {}).get("status") == "finished"]
    done = {s: runs[i, s]["files"][spec] for s in seeds if isinstance(runs[i, s]["files"].get(spec), dict)}
    bf16 = {s: runs[trunk, s]["val_loss"] for s in a["seeds"] if runs.get((trunk, s), {}).get("status") == "finished"}
    f32 = {s: runs[trunk, s]["f32"]["val_loss_llama_cpp"] for s in bf16 if isinstance(runs[trunk, s]["f32"], dict)}
    llama = bool(a.get("llama_cpp"))
    bits = stats([f["block_bits_per_weight"] for f in done.values()])
    return {"arm": f"llama.cpp {spec}" if llama else a["kind"], "spec": spec, "llama_cpp": llama,
            "imatrix": llama and spec.endswith("+imatrix"), "settings": arm_label(a), "seeds": len(done),
            "seeds_total": len(a["seeds"]), "by_seed": {str(s): f["val_loss_llama_cpp"] for s, f in done.items()},
            "val_loss": stats([f["val_loss_llama_cpp"] for f in done.values()]),
            "bf16_by_seed": {str(s): v for s, v in bf16.items()},
            "increase_pct": stats([100 * (f["val_loss_llama_cpp"] / bf16[s] - 1)
                                   for s, f in done.items() if s in bf16]),
            "f32_by_seed": {str(s): v for s, v in f32.items()},
            "increase_f32_pct": stats([100 * (f["val_loss_llama_cpp"] / f32[s] - 1)
                                       for s, f in done.items() if s in f32]),
            "tensors_by_seed": {str(s): f.get("tensors") for s, f in done.items()},
            "by_seed_bits": {str(s): f["block_bits_per_weight"] for s, f in done.items()},
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


def seed_losses(r):
    """A row's llama.cpp val loss per seed."""
    return r["by_seed"]


def share_removed(r, ref, base="f32_by_seed"):
    """The share of ref's (llama.cpp's file's) loss that r removes, per seed (L_ref - L_r) / (L_ref - L_base),
    L_base the unquantized model's val loss of that seed: llama.cpp's of the F32 file (base "f32_by_seed") or
    PyTorch's of the trunk (train.py's, "bf16_by_seed"); with its 95 % interval over the seeds that have all
    three."""
    seeds = sorted(set(r["by_seed"]) & set(ref["by_seed"]) & set(ref[base]), key=int)
    return interval([(ref["by_seed"][s] - r["by_seed"][s]) / (ref["by_seed"][s] - ref[base][s]) for s in seeds])


def reference(r, refs):
    """The best file a llama.cpp user can make in no more bytes than r: of refs (llama-quantize's files with the
    importance matrix), the one of the lowest mean llama.cpp val loss among those whose block Linears hold no more
    bits per weight than r's; None where every one holds more."""
    fits = [q for q in refs if q["bits_per_weight"]["mean"] <= r["bits_per_weight"]["mean"] + 1e-9]
    return min(fits, key=lambda q: q["val_loss"]["mean"]) if fits else None


def gguf_findings(rows):
    """Per size class (CLASSES' order): its rows, lowest first (over the seeds they all have), each other's
    paired difference to the lowest; and for each trained file its reference (the best llama.cpp imatrix file of no more
    bytes, of any class) and the share of the reference's loss it removes, over llama.cpp's F32 file and
    over PyTorch's FP32 loss."""
    findings = []
    refs = [r for r in rows if r["imatrix"] and r["seeds"]]
    for label, _, _ in CLASSES:
        rs = lowest_first([r for r in rows if r["class"] == label and r["seeds"]], seed_losses)
        if not rs:
            continue
        others = []
        for r in rs[1:]:
            d, verdict = paired(r["by_seed"], rs[0]["by_seed"])
            others.append({"arm": r["arm"], "spec": r["spec"], "minus_best": d, "verdict": verdict})
        shares = []
        for r in (r for r in rs if not r["llama_cpp"]):
            ref = reference(r, refs)
            share = {"arm": r["arm"], "spec": r["spec"], "bits_per_weight": r["bits_per_weight"]["mean"],
                     "reference": None, "why": "every llama.cpp file with the importance matrix has more bytes"
                     if refs else "no llama.cpp file with the importance matrix measured yet"}
            if ref is not None:
                share.update(reference={"arm": ref["arm"], "val_loss": ref["val_loss"]["mean"],
                                        "bits_per_weight": ref["bits_per_weight"]["mean"]},
                             removed=share_removed(r, ref), removed_pytorch=share_removed(r, ref, "bf16_by_seed"),
                             f32_lacking=sorted(set(r["by_seed"]) & set(ref["by_seed"]) - set(ref["f32_by_seed"]),
                                                key=int))
            shares.append(share)
        best = rs[0]
        findings.append({"class": label,
                         "best": {"arm": best["arm"], "spec": best["spec"], "val_loss": best["val_loss"]["mean"],
                                  "bits_per_weight": best["bits_per_weight"]["mean"], "seeds": best["seeds"],
                                  "seeds_total": best["seeds_total"], "increase_pct": best["increase_pct"]["mean"],
                                  "increase_f32_pct": best["increase_f32_pct"]["mean"]},
                         "others": others, "shares": shares})
    return findings


# The bar a trained file is held to, as a user weighs it: it removes at least this share of the loss of the best
# llama.cpp file of no more bytes, with the 95 % interval's lower end at or above it too
GOAL_SHARE = 0.5
# A trained file this small (bits per weight of the block Linears) ...
SMALL = (2.6, 3.2)
# ... against llama-quantize's file of this type (with the importance matrix), its lead in more bytes
SMALL_VERSUS = "Q3_K_M+imatrix"


def for_a_user(rows):
    """What a user weighs at each size: per size class holding a trained file, the lowest trained file there
    (ours), the best llama.cpp file of no more bytes (reference()), both losses over llama.cpp's F32 file, the
    share of llama.cpp's loss ours removes (over the F32 file) and whether it meets GOAL_SHARE with its
    interval; then the lowest trained file of SMALL bits per weight against SMALL_VERSUS, paired by seed."""
    refs = [r for r in rows if r["imatrix"] and r["seeds"]]
    ours = [r for r in rows if not r["llama_cpp"] and r["seeds"]]
    sizes = []
    for label, _, _ in CLASSES:
        there = [r for r in ours if r["class"] == label]
        if not there:
            continue
        best = lowest_first(there, seed_losses)[0]
        ref = reference(best, refs)
        # llama.cpp's file over ours' seeds, so that a study half done compares like with like
        size = {"class": label, "ours": brief(best), "reference": brief(ref, best["by_seed"]) if ref else None}
        if ref is not None:  # goal_met None: no llama.cpp loss of the F32 file recorded, so no share over it
            share = share_removed(best, ref)
            met = None if not share["n"] else share["n"] > 1 and share["mean"] - share["ci95"] >= GOAL_SHARE
            size.update(removed=share, removed_pytorch=share_removed(best, ref, "bf16_by_seed"), goal_met=met)
        sizes.append(size)
    small = [r for r in ours if SMALL[0] <= r["bits_per_weight"]["mean"] <= SMALL[1]]
    versus = next((r for r in refs if r["spec"] == SMALL_VERSUS), None)
    lead = None
    if small and versus is not None:
        best = lowest_first(small, seed_losses)[0]
        d, verdict = paired(best["by_seed"], versus["by_seed"])
        lead = {"ours": brief(best), "versus": brief(versus, best["by_seed"]), "minus_versus": d, "verdict": verdict,
                "at_least_as_good": d["n"] > 0 and d["mean"] <= 0}
    return {"sizes": sizes, "small": lead}


def brief(r, seeds=None):
    """A row as the user's table names it: its file, settings, bits and llama.cpp loss, itself and over the F32
    file of the same seed, means over its seeds (over those of `seeds` it has, when given)."""
    seeds = sorted(set(r["by_seed"]) if seeds is None else set(r["by_seed"]) & set(seeds), key=int)
    over = stats([100 * (r["by_seed"][s] / r["f32_by_seed"][s] - 1) for s in seeds if s in r["f32_by_seed"]])
    return {"arm": r["arm"], "spec": r["spec"], "settings": r["settings"], "seeds": len(seeds),
            "bits_per_weight": r["bits_per_weight"]["mean"],
            "val_loss": stats([r["by_seed"][s] for s in seeds])["mean"], "increase_f32_pct": over["mean"]}


def for_a_user_markdown(user):
    """The user's table: per size, the best llama.cpp file of no more bytes and ours, both by llama.cpp."""
    if not user["sizes"]:
        return ["No trained file yet."]
    def file(b):
        over = "-" if b["increase_f32_pct"] is None else f"{b['increase_f32_pct']:+.2f} %"
        return f"{called(b['arm'], b['spec'])}, {b['bits_per_weight']:.2f} bits | {over}"
    lines = ["| size (bits/w) | best llama.cpp file of no more bytes | over F32 | ours | over F32 | "
             "share of llama.cpp's loss removed (95 %) | at least half |", "|---|---|---|---|---|---|---|"]
    for s in user["sizes"]:
        ref = file(s["reference"]) if s["reference"] else "none of no more bytes | -"
        share, met = "-", "-"
        if s["reference"] and s["removed"]["n"]:
            share, met = ci(s["removed"], 2), "yes" if s["goal_met"] else "no"
        elif s["reference"] and s["removed_pytorch"]["n"]:
            share = f"F32 not recorded; over bf16 {ci(s['removed_pytorch'], 2)}"
        lines.append(f"| {s['class']} | {ref} | {file(s['ours'])} | {share} | {met} |")
    lines += ["", "Over F32: the file's llama.cpp val loss over the F32 file's of the same seed, the mean over the "
              "seeds ours has finished, for both files. At least half: the share's 95 % interval lies at or above 0.5 "
              "(two seeds or more). Ours is made by the arm's settings (the arms list at the end), then "
              "`export.py --gguf=True` of its format."]
    lead = user["small"]
    if lead is not None:
        o, v, d = lead["ours"], lead["versus"], lead["minus_versus"]
        lines += ["", f"The lowest trained file of {SMALL[0]}-{SMALL[1]} bits per weight, "
                  f"{called(o['arm'], o['spec'])} at {o['bits_per_weight']:.2f} bits, minus llama.cpp {v['spec']} "
                  f"at {v['bits_per_weight']:.2f} bits: {ci(d)} in val loss, paired by seed, {d_verdict(lead)}."]
    return lines


# The README's table (readme_table): the studies it puts side by side, as (study, what was trained)
README_STUDIES = (("gguf_llama", "Llama, 8 tokens/param"), ("gguf", "GPT2, 8 tokens/param"),
                  ("gguf_short", "GPT2, 2 tokens/param"))


def readme_table(results):
    """The README's table of the llama.cpp studies as a user decides: per size class (CLASSES' order) and study
    (README_STUDIES' order), the best llama.cpp file of no more bytes and ours, both over llama.cpp's F32 file,
    the share ours removes; then our file of SMALL bits per weight against SMALL_VERSUS. `results`: {study:
    its results.json}. `python -m studies --readme_table` prints it from the committed records."""
    def short(b):
        if b["arm"].startswith("llama.cpp "):
            name = b["arm"].removeprefix("llama.cpp ")
        else:
            kinds = (("STE phase", "STE"), ("learned mix", "learned mix"), ("error mix", "error-ranked mix"))
            name = next((f"{k}, `{b['spec']}`" for p, k in kinds if b["arm"].startswith(p)),
                        called(b["arm"], b["spec"]))
        return f"{name}, {b['bits_per_weight']:.2f} bits"
    def pct(b):
        return "-" if b["increase_f32_pct"] is None else f"{b['increase_f32_pct']:+.2f} %"
    lines = ["| bits/w | model | best llama-quantize file of no more bytes | over F32 | ours | over F32 | "
             "its loss removed (95 %) |", "|---|---|---|---|---|---|---|"]
    for label, _, _ in CLASSES:
        for name, what in README_STUDIES:
            s = next((s for s in results[name]["for_a_user"]["sizes"] if s["class"] == label), None)
            if s is None or s["reference"] is None or not s["removed"]["n"]:
                continue
            lines.append(f"| {label} | {what} | {short(s['reference'])} | {pct(s['reference'])} | "
                         f"{short(s['ours'])} | {pct(s['ours'])} | {ci(s['removed'], 2)} |")
    small = []
    for name, what in README_STUDIES:
        lead = results[name]["for_a_user"]["small"]
        if lead is not None:
            o, v = lead["ours"], lead["versus"]
            small.append(f"{what}: {called(o['arm'], o['spec'])} at {o['bits_per_weight']:.2f} bits minus "
                         f"{v['spec']} at {v['bits_per_weight']:.2f} bits, {ci(lead['minus_versus'])}")
    if small:
        lines += ["", f"Our lowest file of {SMALL[0]}-{SMALL[1]} bits against llama-quantize's {SMALL_VERSUS} "
                  "(val loss, paired by seed): " + "; ".join(small) + "."]
    records = ", ".join(f"[{n}](studies/results/{n}/results.md) {results[n]['runs_finished']} of "
                        f"{results[n]['runs_total']} runs" for n, _ in README_STUDIES)
    return lines + ["", f"Records: {records}; `python -m studies --readme_table` prints this table from them."]


def d_verdict(lead):
    """What the small file's paired difference to SMALL_VERSUS says: at least as good in the mean, or not, and
    whether the seeds tell the two apart."""
    return ("at least as good in the mean" if lead["at_least_as_good"] else "worse in the mean") + \
        f", {lead['verdict']}"


def called(arm, spec):
    """How a file is named in the text: llama.cpp's by its spec, a trained arm with its file's format."""
    return arm if arm.startswith("llama.cpp") else f"{arm} ({spec})"


def ci(d, digits=4):
    """A paired mean with its 95 % interval and n, as the text gives it."""
    half = f" ± {d['ci95']:.{digits}f}" if d["ci95"] is not None else ""
    return f"{d['mean']:+.{digits}f}{half} (n={d['n']})"


def over(increase_pct, increase_f32_pct):
    """A file's loss over the unquantized model as the text gives it: over llama.cpp's F32 file where recorded,
    and over PyTorch's FP32 val loss (bf16, train.py's); a trained arm can finish before its trunk does."""
    if increase_pct is None:
        return "no finished bf16 trunk"
    f32 = "the F32 file's llama.cpp loss not recorded" if increase_f32_pct is None else \
        f"{increase_f32_pct:+.2f} % over the F32 file (llama.cpp)"
    return f"{f32}, {increase_pct:+.2f} % over bf16 (PyTorch)"


def share_text(s):
    """One trained file's share of its reference's loss removed, over llama.cpp's F32 file and over PyTorch's."""
    head = f"{called(s['arm'], s['spec'])} at {s['bits_per_weight']:.4f} bits"
    if not s["removed_pytorch"]["n"]:
        return f"{head} (no common seed)"
    lacking = s["f32_lacking"]
    f32 = ci(s["removed"], 2) if not lacking else \
        f"not recorded (no llama.cpp loss of the F32 file for seed{'s' * (len(lacking) > 1)} {', '.join(lacking)})"
    return f"{head}: over the F32 file {f32}, over bf16 {ci(s['removed_pytorch'], 2)}"


def findings_markdown(findings):
    lines = []
    for f in findings:
        b = f["best"]
        line = (f"- **{f['class']} bits per weight**: {called(b['arm'], b['spec'])} is lowest (llama.cpp val loss "
                f"{b['val_loss']:.4f}, {over(b['increase_pct'], b['increase_f32_pct'])}, {b['bits_per_weight']:.4f} "
                f"bits per weight, {b['seeds']} of {b['seeds_total']} seeds)")
        behind = [f"{called(o['arm'], o['spec'])} " + (ci(o["minus_best"]) + f", {o['verdict']}" if o["minus_best"]["n"]
                                                     else "(no common seed)") for o in f["others"]]
        lines.append(line + ("; then " + "; ".join(behind) if behind else "") + ".")
        for s in (s for s in f["shares"] if s["reference"] is None):
            lines.append(f"  {called(s['arm'], s['spec'])} at {s['bits_per_weight']:.4f} bits: {s['why']}.")
        for ref in dict.fromkeys(s["reference"]["arm"] for s in f["shares"] if s["reference"]):
            group = [s for s in f["shares"] if s["reference"] and s["reference"]["arm"] == ref]
            lines.append(f"  Share of the loss of {ref} ({group[0]['reference']['bits_per_weight']:.4f} bits per "
                         f"weight, the best llama.cpp file of no more bytes) removed: "
                         + "; ".join(share_text(s) for s in group) + ".")
    return lines


def unquantized_markdown(rows):
    """Per seed, the unquantized model's val loss by PyTorch (the trunk's, train.py's) and by llama.cpp (its F32
    file): the two denominators."""
    trunk = next((r for r in rows if r["llama_cpp"]), None)
    if trunk is None or not trunk["bf16_by_seed"]:
        return ["No finished bf16 trunk yet."]
    lines = ["| seed | bf16, PyTorch (train.py, FP32) | F32 file, llama.cpp | llama.cpp / PyTorch - 1 |",
             "|---|---|---|---|"]
    for seed, pytorch in trunk["bf16_by_seed"].items():
        llama = trunk["f32_by_seed"].get(seed)
        lines.append(f"| {seed} | {pytorch:.5f} | " + ("not recorded |  |" if llama is None else
                                                      f"{llama:.5f} | {100 * (llama / pytorch - 1):+.4f} % |"))
    return lines


def types_markdown(rows):
    """Each trained file's block Linears' types per seed (what a mix chose): how many of each and their bits,
    then, where they differ between tensors, each tensor's type per seed; 'not recorded' for records made
    before gguf.json kept them."""
    lines = []
    for r in (r for r in rows if not r["llama_cpp"] and r["seeds"]):
        by_seed = r["tensors_by_seed"]
        counts = []
        for seed, tensors in by_seed.items():
            if tensors is None:
                counts.append(f"seed {seed} not recorded")
                continue
            n = {}
            for t in tensors.values():
                n[t["type"]] = n.get(t["type"], 0) + 1
            counts.append(f"seed {seed} " + ", ".join(f"{k} x{v}" for k, v in sorted(n.items())) + f" "
                          f"({r['by_seed_bits'][seed]:.4f} bits per weight)")
        lines.append(f"- {called(r['arm'], r['spec'])}: " + "; ".join(counts) + ".")
        recorded = {seed: t for seed, t in by_seed.items() if t is not None}
        if len({t["type"] for ts in recorded.values() for t in ts.values()}) > 1:
            names = list(dict.fromkeys(name for ts in recorded.values() for name in ts))
            lines += ["", "  | tensor | " + " | ".join(f"seed {seed}" for seed in recorded) + " |",
                      "  |---|" + "---|" * len(recorded)]
            lines += [f"  | {name} | " + " | ".join(ts.get(name, {}).get("type", "-") for ts in recorded.values())
                      + " |" for name in names]
            lines.append("")
    return lines or ["No trained file yet."]


def cost(study, runs):
    """What the finished runs took, from their records: each trunk's median logged seconds a step (train.py's
    ms_per_iter), its steps at that rate, and its wall time (done.json: its segments, evaluations and
    checkpoints too); the phase runs' own steps each at its median step, summed (the files table's own train
    min), and the range of their median steps."""
    arms = study["arms"]
    done = {key: f for key, f in runs.items() if f["status"] == "finished" and f.get("step_s")}
    trunks = {str(s): {"step_s": f["step_s"], "train_h": f["train_min"] / 60, "wall_h": f["wall_s"] / 3600}
              for (i, s), f in sorted(done.items()) if not arms[i].get("trunk")}
    phases = [f for (i, _), f in done.items() if arms[i].get("trunk")]
    return {"trunks": trunks, "trunks_wall_h": sum(t["wall_h"] for t in trunks.values()), "phase_runs": len(phases),
            "phases_h": sum(f["train_min"] for f in phases) / 60,
            "phase_step_s": [min(f["step_s"] for f in phases), max(f["step_s"] for f in phases)] if phases else None}


def cost_markdown(c):
    if not c["trunks"]:
        return ["No finished trunk yet."]
    lines = [f"- bf16 trunk, seed {s}: {t['step_s']:.3f} s a step (the median of its logged steps), "
             f"{t['train_h']:.2f} h of steps, {t['wall_h']:.2f} h of wall time" for s, t in c["trunks"].items()]
    lines.append(f"- the trunks' wall time: {c['trunks_wall_h']:.1f} h")
    if c["phase_runs"]:
        lo, hi = c["phase_step_s"]
        lines.append(f"- the {c['phase_runs']} finished phase runs' own steps: {c['phases_h']:.1f} h "
                     f"({lo:.2f}-{hi:.2f} s a step, each run's median)")
    return lines


def missing_text(missing, width=200):
    """Why a file is missing, as the table gives it: the first reason, cut at `width` characters, and how many
    others (each seed's names its own run; results.json has them whole)."""
    if not missing:
        return ""
    first = missing[0] if len(missing[0]) <= width else missing[0][:width - 3] + "..."
    return first + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")


def row_markdown(r):
    def cell(s, digits=4, unit=""):
        if not s["n"]:
            return "-"
        return f"{s['mean']:.{digits}f}{unit}" + (f" ± {s['std']:.{digits}f}{unit}" if s["std"] is not None else "")
    seeds = f"{r['seeds']} of {r['seeds_total']}" + (f" (+{len(r['diverged'])} diverged)" if r["diverged"] else "")
    increase, f32 = (f"{r[k]['mean']:+.2f} %" if r[k]["n"] else "-" for k in ("increase_pct", "increase_f32_pct"))
    own = f"{r['train_min']['mean']:.1f} ({r['trained_steps']})" if r["train_min"]["n"] else "-"
    cells = [r["class"] or "-", r["arm"], r["spec"], seeds, cell(r["bits_per_weight"]),
             f"{r['bytes']['mean']:,.0f}" if r["bytes"]["n"] else "-", cell(r["val_loss"]), f32, increase, own,
             missing_text(r["missing"])]
    return "| " + " | ".join(cells) + " |"


def gguf_markdown(results):
    about = ("Every val loss is llama.cpp's, of the GGUF "
             "file, on train.py's fixed evaluation batches (export_gguf.py); F32 is llama.cpp's val loss of the "
             "trunk's F32 file of the same seed (the unquantized model, as llama.cpp computes it), bf16 the trunk's "
             "own val loss (train.py, PyTorch, FP32). Embeddings and head are BF16 in every file, so files differ by "
             "their block Linears; bits/w is theirs, scales included, as measured in the files. ± is the standard "
             "deviation over seeds; the paired differences and shares are means over seeds with their 95 % "
             "interval (Student's t; none for one seed). A trained arm forks from its seed's trunk and trains only "
             "its phase: its time is its own steps times its median logged time a step.")
    lines = markdown_head(results, about)
    lines += ["## What it says", "",
              "Per size class (bits per weight of the block Linears), the file with the lowest llama.cpp val loss "
              "(the mean over the seeds every file of the class has), then each other file's val loss minus that "
              "one's, paired by seed (inside the noise when the 95 % interval holds 0); and, for each trained file, "
              "the share of the loss of the best file a llama.cpp user can make in no more bytes (llama-quantize's "
              "with the importance matrix, Q, K or IQ, of the lowest mean val loss among those whose block Linears "
              "hold no more bits per weight) that it removes, (L_llama.cpp - L_file) / (L_llama.cpp - L_F32) per "
              "seed, and the same over PyTorch's loss, L_bf16 in place of L_F32 (1: all of it, 0: none, below 0: "
              "worse than llama.cpp):", "",
              *findings_markdown(results["findings"]), "",
              "## For a user: the best file of each size", "", *for_a_user_markdown(results["for_a_user"]), "",
              "## The unquantized model: the denominators", "", *unquantized_markdown(results["rows"]), "",
              "## The files", ""]
    head = ["class", "arm", "file", "seeds", "bits/w", "bytes", "llama.cpp val loss", "over F32", "over bf16",
            "own train min (steps)", "missing"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += [row_markdown(r) for r in results["rows"]]
    lines += ["", "## The types of each trained file's block Linears", "", *types_markdown(results["rows"])]
    lines += ["", "## What the mixes chose, tensor by tensor", "", *chosen_markdown(results["chosen"])]
    lines += ["", "## Which tensors a bit helps most", "",
              *sensitivity_markdown(results["sensitivity"], results["sensitivity_step"])]
    lines += ["", "## What the runs took (one core each, from their records)", "", *cost_markdown(results["cost"])]
    lines += ["", "Arms (their config and train.py overrides):", ""]
    lines += list(dict.fromkeys(f"- {r['arm'] if not r['llama_cpp'] else 'bf16 trunk'}: `{r['settings']}`"
                                for r in results["rows"]))
    lines += ["", "Plot: plots/gguf.png (llama.cpp val loss over each seed's bf16 model, mean and std over seeds, "
              "against the block Linears' bits per weight: llama.cpp's quantizer with and without the importance "
              "matrix as curves, the trained files as points, and the lowest trained file at each size, over the "
              "seeds the files of that size share, as a curve).", ""]
    return "\n".join(lines)


def write_gguf(name, study, root):
    """results.json, results.md and plots/gguf.png of the llama.cpp study under root/name; the paths written."""
    runs = gguf_runs(study, root)
    rows = gguf_rows(study, runs)
    bf16 = stats([f["val_loss"] for (i, _), f in runs.items() if not study["arms"][i].get("trunk")
                  and f["status"] == "finished"])
    trunk = next(a for a in study["arms"] if a.get("llama_cpp"))
    measured = {str(s): f["sensitivity"] for (i, s), f in sorted(runs.items()) if "sensitivity" in f}
    results = {**results_head(name, study, root, runs), "bf16": bf16, "rows": rows, "findings": gguf_findings(rows),
               "for_a_user": for_a_user(rows),
               "chosen": chosen_types(rows), "sensitivity": measured,
               "sensitivity_step": trunk.get("sensitivity", {}).get("step"),
               "sensitivity_ranks": sensitivity_ranks(measured), "cost": cost(study, runs)}
    out = os.path.join(root, name)
    written = write_results(out, results, gguf_markdown(results))
    if any(r["seeds"] for r in rows):
        written.append(plot_gguf(rows, os.path.join(out, "plots", "gguf.png")))
    return written


def committed_readme_table():
    """readme_table of the committed results of README_STUDIES (studies/results/NAME/results.json)."""
    results = {}
    for name, _ in README_STUDIES:
        with open(os.path.join(REPO, "studies", "results", name, "results.json")) as f:
            results[name] = json.load(f)
    return readme_table(results)
