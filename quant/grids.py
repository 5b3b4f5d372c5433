"""The grid a weight is rounded to for each format train.py's STE trains on and export.py writes, as
float weights (the codes are formats.py's and ggml_quants.py's): fake_quantize(w, name).

    w_q = grids.fake_quantize(w, "int3")      # every 32x32 block on export's grid, with export's scale
    w_q = grids.fake_quantize(w, "q4_k")      # llama.cpp's Q4_K, blocks along each row (ggml_quants)
    w_q = grids.fake_quantize_blocks(w, ids)  # each 32x32 block on its own format (a bit budget's)
    w_q = grids.fake_quantize(w, "iq3_xxs")   # llama.cpp's lattice type IQ3_XXS (quant/lattice.py), to train on

Our formats' values come from torchao (its affine fake quantization for int-b, its MX element casts)
with the scales export.py stores (formats.int_scales, formats.e8m0_exponents), so a model trained on a
grid exports as it was trained; llama.cpp's types are ggml_quants.fake_quantize's.
"""
import torch
import torch.nn.functional as F

from kernels import BL
from kernels.torch_noise import block_absmax
from quant.formats import BUDGET_TARGETS, BY_NAME, FORMATS, GGML_FORMATS, e8m0_exponents, int_scales, pow2

STE_FORMATS = tuple(f"int{b}" for b in range(2, 9)) + ("mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3",
                                                       "mxfp8_e5m2")  # and llama.cpp's types, GGML_FORMATS
LATTICE_FORMATS = {"iq3_xxs": "IQ3_XXS"}  # llama.cpp's lattice types the STE trains on (quant/lattice.py)
LATTICE_BLOCK = 256  # their weights per block of a row


def ggml():
    """quant.ggml_quants, imported where used: it imports torch._dynamo (over a second)."""
    from quant import ggml_quants
    return ggml_quants


def ggml_type(name):
    """gguf's GGMLQuantizationType of a GGML target format name ("q4_k", "mxfp4_row")."""
    return ggml().ggml_type(GGML_FORMATS[name])


def check_format(name):
    """The name of a format the STE trains on (and a PQT phase is matched to), or a ValueError."""
    if name not in STE_FORMATS and name not in GGML_FORMATS and name not in LATTICE_FORMATS:
        raise ValueError(f"target format {name!r}: expected one of {', '.join(STE_FORMATS)} (export.py's formats "
                         f"with a per-block scale, up to 8 bits), llama.cpp's {', '.join(GGML_FORMATS)}, its lattice "
                         f"type {', '.join(LATTICE_FORMATS)} (to train on), or "
                         f"{' / '.join(BUDGET_TARGETS)} with a bit budget")
    return name


def _mx_elements(v, fmt):
    """v (FP32, already divided by the block scale) rounded to fmt's elements, half to even, saturated at
    +-fmt.max: torchao's MX element casts for fp4 and fp6, torch's own for fp8 (clamped first, as torchao
    does: e5m2's cast overflows to inf; clamping to a value on the grid commutes with rounding)."""
    if fmt.name in ("mxfp4", "mxfp6_e2m3", "mxfp6_e3m2"):
        from torchao.prototype.mx_formats import kernels as mx
        to_codes, to_values = {"mxfp4": (mx.f32_to_f4_unpacked, mx.f4_unpacked_to_f32),
                               "mxfp6_e2m3": (mx.f32_to_f6_e2m3_unpacked, mx.f6_e2m3_unpacked_to_f32),
                               "mxfp6_e3m2": (mx.f32_to_f6_e3m2_unpacked, mx.f6_e3m2_unpacked_to_f32)}[fmt.name]
        return to_values(to_codes(v))
    dtype = {"mxfp8_e4m3": torch.float8_e4m3fn, "mxfp8_e5m2": torch.float8_e5m2}[fmt.name]
    return v.clamp(-fmt.max, fmt.max).to(dtype).float()


@torch.no_grad()
def fake_quantize(w, name):
    """w (m, n) on the grid export.py stores for format `name` (FP32 values, no gradient): every 32x32
    block, partial at the edges, with the scale export gives it from max_bl(|w|), a BF16 one rounded up
    for int-b (formats.int_scales) or an E8M0 power of two for the MX formats (formats.e8m0_exponents).
    The values come from torchao: its affine fake quantization with a (32, 32) block for int-b, which
    computes round(w * (1 / s)) in FP32 (export.py rounds the same way), and its MX element casts.
    A GGML format (GGML_FORMATS) is ggml_quants.fake_quantize's grid: blocks along each row, with the
    type's scales; it refuses non-finite weights and a row width the type cannot hold. A lattice type
    (LATTICE_FORMATS) is lattice.fake_quantize's with the STE's trial scales (lattice.STE_TRIALS).
    """
    if check_format(name) in GGML_FORMATS:
        return ggml().fake_quantize(w.detach(), GGML_FORMATS[name])
    if name in LATTICE_FORMATS:
        from quant import lattice
        return lattice.fake_quantize(w.detach(), trials=lattice.STE_TRIALS)
    fmt = FORMATS[BY_NAME[name]]
    m, n = w.shape
    nbm, nbn = -(-m // BL), -(-n // BL)
    amax = block_absmax(w)
    w = F.pad(w.detach().float(), (0, nbn * BL - n, 0, nbm * BL - m))  # zeros: on every grid, and no block's max
    if fmt.kind == "int":
        from torchao.quantization.quant_primitives import ZeroPointDomain, _fake_quantize_affine
        s = int_scales(amax, fmt).float()
        s = torch.where(s > 0, s, 1.0)  # an all-zero block: any scale gives its zeros (export stores 0)
        q = _fake_quantize_affine(w, (BL, BL), s, None, torch.int32, -fmt.levels, fmt.levels, ZeroPointDomain.NONE)
        q = q + 0.0  # -0.0 -> +0.0: export's integer codes have no negative zero
    else:
        x = pow2(e8m0_exponents(amax, fmt)).float().repeat_interleave(BL, 0).repeat_interleave(BL, 1)
        q = _mx_elements(w / x, fmt) * x  # both exact: x is a power of two
    return q[:m, :n]


@torch.no_grad()
def fake_quantize_blocks(w, format_ids, used=None):
    """w (m, n) with each 32x32 block on the grid export.py stores for that block's own format:
    format_ids holds one id of formats.FORMATS per block (export's "format" tensor), `used` the ids it
    holds (read from it when None). Each block is fake_quantize's for its format, whose scales are per
    block, so the whole is export.py's quantize_weight with these ids."""
    m, n = w.shape
    used = sorted(format_ids.unique().tolist()) if used is None else used
    ids = format_ids.repeat_interleave(BL, 0).repeat_interleave(BL, 1)[:m, :n]
    w_q = fake_quantize(w, FORMATS[used[0]].name)
    for fid in used[1:]:
        w_q = torch.where(ids == fid, fake_quantize(w, FORMATS[fid].name), w_q)
    return w_q

