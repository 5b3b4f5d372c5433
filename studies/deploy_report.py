"""The deployment study's report: per arm and deployment format the exported model's val loss, its
increase over the bf16 run's of the same length and seed, the paired differences to PTQ, to uniform
STE and to the error-ranked mix, and per length and format the lowest arm with each other arm's paired
gap (results.json, results.md), and plots/increase.png, plots/pareto.png (studies.plots)."""
import os

from studies.definitions import BUDGET, MIX_PHASE, PHASE, arm_label, run_name
from studies.exports import export_losses
from studies.plots import deploy_panel, plot_deploy
from studies.report import done_figures, fmt_stats, markdown_head, own_step_s, results_head, write_results
from studies.stats import interval, lowest_first, paired, stats


def parameters(config):
    """The model's parameter count (embeddings included), built on the meta device from config.json."""
    import torch
    from model import GPT, ModelConfig
    with torch.device("meta"):
        return GPT(ModelConfig(**config["model_args"])).get_num_params(non_embedding=False)


def deploy_runs(study, root):
    """{(arm index, seed): figures} of every done deployment run, the finished ones' exports measured."""
    runs = {}
    for i, seed, a, run, fig in done_figures(study, root):
        if fig["status"] == "finished":
            fig["export"] = export_losses(os.path.join(root, "runs", run_name(a, seed)), a["export"])
            fig["params"] = parameters(run["config"])
        first = a["overrides"].get("pqt_start", 0) if a.get("trunk") else 0  # earlier records: the trunk's
        fig["trained_steps"] = a["steps"] - first
        step_s = own_step_s(run, first)  # its own steps' time
        fig["train_min"] = step_s * fig["trained_steps"] / 60 if step_s is not None else None
        runs[i, seed] = fig
    return runs


def deploy_row(a, i, fmt, trunk, runs):
    """The row of arm a (index i) exported at fmt, without its paired differences; trunk: the index of
    its length's bf16 run."""
    done = [(s, runs[i, s]) for s in a["seeds"] if runs.get((i, s), {}).get("status") == "finished"
            and isinstance(runs[i, s]["export"].get(fmt), dict)]
    return {"arm": a["kind"], "steps": a["steps"], "format": fmt, "settings": arm_label(a), "seeds": len(done),
            "diverged": [s for s in a["seeds"] if runs.get((i, s), {}).get("status") == "diverged"],
            "tokens_per_param": done[0][1]["tokens"] / done[0][1]["params"] if done else None,
            "val_loss": stats([f["val_loss"] for _, f in done]),
            "exported": stats([f["export"][fmt]["val_loss"] for _, f in done]),
            "exported_by_seed": {str(s): f["export"][fmt]["val_loss"] for s, f in done},
            "bits_per_weight": stats([f["export"][fmt]["bits_per_weight"] for _, f in done
                                      if isinstance(f["export"][fmt].get("bits_per_weight"), (int, float))]),
            # over the bf16 run of the same length and seed: what the format costs the model one
            # would otherwise have (an STE run's own unquantized loss is of weights it never uses)
            "increase_pct": stats([100 * (f["export"][fmt]["val_loss"] / runs[trunk, s]["val_loss"] - 1)
                                   for s, f in done if runs.get((trunk, s), {}).get("status") == "finished"]),
            "wall_min": stats([f["wall_s"] / 60 for _, f in done]),
            "train_min": stats([f["train_min"] for _, f in done if f["train_min"] is not None]),
            "trained_steps": done[0][1]["trained_steps"] if done else None}, done


