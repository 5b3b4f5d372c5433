"""Export a PQT-trained model in real low-precision formats, and measure what that costs.

    python export.py --out_dir=out --format=auto
    python export.py --out_dir=out --format=auto,auto-int,mxfp8_e4m3,mxfp6_e3m2,mxfp4,int4,int3
    python export.py --out_dir=out --format=auto-int,error-int,int3 --bits_per_weight=3.0   # mixed int2/3/4
    python export.py --out_dir=out --format=auto,int4 --json=out/export.json   # also the summary as JSON
    python export.py --out_dir=out --format=q4_k,q3_k --gguf=True   # llama.cpp's types, the .gguf beside

Reads the checkpoint in <out_dir> (ckpt.pt, or ckpt.dcp of an FSDP run; checkpoint.read) and
1. reports the learned bitwidths b_t (one per 32x32 block, Eq. 11) per layer role and overall, as
   the paper's Fig. 5: their distribution and the share of weights in each tier of Table C.
   Printed, and written to bitwidths.json and bitwidths.png beside the exported files;
2. quantizes every 32x32 block of the PQT layers to one element format with one shared scale
   (OCP Microscaling (MX) v1.0), either the same format for all blocks or, with `auto`/`auto-int`,
   the format that the block's own b_t asks for, or, with --bits_per_weight, int2/int3/int4 at that
   mean ranked by b_t (auto-int) or by each block's own error (error-int); or puts each weight whole
   on one of llama.cpp's block types (q4_0, q8_0, q4_k, q5_k, q3_k, q2_k, q6_k, mxfp4_row, iq4_nl, iq4_xs: their GGML
   blocks, the bytes a GGUF file holds; auto-gguf, error-gguf at --bits_per_weight: the type each
   weight of a run that trained at that budget trained on); writes model-<format>.safetensors: packed
   element codes, scales, per-block format ids or GGML blocks, what it takes to rebuild the model (no
   pickle) and the SHA-256 of every tensor and of the metadata, which load checks before it rebuilds
   anything (the file: files/lowbit.py);
3. evaluates the val loss of each exported model on train.py's fixed evaluation batches, beside
   the loss of the checkpoint's own (unquantized) weights;
4. with --gguf=True, writes model-<format>.gguf beside each file, for llama.cpp (files/gguf_file.py,
   docs/GGUF.md).
Every file is written atomically; what an export killed mid-write left beside them is removed first.

    model, info = files.lowbit.load("out/model-auto.safetensors")  # the dequantized model, in eval mode

Layers without PQT, embeddings, head, norms and biases are kept in BF16 (--other_dtype=float32
keeps them exact). A run without PQT layers (a bf16 run) has its block Linears quantized instead,
which is plain post-training quantization, the baseline PQT competes with; an STE run (ste[...]) has
the layers it trained on a format's grid quantized, which give back its trained weights when the
format is its target_format. A run that trained by STE on a bit budget's per-block formats (target
auto-int or error-int) keeps them: exported at its own target_format and --bits_per_weight, each
block takes the format it trained on, and the file holds the trained weights. The same holds for
llama.cpp's types (quant/ggml_quants.py): an STE run on one exports to it as trained, and a run that trained
one type per weight at a budget (its <layer>.ggml_type) exports with --format=auto-gguf or error-gguf
at its --bits_per_weight; a width a type's blocks do not divide is one line, before anything is written.
"""
import io
import json
import math
import os
import sys

import torch

import checkpoint
import gaussws
from configurator import check_device, configure
from data import loader
from data.common import DataError
from files import lowbit
from files.lowbit import ExportError, block_linears, build_model
from quant import ggml_quants
from quant.formats import FORMATS, GGML_FORMATS, GGUF_BUDGETS, block_weights
from util import check_json_path, cli, remove_stale_temporaries, unusable_dir, write_atomic

