"""Export a PQT-trained model in real low-precision formats, and measure what that costs.

    python export.py --out_dir=out --format=auto
    python export.py --out_dir=out --format=auto,auto-int,mxfp8_e4m3,mxfp6_e3m2,mxfp4,int4,int3

Reads the checkpoint in <out_dir> (ckpt.pt, or ckpt.dcp of an FSDP run; checkpoint.read) and
1. reports the learned bitwidths b_t (one per 32x32 block, Eq. 11) per layer role and overall, as
   the paper's Fig. 5: their distribution and the share of weights in each tier of Table C.
   Printed, and written to bitwidths.json and bitwidths.png beside the exported files;
2. quantizes every 32x32 block of the PQT layers to one element format with one shared scale
   (OCP Microscaling (MX) v1.0), either the same format for all blocks or, with `auto`/`auto-int`,
   the format that the block's own b_t asks for, and writes model-<format>.safetensors: packed
   element codes, scales, per-block format ids and what it takes to rebuild the model (no pickle);
3. evaluates the val loss of each exported model on train.py's fixed evaluation batches, beside
   the loss of the checkpoint's own (unquantized) weights.

    model, info = export.load("out/model-auto.safetensors")  # the dequantized model, in eval mode

Layers without PQT, embeddings, head, norms and biases are kept in BF16 (--other_dtype=float32
keeps them exact). A run without PQT layers (a bf16 run) has its block Linears quantized instead,
which is plain post-training quantization, the baseline PQT competes with.
"""
import json
import math
import os
import struct
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

import checkpoint
from configurator import configure
from data import loader
from data.common import DataError
from kernels import BL
from model import GPT, ROLES, ModelConfig
from util import UserError, cli, first_line, write_atomic

# -----------------------------------------------------------------------------------------------
DEFAULTS = dict(
    out_dir="out",  # the run directory holding ckpt.pt
    format="auto",  # an element format, auto, auto-int, or a comma list of them (each exported and evaluated)
    layers="pqt",  # "pqt": quantize the PQT layers (every block Linear in a run without any); "all": every block Linear
    other_dtype="bfloat16",  # every tensor that is not quantized: "bfloat16" or "float32"
    export_dir="",  # where model-<format>.safetensors, bitwidths.json and bitwidths.png go; "" -> out_dir
    plot=True,  # draw bitwidths.png (matplotlib)
    save=True,  # False: evaluate the formats without writing the model files
    overwrite=False,  # replace model files that exist
    evaluate=True,  # val loss of each exported model beside the unquantized one
    eval_iters=0,  # batches of the val loss; 0 -> the run's own eval_iters (the batches of train.py's evaluation)
    json=False,  # print one JSON object instead of tables
    device="cuda" if torch.cuda.is_available() else "cpu",  # where the evaluation runs
)
# -----------------------------------------------------------------------------------------------


class ExportError(UserError):
    """Bad input or an unusable checkpoint; the message is one line that says what to do."""


# --- element formats -------------------------------------------------------------------------

@dataclass(frozen=True)
class Format:
    """An element format: "fp" (sign, ebits exponent, mbits mantissa) or "int" (symmetric integer)."""
    name: str
    kind: str
    bits: int  # bits per element code
    ebits: int = 0
    mbits: int = 0
    emax: int = 0  # exponent of the largest normal value (as the OCP MX v1.0 spec lists it per format)
    max: float = 0.0  # largest finite value: conversions saturate here
    scaled: bool = True  # carries a per-block scale (bf16 and fp32 span every weight with their own exponent)

    @property
    def bias(self):
        return 2 ** (self.ebits - 1) - 1

    @property
    def emin(self):
        return 1 - self.bias  # exponent of the smallest normal; subnormals have E = 0 and this exponent

    @property
    def levels(self):
        return 2 ** (self.bits - 1) - 1  # int: codes -levels..levels (symmetric; -2^(b-1) unused)


def _fp(name, ebits, mbits, emax, max_value, scaled=True):
    return Format(name, "fp", 1 + ebits + mbits, ebits, mbits, emax, max_value, scaled)


