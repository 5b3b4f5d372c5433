"""llama.cpp's block types as grids to train on and to write bit for bit: one spec per type (SPECS: its
blocks, sub-blocks, code and scale bits, the rule that picks its scales, its grid and its bytes), read by
quantize, dequantize, fake_quantize and pack.

    q = quantize(w, "q4_k")         # w: float32 (m, n); blocks run along each row; codes and scales
    w_hat = dequantize(q, "q4_k")   # float32, exactly as ggml's dequantize_row_q4_K computes it
    w_hat = fake_quantize(w, "q4_k")           # the same, the STE forward's weight
    raw = pack(q, "q4_k")           # numpy uint8 (m, bytes per row): the GGML blocks
    writer.add_tensor(name, raw, raw_dtype=ggml_type("q4_k"))   # gguf.GGUFWriter

A type is named by its GGML name in any case ("q4_k", "Q4_K") or by gguf's GGMLQuantizationType.
quantize returns a dict of tensors on w's device, the block's fields as ggml-common.h stores them
(FP16 scales as torch.float16, codes as the unsigned or signed integers of the layout), one entry per
block or sub-block, blocks in row order: each spec's `fields`. Q4_0, Q8_0, IQ4_NL and IQ4_XS are
llama.cpp's own rules, operation for operation (llama-quantize writes the same bytes); MXFP4 is the OCP
MX rule; the K-quants' scales are our own rule (_quantize_affine, _quantize_symmetric; docs/GGUF.md
measures it against llama-quantize's searches). Each rule's docstring says how and why.

dequantize computes as ggml's dequantize_row_* and gguf-py's numpy dequantizer do, in FP32: each
product of an FP16 scale, an integer scale code and an integer code is exact in FP32 (at most 11 + 8
+ 6 significant bits), so the only rounding is the subtraction of dmin*m, where ggml rounds too;
the results are bit-identical whatever the order and FMA contraction. quantize, dequantize and
fake_quantize are opaque to a torch.compile'd model (a graph break): by default inductor keeps a value
cast to FP16 and back in FP32 within a fused kernel, which moves the grid, and on a GPU Triton may
contract Q4_0's x*(1/d) + 8.5 into one FMA. fake_quantize(check=False) of a CPU weight compiles its own
loop with the settings that keep eager's bits (_fake_quantize_compiled).
"""
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

import util
from kernels.torch_noise import Compiled

T = GGMLQuantizationType
QK_K = 256  # weights per K-quant super-block
KVALUES_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # ggml's: twice E2M1's value of each code
KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # ggml-common.h's
IQ4_TRIES = 7  # quantize_iq4_nl/_xs's ntry: trial scales with the largest weight at -127 + k, k in -7..7
GROUP_MAX_EPS = 1e-15  # ggml-quants.c's: a block whose largest magnitude is below it is all zero
LLOYD_ROUNDS = 2  # K-quants' least-squares refits of the sub-block scales: 2 take most of the gain (docs/GGUF.md)


@dataclass(frozen=True)
class BlockType:
    """One of llama.cpp's block types: blocks of `block` weights along each row (gguf's GGML_QUANT_SIZES),
    each sub-block of `sub` weights with a scale (and a min) of its own, a code of `code_bits` per weight.
    Its rule (quantize) picks the scales and codes, its grid (dequantize) gives their values, and its
    packer (pack) writes ggml-common.h's block struct; each reads the numbers here."""
    type: GGMLQuantizationType
    sub: int  # weights per scale: the block's own (Q4_0, Q8_0, MXFP4, IQ4_NL), or a K-quant's sub-block
    code_bits: int  # bits of each weight's code
    scale_bits: int  # bits of a sub-block's scale (and min) code; 0: one FP16 (or E8M0) scale per block
    fields: str  # the fields quantize returns (shapes per row of n weights) and the value x of a code
    quantize: Callable  # the rule: (x (rows, blocks, block) FP32, spec, check[, importance]) -> fields
    dequantize: Callable  # the grid: (fields, spec) -> FP32 values (rows, blocks, block)
    pack: Callable  # the bytes: (numpy fields, codes (rows, blocks, codes per block)) -> [uint8 arrays]
    scale_offset: int = 0  # a stored scale code less this is its signed value
    signed: str = ""  # the field stored as int8; every other code is uint8
    importance: bool = False  # llama.cpp's searched rule: quantize takes its importance weights

    @property
    def block(self):
        return GGML_QUANT_SIZES[self.type][0]

    @property
    def half(self):
        """2^(code_bits - 1): a symmetric grid's extra negative level, the offset of its stored codes."""
        return 2 ** (self.code_bits - 1)

    @property
    def qmax(self):
        return 2 ** self.code_bits - 1

    @property
    def cmax(self):
        """An unsigned scale code's largest (affine K-quants: sub-block scales and mins 0..cmax)."""
        return 2 ** self.scale_bits - 1

    @property
    def cneg(self):
        """A signed scale code's range is -cneg..cneg - 1 (the symmetric K-quants, IQ4_XS)."""
        return 2 ** (self.scale_bits - 1)


class QuantError(util.UserError, ValueError):
    """A weight a GGML type cannot hold: its width, its shape, non-finite values, a scale beyond FP16."""


def ggml_type(name):
    """gguf's GGMLQuantizationType of one of SPECS' types, from it or its name in any case ("q4_k")."""
    t = name if isinstance(name, GGMLQuantizationType) else T.__members__.get(str(name).upper())
    if t not in SPECS:
        raise QuantError(f"unknown GGML block type {name!r}: one of {', '.join(t.name.lower() for t in SPECS)}")
    return t


