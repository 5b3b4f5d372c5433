"""Export a PQT-trained model in real low-precision formats, and measure what that costs.

    python export.py --out_dir=out --format=auto
    python export.py --out_dir=out --format=auto,auto-int,mxfp8_e4m3,mxfp6_e3m2,mxfp4,int4,int3
    python export.py --out_dir=out --format=auto-int,error-int,int3 --bits_per_weight=3.0   # mixed int2/3/4
    python export.py --out_dir=out --format=auto,int4 --json=out/export.json   # also the summary as JSON

Reads the checkpoint in <out_dir> (ckpt.pt, or ckpt.dcp of an FSDP run; checkpoint.read) and
1. reports the learned bitwidths b_t (one per 32x32 block, Eq. 11) per layer role and overall, as
   the paper's Fig. 5: their distribution and the share of weights in each tier of Table C.
   Printed, and written to bitwidths.json and bitwidths.png beside the exported files;
2. quantizes every 32x32 block of the PQT layers to one element format with one shared scale
   (OCP Microscaling (MX) v1.0), either the same format for all blocks or, with `auto`/`auto-int`,
   the format that the block's own b_t asks for, or, with --bits_per_weight, int2/int3/int4 at that
   mean ranked by b_t (auto-int) or by each block's own error (error-int); writes
   model-<format>.safetensors: packed element codes, scales, per-block format ids, what it takes
   to rebuild the model (no pickle) and the SHA-256 of every tensor and of the metadata, which
   load checks before it rebuilds anything;
3. evaluates the val loss of each exported model on train.py's fixed evaluation batches, beside
   the loss of the checkpoint's own (unquantized) weights.

    model, info = export.load("out/model-auto.safetensors")  # the dequantized model, in eval mode

The file: for each quantized weight W, W.format (a uint8 format id per block, ids in the
metadata's "formats"), W.<format>.codes (that format's element codes, packed little-endian, blocks
in row-major order) and W.<format>.scales (E8M0 bytes, or BF16 for integers); every other tensor
under its own name; metadata with the architecture, the PQT settings, the format and its mix, the
training config, the dataset's meta.json and the SHA-256s.

load refuses in one line (ExportError) a file that is damaged (a checksum differs), malformed (a
tensor of the wrong size for its blocks, a format id the file does not name, model_args the model
does not know), of another tool or of an older export.py (no checksums: export the run again),
and a model that rebuilds non-finite.

Layers without PQT, embeddings, head, norms and biases are kept in BF16 (--other_dtype=float32
keeps them exact). A run without PQT layers (a bf16 run) has its block Linears quantized instead,
which is plain post-training quantization, the baseline PQT competes with; an STE run (ste[...]) has
the layers it trained on a format's grid quantized, which give back its trained weights when the
format is its target_format. A run that trained by STE on a bit budget's per-block formats (target
auto-int or error-int) keeps them: exported at its own target_format and --bits_per_weight, each
block takes the format it trained on, and the file holds the trained weights.
"""
import hashlib
import io
import json
import math
import os
import struct
import sys
from dataclasses import fields

import numpy as np
import torch

import checkpoint
import gaussws
import ste
from configurator import check_device, configure
from data import loader
from data.common import DataError, unusable_dir
from formats import (BY_NAME, FORMATS, block_weights, budget_format_ids, dequantize_blocks, from_blocks,
                     quantize_blocks, to_blocks)
from kernels import BL
from model import GPT, ROLES, ModelConfig
from util import UserError, cli, first_line, write_atomic