def deploy_rows(study, runs):
    """One row per (arm, exported format): the unquantized and exported val loss, the increase of the
    exported loss over the bf16 run's (same length and seed), and the
    exported loss minus PTQ's (the trunk exported at the same format, or at the same budget by each
    block's own error for the learned mix) and, for the mixes, minus uniform STE int3's and int4's (the
    formats their budget lies between), and for the learned mix minus the error-ranked mix's (the same
    budget allocated by each block's own error, then finished by STE), paired by seed."""
    arms = study["arms"]
    index = {id(a): i for i, a in enumerate(arms)}
    ste = {(a["steps"], a["format"]): i for i, a in enumerate(arms) if a["kind"] == "STE phase"}
    error_mix = {a["steps"]: i for i, a in enumerate(arms) if a["kind"] == f"error mix {BUDGET:g} bits"}
    rows = []
    for i, a in enumerate(arms):
        trunk = index[id(a["trunk"])] if a.get("trunk") else next(
            j for j, b in enumerate(arms) if b["kind"] == "bf16 + PTQ" and b["steps"] == a["steps"])
        for fmt in a["export"]:
            row, done = deploy_row(a, i, fmt, trunk, runs)
            ptq = fmt if fmt in arms[trunk]["export"] else f"error-int@{BUDGET:g}"
            mix, learned = fmt.startswith(("auto-int", "error-int")), fmt.startswith("auto-int")
            for key, j, other in (("vs_ptq", trunk, ptq), ("vs_ste_int3", ste.get((a["steps"], "int3")), "int3"),
                                  ("vs_ste_int4", ste.get((a["steps"], "int4")), "int4"),
                                  ("vs_error_mix", error_mix.get(a["steps"]) if learned else None,
                                   f"error-int@{BUDGET:g}")):
                if j is None or j == i or (key != "vs_ptq" and not mix):
                    continue
                diffs = [f["export"][fmt]["val_loss"] - runs[j, s]["export"][other]["val_loss"] for s, f in done
                         if isinstance(runs.get((j, s), {}).get("export", {}).get(other), dict)]
                row[key] = {"against": f"{arms[j]['kind']} at {other}", **interval(diffs)}
            rows.append(row)
    return rows


def deploy_findings(rows):
    """Per length and deployment format, longest length first: the arm whose exported model has the
    lowest mean val loss, and each other arm's exported loss minus the winner's, paired by seed, with
    whether its 95 % interval holds 0 (inside the noise)."""
    groups = {}
    for r in rows:
        if r["seeds"]:
            groups.setdefault((r["steps"], deploy_panel(r["format"])), []).append(r)
    findings = []
    for (steps, group), rs in sorted(groups.items(), key=lambda kv: -kv[0][0]):
        rs = lowest_first(rs, lambda r: r["exported_by_seed"])
        best, others = rs[0], []
        for r in rs[1:]:
            d, verdict = paired(r["exported_by_seed"], best["exported_by_seed"])
            others.append({"arm": r["arm"], "format": r["format"], "increase_pct": r["increase_pct"]["mean"],
                           "minus_best": d, "verdict": verdict})
        findings.append({"steps": steps, "tokens_per_param": best["tokens_per_param"], "group": group,
                         "best": {"arm": best["arm"], "format": best["format"], "seeds": best["seeds"],
                                  "exported": best["exported"]["mean"], "increase_pct": best["increase_pct"]["mean"]},
                         "others": others})
    return findings


def at_budget(r):
    """" (error-int@3.5)" for an arm that is not itself a mix but was exported as one (PTQ)."""
    return f" ({r['format']})" if "@" in r["format"] and " mix " not in r["arm"] else ""


def findings_markdown(findings):
    lines = []
    for f in findings:
        b = f["best"]
        at = at_budget(b)
        line = (f"- **{f['steps']} steps ({f['tokens_per_param']:.1f} tokens/param), {f['group']}**: {b['arm']}{at} "
                f"is lowest (exported val loss {b['exported']:.4f}, {b['increase_pct']:+.2f} % over bf16, "
                f"{b['seeds']} seed{'s' if b['seeds'] > 1 else ''})")
        behind = []
        for o in f["others"]:
            d, at = o["minus_best"], at_budget(o)
            if not d["n"]:
                behind.append(f"{o['arm']}{at} (no common seed)")
                continue
            ci = f" ± {d['ci95']:.4f}" if d["ci95"] is not None else ""
            behind.append(f"{o['arm']}{at} {d['mean']:+.4f}{ci} (n={d['n']}, {o['verdict']})")
        lines.append(line + ("; then " + ", ".join(behind) if behind else "") + ".")
    return lines