# The file stores a block's format as its index here: append, never reorder.
FORMATS = [
    _fp("mxfp4", 2, 1, 2, 6.0),  # e2m1: no Inf/NaN codes
    _fp("mxfp6_e2m3", 2, 3, 2, 7.5),  # no Inf/NaN codes
    _fp("mxfp6_e3m2", 3, 2, 4, 28.0),  # no Inf/NaN codes
    _fp("mxfp8_e4m3", 4, 3, 8, 448.0),  # e4m3fn: only S.1111.111 is NaN
    _fp("mxfp8_e5m2", 5, 2, 15, 57344.0),  # IEEE-like: exponent 11111 is Inf/NaN
    _fp("bf16", 8, 7, 127, 3.3895313892515355e38, scaled=False),
    _fp("fp16", 5, 10, 15, 65504.0),  # scaled, so that its narrow exponent sits where the block's weights are
    _fp("fp32", 8, 23, 127, 3.4028234663852886e38, scaled=False),
] + [Format(f"int{b}", "int", b) for b in range(2, 17)]
BY_NAME = {f.name: i for i, f in enumerate(FORMATS)}

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


def _pow2(k):
    """2^k as float64, exactly, for an int64 tensor k in [-1022, 1023] (built from its bits)."""
    return ((k + 1023) << 52).view(torch.float64)


def _floor_log2(a):
    """floor(log2 a) of positive float64 values, exactly (frexp: a = f * 2^e with f in [0.5, 1))."""
    return torch.frexp(a)[1].long() - 1


def fp_round(v, fmt):
    """v (float64, already divided by the block scale) on fmt's grid: round to nearest, ties to even,
    saturated at +-fmt.max. Exact in float64: v / step is a power-of-two rescaling."""
    a = v.abs()
    e = _floor_log2(a).clamp(min=fmt.emin)  # below the smallest normal the grid is the subnormals'
    step = _pow2(e - fmt.mbits)
    q = (torch.round(a / step) * step).clamp(max=fmt.max)  # torch.round: half to even
    return torch.where(torch.signbit(v), -q, q)


def fp_encode(q, fmt):
    """Codes (sign | exponent E | mantissa M, int64) of values on fmt's grid (fp_round's output)."""
    a = q.abs()
    e = _floor_log2(a).clamp(min=fmt.emin)
    significand = (a / _pow2(e - fmt.mbits)).long()  # 2^m + M for normals, M for subnormals (and 0)
    normal = significand >= 2 ** fmt.mbits
    exponent = torch.where(normal, e + fmt.bias, 0)
    mantissa = torch.where(normal, significand - 2 ** fmt.mbits, significand)
    return (torch.signbit(q).long() << (fmt.ebits + fmt.mbits)) | (exponent << fmt.mbits) | mantissa


def fp_decode(codes, fmt):
    """Values (float64) of codes: (-1)^s * 2^(E - bias) * (1 + M / 2^m), or 2^emin * M / 2^m when E = 0."""
    mantissa = codes & (2 ** fmt.mbits - 1)
    exponent = (codes >> fmt.mbits) & (2 ** fmt.ebits - 1)
    magnitude = torch.where(exponent == 0, mantissa * _pow2(torch.full_like(codes, fmt.emin - fmt.mbits)),
                            (mantissa + 2 ** fmt.mbits) * _pow2(exponent - fmt.bias - fmt.mbits))
    return torch.where((codes >> (fmt.ebits + fmt.mbits)) & 1 == 1, -magnitude, magnitude)


def e8m0_exponents(amax, fmt):
    """The shared scale X = 2^k of each block, by the OCP MX v1.0 conversion: k = floor(log2 amax) - emax,
    emax that of the element format's largest normal, clamped to E8M0's range [-127, 127]. The
    largest weight then lands in [2^emax, 2^(emax+1)); above fmt.max it saturates. An all-zero
    block gets the smallest scale, 2^-127 (any scale codes its zeros)."""
    a = amax.double()
    k = torch.where(a > 0, _floor_log2(a.clamp(min=torch.finfo(torch.float64).tiny)) - fmt.emax, -127)
    return k.clamp(-127, 127)


