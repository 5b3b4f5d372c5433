"""The llama.cpp study tensor by tensor, from the committed records alone: which GGML type each mix gave each
block Linear (its file's per-tensor types, gguf.json), and which tensors a bit helps most on each trunk at
the mixes' fork, by the val loss and by error-gguf's proxy (python -m studies.sensitivity, sensitivity.json).

    chosen = chosen_types(rows)           # {mix kind: {tensor: {type: runs}}} over sizes and seeds
    ranks = sensitivity_ranks(records)    # {seed: {step: {ranks by loss and proxy, Spearman}}}

A rank is 1 for the tensor where a bit per weight buys most (the largest drop per weight and per bit, as
quant.budget.gguf_types ranks upgrades); Spearman's correlation of the two rankings over the tensors says how
well the proxy orders them as the loss does.
"""
from studies.definitions import MIX_KINDS


def mix_kind(arm):
    """The kind of mix (MIX_KINDS' key: "learned mix", "error mix") of a row's arm, or None for another arm."""
    return next((kind for kind in MIX_KINDS if arm.startswith(kind)), None)


def chosen_types(rows):
    """{mix kind: {tensor: {type: how many runs gave it that type}}, plus "runs": how many runs recorded
    types} over every size and seed of the mixes whose records hold their files' tensors."""
    out = {}
    for r in rows:
        kind = mix_kind(r["arm"])
        if kind is None:
            continue
        entry = out.setdefault(kind, {"runs": 0, "tensors": {}})
        for tensors in (t for t in r["tensors_by_seed"].values() if t):
            entry["runs"] += 1
            for name, t in tensors.items():
                counts = entry["tensors"].setdefault(name, {})
                counts[t["type"]] = counts.get(t["type"], 0) + 1
    return out


def ranks(values):
    """The rank of each value, 1 for the largest (ties: the first listed first)."""
    order = sorted(range(len(values)), key=lambda i: -values[i])
    out = [0] * len(values)
    for rank, i in enumerate(order, 1):
        out[i] = rank
    return out


def sensitivity_ranks(records):
    """{seed: {step ("q2_k->q3_k"): {"tensors": [names], "loss_rank", "proxy_rank": [rank of each], "spearman"}}}
    of each seed's sensitivity record ({seed: record, or why none}), the seeds without one left out."""
    out = {}
    for seed, rec in records.items():
        if not isinstance(rec, dict):
            continue
        names = [t["tensor"] for t in rec["tensors"]]
        out[seed] = {step: {"tensors": names, "loss_rank": ranks(u["loss_per_bit"]),
                            "proxy_rank": ranks(u["proxy_per_bit"]), "spearman": u["spearman"]}
                     for step, u in rec["upgrades"].items()}
    return out


def gguf_name(path):
    """llama.cpp's name of a block Linear from our module path (transformer.h.0.attn.c_proj -> blk.0.attn_output),
    as the files' tensors tables name them (files.gguf_file.NAMES), for GPT2 and Llama2."""
    parts = path.split(".")
    role = ".".join(parts[3:])
    names = {"attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down",
             "attn.q": "attn_q", "attn.k": "attn_k", "attn.v": "attn_v", "attn.out": "attn_output",
             "mlp.gate": "ffn_gate", "mlp.up": "ffn_up", "mlp.down": "ffn_down"}
    return f"blk.{parts[2]}.{names.get(role, role)}.weight"


def chosen_markdown(chosen):
    if not chosen:
        return ["No mix's per-tensor types recorded yet (records made before gguf.json kept them lack them)."]
    lines = []
    for kind, entry in chosen.items():
        if not entry["runs"]:
            lines += [f"{kind}: no run's types recorded (records made before gguf.json kept each file's tensors).", ""]
            continue
        lines += [f"{kind} ({entry['runs']} runs with their types recorded, every size and seed):", "",
                  "| tensor | types given (runs) |", "|---|---|"]
        lines += [f"| {name} | " + ", ".join(f"{t} {n}" for t, n in sorted(counts.items())) + " |"
                  for name, counts in entry["tensors"].items()]
        lines.append("")
    return lines


def sensitivity_markdown(records, step):
    """The tables of each upgrade step: every tensor's rank by the loss and by the proxy per seed, and Spearman's
    correlation per seed; the seeds without a record, and why."""
    lines = [f"Each trunk's block Linears rounded one at a time at step {step} (python -m studies.sensitivity), "
             "ranked by what a bit per weight buys (1: most), by our model's val loss and by error-gguf's proxy:", ""]
    for seed, rec in records.items():
        if not isinstance(rec, dict):
            lines.append(f"- seed {seed}: {rec}")
    by_seed = sensitivity_ranks(records)
    if not by_seed:
        return lines + ["", "No sensitivity record yet."]
    seeds = list(by_seed)
    for step_name in next(iter(by_seed.values())):
        names = by_seed[seeds[0]][step_name]["tensors"]
        lines += ["", f"**{step_name}**: rank by loss / by proxy per seed "
                  + "(Spearman " + ", ".join(f"seed {s} {by_seed[s][step_name]['spearman']:+.2f}" for s in seeds) + ")",
                  "", "| tensor | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|---|" + "---|" * len(seeds)]
        for i, name in enumerate(names):
            cells = [f"{by_seed[s][step_name]['loss_rank'][i]} / {by_seed[s][step_name]['proxy_rank'][i]}"
                     for s in seeds]
            lines.append(f"| {gguf_name(name)} | " + " | ".join(cells) + " |")
    return lines
