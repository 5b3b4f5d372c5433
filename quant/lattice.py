"""llama.cpp's lattice type IQ3_XXS as a grid to train on: each group of 4 weights' magnitudes is one of 256
points of a fixed codebook (gguf-py's IQ3_XXS grid, the iq3xxs_grid of llama.cpp's ggml-common.h), each
weight has a sign (7 stored per 8 weights, the 8th by even parity), each 32 weights a 4-bit scale and each
256 an FP16 d; 3.0625 bits per weight (block_iq3_xxs: d, 64 grid indices, 8 uint32 of signs and scale).

    q = quantize(w)          # w: float32 (m, n), n a multiple of 256; d, sc, grid, signs
    w_hat = dequantize(q)    # float32, as ggml's dequantize_row_iq3_xxs computes it
    w_hat = fake_quantize(w) # the same, the STE forward's weight (grids.fake_quantize(w, "iq3_xxs"))
    raw = pack(q)            # numpy uint8 (m, 98 * n / 256): the GGML blocks

quantize follows ggml-quants.c's quantize_row_iq3_xxs_impl: per 32 weights, the signs with the parity fix
(the weight of least importance * x^2 takes the wrong sign), then 31 trial scales; at each, every group's
nearest levels 2l+1 (l in 0..7) and, off the codebook, the best of its precomputed neighbours (the grid
points at the two smallest distances, as iq3xs_init_impl's map); the least-squares scale of the best trial;
then the groups that were off the codebook searched again at that scale and the scale refit. Per 256: d =
1.0125 * the largest scale / 31 in FP16, each scale a 4-bit code against the unfudged d. Differences from
llama.cpp: sums over 4 and 32 weights in torch's order, not C's (a trial or neighbour can differ at an FP32
tie). tests/test_lattice.py measures how close llama.cpp's own quantizer and this one are.
"""
import functools

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType

from quant.ggml_quants import QuantError, _fp16

QK_K = 256
MAX_Q = 8  # levels per magnitude: l in 0..7, the quantizer's value 2l+1
N_WANT = 2  # iq3xs_init_impl's nwant for the 256-point grid: neighbours at the 2 smallest distances
FUDGE = 1.0125  # quantize_row_iq3_xxs_impl's "small improvement via this fudge factor" on d
GROUP_MAX_EPS = 1e-8  # GROUP_MAX_EPS_IQ3_XXS: a sub-block whose largest magnitude is below it is all zero
BYTES = 2 + QK_K // 4 + QK_K // 8  # block_iq3_xxs: d, qs (64 grid indices), 8 uint32 of signs and scale
POWERS = (1, 8, 64, 512)  # a group's levels as iq3xs_init_impl's 12-bit key
TRIALS = tuple(range(-15, 16))  # llama.cpp's trial scales: the largest magnitude / (15 + 0.2 * trial)
STE_TRIALS = (0,)  # the STE's: the middle one (largest magnitude at level 7) alone, 1 of the 31 searches (docs/GGUF.md)


@functools.lru_cache(maxsize=None)
def tables(device="cpu"):
    """(values (256, 4) float32: the grid's dequantized magnitudes, 4 12 ... 52 62; levels (256, 4) int64 l;
    key_index (4096,) the grid index of each 12-bit key of levels, -1 off the grid; neighbours (CSR: start,
    count, flat) of each key: the grid points at the N_WANT smallest squared distances of 2l+1, by distance
    then index, as iq3xs_init_impl's qsort orders them)."""
    from gguf.quants import IQ3_XXS
    IQ3_XXS.init_grid()
    values = np.asarray(IQ3_XXS.grid, dtype=np.float32).reshape(256, 4)
    levels = np.searchsorted(np.asarray(IQ3_XXS.grid_map), values)
    keys = (levels * np.array(POWERS)).sum(1)
    key_index = np.full(4096, -1, dtype=np.int64)
    key_index[keys] = np.arange(256)
    all_levels = (np.arange(4096)[:, None] >> (3 * np.arange(4))) & 7
    d2 = ((2 * all_levels[:, None, :] - 2 * levels[None]) ** 2).sum(-1)  # (4096, 256): (2l+1) - (2l'+1)
    order = np.argsort(d2 * 256 + np.arange(256), axis=1, kind="stable")
    ranked = np.take_along_axis(d2, order, 1)
    cutoff = np.array([np.unique(row)[N_WANT - 1] for row in d2])  # the N_WANT-th smallest distance
    count = (ranked <= cutoff[:, None]).sum(1)
    count[key_index >= 0] = 0  # a key on the grid needs none
    flat = np.concatenate([order[k, :c] for k, c in enumerate(count)])
    start = np.concatenate([[0], np.cumsum(count)[:-1]])
    return tuple(torch.from_numpy(a).to(device) for a in (values, levels, key_index, start, count, flat))