# -----------------------------------------------------------------------------------------------
DEFAULTS = dict(
    out_dir="out",  # the run directory holding ckpt.pt
    format="auto",  # an element format, auto, auto-int, error-int, or a comma list of them (each exported, evaluated)
    bits_per_weight=0.0,  # auto-int, error-int: int2/int3/int4 at this mean element bits per weight (budget_bits)
    layers="pqt",  # "pqt": the PQT (or STE) layers, every block Linear of a bf16 run; "all": every block Linear
    other_dtype="bfloat16",  # every tensor that is not quantized: "bfloat16" or "float32"
    export_dir="",  # where model-<format>.safetensors, bitwidths.json and bitwidths.png go; "" -> out_dir
    plot=True,  # draw bitwidths.png (matplotlib)
    save=True,  # False: evaluate the formats without writing the model files
    overwrite=False,  # replace model files that exist
    evaluate=True,  # val loss of each exported model beside the unquantized one
    eval_iters=0,  # batches of the val loss; 0 -> the run's own eval_iters (the batches of train.py's evaluation)
    json="",  # also write the summary (checkpoint, notes, bitwidths, a record per format) to this path as JSON
    gguf=False,  # also write model-<format>.gguf beside each file, for llama.cpp (export_gguf.py)
    device="cuda" if torch.cuda.is_available() else "cpu",  # where the evaluation runs
)
# -----------------------------------------------------------------------------------------------


class ExportError(UserError):
    """Bad input or an unusable checkpoint; the message is one line that says what to do."""


# --- which format a block takes (the formats themselves: formats.py) ---------------------------

# auto's candidates, cheapest first (element bits, then scale bits): a block takes the first one
# that Table C allows for its b_t. fp32 allows every b_t up to 25, and is the master weight itself.
AUTO_ORDER = ["mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2", "bf16", "fp16", "fp32"]
TIERS = [(4.0, "<=4"), (5.0, "4-5"), (9.0, "5-9"), (12.0, "9-12"), (math.inf, ">12")]  # Table C's tiers of b_t


def table_c_allows(fmt, b_t):
    """Table C of the paper (appendix C; METHOD.md section 3): w_hat of bitwidth b_t needs an FP
    exponent of ceil(log2(b_t + 3)) bits and a mantissa of b_t - 2 bits. ceil(log2(b_t + 3)) <= e
    is b_t <= 2^e - 3, which spares a log of a float at the tier edges (b_t = 5 exactly: e = 3)."""
    return (b_t <= 2 ** fmt.ebits - 3) & (b_t <= fmt.mbits + 2)


def auto_format_ids(b_t):
    """Per block, the cheapest format of AUTO_ORDER that Table C allows for its b_t."""
    ids = torch.full(b_t.shape, BY_NAME["fp32"], dtype=torch.uint8)
    for name in reversed(AUTO_ORDER):  # cheaper formats overwrite dearer ones
        ids[table_c_allows(FORMATS[BY_NAME[name]], b_t)] = BY_NAME[name]
    return ids


def auto_int_format_ids(b_t):
    """Per block, the symmetric integer of ceil(b_t) bits (at least 2): its step, max_bl / (2^(b-1) - 1),
    is the grid Eq. 3's noise scale max_bl * 2^(1 - b_t) stands in for. Past 16 bits: fp32."""
    bits = torch.ceil(b_t).clamp(min=2)
    ids = torch.full(b_t.shape, BY_NAME["fp32"], dtype=torch.uint8)
    for b in range(2, 17):
        ids[bits == b] = BY_NAME[f"int{b}"]
    return ids


# --- 32x32 blocks and bit packing ----------------------------------------------------------------

def pack(codes, bits):
    """Codes (int64, each < 2^bits) as a little-endian bit stream: code i in bits [i*bits, (i+1)*bits)."""
    c = codes.numpy()
    stream = np.empty((len(c), bits), dtype=np.uint8)
    for j in range(bits):
        stream[:, j] = (c >> j) & 1
    return torch.from_numpy(np.packbits(stream.reshape(-1), bitorder="little"))


def unpack(packed, bits, count):
    stream = np.unpackbits(packed.numpy(), count=count * bits, bitorder="little").reshape(count, bits)
    codes = np.zeros(count, dtype=np.int64)
    for j in range(bits):
        codes |= stream[:, j].astype(np.int64) << j
    return torch.from_numpy(codes)