def row_markdown(r):
    """One row of the runs' table."""
    tpp = f"{r['steps']} ({r['tokens_per_param']:.1f})" if r["tokens_per_param"] else str(r["steps"])
    seeds = str(r["seeds"]) + (f" (+{len(r['diverged'])} diverged)" if r["diverged"] else "")
    paired = []
    for key in ("vs_ptq", "vs_ste_int3", "vs_ste_int4", "vs_error_mix"):
        p = r.get(key)
        if not p or not p["n"]:
            paired.append("-")
        else:
            ci = f" ± {p['ci95']:.4f}" if p["ci95"] is not None else ""
            paired.append(f"{p['mean']:+.4f}{ci} (n={p['n']})")
    bits = f"{r['bits_per_weight']['mean']:.2f}" if r["bits_per_weight"]["n"] else "-"
    wall = f"{r['train_min']['mean']:.1f} ({r['trained_steps']})" if r["train_min"]["n"] else "-"
    cells = [tpp, r["arm"], r["format"], seeds, fmt_stats(r["val_loss"]), fmt_stats(r["exported"]),
             fmt_stats(r["increase_pct"], 2, pct=True), bits, *paired, wall]
    return "| " + " | ".join(cells) + " |"


def deploy_markdown(results):
    about = ("Val losses are the last evaluation's (20 fixed "
             "batches of train.py), the exported model's on the same batches (export.py); the increase is the "
             "exported val loss over the bf16 run's of the same length and seed; ± is the standard deviation over "
             "seeds; the paired columns give the mean difference by seed with its 95 % interval (Student's t; none "
             "for one seed). Every phase arm trains exactly the bf16 run's steps and tokens: it is that run until its "
             "switch and forks from its checkpoint there, so its time is the phase's own: its steps times its median "
             "logged time a step (a runner paused on the shared machine does not count; each run's done.json has its "
             "wall time, results.json both). The two mixes end on the same STE phase over the last "
             f"{100 - 100 * PHASE:.0f} %; the learned one leaves bf16 earlier, at {100 * MIX_PHASE:.0f} %, for the "
             "gaussws phase whose b_t allocate its formats.")
    lines = markdown_head(results, about)
    head = ["steps (tokens/param)", "arm", "exported at", "seeds", "val loss", "exported val loss", "increase",
            "bits/w", "− PTQ (paired)", "− STE int3 (paired)", "− STE int4 (paired)", "− error mix (paired)",
            "own train min (steps)"]
    lines += ["## What it says", "",
              "Per length and deployment format, the arm with the lowest exported val loss, then each other "
              "arm's exported val loss minus that one's, paired by seed (95 % interval; inside the noise when it "
              "holds 0, one seed gives none):", "", *findings_markdown(results["findings"]), "", "## The runs", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += [row_markdown(r) for r in results["rows"]]
    lines += ["", "Arms (their train.py overrides of config/mini_gpt2_deploy.py):", ""]
    lines += list(dict.fromkeys(f"- {r['arm']}, {r['steps']} steps: `{r['settings']}`" for r in results["rows"]))
    lines += ["", "Plots: plots/increase.png (the exported model's loss increase against tokens per parameter), "
              "plots/pareto.png (exported val loss against bits per weight at the longest length).", ""]
    return "\n".join(lines)


def write_deploy(name, study, root):
    """results.json, results.md and plots/ of the deployment study under root/name; the paths written."""
    runs = deploy_runs(study, root)
    rows = deploy_rows(study, runs)
    results = {**results_head(name, study, root, runs), "rows": rows, "findings": deploy_findings(rows)}
    out = os.path.join(root, name)
    written = write_results(out, results, deploy_markdown(results))
    if any(r["seeds"] for r in rows):
        written += plot_deploy(rows, os.path.join(out, "plots"), longest=max(r["steps"] for r in rows))
    return written