def _nearest_int(v):
    """ggml's nearest_int (the float's bits after adding 1.5 * 2^23): to nearest, ties to even, as torch.round."""
    return torch.round(v)


def _grid_points(xval, waux, scale, inverse):
    """Each group's grid index (S, 8) and whether its nearest levels were on the grid: levels
    nearest_int((inverse * x - 1) / 2) clamped to 0..7; a key off the grid takes the neighbour of least
    sum(waux * (scale * (2l+1) - x)^2), the first in the neighbours' order at ties (iq3_find_best_neighbour)."""
    _, levels, key_index, start, count, flat = tables(str(xval.device))
    lv = _nearest_int(0.5 * (inverse[:, None, None] * xval - 1)).clamp_(0, MAX_Q - 1)
    key = (lv @ torch.tensor(POWERS, dtype=lv.dtype, device=lv.device)).long().view(-1)  # exact: integers below 2^12
    index = key_index.index_select(0, key)
    on = index >= 0
    off = (~on).nonzero().squeeze(1)
    if off.numel():
        k = key.index_select(0, off)
        n = count.index_select(0, k)
        owner = torch.repeat_interleave(n)
        at = torch.arange(owner.numel(), device=n.device) - (torch.cumsum(n, 0) - n).index_select(0, owner)
        cand = flat.index_select(0, start.index_select(0, k).index_select(0, owner) + at)
        group = off.index_select(0, owner)
        diff = levels.index_select(0, cand).mul_(2).add_(1).float()
        diff.mul_(scale.repeat_interleave(8).index_select(0, group)[:, None])
        diff.sub_(xval.reshape(-1, 4).index_select(0, group))
        term = waux.reshape(-1, 4).index_select(0, group).mul_(diff).mul_(diff)
        d2 = term[:, 0] + term[:, 1] + term[:, 2] + term[:, 3]  # C's order
        best = torch.full((k.numel(),), float("inf"), device=k.device).scatter_reduce_(0, owner, d2, "amin")
        pos = torch.arange(owner.numel(), device=k.device)
        pos = torch.where(d2 == best.index_select(0, owner), pos, owner.numel())  # the first at ties
        pick = torch.full((k.numel(),), owner.numel(), device=k.device).scatter_reduce_(0, owner, pos, "amin")
        index.index_copy_(0, off, cand.index_select(0, pick))
    return index.view(-1, 8), on.view(-1, 8)


def _fit(weight, xval, index):
    """sum(w x q) and sum(w q^2) per sub-block of the levels q = 2l+1 of the groups' grid points."""
    q = tables(str(xval.device))[1].index_select(0, index.view(-1)).mul_(2).add_(1).float().view(index.shape[0], 32)
    wq = weight * q
    return (wq * xval).sum(1), (wq * q).sum(1)


def _signs(xb, weight):
    """Per 8 weights: xval = |x| but for the weight of least weight * x^2 (the first) where an odd number are
    negative, which is negated (its sign bit flipped, so that the 8 bits have even parity); the 8 sign bits."""
    neg = (xb < 0).view(-1, 4, 8)
    odd = neg.sum(-1) % 2 == 1
    imin = (weight * xb * xb).view(-1, 4, 8).argmin(-1)
    flip = odd[..., None] & (torch.arange(8, device=xb.device) == imin[..., None])
    bits = neg ^ flip
    xval = xb.abs().view(-1, 4, 8)
    return torch.where(flip, -xval, xval).view(-1, 32), bits


