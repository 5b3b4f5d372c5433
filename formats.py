"""The element formats a 32x32 block is stored in: their grids, codes and shared scales.

export.py writes weights in them; gaussws.py's STE trains on the same grids, with the same scales
(gaussws.fake_quantize), so a model trained with it exports as it was trained. Both import this file
and neither imports the other. The grids and codes are exact in float64.
"""
from dataclasses import dataclass

import torch


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