def block_size(name):
    """Weights per block of a row: 32, or 256 for the K-quants and IQ4_XS."""
    return SPECS[ggml_type(name)].block


def bits_per_weight(name):
    """The type's bits per weight, from gguf's own block sizes (bytes per block * 8 / weights per block)."""
    weights, size = GGML_QUANT_SIZES[ggml_type(name)]
    return size * 8 / weights


def _check(w, t, check):
    """w as float32 (m, n) blocks of t: a one-line QuantError for a shape or width t cannot hold, and with
    check for NaN or infinite weights (one host-device synchronisation)."""
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise QuantError(f"{t.name} quantizes a 2-D floating-point weight (rows, input width); got {shape}")
    bs = GGML_QUANT_SIZES[t][0]
    if w.shape[1] % bs:
        raise QuantError(f"{t.name} needs a row width (the Linear's input dimension) that is a multiple of {bs}; "
                         f"this weight's is {w.shape[1]}")
    if check and not bool(torch.isfinite(torch.stack(torch.aminmax(w))).all()):  # NaN propagates to both
        raise QuantError(f"{t.name}: the weight has NaN or infinite values; only finite weights can be quantized")
    return w.float()


def _fp16(s, t, what, check, cmax=None):
    """FP32 scales in FP16, rounded to nearest even (GGML_FP32_TO_FP16), refusing any beyond FP16's range.
    With cmax (a K-quant's d or dmin: the largest sub-block scale / cmax): rounded instead to the next FP16
    value away from zero where nearest would put the largest sub-block scale's code beyond cmax + 1/2; a
    subnormal d rounded to nearest can be a third too small (a non-zero one 0); in FP16's normal range
    (relative rounding below 2^-11) this never happens."""
    s16 = s.half()
    if cmax is not None:
        s16 = s16 + 0.0  # -0 + 0 = +0: an all-zero block's d is 0, not -0 (its codes then dequantize to +0)
        short = s16.float().abs() * (cmax + 0.5) < s.abs() * cmax
        s16 = torch.where(short, _next_from_zero(s16), s16)
    if check and not bool(torch.isfinite(s16).all()):
        raise QuantError(f"{t.name}: a block's {what} {s.abs().max().item():.6g} is beyond FP16's largest value "
                         f"65504; these weights are too large for {t.name} (scale them down)")
    return s16


def _next_from_zero(h):
    """The FP16 value next to h away from zero (2^-24 for +0): the successor of h's bit pattern, computed
    in floats (a bit-cast view stops inductor fusing the K-quants' loops). A normal h = m * ulp, m in
    1024..2047, gains m * (2^-11 + 2^-20) ulp, between 1/2 and 3/2 ulp, which rounds to one ulp; a
    subnormal h gains its ulp 2^-24 exactly. tests/test_ggml_quants.py checks every finite FP16 value."""
    a = h.float().abs()
    return torch.copysign(torch.maximum((a * (1 + 2**-11 + 2**-20)).half(), (a + 2**-24).half()), h)


def _first_absmax(x):
    """Each row's (last dimension's) signed value of largest magnitude, the first at ties, as
    llama.cpp's loops find it; +0 for an all-zero row."""
    v = x.gather(-1, torch.max(x.abs(), -1, keepdim=True).indices).squeeze(-1)  # max: the first index at ties
    return v + 0.0  # -0 + 0 = +0: an all-zero block's "max" stays the reference's initial +0


def _signed_absmax(x):
    """Each row's (last dimension's) signed value of largest magnitude, the positive one where +a and -a
    tie: the K-quants' rule, which need not find the first as llama.cpp's loops do, in two reductions."""
    hi, lo = x.amax(-1), x.amin(-1)
    return torch.where(hi >= -lo, hi, lo) + 0.0  # -0 + 0 = +0


def _round_half_away(p):
    """C's roundf: round to nearest, ties away from zero, exactly (a + 0.5 would round 0.49999997 to 1)."""
    a = p.abs()
    f = a.floor()
    return torch.copysign(f.add_(a.sub_(f) >= 0.5), p).add_(0.0)  # -0 + 0 = +0: the integer 0


def _div_or_zero(a, b):
    """a / b where b != 0, else 0 (correctly rounded division, no NaN from 0/0)."""
    return a / torch.where(b != 0, b, torch.inf)


def _codes(x, scale, offset, lo, hi):
    """round((x + offset) / scale), clamped to lo..hi, per sub-block (scale, offset: x's shape less its last
    dimension; a zero scale gives code 0, possibly -0)."""
    step = torch.where(scale != 0, scale, torch.inf)[..., None]
    q = (x + offset[..., None]).div_(step) if offset is not None else x / step
    return q.round_().clamp_(lo, hi)



# --- llama.cpp's reference rules: Q4_0, Q8_0 --------------------------------------------------------------