def _sub_block_scales(xb, weight, trials):
    """quantize_row_iq3_xxs_impl's loop over 32 weights, for S sub-blocks at once: (scale (S,), grid index
    (S, 8), sign bits (S, 4, 8))."""
    xval, bits = _signs(xb, weight)
    waux = weight.sqrt()
    groups, wgroups = xval.view(-1, 8, 4), waux.view(-1, 8, 4)
    mx = xval.amax(1)
    zero = mx < GROUP_MAX_EPS
    safe = torch.where(zero, 1.0, mx)
    best = torch.zeros_like(mx)
    scale = safe / (2 * MAX_Q - 1)
    index = torch.zeros(xb.shape[0], 8, dtype=torch.long, device=xb.device)
    on = torch.ones(xb.shape[0], 8, dtype=torch.bool, device=xb.device)
    for trial in trials:
        inverse = torch.full_like(safe, float(np.float32(2 * MAX_Q - 1) + np.float32(trial) * np.float32(0.2))) / safe
        idx, on_t = _grid_points(groups, wgroups, 1 / inverse, inverse)
        sumqx, sumq2 = _fit(weight, xval, idx)
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        scale = torch.where(better, sumqx / torch.where(sumq2 > 0, sumq2, 1.0), scale)
        best = torch.where(better, scale * sumqx, best)
        index = torch.where(better[:, None], idx, index)
        on = torch.where(better[:, None], on_t, on)
    redo = (~on).any(1) & (scale > 0)
    if redo.any():
        r = redo.nonzero(as_tuple=True)[0]
        idx, _ = _grid_points(groups[r], wgroups[r], scale[r], 1 / scale[r])
        idx = torch.where(on[r], index[r], idx)
        sumqx, sumq2 = _fit(weight[r], xval[r], idx)
        index[r] = idx
        scale[r] = torch.where(sumq2 > 0, sumqx / torch.where(sumq2 > 0, sumq2, 1.0), scale[r])
    negative = scale < 0  # "should never happen": the scale made positive and all 32 signs flipped
    bits = torch.where(negative[:, None, None], ~bits, bits)
    scale = scale.abs()
    # a sub-block of zeros: grid index 0, no signs, scale 0 (llama.cpp skips it: its bytes stay zero)
    index = torch.where(zero[:, None], 0, index)
    bits = torch.where(zero[:, None, None], False, bits)
    return torch.where(zero, 0.0, scale), index, bits