def quantize_weight(name, w, format_ids):
    """A weight (m, n) and the format id of each 32x32 block -> the file's tensors for it, by suffix:
    "format" (uint8 ids, (ceil(m/32), ceil(n/32))) and, per format used, "<format>.codes" (its blocks'
    codes, packed in block order, only the real elements of edge blocks) and "<format>.scales"."""
    if not torch.isfinite(w).all():
        raise ExportError(f"{name} holds {int((~torch.isfinite(w)).sum())} non-finite values (NaN or Inf); "
                          f"a non-finite model cannot be exported: export an earlier checkpoint")
    blocks, real = to_blocks(w.double()), to_blocks(torch.ones(w.shape, dtype=torch.bool))
    ids = format_ids.flatten()
    out = {"format": format_ids.to(torch.uint8).contiguous()}
    for fid in ids.unique().tolist():
        fmt, sel = FORMATS[fid], ids == fid
        codes, scales = quantize_blocks(blocks[sel], fmt)
        out[f"{fmt.name}.codes"] = pack(codes[real[sel]], fmt.bits)
        if scales is not None:
            out[f"{fmt.name}.scales"] = scales.contiguous()
    return out


def dequantize_weight(tensors, m, n):
    """The float32 weight (m, n) from quantize_weight's tensors."""
    ids = tensors["format"].flatten().long()
    real = to_blocks(torch.ones(m, n, dtype=torch.bool))
    blocks = torch.zeros(real.shape, dtype=torch.float64)
    for fid in ids.unique().tolist():
        fmt, sel = FORMATS[fid], ids == fid
        mask = real[sel]
        codes = torch.zeros(mask.shape, dtype=torch.int64)
        codes[mask] = unpack(tensors[f"{fmt.name}.codes"], fmt.bits, int(mask.sum()))
        blocks[sel] = dequantize_blocks(codes, tensors.get(f"{fmt.name}.scales"), fmt)
    return from_blocks(blocks, m, n).float()


# --- the checkpoint --------------------------------------------------------------------------

def layer_roles(arch):
    """Module path inside a transformer block (transformer.h.<i>.<path>) -> the layer's role."""
    return ROLES[arch]


def block_linears(state_dict, arch):
    """{module path: role} of every Linear of the transformer blocks, in the state dict's order."""
    roles, found = layer_roles(arch), {}
    for key in state_dict:
        parts = key.split(".")
        if key.startswith("transformer.h.") and key.endswith(".weight") and ".".join(parts[3:-1]) in roles:
            found[".".join(parts[:-1])] = roles[".".join(parts[3:-1])]
    return found


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


def build_model(state_dict, arch_args):
    """The model with the checkpoint's weights, b_i and format_ids aside: an eval-mode PQT or STE layer
    is a plain Linear."""
    try:
        model = GPT(ModelConfig(**arch_args))
        result = model.load_state_dict(state_dict, strict=False)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ExportError(f"the checkpoint does not fit this project's model: {first_line(e)}")
    unexpected = [k for k in result.unexpected_keys if not k.endswith((".b_i", ".format_ids"))]
    if result.missing_keys or unexpected:
        raise ExportError(f"the checkpoint does not fit this project's model: missing {result.missing_keys[:3]}, "
                          f"unexpected {unexpected[:3]}")
    return model.eval()


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


# --- the exported file -------------------------------------------------------------------------

EXPORT_VERSION = "2"  # the file's "pqt_export"; "1": an older export.py, which recorded no checksums
INFO_KEYS = ("model_args", "pqt", "formats", "quantized", "mix", "config", "meta", "iter_num")  # JSON in the metadata


def trained_formats(state_dict, pqt, quantized, fmt_name, budget):
    """{layer: format ids} a run trained on (STE at a bit budget: the format_ids saved beside each
    weight, chosen at its switch), when they are what --format at --bits_per_weight asks for: the run's
    own target_format and bits_per_weight, every quantized layer holding its chosen ids. Else None: the
    budget is allocated afresh (budget_format_ids) from the checkpoint's weights and b_t."""
    ids = {k[:-len(".format_ids")]: v for k, v in state_dict.items() if k.endswith(".format_ids")}
    if (fmt_name, budget) != (pqt.get("target_format"), pqt.get("bits_per_weight")) or set(ids) != set(quantized):
        return None
    if any((v == ste.UNCHOSEN).any() for v in ids.values()):
        return None  # saved before the switch: the run has not chosen them yet
    return {k: ids[k].to(torch.uint8) for k in quantized}