def int_scales(amax, fmt):
    """Symmetric absmax scale s = max_bl(|w|) / (2^(b-1) - 1), held in BF16 and rounded up there, so
    that no weight of the block lies beyond the top level (the largest reaches it)."""
    s = amax.double() / fmt.levels
    s16 = s.to(torch.bfloat16)
    up = s16.double() < s
    s16[up] = (s16[up].view(torch.int16) + 1).view(torch.bfloat16)  # the next BF16 value above
    return s16


def quantize_blocks(blocks, fmt):
    """Blocks (k, BL*BL) float64 -> (codes int64 (k, BL*BL), scales (k,) or None)."""
    amax = blocks.abs().amax(dim=1)
    if fmt.kind == "int":
        scales = int_scales(amax, fmt)
        s = scales.double()
        q = torch.round(blocks / torch.where(s > 0, s, 1.0)[:, None]).clamp(-fmt.levels, fmt.levels)
        return q.long() & (2 ** fmt.bits - 1), scales  # two's complement in fmt.bits bits
    if not fmt.scaled:
        return fp_encode(fp_round(blocks, fmt), fmt), None
    k = e8m0_exponents(amax, fmt)
    codes = fp_encode(fp_round(blocks / _pow2(k)[:, None], fmt), fmt)
    return codes, (k + 127).to(torch.uint8)  # E8M0 code: the biased exponent


def dequantize_blocks(codes, scales, fmt):
    """Inverse of quantize_blocks: float64 values, exact in float32 for every format here."""
    if fmt.kind == "int":
        q = torch.where(codes >= 2 ** (fmt.bits - 1), codes - 2 ** fmt.bits, codes)
        return q.double() * scales.double()[:, None]
    values = fp_decode(codes, fmt)
    return values if scales is None else values * _pow2(scales.long() - 127)[:, None]


# --- 32x32 blocks and bit packing ----------------------------------------------------------------