# -----------------------------------------------------------------------------------------------
DEFAULTS = dict(
    out_dir="out",  # the run directory holding ckpt.pt
    format="auto",  # one or a comma list: mxfp4 ... int16, auto, auto-int, error-int, q4_0 ... mxfp4_row, auto-gguf...
    bits_per_weight=0.0,  # auto-int, error-int: int2/int3/int4 at this mean; auto-gguf, error-gguf: the run's own
    layers="pqt",  # "pqt": the PQT (or STE) layers, every block Linear of a bf16 run; "all": every block Linear
    other_dtype="bfloat16",  # every tensor that is not quantized: "bfloat16" or "float32"
    export_dir="",  # where model-<format>.safetensors, bitwidths.json and bitwidths.png go; "" -> out_dir
    plot=True,  # draw bitwidths.png (matplotlib)
    save=True,  # False: evaluate the formats without writing the model files
    overwrite=False,  # replace model files that exist
    evaluate=True,  # val loss of each exported model beside the unquantized one
    eval_iters=0,  # batches of the val loss; 0 -> the run's own eval_iters (the batches of train.py's evaluation)
    json="",  # also write the summary (checkpoint, notes, bitwidths, a record per format) to this path as JSON
    gguf=False,  # also write model-<format>.gguf beside each file, for llama.cpp (files/gguf_file.py, docs/GGUF.md)
    device="cuda" if torch.cuda.is_available() else "cpu",  # where the evaluation runs
)
# -----------------------------------------------------------------------------------------------

TIERS = [(4.0, "<=4"), (5.0, "4-5"), (9.0, "5-9"), (12.0, "9-12"), (math.inf, ">12")]  # Table C's tiers of b_t


# --- the checkpoint --------------------------------------------------------------------------

def trained_layers(linears, b_t, pqt):
    """The block Linears --layers=pqt quantizes: a PQT run's PQT layers (those with b_t), an STE run's
    STE layers (the roles its method names: those trained on the grid), a bf16 run's every one (PTQ)."""
    if b_t:
        return {k: v for k, v in linears.items() if k in b_t}
    try:
        kind, roles = gaussws.parse_method(pqt.get("method", "bf16"), linears.values())
    except ValueError as e:
        raise ExportError(f"the checkpoint's method cannot be read: {e}") from None
    return {k: v for k, v in linears.items() if v in roles} if kind == "ste" else linears


def learned_bitwidths(state_dict, pqt):
    """{module path: b_t (float64, one per 32x32 block)} of the PQT layers.

    Eq. 11: b_t = b_target + b_i (b_init - b_target), b_i saved beside each PQT layer's weight.
    """
    b_i = {k[:-len(".b_i")]: v for k, v in state_dict.items() if k.endswith(".b_i")}
    b_t = {name: gaussws.eq11_float64(v, pqt["b_init"], pqt["b_target"]) for name, v in b_i.items()}
    for name, v in b_t.items():
        if not torch.isfinite(v).all():
            raise ExportError(f"{name}.b_i holds non-finite values; a non-finite model cannot be exported")
    return b_t


# --- the bitwidth report (the paper's Fig. 5) -------------------------------------------------------

def bitwidth_report(b_t, shapes, roles, pqt):
    """Distribution of b_t per role and overall, weighted by the weights each block holds.

    b_t: {layer: b_t per block}; shapes: {layer: (m, n)}; roles: {layer: role}.
    """
    groups = {}
    for name in b_t:
        groups.setdefault(roles.get(name, name), []).append(name)
    every = torch.cat([v.flatten() for v in b_t.values()])
    lo, hi = math.floor(every.min().item()), math.ceil(every.max().item())
    hi = max(hi, lo + 1)
    edges = torch.linspace(lo, hi, min(200, 20 * (hi - lo)) + 1, dtype=torch.float64)

    def summary(names):
        x = torch.cat([b_t[nm].flatten() for nm in names])
        wt = torch.cat([block_weights(*shapes[nm]).flatten() for nm in names])
        order = x.argsort()
        cum = wt[order].cumsum(0) / wt.sum()
        at = lambda p: min(int(torch.searchsorted(cum, p / 100)), len(x) - 1)
        quant = {f"p{p}": x[order][at(p)].item() for p in (1, 10, 50, 90, 99)}
        tiers, lower = {}, -math.inf
        for bound, label in TIERS:
            tiers[label] = wt[(x > lower) & (x <= bound)].sum().item() / wt.sum().item()
            lower = bound
        share = torch.histogram(x, bins=edges, weight=wt)[0] / wt.sum()
        return dict(layers=len(names), blocks=len(x), weights=int(wt.sum().item()),
                    mean=(x * wt).sum().item() / wt.sum().item(), min=x.min().item(), max=x.max().item(),
                    quantiles=quant, tiers=tiers, hist=dict(edges=edges.tolist(), share=share.tolist()))

    return dict(method=pqt.get("method"), b_init=pqt.get("b_init"), b_target=pqt.get("b_target"),
                roles={role: summary(names) for role, names in groups.items()}, overall=summary(list(b_t)))


