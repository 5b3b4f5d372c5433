"""The element formats a 32x32 block is stored in (their grids, codes and shared scales), and the names
of every format a weight can be trained toward and exported in.

export.py writes weights in them; the STE trains on the same grids, with the same scales
(grids.fake_quantize), so a model trained with it exports as it was trained. The grids and codes
are exact in float64.

llama.cpp's block types are export formats too (GGML_FORMATS): their grids, codes and bytes are
ggml_quants.py's, and a weight takes one of them whole, blocks along its rows, not one per 32x32 block.
A bit budget (INT_BUDGETS, GGUF_BUDGETS) mixes formats at a mean number of bits per weight: budget.py.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import BL


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

# llama.cpp's block types (ggml_quants.py) as formats of a whole weight: our name -> the GGML type's.
# mxfp4_row is GGUF's MXFP4, one E8M0 scale per 32 weights of a row; mxfp4 above is our 32x32 block.
# A file stores the name's position here (lowbit's format order): append, never reorder.
GGML_FORMATS = {"q4_0": "Q4_0", "q8_0": "Q8_0", "q4_k": "Q4_K", "q5_k": "Q5_K", "q3_k": "Q3_K", "q2_k": "Q2_K",
                "q6_k": "Q6_K", "mxfp4_row": "MXFP4", "iq4_nl": "IQ4_NL", "iq4_xs": "IQ4_XS"}
GGML_NAMES = {t: name for name, t in GGML_FORMATS.items()}
# The bit budgets: a format per 32x32 block of int2/int3/int4, or a GGML type per tensor, at bits_per_weight, ranked
# by the learned b_t (auto-*) or by each one's own rounding error (error-*)
INT_BUDGETS = ("auto-int", "error-int")
GGUF_BUDGETS = ("auto-gguf", "error-gguf")
BUDGET_TARGETS = INT_BUDGETS + GGUF_BUDGETS


def pow2(k):
    """2^k as float64, exactly, for an int64 tensor k in [-1022, 1023] (built from its bits)."""
    return ((k + 1023) << 52).view(torch.float64)


def floor_log2(a):
    """floor(log2 a) of positive float64 values, exactly (frexp: a = f * 2^e with f in [0.5, 1))."""
    return torch.frexp(a)[1].long() - 1


def fp_round(v, fmt):
    """v (float64, already divided by the block scale) on fmt's grid: round to nearest, ties to even,
    saturated at +-fmt.max. Exact in float64: v / step is a power-of-two rescaling."""
    a = v.abs()
    e = floor_log2(a).clamp(min=fmt.emin)  # below the smallest normal the grid is the subnormals'
    step = pow2(e - fmt.mbits)
    q = (torch.round(a / step) * step).clamp(max=fmt.max)  # torch.round: half to even
    return torch.where(torch.signbit(v), -q, q)


def fp_encode(q, fmt):
    """Codes (sign | exponent E | mantissa M, int64) of values on fmt's grid (fp_round's output)."""
    a = q.abs()
    e = floor_log2(a).clamp(min=fmt.emin)
    significand = (a / pow2(e - fmt.mbits)).long()  # 2^m + M for normals, M for subnormals (and 0)
    normal = significand >= 2 ** fmt.mbits
    exponent = torch.where(normal, e + fmt.bias, 0)
    mantissa = torch.where(normal, significand - 2 ** fmt.mbits, significand)
    return (torch.signbit(q).long() << (fmt.ebits + fmt.mbits)) | (exponent << fmt.mbits) | mantissa


def fp_decode(codes, fmt):
    """Values (float64) of codes: (-1)^s * 2^(E - bias) * (1 + M / 2^m), or 2^emin * M / 2^m when E = 0."""
    mantissa = codes & (2 ** fmt.mbits - 1)
    exponent = (codes >> fmt.mbits) & (2 ** fmt.ebits - 1)
    magnitude = torch.where(exponent == 0, mantissa * pow2(torch.full_like(codes, fmt.emin - fmt.mbits)),
                            (mantissa + 2 ** fmt.mbits) * pow2(exponent - fmt.bias - fmt.mbits))
    return torch.where((codes >> (fmt.ebits + fmt.mbits)) & 1 == 1, -magnitude, magnitude)


def e8m0_exponents(amax, fmt):
    """The shared scale X = 2^k of each block, by the OCP MX v1.0 conversion: k = floor(log2 amax) - emax,
    emax that of the element format's largest normal, clamped to E8M0's range [-127, 127]. The
    largest weight then lands in [2^emax, 2^(emax+1)); above fmt.max it saturates. An all-zero
    block gets the smallest scale, 2^-127 (any scale codes its zeros)."""
    a = amax.double()
    k = torch.where(a > 0, floor_log2(a.clamp(min=torch.finfo(torch.float64).tiny)) - fmt.emax, -127)
    return k.clamp(-127, 127)


def int_scales(amax, fmt):
    """Symmetric absmax scale s = max_bl(|w|) / (2^(b-1) - 1), held in BF16 and rounded up there, so
    that no weight of the block lies beyond the top level (the largest reaches it)."""
    s = amax.double() / fmt.levels
    s16 = s.to(torch.bfloat16)
    above = (s16.view(torch.int16) + 1).view(torch.bfloat16)  # the next BF16 value above
    return torch.where(s16.double() < s, above, s16)


# --- 32x32 blocks ---------------------------------------------------------------------------------

def to_blocks(w):
    """(m, n) -> (ceil(m/BL) * ceil(n/BL), BL*BL), blocks in row-major order, zero-padded at the edges."""
    m, n = w.shape
    nbm, nbn = -(-m // BL), -(-n // BL)
    p = F.pad(w, (0, nbn * BL - n, 0, nbm * BL - m))
    return p.view(nbm, BL, nbn, BL).permute(0, 2, 1, 3).reshape(nbm * nbn, BL * BL)


def from_blocks(blocks, m, n):
    nbm, nbn = -(-m // BL), -(-n // BL)
    return blocks.view(nbm, nbn, BL, BL).permute(0, 2, 1, 3).reshape(nbm * BL, nbn * BL)[:m, :n]


def block_weights(m, n):
    """Number of weights of each 32x32 block of an (m, n) weight: edge blocks hold fewer."""
    rows = torch.tensor([min(BL, m - i) for i in range(0, m, BL)], dtype=torch.float64)
    cols = torch.tensor([min(BL, n - j) for j in range(0, n, BL)], dtype=torch.float64)
    return torch.outer(rows, cols)


# --- a block's codes and values ---------------------------------------------------------------------

def quantize_blocks(blocks, fmt):
    """Blocks (k, BL*BL) float64 holding FP32 weights -> (codes int64 (k, BL*BL), scales (k,) or None)."""
    amax = blocks.abs().amax(dim=1)
    if fmt.kind == "int":
        scales = int_scales(amax, fmt)
        s = scales.float()
        # w / s as torchao's fake quantization (the STE's, grids.fake_quantize) computes it: w times
        # the FP32 reciprocal of s, rounded half to even. The exact quotient rounds the other way where
        # w / s is within an FP32 rounding of a half-integer, and an STE-trained model would not export as trained.
        q = torch.round(blocks.float() * (1.0 / torch.where(s > 0, s, 1.0))[:, None]).clamp(-fmt.levels, fmt.levels)
        return q.long() & (2 ** fmt.bits - 1), scales  # two's complement in fmt.bits bits
    if not fmt.scaled:
        return fp_encode(fp_round(blocks, fmt), fmt), None
    k = e8m0_exponents(amax, fmt)
    codes = fp_encode(fp_round(blocks / pow2(k)[:, None], fmt), fmt)
    return codes, (k + 127).to(torch.uint8)  # E8M0 code: the biased exponent


def dequantize_blocks(codes, scales, fmt):
    """Inverse of quantize_blocks: float64 values, exact in float32 for every format here."""
    if fmt.kind == "int":
        q = torch.where(codes >= 2 ** (fmt.bits - 1), codes - 2 ** fmt.bits, codes)
        return q.double() * scales.double()[:, None]
    values = fp_decode(codes, fmt)
    return values if scales is None else values * pow2(scales.long() - 127)[:, None]