def to_blocks(w):
    """(m, n) -> (ceil(m/BL) * ceil(n/BL), BL*BL), blocks in row-major order, zero-padded at the edges."""
    m, n = w.shape
    nbm, nbn = -(-m // BL), -(-n // BL)
    p = F.pad(w, (0, nbn * BL - n, 0, nbm * BL - m))
    return p.view(nbm, BL, nbn, BL).permute(0, 2, 1, 3).reshape(nbm * nbn, BL * BL)


def from_blocks(blocks, m, n):
    nbm, nbn = -(-m // BL), -(-n // BL)
    return blocks.view(nbm, nbn, BL, BL).permute(0, 2, 1, 3).reshape(nbm * BL, nbn * BL)[:m, :n]


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


def build_model(state_dict, arch_args):
    """The model with the checkpoint's weights, b_i aside: an eval-mode PQT layer is a plain Linear."""
    try:
        model = GPT(ModelConfig(**arch_args))
        result = model.load_state_dict(state_dict, strict=False)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ExportError(f"the checkpoint does not fit this project's model: {first_line(e)}")
    unexpected = [k for k in result.unexpected_keys if not k.endswith(".b_i")]
    if result.missing_keys or unexpected:
        raise ExportError(f"the checkpoint does not fit this project's model: missing {result.missing_keys[:3]}, "
                          f"unexpected {unexpected[:3]}")
    return model.eval()


def learned_bitwidths(state_dict, pqt):
    """{module path: b_t (float64, one per 32x32 block)} of the PQT layers.

    Eq. 11: b_t = b_target + b_i (b_init - b_target), b_i saved beside each PQT layer's weight.
    """
    b_i = {k[:-len(".b_i")]: v for k, v in state_dict.items() if k.endswith(".b_i")}
    b_t = {name: pqt["b_target"] + v.double() * (pqt["b_init"] - pqt["b_target"]) for name, v in b_i.items()}
    for name, v in b_t.items():
        if not torch.isfinite(v).all():
            raise ExportError(f"{name}.b_i holds non-finite values; a non-finite model cannot be exported")
    return b_t


def block_weights(m, n):
    """Number of weights of each 32x32 block of an (m, n) weight: edge blocks hold fewer."""
    rows = torch.tensor([min(BL, m - i) for i in range(0, m, BL)], dtype=torch.float64)
    cols = torch.tensor([min(BL, n - j) for j in range(0, n, BL)], dtype=torch.float64)
    return torch.outer(rows, cols)


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


def plot_bitwidths(report, path):
    """Histograms of b_t per role and overall (the paper's Fig. 5), Table C's tier bounds dashed; PNG at path."""
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
    fig.savefig(path, dpi=110)


# --- the exported file -------------------------------------------------------------------------

def format_ids_for(name, fmt_name, b_t, shape):
    """The format id of each block of layer `name` under --format (auto/auto-int need the layer's b_t)."""
    nb = (-(-shape[0] // BL), -(-shape[1] // BL))
    if fmt_name in ("auto", "auto-int"):
        if b_t is None:  # a block Linear without PQT: nothing learned to choose from
            return torch.full(nb, BY_NAME["bf16"], dtype=torch.uint8)
        return auto_format_ids(b_t) if fmt_name == "auto" else auto_int_format_ids(b_t)
    return torch.full(nb, BY_NAME[fmt_name], dtype=torch.uint8)


def export_bytes(model, quantized, b_t, fmt_name, other_dtype, metadata):
    """The safetensors file (bytes) of `model` with the weights of `quantized` ({module path: role})
    quantized per block, and its mix: share of quantized weights per format and bits per weight."""
    from safetensors.torch import save
    tensors, seen, shapes = {}, set(), {}
    weights_by_format, quantized_bytes = {}, 0
    for key, value in model.state_dict().items():
        if value.data_ptr() in seen:  # a tied weight (GPT2's lm_head is wte) is stored once
            continue
        seen.add(value.data_ptr())
        layer = key[:-len(".weight")]
        if key.endswith(".weight") and layer in quantized:
            ids = format_ids_for(layer, fmt_name, b_t.get(layer), value.shape)
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
    metadata = {**metadata, "format": fmt_name, "formats": json.dumps([f.name for f in FORMATS]),
                "quantized": json.dumps(shapes), "mix": json.dumps(mix)}
    return save(tensors, metadata=metadata), mix


def _parse(data, where):
    """(tensors, metadata) of an exported file's bytes."""
    from safetensors.torch import load as load_tensors
    try:
        (header_len,) = struct.unpack("<Q", data[:8])
        metadata = json.loads(data[8:8 + header_len]).get("__metadata__") or {}
        if metadata.get("pqt_export") != "1":
            raise ValueError("no pqt_export metadata")
        return load_tensors(data), metadata
    except Exception as e:
        raise ExportError(f"{where} is not a model file written by export.py ({type(e).__name__}: {e})")


def rebuild(data, device="cpu", where="the exported file"):
    """(model in eval mode with the dequantized weights, info) from an exported file's bytes."""
    tensors, metadata = _parse(data, where)
    info = {k: (json.loads(v) if k not in ("format", "pqt_export") else v) for k, v in metadata.items()}
    if info["formats"] != [f.name for f in FORMATS][:len(info["formats"])]:
        raise ExportError(f"{where} numbers its formats differently from this export.py: {info['formats']}")
    model = GPT(ModelConfig(**info["model_args"]))
    own = model.state_dict()
    state = {k: v.float() for k, v in tensors.items() if k in own}
    for key, (m, n) in info["quantized"].items():
        prefix = key + "."
        state[key] = dequantize_weight({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}, m, n)
    result = model.load_state_dict(state, strict=False)
    loaded = {own[k].data_ptr() for k in state}
    missing = [k for k in result.missing_keys if own[k].data_ptr() not in loaded]  # a tied weight is loaded
    if missing:
        raise ExportError(f"{where} lacks tensors of the model: {missing[:3]}")
    return model.to(device).eval(), info


def load(path, device="cpu"):
    """(model, info) from a file written by export.py: the model (eval mode) holds the dequantized
    weights; info holds model_args, pqt, format, mix, config and meta (the dataset's tokenizer)."""
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
    accepted = ["auto", "auto-int"] + [f.name for f in FORMATS]
    for name in names or [""]:
        if name not in accepted:
            raise ExportError(f"unknown format {name!r}; expected one of auto, auto-int, "
                              f"{', '.join(f.name for f in FORMATS[:8])}, int2..int16, or a comma list of them")
    return list(dict.fromkeys(names))


def main(argv):
    cfg = dict(DEFAULTS)
    configure(cfg, argv)
    formats = parse_formats(cfg["format"])
    if cfg["layers"] not in ("pqt", "all"):
        raise ExportError(f"--layers={cfg['layers']!r}: expected 'pqt' or 'all'")
    if cfg["other_dtype"] not in ("bfloat16", "float32"):
        raise ExportError(f"--other_dtype={cfg['other_dtype']!r}: expected 'bfloat16' or 'float32'")
    if cfg["eval_iters"] < 0:
        raise ExportError(f"--eval_iters={cfg['eval_iters']}: expected >= 1 batches, or 0 for the run's own")
    export_dir = cfg["export_dir"] or cfg["out_dir"]
    paths = {f: os.path.join(export_dir, f"model-{f}.safetensors") for f in formats}
    if cfg["save"] and not cfg["overwrite"]:
        for path in paths.values():
            if os.path.exists(path):
                raise ExportError(f"{path} exists; pass --overwrite=True to replace it, or choose another --export_dir")

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
    quantized = linears if cfg["layers"] == "all" or not b_t else {k: v for k, v in linears.items() if k in b_t}
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
    if cfg["evaluate"]:
        eval_iters = cfg["eval_iters"] or config["eval_iters"]
        val_loss = run_val_loss(config, meta, model.config.block_size, eval_iters, cfg["device"])
        reference = val_loss(model.to(cfg["device"]))
    report = bitwidth_report(b_t, shapes, linears, pqt) if b_t else None
    if cfg["save"] or report:
        os.makedirs(export_dir, exist_ok=True)
    if report:
        with open(os.path.join(export_dir, "bitwidths.json"), "w") as f:
            json.dump(report, f, indent=1)
        if cfg["plot"]:
            plot_bitwidths(report, os.path.join(export_dir, "bitwidths.png"))

    metadata = {"pqt_export": "1", "model_args": json.dumps(arch_args), "pqt": json.dumps(pqt),
                "config": json.dumps(config), "meta": json.dumps(meta), "iter_num": json.dumps(iter_num)}
    results = []
    other_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[cfg["other_dtype"]]
    for fmt_name in formats:
        data, mix = export_bytes(model, quantized, b_t, fmt_name, other_dtype, metadata)
        result = dict(mix, path=paths[fmt_name] if cfg["save"] else None, file_bytes=len(data))
        if cfg["save"]:
            write_atomic(paths[fmt_name], data)  # a crash leaves no half-written model file
        if cfg["evaluate"]:
            exported, _ = rebuild(data, cfg["device"])
            loss = val_loss(exported)
            result.update(val_loss=loss, val_loss_unquantized=reference, increase_pct=100 * (loss / reference - 1))
        results.append(result)

    summary = dict(checkpoint=ckpt_path, iter_num=iter_num, notes=notes, bitwidths=report, exports=results)
    if cfg["json"]:
        print(json.dumps(summary, indent=1))
    else:
        print_summary(summary, export_dir, cfg["plot"], (eval_iters, config["dtype"]) if cfg["evaluate"] else None)


def print_summary(summary, export_dir, plot, evaluation):
    """The tables of main's summary (what --json=True prints as one object); evaluation: (batches,
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