def print_bitwidths(report):
    print(f"learned bitwidths b_t ({report['method']}, b_init {report['b_init']}, b_target {report['b_target']}); "
          f"share of weights per tier of Table C")
    print(f"{'role':<8}{'blocks':>8}{'weights':>11}{'mean':>7}{'min':>7}{'p50':>7}{'max':>7}"
          + "".join(f"{label:>7}" for _, label in TIERS))
    for name, r in list(report["roles"].items()) + [("all", report["overall"])]:
        print(f"{name:<8}{r['blocks']:>8}{r['weights']:>11,}{r['mean']:>7.2f}{r['min']:>7.2f}"
              f"{r['quantiles']['p50']:>7.2f}{r['max']:>7.2f}"
              + "".join(f"{100 * r['tiers'][label]:>6.1f}%" for _, label in TIERS))


def plot_bitwidths(report):
    """Histograms of b_t per role and overall (the paper's Fig. 5), Table C's tier bounds dashed: PNG bytes."""
    from matplotlib.figure import Figure  # optional dependency, needed only here; no pyplot, no backend
    groups = list(report["roles"].items()) + [("all", report["overall"])]
    fig = Figure(figsize=(7, 1.6 * len(groups) + 0.6), layout="tight")
    axes = fig.subplots(len(groups), 1, sharex=True, squeeze=False)[:, 0]
    edges = report["overall"]["hist"]["edges"]
    xlim = (min(edges[0], 3.5), max(edges[-1], 5.5))  # the 4 and 5 bounds always show
    for ax, (name, r) in zip(axes, groups):
        ax.stairs([100 * s for s in r["hist"]["share"]], r["hist"]["edges"], fill=True, color="tab:blue")
        for bound, _ in TIERS[:-1]:
            if xlim[0] <= bound <= xlim[1]:
                ax.axvline(bound, color="k", linestyle="--", linewidth=0.8)
        ax.set_ylabel("% of weights")
        ax.set_title(f"{name}: mean b_t {r['mean']:.2f}, {r['blocks']} blocks", fontsize=9, loc="left", pad=12)
    axes[-1].set_xlim(*xlim)
    lower = xlim[0]  # name each tier by the format auto gives it, above the first histogram
    for (bound, _), name in zip(TIERS, ("fp6 e3m2", "fp8 e4m3", "bf16", "fp16", "fp32")):
        left, right = max(lower, xlim[0]), min(bound, xlim[1])
        if left < right:
            axes[0].text((left + right) / 2, 1.02, name, transform=axes[0].get_xaxis_transform(), ha="center",
                         va="bottom", fontsize=8, color="dimgray")
        lower = bound
    axes[-1].set_xlabel("learned bitwidth b_t of a 32x32 block (dashed: Table C tiers 4, 5, 9, 12)")
    fig.suptitle(f"{report['method']}: b_init {report['b_init']}, b_target {report['b_target']}", fontsize=10)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    return png.getvalue()


# --- evaluation ----------------------------------------------------------------------------------