def format_ids_for(name, fmt_name, b_t, shape):
    """The format id of each block of layer `name` under --format (auto/auto-int need the layer's b_t)."""
    nb = (-(-shape[0] // BL), -(-shape[1] // BL))
    if fmt_name in ("auto", "auto-int"):
        if b_t is None:  # a block Linear without PQT: nothing learned to choose from
            return torch.full(nb, BY_NAME["bf16"], dtype=torch.uint8)
        return auto_format_ids(b_t) if fmt_name == "auto" else auto_int_format_ids(b_t)
    return torch.full(nb, BY_NAME[fmt_name], dtype=torch.uint8)


def export_bytes(model, quantized, b_t, fmt_name, other_dtype, metadata, chosen=None):
    """The safetensors file (bytes) of `model` with the weights of `quantized` ({module path: role})
    quantized per block, and its mix: share of quantized weights per format and bits per weight.
    chosen: {layer: format ids} made beforehand (a bit budget's), instead of format_ids_for's."""
    from safetensors.torch import save
    tensors, seen, shapes = {}, set(), {}
    weights_by_format, quantized_bytes = {}, 0
    for key, value in model.state_dict().items():
        if value.data_ptr() in seen:  # a tied weight (GPT2's lm_head is wte) is stored once
            continue
        seen.add(value.data_ptr())
        layer = key[:-len(".weight")]
        if key.endswith(".weight") and layer in quantized:
            ids = chosen[layer] if chosen else format_ids_for(layer, fmt_name, b_t.get(layer), value.shape)
            parts = quantize_weight(key, value.detach().float().cpu(), ids)
            tensors.update({f"{key}.{suffix}": t for suffix, t in parts.items()})
            quantized_bytes += sum(t.numel() * t.element_size() for t in parts.values())
            shapes[key] = list(value.shape)
            counts = block_weights(*value.shape).flatten()
            for fid in ids.flatten().unique().tolist():
                weights_by_format[FORMATS[fid].name] = (weights_by_format.get(FORMATS[fid].name, 0)
                                                        + int(counts[ids.flatten() == fid].sum().item()))
        else:
            tensors[key] = value.detach().to(other_dtype).cpu().contiguous()
    n = sum(weights_by_format.values())
    mix = dict(format=fmt_name, quantized_weights=n, quantized_bytes=quantized_bytes,
               bits_per_weight=8 * quantized_bytes / n if n else None,
               share={f: c / n for f, c in sorted(weights_by_format.items(), key=lambda fc: BY_NAME[fc[0]])})
    metadata = {**metadata, "pqt_export": EXPORT_VERSION, "format": fmt_name,
                "formats": json.dumps([f.name for f in FORMATS]), "quantized": json.dumps(shapes), "mix": json.dumps(mix)}
    metadata["sha256"] = checksums(tensors, metadata)
    return save(tensors, metadata=metadata), mix


def tensor_sha256(t):
    """SHA-256 of a tensor's bytes as safetensors stores them (little-endian, row-major)."""
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def metadata_sha256(metadata):
    """SHA-256 of the metadata entries but the checksums themselves, in a canonical order."""
    return hashlib.sha256(json.dumps({k: v for k, v in metadata.items() if k != "sha256"}, sort_keys=True).encode()
                          ).hexdigest()


def checksums(tensors, metadata):
    """The "sha256" metadata entry: every tensor's checksum and the metadata's, checked by load."""
    return json.dumps({"tensors": {k: tensor_sha256(t) for k, t in tensors.items()},
                       "metadata": metadata_sha256(metadata)})


def _header(data, where):
    """(tensor entries {name: {dtype, shape, data_offsets}}, metadata) of a safetensors file's bytes."""
    foreign = f"{where} is not a model file written by export.py"
    if len(data) < 8 or struct.unpack("<Q", data[:8])[0] > len(data) - 8:
        raise ExportError(f"{foreign} (shorter than its header says: truncated, or not a safetensors file)")
    (n,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as e:
        raise ExportError(f"{foreign} (its header is not JSON: {e})") from None
    metadata = header.pop("__metadata__", None) if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or "pqt_export" not in metadata:
        raise ExportError(f"{foreign} (no pqt_export metadata)")
    if metadata["pqt_export"] == "1" and "sha256" not in metadata:
        raise ExportError(f"{where} was written by an older export.py that recorded no checksums, so it cannot be "
                          f"verified; export the run again (python export.py --out_dir=RUN --format=...)")
    if metadata["pqt_export"] != EXPORT_VERSION:
        raise ExportError(f"{where} has export version {metadata['pqt_export']!r}; this export.py reads "
                          f"{EXPORT_VERSION!r}: export the run again with this export.py")
    return header, metadata


def _verify(data, header, metadata, where):
    """Every tensor's bytes and the metadata against the checksums recorded at export."""
    damaged = f"{where} fails verification (damaged, or not written by export.py)"
    try:
        sums = json.loads(metadata["sha256"])
        tensor_sums, metadata_sum = dict(sums["tensors"]), sums["metadata"]
    except (KeyError, TypeError, ValueError):
        raise ExportError(f"{damaged}: its checksums cannot be read; export the run again") from None
    if metadata_sha256(metadata) != metadata_sum:
        raise ExportError(f"{damaged}: its metadata does not match its checksum; export the run again")
    if set(tensor_sums) != set(header):
        odd = sorted(set(tensor_sums) ^ set(header))
        raise ExportError(f"{damaged}: tensors {odd[:3]} are missing or were added; export the run again")
    base = 8 + struct.unpack("<Q", data[:8])[0]
    view = memoryview(data)
    for name, entry in header.items():
        try:
            start, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ExportError(f"{damaged}: the header entry of {name} is malformed; export the run again") from None
        if not 0 <= start <= end <= len(data) - base or hashlib.sha256(view[base + start:base + end]).hexdigest() \
                != tensor_sums[name]:
            raise ExportError(f"{damaged}: tensor {name} does not match its checksum (flipped or missing bytes); "
                              f"export the run again")


def _info(metadata, where):
    """The metadata's JSON entries, parsed and type-checked."""
    info = {"format": metadata.get("format")}
    if not isinstance(info["format"], str):
        raise ExportError(f"{where} lacks the metadata entry 'format' export.py writes; export the run again")
    for key in INFO_KEYS:
        if key not in metadata:
            raise ExportError(f"{where} lacks the metadata entry {key!r} export.py writes; export the run again")
        try:
            info[key] = json.loads(metadata[key])
        except (TypeError, ValueError) as e:
            raise ExportError(f"{where}: metadata entry {key!r} is not JSON ({e}); export the run again") from None
    kinds = dict(model_args=dict, pqt=dict, formats=list, quantized=dict, mix=dict, config=dict, meta=(dict, type(None)))
    for key, kind in kinds.items():
        if not isinstance(info[key], kind):
            raise ExportError(f"{where}: metadata entry {key!r} is a JSON {type(info[key]).__name__}, not what "
                              f"export.py writes; export the run again")
    if info["formats"] != [f.name for f in FORMATS][:len(info["formats"])]:
        raise ExportError(f"{where} numbers its formats differently from this export.py: {info['formats']}")
    unknown = sorted(set(info["model_args"]) - {f.name for f in fields(ModelConfig)})
    if unknown:
        raise ExportError(f"{where}: model_args has keys this project's model does not know: {unknown}")
    return info


def _reference(info, where):
    """{key: shape} of the unique tensors (a tied weight once) of the model that info describes (meta device)."""
    try:
        with torch.device("meta"):
            model = GPT(ModelConfig(**info["model_args"]))
    except (TypeError, ValueError, ZeroDivisionError, RuntimeError, OverflowError) as e:
        raise ExportError(f"{where}: model_args {info['model_args']} do not describe a model "
                          f"({type(e).__name__}: {e})") from None
    shapes, seen = {}, set()
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) not in seen:  # export_bytes stores a tied weight once, under its first name
            seen.add(id(value))
            shapes[key] = tuple(value.shape)
    return shapes


def _check_quantized(tensors, key, shape, n_formats, where):
    """The names of a quantized weight's tensors, each checked against the block count of its shape."""
    ids = tensors.get(f"{key}.format")
    nb = (-(-shape[0] // BL), -(-shape[1] // BL))
    if ids is None or ids.dtype != torch.uint8 or tuple(ids.shape) != nb:
        got = "missing" if ids is None else f"{ids.dtype} {tuple(ids.shape)}"
        raise ExportError(f"{where}: {key}.format should hold one uint8 format id per 32x32 block {nb}, got {got}")
    ids = ids.flatten().long()
    if (ids >= n_formats).any():
        raise ExportError(f"{where}: {key}.format holds format id {int(ids.max())}; the file names {n_formats} formats")
    real = to_blocks(torch.ones(shape, dtype=torch.bool)).sum(dim=1)  # elements of each block (edge blocks fewer)
    names = {f"{key}.format"}
    for fid in ids.unique().tolist():
        fmt, sel = FORMATS[fid], ids == fid
        want = {f"{key}.{fmt.name}.codes": (torch.uint8, (-(-int(real[sel].sum()) * fmt.bits // 8),))}
        if fmt.scaled:
            want[f"{key}.{fmt.name}.scales"] = (torch.bfloat16 if fmt.kind == "int" else torch.uint8, (int(sel.sum()),))
        for name, (dtype, size) in want.items():
            t = tensors.get(name)
            if t is None or t.dtype != dtype or tuple(t.shape) != size:
                got = "missing" if t is None else f"{t.dtype} {tuple(t.shape)}"
                raise ExportError(f"{where}: {name} should be {dtype} {size} for the blocks of {key}, got {got}")
        scales = tensors.get(f"{key}.{fmt.name}.scales")
        if fmt.kind == "fp" and scales is not None and (scales == 255).any():
            raise ExportError(f"{where}: {key} has the E8M0 scale code 255 (NaN), which export.py never writes")
        names |= want.keys()
    return names


def _check_tensors(tensors, info, where):
    """Every tensor of the model is in the file, of its shape; nothing else is."""
    reference, quantized = _reference(info, where), info["quantized"]
    expected = set()
    for key, shape in quantized.items():
        if key not in reference or list(reference[key]) != shape or len(shape) != 2:
            raise ExportError(f"{where}: quantized weight {key} {shape} is not a weight of the model "
                              f"{info['model_args']} ({list(reference.get(key, ())) or 'no such weight'})")
        expected |= _check_quantized(tensors, key, tuple(shape), len(info["formats"]), where)
    for key, shape in reference.items():
        if key in quantized:
            continue
        t = tensors.get(key)
        if t is None or not t.is_floating_point() or tuple(t.shape) != shape:
            got = "missing" if t is None else f"{t.dtype} {tuple(t.shape)}"
            raise ExportError(f"{where}: {key} should be a float tensor of shape {shape}, got {got}")
        expected.add(key)
    if set(tensors) - expected:
        raise ExportError(f"{where} holds tensors the model does not have: {sorted(set(tensors) - expected)[:3]}")


def rebuild(data, device="cpu", where="the exported file"):
    """(model in eval mode with the dequantized weights, info) from an exported file's bytes, verified
    first: the checksums export recorded, every tensor's size against the model and its blocks, and
    the rebuilt model finite. Anything else is ExportError, one line."""
    from safetensors.torch import load as load_tensors
    header, metadata = _header(data, where)
    _verify(data, header, metadata, where)
    info = _info(metadata, where)
    try:
        tensors = load_tensors(data)
    except Exception as e:  # safetensors' own errors have no common base class
        raise ExportError(f"{where} is not a valid safetensors file ({type(e).__name__}: {e})") from None
    _check_tensors(tensors, info, where)
    model = GPT(ModelConfig(**info["model_args"]))
    own = model.state_dict()
    state = {k: v.float() for k, v in tensors.items() if k in own and k not in info["quantized"]}
    for key, (m, n) in info["quantized"].items():
        prefix = key + "."
        state[key] = dequantize_weight({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}, m, n)
    model.load_state_dict(state, strict=False)  # complete, as _check_tensors found; a tied weight comes with its twin
    for key, value in model.state_dict().items():
        if not torch.isfinite(value).all():
            raise ExportError(f"{where}: {key} holds {int((~torch.isfinite(value)).sum())} non-finite values (an Inf "
                              f"or NaN scale, norm or weight); a non-finite model is not loaded: export the run again")
    return model.to(device).eval(), info


def load(path, device="cpu"):
    """(model, info) from a file written by export.py, verified (rebuild): the model (eval mode) holds
    the dequantized weights; info holds model_args, pqt, format, mix, config and meta (the dataset's tokenizer)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ExportError(f"cannot read {path}: {first_line(e)}")
    return rebuild(data, device, where=path)


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
    accepted = ["auto", "auto-int", "error-int"] + [f.name for f in FORMATS]
    for name in names or [""]:
        if name not in accepted:
            raise ExportError(f"unknown format {name!r}; expected one of auto, auto-int, error-int, "
                              f"{', '.join(f.name for f in FORMATS[:8])}, int2..int16, or a comma list of them")
    return list(dict.fromkeys(names))


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
    budget = cfg["bits_per_weight"]
    if budget and not 2 <= budget <= 4:
        raise ExportError(f"--bits_per_weight={budget:g}: expected a mean of 2 to 4 element bits per weight (int2 to "
                          f"int4), or 0 for no budget")
    if budget and not {"auto-int", "error-int"} & set(formats):
        raise ExportError(f"--bits_per_weight={budget:g} is for --format=auto-int or error-int, and --format="
                          f"{cfg['format']} has neither")
    if "error-int" in formats and not budget:
        raise ExportError("--format=error-int mixes int2/int3/int4 at a budget: pass --bits_per_weight (e.g. 3.0)")
    check_json_path(cfg["json"])
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


def check_json_path(path):
    """--json names a file to write (as bench.py's --json): not a bool, not a directory, in a folder that
    exists and can be written."""
    if path in ("True", "False"):
        raise ExportError(f"--json={path}: --json takes the path of the JSON file to write, e.g. --json=export.json")
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ExportError(f"--json={path} is a directory; give the path of the JSON file to write, e.g. "
                          f"--json={os.path.join(path, 'export.json')}")
    if not os.path.isdir(folder):
        raise ExportError(f"--json={path}: its folder {folder} does not exist; make it, or choose another path")
    why = unusable_dir(folder)
    if why:
        raise ExportError(f"--json={path} cannot be written: {why}; choose another path")


def write_output(path, data, option="--export_dir"):
    """bytes to path atomically (util.write_atomic): a full disk is one line, the old file kept."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_atomic(path, data)
    except OSError as e:
        raise ExportError(f"cannot write {path} ({e.strerror or e}): free space or choose another {option}; "
                          f"no file there was replaced") from None


def budget_formats(fmt_name, budget, model, state_dict, pqt, quantized, b_t, notes):
    """{layer: format ids} of --format auto-int or error-int at a bit budget (--bits_per_weight; None
    without one): the per-block formats the run trained on, where it trained on this budget's (a note
    says so), else formats.budget_format_ids's choice from the weights (and b_t, for auto-int)."""
    if not budget or fmt_name not in ("auto-int", "error-int"):
        return None
    chosen = trained_formats(state_dict, pqt, quantized, fmt_name, budget)
    if chosen is not None:
        notes.append(f"{fmt_name} at {budget:g} bits per weight: the per-block formats the run trained on, "
                     f"chosen at its step {pqt.get('ste_start') or pqt.get('pqt_start'):.0f}")
        return chosen
    if fmt_name == "auto-int" and any(k not in b_t for k in quantized):
        raise ExportError("auto-int with --bits_per_weight ranks blocks by their learned b_t, and these layers "
                          "have none (no PQT): use --format=error-int, which ranks them by their own error")
    weights = {k: model.get_submodule(k).weight for k in quantized}
    return budget_format_ids(fmt_name, weights, b_t, budget)


def main(argv):
    cfg = dict(DEFAULTS)
    configure(cfg, argv)
    formats, export_dir, paths = check_args(cfg)

    ckpt = checkpoint.read(cfg["out_dir"])  # verified first; a sharded (FSDP) checkpoint gathered here
    ckpt_path, state_dict, arch_args, pqt, iter_num = (ckpt[k] for k in ("path", "model", "model_args", "pqt", "iter_num"))
    model = build_model(state_dict, arch_args)
    for key, value in model.state_dict().items():
        if not torch.isfinite(value).all():
            raise ExportError(f"{key} holds {int((~torch.isfinite(value)).sum())} non-finite values (NaN or Inf) in "
                              f"{ckpt_path}; a non-finite model cannot be exported: export an earlier checkpoint")
    arch = model.config.arch
    b_t = learned_bitwidths(state_dict, pqt)
    linears = block_linears(state_dict, arch)
    quantized = linears if cfg["layers"] == "all" else trained_layers(linears, b_t, pqt)
    shapes = {name: tuple(state_dict[name + ".weight"].shape) for name in linears}
    notes = []
    if not b_t and any(f.startswith("auto") for f in formats):
        notes.append(f"{ckpt_path} has no PQT layers (method {pqt.get('method', 'bf16')!r}), so auto and auto-int have "
                     f"no learned b_t to choose a format from: they keep its block Linears in bf16")

    config = ckpt["config"]
    lacking = [k for k in ("dataset", "seed", "batch_size", "eval_iters", "dtype") if k not in config]
    if cfg["evaluate"] and lacking:
        raise ExportError(f"{ckpt_path} does not record {', '.join(lacking)} of its run, so train.py's evaluation "
                          f"batches cannot be drawn again; pass --evaluate=False to export without the loss")
    meta = None
    try:
        meta = loader.read_meta(loader.data_dir(config["dataset"])) if "dataset" in config else None
    except DataError:
        if cfg["evaluate"]:
            raise
    if cfg["gguf"]:
        import export_gguf  # needs the gguf package, and only here
        gguf_plan = export_gguf.plan(model, quantized, meta, config, formats, export_dir, cfg)
    if cfg["evaluate"]:
        eval_iters = cfg["eval_iters"] or config["eval_iters"]
        val_loss = run_val_loss(config, meta, model.config.block_size, eval_iters, cfg["device"])
        reference = val_loss(model.to(cfg["device"]))
    report = bitwidth_report(b_t, shapes, linears, pqt) if b_t else None
    if report:
        write_output(os.path.join(export_dir, "bitwidths.json"), json.dumps(report, indent=1).encode())
        if cfg["plot"]:
            write_output(os.path.join(export_dir, "bitwidths.png"), plot_bitwidths(report))

    metadata = {"model_args": json.dumps(arch_args), "pqt": json.dumps(pqt),
                "config": json.dumps(config), "meta": json.dumps(meta), "iter_num": json.dumps(iter_num)}
    results = []
    other_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[cfg["other_dtype"]]
    for fmt_name in formats:
        chosen = budget_formats(fmt_name, cfg["bits_per_weight"], model, state_dict, pqt, quantized, b_t, notes)
        data, mix = export_bytes(model, quantized, b_t, fmt_name, other_dtype, metadata, chosen)
        result = dict(mix, path=paths[fmt_name] if cfg["save"] else None, file_bytes=len(data))
        if cfg["save"]:
            write_output(paths[fmt_name], data)  # atomic: a crash leaves no half-written model file
        if cfg["evaluate"]:
            exported, _ = rebuild(data, cfg["device"])
            loss = val_loss(exported)
            result.update(val_loss=loss, val_loss_unquantized=reference, increase_pct=100 * (loss / reference - 1))
        if cfg["gguf"]:
            result["gguf"] = export_gguf.write(gguf_plan, fmt_name, data, log=print,
                                               evaluate=val_loss if cfg["evaluate"] else None)
        results.append(result)

    summary = dict(checkpoint=ckpt_path, iter_num=iter_num, notes=notes, bitwidths=report, exports=results)
    print_summary(summary, export_dir, cfg["plot"], (eval_iters, config["dtype"]) if cfg["evaluate"] else None)
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
