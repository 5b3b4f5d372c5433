"""Which block Linears a bit per weight helps most: by the val loss and by error-gguf's proxy.

    python -m studies.sensitivity --checkpoint=RUN/ckpt_4480.pt --types=q2_k,q3_k,q4_k --json=s.json

For each block Linear of a checkpoint and each type (cheapest first), on train.py's evaluation batches
of its run: the val loss with that tensor alone on the type's grid (llama.cpp's reference rounding,
without an importance matrix) less the checkpoint's own, and error-gguf's proxy of it (budget.imatrix_error,
the importance matrix taken over the same batches). Then, for each step up the types, what one bit per
weight buys by each measure (the drop per weight and per bit: what budget.gguf_types' greedy allocator ranks
upgrades by), and Spearman's correlation of the tensors' two rankings: how well the proxy orders the
tensors as the loss does. The rounding is after training (no STE phase adapts the weights to it), so it
measures which tensors are sensitive, not what a trained mix reaches.
"""
import json
import sys

import torch

import checkpoint
import configurator
from data import loader
from files import lowbit
from quant import budget, formats, ggml_quants, grids
from util import UserError, check_json_path, cli, write_atomic

DEFAULTS = dict(
    checkpoint="out/ckpt.pt",  # a checkpoint of train.py, or the run directory that holds one
    types="q2_k,q3_k,q4_k",  # llama.cpp types, cheapest first (of budget.GGUF_BUDGET_TYPES)
    eval_iters=0,  # evaluation batches; 0 -> the run's own eval_iters
    json="",  # also write the measurements to this file
    threads=0,  # torch's CPU threads; 0 -> torch's default
)


def spearman(a, b):
    """Spearman's rank correlation of two sequences of distinct values: the correlation of their ranks."""
    ra, rb = (torch.tensor(v, dtype=torch.float64).argsort().argsort().double() for v in (a, b))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return (ra @ rb / (ra.norm() * rb.norm())).item()


@torch.no_grad()
def _val_loss(model, batches):
    return sum(model(x, y)[1].item() for x, y in batches) / len(batches)


@torch.no_grad()
def measure(ckpt, types, eval_iters):
    """{val_loss, batches, tensors: [{tensor, role, numel, loss: {type: val loss change}, proxy: {type:
    imatrix_error}}]} of checkpoint.read's dict, the evaluation batches train.py draws for its run."""
    model = lowbit.build_model(ckpt["model"], ckpt["model_args"])
    layers = lowbit.block_linears(ckpt["model"], model.config.arch)
    for name in layers:
        width = model.get_submodule(name).weight.shape[1]
        odd = [t for t in types if width % ggml_quants.block_size(formats.GGML_FORMATS[t])]
        if odd:
            size = ggml_quants.block_size(formats.GGML_FORMATS[odd[0]])
            raise UserError(f"{name} reads {width} inputs, which {odd[0]}'s blocks of {size} do not divide: choose "
                            f"other --types")
    batches = loader.eval_batches(ckpt["config"], model.config.block_size, eval_iters)
    columns = dict.fromkeys(layers, 0.0)

    def collect(name):
        def hook(module, inputs, output):
            x = inputs[0].double()
            columns[name] = columns[name] + x.square().reshape(-1, x.shape[-1]).sum(0)
        return hook
    hooks = [model.get_submodule(name).register_forward_hook(collect(name)) for name in layers]
    base = _val_loss(model, batches)
    for hook in hooks:
        hook.remove()
    tensors = []
    for name, role in layers.items():
        weight = model.get_submodule(name).weight
        w = weight.detach().clone()
        row = dict(tensor=name, role=role, numel=w.numel(), loss={}, proxy={})
        for t in types:
            weight.copy_(grids.fake_quantize(w, t))
            row["loss"][t] = _val_loss(model, batches) - base
            row["proxy"][t] = budget.imatrix_error(w, t, columns[name])
        weight.copy_(w)
        tensors.append(row)
    return dict(val_loss=base, batches=len(batches), tensors=tensors)


def upgrades(tensors, types):
    """For each step up the types ("q2_k->q3_k"): per tensor, the loss and the proxy dropped per weight
    and per bit, and Spearman's correlation of the two over the tensors."""
    bits = {t: ggml_quants.bits_per_weight(formats.GGML_FORMATS[t]) for t in types}
    steps = {}
    for lo, hi in zip(types, types[1:]):
        extra = bits[hi] - bits[lo]
        loss = [(r["loss"][lo] - r["loss"][hi]) / (r["numel"] * extra) for r in tensors]
        proxy = [(r["proxy"][lo] - r["proxy"][hi]) / extra for r in tensors]
        steps[f"{lo}->{hi}"] = dict(loss_per_bit=loss, proxy_per_bit=proxy, spearman=spearman(loss, proxy))
    return steps


def main(argv):
    c = dict(DEFAULTS)
    configurator.configure(c, argv, usage="usage: python -m studies.sensitivity [--key=value ...]")
    types = [t.strip() for t in c["types"].split(",") if t.strip()]
    order = list(budget.GGUF_BUDGET_TYPES)
    if len(types) < 2 or any(t not in order for t in types) or types != sorted(set(types), key=order.index):
        raise UserError(f"--types={c['types']!r}: expected two or more of {', '.join(order)}, each once, cheapest "
                        f"first (each step up the list is an upgrade: q2_k,q3_k,q4_k)")
    configurator.check_at_least(c, {"eval_iters": 0, "threads": 0})
    check_json_path(c["json"], "sensitivity.json")
    if c["threads"]:
        torch.set_num_threads(c["threads"])
    ckpt = checkpoint.read(c["checkpoint"])
    result = dict(checkpoint=ckpt["path"], iter_num=ckpt["iter_num"], types=types,
                  **measure(ckpt, types, c["eval_iters"]))
    result["upgrades"] = upgrades(result["tensors"], types)
    print(f"{ckpt['path']} (step {ckpt['iter_num']}): val loss {result['val_loss']:.5f} on {result['batches']} "
          f"evaluation batches; each tensor alone on a type: the val loss change, then what a bit per weight "
          f"buys (loss, proxy: rank of {len(result['tensors'])}, 1 = most)")
    ranks = {s: [sorted(v[k], reverse=True).index(x) + 1 for k in ("loss_per_bit", "proxy_per_bit") for x in v[k]]
             for s, v in result["upgrades"].items()}
    n = len(result["tensors"])
    for i, r in enumerate(result["tensors"]):
        changes = " ".join(f"{t} {r['loss'][t]:+.5f}" for t in types)
        buys = " ".join(f"{s} {ranks[s][i]:2d} {ranks[s][n + i]:2d}" for s in ranks)
        print(f"  {r['tensor']:<30} {changes}  {buys}")
    print("Spearman (loss, proxy) per step: " + ", ".join(f"{s} {v['spearman']:+.2f}"
                                                          for s, v in result["upgrades"].items()))
    if c["json"]:
        write_atomic(c["json"], json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(cli(main))