def _quantize_q4_0(x, spec, check):
    """llama.cpp's quantize_row_q4_0_ref, operation for operation in FP32, so that llama-quantize (without an
    importance matrix) of an F32 GGUF of the trained master weights writes the bytes pack(quantize(w)) writes:
    a model trained on this grid and its llama.cpp file are the same whichever of the two writes it. d = the
    block's signed value of largest magnitude (the first, at ties) / -8, stored FP16 (to nearest, as
    llama.cpp: a tiny block's d may be subnormal, or zero, and then the block is all zeros); the codes use
    the FP32 1/d of the unrounded d: q = min(15, trunc(x*(1/d) + 8.5)) with the product and the sum each
    rounded to FP32 (llama.cpp's ggml-base is built without FMA). As in llama.cpp, a code is not always the
    nearest point of the stored (FP16-rounded) grid. Idempotent: the block's largest weight lands on the
    extreme code, which gives back the same scale."""
    d = _first_absmax(x) / -spec.half
    q = x * _div_or_zero(torch.ones_like(d), d)[..., None]
    q.add_(spec.half + 0.5).trunc_().clamp_(max=spec.qmax)  # the product and the sum each rounded to FP32, as C
    return {"d": _fp16(d, spec.type, "scale d", check), "q": q}


def _quantize_q8_0(x, spec, check):
    """llama.cpp's quantize_row_q8_0_ref, operation for operation in FP32 (as Q4_0's): d = amax/127 in FP16,
    q = roundf(x*(1/d)) (half away from zero). Idempotent."""
    d = x.abs().amax(-1) / (spec.half - 1)
    q = _round_half_away(x * _div_or_zero(torch.ones_like(d), d)[..., None])
    return {"d": _fp16(d, spec.type, "scale d", check), "q": q}


# --- MXFP4: the OCP MX rule ------------------------------------------------------------------------------

def _e8m0_to_fp32(e, half=False):
    """2^(e-127) (half: 2^(e-128), ggml's GGML_E8M0_TO_FP32_HALF) as FP32, built from its bits, exact down to
    the subnormals."""
    e = e.to(torch.int32) - int(half)
    subnormal = torch.tensor(0x00400000, dtype=torch.int32, device=e.device) >> -e.clamp(max=0)
    return torch.where(e >= 1, e << 23, subnormal).view(torch.float32)


def _quantize_mxfp4(x, spec, check):
    """The OCP MX v1.0 conversion, as our safetensors file's mxfp4 (formats.py): shared exponent
    floor(log2 amax) - 2 (exact, from the float's own exponent), elements E2M1 rounded half to even,
    saturating at 6, a zero stored as the +0 code. llama.cpp's quantize_row_mxfp4_ref takes the same
    exponent but rounds each element to the first nearest of its table, i.e. half towards zero: at the
    ties 0.75, 1.75 and 3.5 (in units of the scale) it writes 0.5, 1.5 and 3 where OCP writes 1, 2 and
    4; and its FP32 log2f rounds up to the next exponent when amax lies within a few FP32 roundings
    below a power of two. Anywhere else the two write the same codes. An amax below 2^-125 (whose
    exponent is below E8M0's range) takes the smallest scale, 2^-127. Idempotent."""
    amax = x.abs().amax(-1)
    exponent = torch.frexp(amax)[1] - 1  # floor(log2 amax), exactly: amax = f * 2^e, f in [0.5, 1)
    e = torch.where(amax > 0, exponent - 2 + 127, 0).clamp_(0, 254).float()
    v = x / _e8m0_to_fp32(e)[..., None]  # exact: a power-of-two rescaling
    a = v.abs()
    step = (a >= 2).float().mul_(0.5).add_(0.5).add_(a >= 4)  # E2M1's spacing at a: 0.5, 1 from 2, 2 from 4
    r = a.div_(step).round_().mul_(step).clamp_(max=6.0)  # round half to even, saturating
    code = torch.minimum(2 * r, r + 2).sub_((r > 4).float())  # r's index in E2M1's table 0, .5, 1, 1.5, 2, 3, 4, 6
    code += ((v < 0) & (code > 0)).float().mul_(8)  # the sign bit; a zero takes the +0 code, as llama.cpp's
    return {"e": e, "q": code}



# --- K-quants: our rule ----------------------------------------------------------------------------------

def _scale_codes(s, d, cmin, cmax):
    """Codes of scales s against the stored super-block scale d: rounded to nearest, clamped to the code
    range, and at least magnitude 1 where s is not zero (d = 0 gives code 0)."""
    c = torch.round(_div_or_zero(s, d[..., None]))
    c = torch.where((c == 0) & (s != 0) & (d[..., None] != 0), torch.sign(s * d[..., None]), c)
    return c.clamp_(cmin, cmax).add_(0.0)  # -0 + 0 = +0: the integer 0