def run_val_loss(config, meta, block_size, eval_iters, device):
    """model -> its val loss on the batches of its run's evaluation (seed, "val", "eval", k), k <
    eval_iters, by train.py's own estimator (data/loader.py) with the run's autocast dtype."""
    data = loader.open_split(loader.data_dir(config["dataset"]), "val", meta, block_size)
    autocast = loader.autocast_for(config["dtype"], device)
    return lambda model: loader.estimate_loss(model, {"val": data}, seed=config["seed"], eval_iters=eval_iters,
                                              batch_size=config["batch_size"], block_size=block_size, device=device,
                                              autocast=autocast)["val"]


# --- the command ---------------------------------------------------------------------------------

def parse_formats(spec):
    names = [s.strip() for s in str(spec).split(",") if s.strip()]
    accepted = ["auto", "auto-int", "error-int", *(f.name for f in FORMATS), *GGML_FORMATS, *GGUF_BUDGETS]
    for name in names or [""]:
        if name not in accepted:
            raise ExportError(f"unknown format {name!r}; expected one of auto, auto-int, error-int, "
                              f"{', '.join(f.name for f in FORMATS[:8])}, int2..int16, llama.cpp's "
                              f"{', '.join(GGML_FORMATS)}, {', '.join(GGUF_BUDGETS)}, or a comma list of them")
    return list(dict.fromkeys(names))


def check_budget(formats, budget, spec):
    """--bits_per_weight against the formats that take it: auto-int and error-int a mean of 2 to 4 element
    bits, auto-gguf and error-gguf the budget (q2_k's to q8_0's bits) a run trained its GGML types at."""
    ints, ggufs = [f for f in formats if f in ("auto-int", "error-int")], [f for f in formats if f in GGUF_BUDGETS]
    if budget and not ints + ggufs:
        raise ExportError(f"--bits_per_weight={budget:g} is for --format=auto-int or error-int (int2/int3/int4 per "
                          f"block), or auto-gguf or error-gguf (a GGML type per weight), and --format={spec} has none")
    if budget and ints and not 2 <= budget <= 4:
        raise ExportError(f"--bits_per_weight={budget:g}: expected a mean of 2 to 4 element bits per weight (int2 to "
                          f"int4), or 0 for no budget")
    low, high = ggml_quants.bits_per_weight("q2_k"), ggml_quants.bits_per_weight("q8_0")
    if budget and ggufs and not low <= budget <= high:
        raise ExportError(f"--bits_per_weight={budget:g}: expected a mean of {low:g} (q2_k) to {high:g} (q8_0) bits "
                          f"per weight for --format={ggufs[0]}")
    if "error-int" in formats and not budget:
        raise ExportError("--format=error-int mixes int2/int3/int4 at a budget: pass --bits_per_weight (e.g. 3.0)")
    if ggufs and not budget:
        raise ExportError(f"--format={ggufs[0]} writes the GGML types a run trained at a budget: pass that "
                          f"--bits_per_weight (the run's own)")


def check_args(cfg):
    """(formats, export_dir, {format: path}) of the command line, every value checked before any work."""
    formats = parse_formats(cfg["format"])
    if cfg["layers"] not in ("pqt", "all"):
        raise ExportError(f"--layers={cfg['layers']!r}: expected 'pqt' or 'all'")
    if cfg["other_dtype"] not in ("bfloat16", "float32"):
        raise ExportError(f"--other_dtype={cfg['other_dtype']!r}: expected 'bfloat16' or 'float32'")
    if cfg["eval_iters"] < 0:
        raise ExportError(f"--eval_iters={cfg['eval_iters']}: expected >= 1 batches, or 0 for the run's own")
    check_device(cfg)
    check_budget(formats, cfg["bits_per_weight"], cfg["format"])
    check_json_path(cfg["json"], "export.json")
    export_dir = cfg["export_dir"] or cfg["out_dir"]
    why = unusable_dir(export_dir)
    if why:
        raise ExportError(f"--export_dir={export_dir!r} is unusable: {why}; choose a directory that can be written")
    paths = {f: os.path.join(export_dir, f"model-{f}.safetensors") for f in formats}
    if cfg["save"] and not cfg["overwrite"]:
        for path in paths.values():
            if os.path.exists(path):
                raise ExportError(f"{path} exists; pass --overwrite=True to replace it, or choose another --export_dir")
    return formats, export_dir, paths