@torch.no_grad()
def quantize(w, check=True, weights=None, trials=TRIALS):
    """IQ3_XXS codes of w (float (m, n), n a multiple of 256), rows along the input dimension: {"d": (m, n/256)
    float16, "sc": (m, n/256, 8) uint8 0..15, "grid": (m, n/256, 64) uint8 grid indices, "signs": (m, n/256, 32)
    uint8 7-bit sign codes}. weights: llama.cpp's importance matrix (one value per input column; the weight of x
    is then qw * sqrt(sigma2 + x^2), sigma2 = 2 * mean x^2 of its 256); None: x^2 (llama-quantize without
    --imatrix)."""
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise QuantError(f"IQ3_XXS quantizes a 2-D floating-point weight (rows, input width); got "
                         f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
    m, n = w.shape
    if n % QK_K:
        raise QuantError(f"IQ3_XXS needs a row width (the Linear's input dimension) that is a multiple of {QK_K}; "
                         f"this weight's is {n}")
    if check and not bool(torch.isfinite(w).all()):
        raise QuantError("IQ3_XXS: the weight has NaN or infinite values; only finite weights can be quantized")
    x = w.float().reshape(-1, QK_K)
    if weights is None:
        weight = x * x
    else:
        qw = torch.as_tensor(weights, dtype=torch.float32, device=w.device)
        if qw.shape != (n,) or not bool((torch.isfinite(qw) & (qw >= 0)).all()):
            raise QuantError(f"IQ3_XXS: importance weights are one finite value >= 0 per input column ({n}); got "
                             f"shape {tuple(qw.shape)}")
        sigma2 = 2 * (x * x).sum(1, keepdim=True) / QK_K
        weight = qw.view(n // QK_K, QK_K).repeat(m, 1) * (sigma2 + x * x).sqrt()
    scale, index, bits = _sub_block_scales(x.reshape(-1, 32), weight.reshape(-1, 32), trials)
    scale = scale.view(-1, 8)
    d = scale.amax(1) / 31
    d16 = _fp16(d * FUDGE, GGMLQuantizationType.IQ3_XXS, "scale d", check)
    inverse = torch.where(d > 0, 1 / torch.where(d > 0, d, 1.0), 0.0)
    sc = _nearest_int(0.5 * (inverse[:, None] * scale - 1)).clamp_(0, 15)
    sc = torch.where(d[:, None] > 0, sc, 0.0)
    d16 = torch.where(d > 0, d16, torch.zeros_like(d16))
    index = torch.where(d[:, None] > 0, index.view(-1, 64), 0)
    codes = (bits.view(-1, 4, 8).to(torch.int64) << torch.arange(8, device=w.device)).sum(-1) & 127
    codes = torch.where(d[:, None] > 0, codes.view(-1, 32), 0)
    nb = n // QK_K
    return {"d": d16.view(m, nb), "sc": sc.to(torch.uint8).view(m, nb, 8),
            "grid": index.to(torch.uint8).view(m, nb, 64), "signs": codes.to(torch.uint8).view(m, nb, 32)}


@torch.no_grad()
def dequantize(q):
    """The float32 (m, n) values of quantize's codes, as ggml's dequantize_row_iq3_xxs: d * (0.5 + sc) * 0.5 *
    grid value * sign, each product exact in FP32 (11 + 5 + 6 significant bits); the 8th sign of 8 weights is
    the parity of the 7 stored."""
    values = tables(str(q["d"].device))[0]
    db = q["d"].float()[..., None] * (0.5 + q["sc"].float()) * 0.5  # (m, nb, 8)
    mag = values[q["grid"].long()].view(*db.shape, 32)  # 8 groups of 4 per sub-block
    s = q["signs"].long()
    s = s | ((_popcount7(s) & 1) << 7)
    neg = (s[..., None] >> torch.arange(8, device=s.device)) & 1  # (m, nb, 32, 8)
    sign = (1 - 2 * neg).float().view(*db.shape, 32)
    return (db[..., None] * mag * sign).reshape(q["d"].shape[0], -1)


def _popcount7(s):
    return sum((s >> i) & 1 for i in range(7))


def fake_quantize(w, check=True, trials=TRIALS):
    """dequantize(quantize(w)): w on IQ3_XXS's grid, blocks along each row, the STE forward's weight."""
    return dequantize(quantize(w, check, trials=trials)).view(w.shape)


def pack(q):
    """quantize's codes as block_iq3_xxs bytes, a numpy uint8 array (m, 98 * n / 256): d (FP16), qs (64 grid
    indices), then per 32 weights a little-endian uint32: its 4 sign codes at bits 0, 7, 14, 21, the scale's
    4 bits at 28."""
    d = q["d"].cpu().numpy().astype("<f2").view(np.uint8).reshape(*q["d"].shape, 2)
    s = q["signs"].cpu().numpy().astype(np.uint32).reshape(*q["sc"].shape, 4)
    words = s[..., 0] | (s[..., 1] << 7) | (s[..., 2] << 14) | (s[..., 3] << 21)
    words |= q["sc"].cpu().numpy().astype(np.uint32) << 28
    blocks = np.concatenate([d, q["grid"].cpu().numpy(), words.astype("<u4").view(np.uint8)], axis=-1)
    return np.ascontiguousarray(blocks.reshape(blocks.shape[0], -1))