def _tree_sum(x):
    """Sum over the last dimension (a power of two) by halves: one fixed order, so that every device gives
    the same FP32 sum and the same codes."""
    while x.shape[-1] > 1:
        x = x[..., :x.shape[-1] // 2] + x[..., x.shape[-1] // 2:]
    return x[..., 0]


def _affine_fit(x, qmax):
    """Each sub-block's scale s and min b >= 0 (x ~ s*L - b, L in 0..qmax): its range [min(x, 0), max(x)],
    then LLOYD_ROUNDS of: each weight's nearest code L, then the least-squares s and b for those L."""
    lo = x.amin(-1).clamp_(max=0)
    s, b = (x.amax(-1) - lo) / qmax, -lo
    n, sx = x.shape[-1], _tree_sum(x)
    for _ in range(LLOYD_ROUNDS):
        L = _codes(x, s, b, 0, qmax)
        sl, sl2, sxl = L.sum(-1), (L * L).sum(-1), _tree_sum(x * L)  # sums of integers: exact in any order
        det = n * sl2 - sl * sl
        fit_s, fit_b = _div_or_zero(n * sxl - sx * sl, det), _div_or_zero(sl * sxl - sl2 * sx, det)
        lowest_above_0 = fit_b < 0  # the grid's lowest point -b may not lie above 0: fit s alone, b = 0
        fit_s = torch.where(lowest_above_0, _div_or_zero(sxl, sl2), fit_s)
        ok = (det > 0) & (fit_s > 0)  # L not all equal
        s, b = torch.where(ok, fit_s, s), torch.where(ok, fit_b.clamp_(min=0), b)
    return s, b


def _quantize_affine(x, spec, check):
    """Our rule for the affine K-quants (x = d*sc*q - dmin*m, sub-blocks of spec.sub weights, q in 0..qmax,
    scale and min codes 0..cmax), vectorised, about 25 passes over the weight, and the same codes on every
    device (maxima, minima, correctly rounded divisions, sums in one fixed order: _tree_sum). Each
    sub-block's scale starts from its range [min(x, 0), max(x)], the grid's lowest point -dmin*m never
    above 0, as in llama.cpp; then LLOYD_ROUNDS rounds of Lloyd's algorithm (_affine_fit), which clip the
    tails where that lowers the error. The range alone leaves 1-12 % more RMS error than llama-quantize's
    searches on Gaussian and heavy-tailed weights; two rounds 1-4 % more for Q4_K and Q5_K and 2-12 % less
    for Q2_K (docs/GGUF.md); more rounds add little. The super-block's d and dmin: the largest sub-block
    scale (min) / cmax in FP16 (to nearest, or to the FP16 value above where nearest would put the largest
    code beyond its range: _fp16); each sub-block's codes rounded to nearest against them, at least 1 where
    its scale is not 0 (no sub-block collapses to one value); every weight's code q = round((x + dmin*m) /
    (d*sc)), clamped, from the stored FP16 d, dmin and integer codes: dequantize gives the nearest point of
    the stored grid (up to an FP32 rounding at the midpoints). Not idempotent: a sub-block whose weights
    miss its extreme codes starts again from a narrower range and may settle on another grid."""
    sub, qmax, cmax, t = spec.sub, spec.qmax, spec.cmax, spec.type
    x = x.unflatten(-1, (QK_K // sub, sub))
    scale, mn = _affine_fit(x, qmax)
    d = _fp16(scale.amax(-1) / cmax, t, "scale d", check, cmax)
    dmin = _fp16(mn.amax(-1) / cmax, t, "min scale dmin", check, cmax)
    sc, m = _scale_codes(scale, d.float(), 0, cmax), _scale_codes(mn, dmin.float(), 0, cmax)
    q = _codes(x, d.float()[..., None] * sc, dmin.float()[..., None] * m, 0, qmax)  # the stored grid, as ggml
    q += 0.0  # -0 + 0 = +0: the integer 0 (d1*0 - m1 is then ggml's value where m1 = 0)
    return {"d": d, "dmin": dmin, "sc": sc, "m": m, "q": q}


def _symmetric_fit(x, qneg):
    """Each sub-block's signed scale s (x ~ s*L, L in -qneg..qneg-1): its signed value of largest magnitude
    / -qneg (which takes the extra level), then LLOYD_ROUNDS of: nearest codes, least-squares s."""
    s = _signed_absmax(x) / -qneg
    for _ in range(LLOYD_ROUNDS):
        L = _codes(x, s, None, -qneg, qneg - 1)
        fit = _div_or_zero(_tree_sum(x * L), (L * L).sum(-1))  # the sum of integers: exact in any order
        s = torch.where(fit != 0, fit, s)
    return s


def _quantize_symmetric(x, spec, check):
    """Our rule for the symmetric K-quants (x = d*sc*q, sub-blocks of spec.sub weights, q in -qneg..qneg-1
    with qneg = spec.half, scale codes in -cneg..cneg-1; stored as q + qneg and sc + spec.scale_offset), as
    _quantize_affine's: each sub-block's scale starts from its signed value of largest magnitude (the
    positive one at a tie) / -qneg, so that this weight takes the one extra negative level, as Q4_0 does,
    then LLOYD_ROUNDS of nearest codes and the least-squares scale (_symmetric_fit: 1-4 % more RMS error
    than llama-quantize's searches at 6 code bits, 2-12 % less at 3); d = the signed largest scale / -cneg in
    FP16, which takes the extra negative scale code."""
    qneg, cneg, t = spec.half, spec.cneg, spec.type
    x = x.unflatten(-1, (QK_K // spec.sub, spec.sub))
    scale = _symmetric_fit(x, qneg)
    d = _fp16(_signed_absmax(scale) / -cneg, t, "scale d", check, cneg)
    sc = _scale_codes(scale, d.float(), -cneg, cneg - 1)
    q = _codes(x, d.float()[..., None] * sc, None, -qneg, qneg - 1).add_(qneg)
    return {"d": d, "sc": sc + spec.scale_offset if spec.scale_offset else sc, "q": q}



# --- IQ4_NL, IQ4_XS: llama.cpp's rule (quantize_row_iq4_nl_impl) ----------------------------------------

def _sequential_sum(t):
    """The sum over the first dimension in index order from +0, each addition rounded to FP32: a C loop's
    `float s = 0; for (j...) s += t[j];` (ggml-base has no FMA to contract it)."""
    s = torch.zeros(t.shape[1:], dtype=t.dtype, device=t.device)
    for term in t:
        s.add_(term)
    return s


def _divide(a, b):
    """a / b for a number a and a tensor b: one correctly rounded FP32 division each, as C's (torch's own
    a / b multiplies by b's reciprocal)."""
    return torch.full_like(b, a) / b



# best_index_int8 as tables over floor(x) (the levels are integers, so kvalues[l] <= x exactly where
# kvalues[l] <= floor(x)): for each integer i from -127 to 113, the level l of KVALUES_IQ4NL (at most 14) with
# kvalues[l] <= i, and the two levels around it
_IQ4_BELOW = [max(k for k in range(15) if KVALUES_IQ4NL[k] <= i) for i in range(-127, 114)]
_IQ4_AROUND = [[KVALUES_IQ4NL[k] for k in _IQ4_BELOW], [KVALUES_IQ4NL[k + 1] for k in _IQ4_BELOW]]


def _iq4_nearest(x):
    """best_index_int8 of each value of x (finite) on KVALUES_IQ4NL, as (its level's value, whether it is the
    upper of the two around x): around x the levels lo <= x < hi (the lowest two below the grid, the highest
    two above it), then hi unless x - lo < hi - x, both differences in FP32, which gives the lowest level
    below the grid and the highest above it, as the C's early returns do."""
    at = x.clamp(-127, 113).floor_().add_(127).long().flatten()
    around = torch.tensor(_IQ4_AROUND, dtype=torch.float32, device=x.device)
    lo, hi = around[0].index_select(0, at).view_as(x), around[1].index_select(0, at).view_as(x)
    upper = (x - lo) >= (hi - x)
    return torch.where(upper, hi, lo), upper


def _iq4_codes(x):
    """The level index (0..15) best_index_int8 gives each value of x, as floats."""
    _, upper = _iq4_nearest(x)
    at = x.clamp(-127, 113).floor_().add_(127).long().flatten()
    below = torch.tensor(_IQ4_BELOW, dtype=torch.float32, device=x.device).index_select(0, at).view_as(x)
    return below + upper


def _iq4_scales(x, weight):
    """Each 32-weight block's FP32 scale (the first loop of quantize_row_iq4_nl_impl), x and weight (32, ...):
    the least-squares scale of the codes at the block's signed largest weight / 127, then at each of
    IQ4_TRIES' trial scales, keeping the one with the best weighted fit sumqx^2 / sumq2 (the first at ties);
    each sum in the C's order, each product (w*q)*x rounded. 0 for a block of magnitude below GROUP_MAX_EPS
    (whose trials are made at 0 and not used)."""
    top = _first_absmax(x.movedim(0, -1))
    zero = top.abs() < GROUP_MAX_EPS
    top = torch.where(zero, 1.0, top)
    trials = [_divide(1, (-top) / torch.full_like(top, -127.0))]
    trials += [_divide(k - 127, top) for k in range(-IQ4_TRIES, IQ4_TRIES + 1)]
    inverse = torch.where(zero, 0.0, torch.stack(trials))  # (trials, ...)
    q, _ = _iq4_nearest(inverse * x[:, None])  # (32, trials, ...)
    wq = weight[:, None] * q
    sumqx, sumq2 = _sequential_sum(wq * x[:, None]), _sequential_sum(wq.mul_(q))
    d = torch.where(sumq2[0] > 0, _div_or_zero(sumqx[0], sumq2[0]), 0.0)
    best = d * sumqx[0]
    for k in range(1, len(trials)):
        better = (sumq2[k] > 0) & (sumqx[k] * sumqx[k] > best * sumq2[k])
        d = torch.where(better, _div_or_zero(sumqx[k], sumq2[k]), d)
        best = torch.where(better, d * sumqx[k], best)
    return torch.where(zero, 0.0, d)


def _iq4_weights(x, weights, sub):
    """Each weight's importance in the fit, x (32, rows, super-blocks, sub / 32): x^2 without an importance
    matrix; with one (weights: (columns,), the same for every row), weights * sqrt(sigma2 + x^2), sigma2 = 2
    / sub * the sum of squares of its super-block of sub weights."""
    if weights is None:
        return x * x
    sigma2 = _sequential_sum((x * x).movedim(-1, 0).flatten(0, 1)) * (2 / sub)  # its blocks in order
    root = torch.sqrt((sigma2[..., None] + x * x).double()).float()  # correctly rounded, as C's sqrtf (torch's is not)
    return weights.float().view(-1, sub // 32, 32).permute(2, 0, 1)[:, None] * root


def _quantize_iq4(x, spec, check, weights=None):
    """llama.cpp's quantize_iq4_nl and quantize_iq4_xs (quantize_row_iq4_nl_impl with ntry IQ4_TRIES),
    operation for operation in FP32 (sums in the C's order, _sequential_sum), so that llama-quantize writes
    the bytes pack(quantize(w)) writes, with its importance matrix too (weights: each input column's imatrix
    value). Per 32 weights: each weight's importance (_iq4_weights), then the least-squares scale of the
    codes nearest at 16 trial scales, the one whose weighted fit is best (_iq4_scales). As for Q4_0, a code
    is not always the nearest point of the stored grid; nor is the rule idempotent (the search may find
    another scale). A block whose largest magnitude is below GROUP_MAX_EPS is all zero (its codes the level
    1, index 8); an IQ4_XS super-block of zeros stores d = -0. (quantize_row_iq4_nl_ref, which ggml's CPU
    backend uses to quantize activations, differs: one trial scale, the mirrored one.)

    x: (m, blocks, 32) for IQ4_NL, (m, super-blocks, 256) for IQ4_XS: the scales of the
    32-weight blocks (_iq4_scales), then IQ4_NL's in FP16 with each weight's level against the FP32 scale;
    IQ4_XS's as scale_bits codes of d = -(the super-block's signed largest scale) / cneg (the first block of the
    largest magnitude; +0 where all are 0, so that d is -0), d in FP16, each weight's level against d * code
    in FP32. The weights are laid out (32, rows, super-blocks, blocks) inside, so that each sum over a
    block's 32 weights runs over contiguous slices."""
    sub = x.shape[-1]
    xt = x.unflatten(-1, (sub // 32, 32)).permute(3, 0, 1, 2).contiguous()
    scale = _iq4_scales(xt, _iq4_weights(xt, weights, sub))  # (rows, super-blocks, blocks)
    t = spec.type
    if not spec.scale_bits:  # IQ4_NL: each block's own FP16 scale
        fields = {"d": _fp16(scale[..., 0], t, "scale d", check)}
        inverse = torch.where(scale != 0, _divide(1, scale), 0.0)
    else:
        d = -_first_absmax(scale) / spec.cneg
        sc = (torch.where(d != 0, _divide(1, d), 0.0)[..., None] * scale).round_()  # nearest_int
        sc.clamp_(-spec.cneg, spec.cneg - 1)
        dl = d[..., None] * sc
        fields = {"d": _fp16(d, t, "scale d", check), "sc": sc + spec.scale_offset}
        inverse = torch.where(dl != 0, _divide(1, dl), 0.0)
    q = _iq4_codes(inverse * xt)  # (32, rows, super-blocks, blocks)
    return {**fields, "q": q.permute(1, 2, 3, 0).reshape(x.shape)}



# --- the grids: ggml's dequantize_row_* --------------------------------------------------------------------

def _dequantize_offset(q, spec):
    """Q4_0, Q8_0: d * (q - offset), the stored codes' offset (Q4_0's 8; none for Q8_0's int8 codes)."""
    x = q["q"].reshape(*q["d"].shape, spec.block).float()
    return (x if spec.signed == "q" else x - spec.half) * q["d"].float()[..., None]


def _dequantize_affine(q, spec):
    d1 = q["d"].float()[..., None] * q["sc"].float()  # ggml: d1 = d * sc, m1 = dmin * m (exact), d1*q - m1
    m1 = q["dmin"].float()[..., None] * q["m"].float()
    x = q["q"].reshape(*d1.shape, spec.sub).float()
    return (d1[..., None] * x).sub_(m1[..., None])


def _dequantize_symmetric(q, spec):
    sc = q["sc"].float() - spec.scale_offset if spec.scale_offset else q["sc"]
    d1 = q["d"].float()[..., None] * sc.float()
    return d1[..., None] * (q["q"].reshape(*d1.shape, spec.sub).float() - spec.half)


def _dequantize_mxfp4(q, spec):
    values = torch.tensor(KVALUES_MXFP4, dtype=torch.float32, device=q["q"].device)
    d = _e8m0_to_fp32(q["e"], half=True)  # ggml's table holds twice the E2M1 values, so half the scale
    return values[q["q"].long()].reshape(*d.shape, spec.block) * d[..., None]


def _dequantize_iq4(q, spec):
    """ggml's dequantize_row_iq4_nl/_xs: d (per 32 weights) * kvalues[q], exact in FP32 (11 + 6 + 7 bits)."""
    d = q["d"].float()
    if spec.scale_bits:  # IQ4_XS: the super-block's d times each block's scale code
        d = d[..., None] * (q["sc"].float() - spec.scale_offset)
    values = torch.tensor(KVALUES_IQ4NL, dtype=torch.float32, device=q["q"].device)
    return values[q["q"].long()].reshape(*d.shape, spec.sub) * d[..., None]


# --- the GGML block bytes (ggml-common.h's block structs) ----------------------------------------------------

def _np(q):
    return {k: v.detach().cpu().numpy() for k, v in q.items()}


def _f16_bytes(d):
    return d.astype("<f2").view(np.uint8).reshape(*d.shape, 2)


def _nibbles(q, groups):
    """Pairs of 4-bit codes: byte l of each 2*groups codes holds code l (low nibble) and code groups + l."""
    q = q.reshape(*q.shape[:-1], -1, 2, groups)
    return (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(*q.shape[:-3], -1)


def _crumbs(q):
    """Four 2-bit fields per byte: byte l of each 128 codes holds codes l, 32+l, 64+l, 96+l from bit 0 up."""
    q = q.reshape(*q.shape[:-1], -1, 4, 32).astype(np.uint8)
    return np.bitwise_or.reduce(q << (2 * np.arange(4, dtype=np.uint8))[:, None], axis=-2).reshape(*q.shape[:-3], -1)


def _k_scales(sc, m):
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and mins: low 6 bits of sub-blocks 0-3 in bytes 0-3 (scales)
    and 4-7 (mins), sub-blocks 4-7's low nibbles in bytes 8-11, their top 2 bits in bytes 0-7's top bits."""
    return np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), m[..., :4] | ((m[..., 4:] >> 4) << 6),
                           (sc[..., 4:] & 0xF) | ((m[..., 4:] & 0xF) << 4)], axis=-1)


def _q3_k_scales(sc):
    """block_q3_K's 12 bytes of sixteen 6-bit scales: low nibbles of 0-7 and (above) 8-15 in bytes 0-7, the top
    2 bits of scale j in byte 8 + j%4 at bit 2*(j//4)."""
    top = (sc >> 4).reshape(*sc.shape[:-1], 4, 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]
    return np.concatenate([(sc[..., :8] & 0xF) | ((sc[..., 8:] & 0xF) << 4),
                           np.bitwise_or.reduce(top, axis=-2)], axis=-1)


def _bits(q, shift, groups):
    """Bit `shift` of each code, in byte l of `groups` bytes at bit (index // groups)."""
    b = ((q >> shift) & 1).reshape(*q.shape[:-1], -1, groups)
    return np.bitwise_or.reduce(b << np.arange(b.shape[-2], dtype=np.uint8)[:, None], axis=-2)


def _block_d_nibbles(q, codes):
    """block_q4_0, block_iq4_nl: d, then the 32 codes as nibbles (byte l: codes l and 16 + l)."""
    return [_f16_bytes(q["d"]), _nibbles(codes, 16)]


def _block_q8_0(q, codes):
    return [_f16_bytes(q["d"]), codes.view(np.uint8)]


def _block_mxfp4(q, codes):
    return [q["e"][..., None], _nibbles(codes, 16)]


def _block_iq4_xs(q, codes):
    """d, scales_h (uint16: bits 2j, 2j+1 the top of scale j), scales_l (nibbles: j even low), qs."""
    sc = q["sc"].astype(np.uint16)
    high = np.bitwise_or.reduce((sc >> 4) << (2 * np.arange(8, dtype=np.uint16)), axis=-1)
    return [_f16_bytes(q["d"]), high[..., None].astype("<u2").view(np.uint8),
            (sc[..., 0::2] & 0xF) | ((sc[..., 1::2] & 0xF) << 4), _nibbles(codes, 16)]


def _block_q4_k(q, codes):
    return [_f16_bytes(q["d"]), _f16_bytes(q["dmin"]), _k_scales(q["sc"], q["m"]), _nibbles(codes, 32)]


def _block_q5_k(q, codes):
    return [_f16_bytes(q["d"]), _f16_bytes(q["dmin"]), _k_scales(q["sc"], q["m"]), _bits(codes, 4, 32),
            _nibbles(codes & 0xF, 32)]


def _block_q2_k(q, codes):
    return [q["sc"] | (q["m"] << 4), _crumbs(codes), _f16_bytes(q["d"]), _f16_bytes(q["dmin"])]


def _block_q3_k(q, codes):
    return [_bits(codes, 2, 32), _crumbs(codes & 3), _q3_k_scales(q["sc"]), _f16_bytes(q["d"])]


def _block_q6_k(q, codes):
    """ql byte 64h + 32b + l holds the low 4 bits of codes 128h + 32b + l and (above) 128h + 64 + 32b + l."""
    low = (codes & 0xF).reshape(*codes.shape[:-1], 2, 2, 2, 32)
    ql = (low[..., 0, :, :] | (low[..., 1, :, :] << 4)).reshape(*codes.shape[:-1], -1)
    return [ql, _crumbs(codes >> 4), q["sc"].view(np.uint8), _f16_bytes(q["d"])]


# --- the types: one spec each, in formats.GGML_FORMATS' order ----------------------------------------------
# Each: the type, its weights per scale, code bits and scale code bits, the fields quantize returns (their shapes
# for an (m, n) weight, and the value x of a code), its rule, grid and bytes.
SPECS = {spec.type: spec for spec in (
    BlockType(T.Q4_0, 32, 4, 0, "d (m, n/32) f16; q (m, n) u8 0..15; x = d*(q-8)",
              _quantize_q4_0, _dequantize_offset, _block_d_nibbles),
    BlockType(T.Q8_0, 32, 8, 0, "d (m, n/32) f16; q (m, n) i8 -127..127; x = d*q",
              _quantize_q8_0, _dequantize_offset, _block_q8_0, signed="q"),
    BlockType(T.Q4_K, 32, 4, 6, "d, dmin (m, n/256) f16; sc, m (m, n/256, 8) u8 0..63; q (m, n) u8 0..15; "
              "x = d*sc*q - dmin*m", _quantize_affine, _dequantize_affine, _block_q4_k),
    BlockType(T.Q5_K, 32, 5, 6, "d, dmin (m, n/256) f16; sc, m (m, n/256, 8) u8 0..63; q (m, n) u8 0..31; "
              "x = d*sc*q - dmin*m", _quantize_affine, _dequantize_affine, _block_q5_k),
    BlockType(T.Q3_K, 16, 3, 6, "d (m, n/256) f16; sc (m, n/256, 16) u8 0..63; q (m, n) u8 0..7; "
              "x = d*(sc-32)*(q-4)", _quantize_symmetric, _dequantize_symmetric, _block_q3_k, scale_offset=32),
    BlockType(T.Q2_K, 16, 2, 4, "d, dmin (m, n/256) f16; sc, m (m, n/256, 16) u8 0..15; q (m, n) u8 0..3; "
              "x = d*sc*q - dmin*m", _quantize_affine, _dequantize_affine, _block_q2_k),
    BlockType(T.Q6_K, 16, 6, 8, "d (m, n/256) f16; sc (m, n/256, 16) i8; q (m, n) u8 0..63; x = d*sc*(q-32)",
              _quantize_symmetric, _dequantize_symmetric, _block_q6_k, signed="sc"),
    BlockType(T.MXFP4, 32, 4, 0, "e (m, n/32) u8 E8M0; q (m, n) u8 E2M1 code (bit 3 the sign); "
              "x = 2^(e-127) * E2M1(q)", _quantize_mxfp4, _dequantize_mxfp4, _block_mxfp4),
    BlockType(T.IQ4_NL, 32, 4, 0, "d (m, n/32) f16; q (m, n) u8 0..15; x = d*kvalues[q] (KVALUES_IQ4NL)",
              _quantize_iq4, _dequantize_iq4, _block_d_nibbles, importance=True),
    BlockType(T.IQ4_XS, 32, 4, 6, "d (m, n/256) f16; sc (m, n/256, 8) u8 0..63; q (m, n) u8 0..15; "
              "x = d*(sc-32)*kvalues[q]", _quantize_iq4, _dequantize_iq4, _block_iq4_xs, scale_offset=32,
              importance=True),
)}
TYPES = tuple(SPECS)
IQ4 = tuple(t for t, spec in SPECS.items() if spec.importance)  # quantize takes importance weights (an imatrix)


# --- the API: quantize, dequantize, fake_quantize, pack ----------------------------------------------------

def _importance(weights, spec, n):
    """quantize's importance weights as a float32 (n,) tensor, or a one-line QuantError: for IQ4_NL and IQ4_XS
    only (the other types' rules weigh every weight alike), one finite value >= 0 per input column."""
    t = spec.type
    if not spec.importance:
        raise QuantError(f"{t.name} takes no importance weights (its rule weighs every weight alike); "
                         f"{' and '.join(x.name for x in IQ4)} do")
    weights = torch.as_tensor(weights).float()
    if weights.shape != (n,) or not bool((torch.isfinite(weights) & (weights >= 0)).all()):
        raise QuantError(f"{t.name}: importance weights are one finite value >= 0 per input column ({n}); got "
                         f"shape {tuple(weights.shape)}" + ("" if weights.shape != (n,) else " with others"))
    return weights


def _quantize_float(w, spec, check, weights=None):
    """quantize's fields with the integer codes still in FP32 (what fake_quantize dequantizes directly)."""
    w = _check(w, spec.type, check)
    m, n = w.shape
    bs = spec.block
    x = w.reshape(m, n // bs, bs)
    if weights is None:
        q = spec.quantize(x, spec, check)
    else:
        q = spec.quantize(x, spec, check, _importance(weights, spec, n).to(w.device))
    q["q"] = q["q"].reshape(m, n)
    return q


@torch.compiler.disable
@torch.no_grad()
def quantize(w, type, check=True, weights=None):
    """Codes and scales of w (float (m, n), n a multiple of the type's block) on the type's grid by the
    type's rule: a dict of tensors on w's device, laid out as its spec's fields.
    check=False skips the host-device synchronisations that refuse non-finite weights and FP16-overflowing
    scales (for a training step, whose loss is checked). weights: IQ4_NL's and IQ4_XS's importance of each
    input column, llama.cpp's importance matrix (llama-quantize --imatrix); None: each weight's square."""
    spec = SPECS[ggml_type(type)]
    q = _quantize_float(w, spec, check, weights)
    return {k: v if v.dtype == torch.float16 else v.to(torch.int8 if spec.signed == k else torch.uint8)
            for k, v in q.items()}


@torch.compiler.disable
@torch.no_grad()
def dequantize(q, type):
    """The float32 (m, n) values of quantize's codes and scales, bit for bit as ggml's dequantize_row_*."""
    spec = SPECS[ggml_type(type)]
    return spec.dequantize(q, spec).reshape(q["q"].shape)


def _fake_quantize(w, t, check=False):
    spec = SPECS[T(t)]  # called with the type's int: given the IntEnum, torch 2.13's compile ran Q4_0's loop for Q8_0
    return spec.dequantize(_quantize_float(w, spec, check), spec).reshape(w.shape)


# The STE's fake quantization on CPU: one compiled loop per weight shape and type, a few passes over the
# weight instead of eager's dozens: 3-5x less of a training step (docs/BENCH.md). Compiling one takes 5-20 s, which a
# weight of 2^19 elements (GPT2-124M's smallest Linear has 589,824) repays within about a thousand
# steps; smaller ones stay eager. emulate_precision_casts keeps every FP16 rounding of
# a scale inside the fused loop (inductor would otherwise keep the FP32 value), and inductor's C++ is
# built with -ffp-contract=off, so no product and sum become one FMA: the loop gives eager's bits, which
# tests/test_ggml_quants.py checks for every type on weights made to hit the rules' edges. On a GPU
# the eager kernels run (Triton contracts FMAs, and each pass is cheap there).
_fake_quantize_compiled = Compiled(_fake_quantize, min_numel=2**19, options={"emulate_precision_casts": True},
                                   what="llama.cpp's grids")


@torch.compiler.disable
@torch.no_grad()
def fake_quantize(w, type, check=True):
    """dequantize(quantize(w, type)), bit for bit: w on the type's grid, the STE forward's weight. With
    check=False (no host-device synchronisation) a CPU weight goes through one compiled loop."""
    t = ggml_type(type)
    if not check and w.device.type == "cpu" and not SPECS[t].importance:
        return _fake_quantize_compiled(w, int(t))
    return _fake_quantize(w, t, check)


def pack(q, type):
    """quantize's codes and scales as the type's GGML blocks: a numpy uint8 array (m, bytes per row), the
    raw data gguf.GGUFWriter.add_tensor(name, packed, raw_dtype=type) writes."""
    spec = SPECS[ggml_type(type)]
    q = _np(q)
    nb = q["q"].shape[1] // spec.block
    fields = spec.pack(q, q["q"].reshape(q["q"].shape[0], nb, -1))
    blocks = np.concatenate([f.astype(np.uint8, copy=False) for f in fields], axis=-1)
    return np.ascontiguousarray(blocks.reshape(blocks.shape[0], -1))