def cannot_write(path, e, option="--export_dir"):
    """The one line of a write that failed (a full disk, a folder gone): nothing was replaced."""
    return ExportError(f"cannot write {path} ({e.strerror or e}): free space or choose another {option}; "
                       f"no file there was replaced")


def write_output(path, data, option="--export_dir"):
    """bytes to path atomically (util.write_atomic): a full disk is one line, the old file kept."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_atomic(path, data)
    except OSError as e:
        raise cannot_write(path, e, option) from None


def read_run(cfg, formats):
    """The checkpoint of --out_dir as export needs it: (checkpoint dict, model, b_t, block Linears,
    the layers to quantize, notes), every weight finite."""
    ckpt = checkpoint.read(cfg["out_dir"])  # verified first; a sharded (FSDP) checkpoint gathered here
    state_dict, pqt = ckpt["model"], ckpt["pqt"]
    model = build_model(state_dict, ckpt["model_args"])
    for key, value in model.state_dict().items():
        if not torch.isfinite(value).all():
            raise ExportError(f"{key} holds {int((~torch.isfinite(value)).sum())} non-finite values (NaN or Inf) in "
                              f"{ckpt['path']}; a non-finite model cannot be exported: export an earlier checkpoint")
    b_t = learned_bitwidths(state_dict, pqt)
    linears = block_linears(state_dict, model.config.arch)
    quantized = linears if cfg["layers"] == "all" else trained_layers(linears, b_t, pqt)
    notes = []
    if not b_t and any(f.startswith("auto") for f in formats):
        notes.append(f"{ckpt['path']} has no PQT layers (method {pqt.get('method', 'bf16')!r}), so auto and auto-int "
                     f"have no learned b_t to choose a format from: they keep its block Linears in bf16")
    return ckpt, model, b_t, linears, quantized, notes


def read_meta(ckpt, evaluate):
    """The dataset's meta.json of the run (None where the run records no dataset); needed to evaluate."""
    config = ckpt["config"]
    lacking = [k for k in ("dataset", "seed", "batch_size", "eval_iters", "dtype") if k not in config]
    if evaluate and lacking:
        raise ExportError(f"{ckpt['path']} does not record {', '.join(lacking)} of its run, so train.py's evaluation "
                          f"batches cannot be drawn again; pass --evaluate=False to export without the loss")
    try:
        return loader.read_meta(loader.data_dir(config["dataset"])) if "dataset" in config else None
    except DataError:
        if evaluate:
            raise
    return None


def write_gguf(gguf_plan, fmt_name, data, val_loss):
    """model-<format>.gguf of the exported bytes (gguf_file.write): a failed write is one line."""
    from files import gguf_file
    try:
        return gguf_file.write(gguf_plan, fmt_name, data, log=print, evaluate=val_loss)
    except OSError as e:
        raise cannot_write(gguf_plan.paths[fmt_name], e) from None


def main(argv):
    cfg = dict(DEFAULTS)
    configure(cfg, argv)
    formats, export_dir, paths = check_args(cfg)
    ckpt, model, b_t, linears, quantized, notes = read_run(cfg, formats)
    config, pqt, state_dict = ckpt["config"], ckpt["pqt"], ckpt["model"]
    meta = read_meta(ckpt, cfg["evaluate"])
    ggml = {f: lowbit.ggml_types(f, cfg["bits_per_weight"], state_dict, pqt, quantized, notes) for f in formats}
    gguf_plan = None
    if cfg["gguf"]:
        from files import gguf_file  # needs the gguf package, and only here
        gguf_plan = gguf_file.plan(model, quantized, meta, config, formats, export_dir, cfg)
    outputs = [*paths.values(), *(gguf_plan.paths.values() if gguf_plan else ()), cfg["json"] or None,
               *(os.path.join(export_dir, f"bitwidths.{ext}") for ext in ("json", "png"))]
    for path in filter(None, outputs):  # what an export killed mid-write left
        directory, name = os.path.split(os.path.abspath(path))
        remove_stale_temporaries(directory, {name})
    val_loss = reference = None
    if cfg["evaluate"]:
        eval_iters = cfg["eval_iters"] or config["eval_iters"]
        val_loss = run_val_loss(config, meta, model.config.block_size, eval_iters, cfg["device"])
        reference = val_loss(model.to(cfg["device"]))
    shapes = {name: tuple(state_dict[name + ".weight"].shape) for name in linears}
    report = bitwidth_report(b_t, shapes, linears, pqt) if b_t else None
    if report:
        write_output(os.path.join(export_dir, "bitwidths.json"), json.dumps(report, indent=1).encode())
        if cfg["plot"]:
            write_output(os.path.join(export_dir, "bitwidths.png"), plot_bitwidths(report))

    metadata = lowbit.run_metadata(ckpt, meta)
    other_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[cfg["other_dtype"]]
    results = []
    for fmt_name in formats:
        chosen = lowbit.budget_formats(fmt_name, cfg["bits_per_weight"], model, state_dict, pqt, quantized, b_t, notes)
        data, mix = lowbit.export_bytes(model, quantized, b_t, fmt_name, other_dtype, metadata, chosen, ggml[fmt_name])
        result = dict(mix, path=paths[fmt_name] if cfg["save"] else None, file_bytes=len(data))
        if cfg["save"]:
            write_output(paths[fmt_name], data)  # atomic: a crash leaves no half-written model file
        if val_loss:
            exported, _ = lowbit.rebuild(data, cfg["device"])
            loss = val_loss(exported)
            result.update(val_loss=loss, val_loss_unquantized=reference, increase_pct=100 * (loss / reference - 1))
        if gguf_plan:
            result["gguf"] = write_gguf(gguf_plan, fmt_name, data, val_loss)
        results.append(result)

    summary = dict(checkpoint=ckpt["path"], iter_num=ckpt["iter_num"], notes=notes, bitwidths=report, exports=results)
    print_summary(summary, export_dir, cfg["plot"], (eval_iters, config["dtype"]) if val_loss else None)
    if cfg["json"]:
        write_output(cfg["json"], (json.dumps(summary, indent=1) + "\n").encode(), "--json")
        print(f"wrote {cfg['json']}")


def print_summary(summary, export_dir, plot, evaluation):
    """The tables of main's summary (what --json=PATH writes as one object); evaluation: (batches,
    dtype) of the val losses, or None."""
    ckpt_path, notes, report, results = (summary[k] for k in ("checkpoint", "notes", "bitwidths", "exports"))
    for note in notes:
        print(f"note: {note}")
    if report:
        print_bitwidths(report)
        print(f"wrote {os.path.join(export_dir, 'bitwidths.json')}" + (" and bitwidths.png" if plot else ""))
    else:
        print(f"{ckpt_path} has no PQT layers: no learned bitwidths to report")
    print(f"\n{'format':<12}{'bits/w':>8}{'file MB':>9}  mix (share of quantized weights)")
    for r in results:
        bpw = f"{r['bits_per_weight']:.3f}" if r["bits_per_weight"] is not None else "-"
        mix = ", ".join(f"{f} {100 * s:.1f}%" for f, s in r["share"].items())
        print(f"{r['format']:<12}{bpw:>8}{r['file_bytes'] / 1e6:>9.3f}  {mix}")
    if evaluation:
        print(f"\nval loss on {evaluation[0]} batches of train.py's evaluation ({evaluation[1]}):")
        print(f"{'format':<12}{'val loss':>10}{'unquantized':>13}{'increase':>10}")
        for r in results:
            print(f"{r['format']:<12}{r['val_loss']:>10.4f}{r['val_loss_unquantized']:>13.4f}"
                  f"{r['increase_pct']:>9.2f}%")


if __name__ == "__main__":
    sys.exit(cli(main))
