"""Triton kernels for the noise R and Eq. 3 / Eq. 4 (GPU; CPU tensors under TRITON_INTERPRET=1).

The pattern is Triton's seeded-dropout tutorial: R is a pure function of (seed, element index),
so the backward regenerates it instead of storing it. Arithmetic is FP32 with a cast at the
store (the interpreter's BF16 arithmetic is wrong, and FP32 is what we want anyway), and FMA
contraction is off in the apply kernel so that w + R * scale rounds exactly as in PyTorch.
"""
import torch
import triton
import triton.language as tl

from kernels import BL

GEN_BLOCK = 1024  # Philox calls per program: 8K gaussws elements; enough work to hide launch cost
TILE_M, TILE_N = 32, 128  # apply tile: one block row, four blocks wide; 4K elements per program


@triton.jit
def _nibble(bits):
    """Sign-magnitude 4-bit code of R from 16 random bits: torch_noise.nibbles' recipe, one lane."""
    fg = ((bits >> 1) | (bits >> 2)) & 1
    h = (((bits >> 3) & 0xFF) == 0xFF).to(tl.uint32)
    mag2 = fg & h
    mag1 = ((bits >> 11) | (bits >> 12)) & ((bits >> 13) | (bits >> 14)) & (bits >> 15) & 1 & (1 - mag2)
    mag = 2 * mag2 + mag1
    sign = bits & 1 & (mag != 0).to(tl.uint32)
    return sign * 8 + mag


@triton.jit
def _gen_gaussws_kernel(out_ptr, n_words, seed, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    r0, r1, r2, r3 = tl.randint4x(seed, offs)
    word = _nibble(r0 & 0xFFFF) | (_nibble(r0 >> 16) << 4)
    word |= (_nibble(r1 & 0xFFFF) << 8) | (_nibble(r1 >> 16) << 12)
    word |= (_nibble(r2 & 0xFFFF) << 16) | (_nibble(r2 >> 16) << 20)
    word |= (_nibble(r3 & 0xFFFF) << 24) | (_nibble(r3 >> 16) << 28)
    tl.store(out_ptr + offs, word.to(tl.int32, bitcast=True), mask=offs < n_words)


@triton.jit
def _bf16_bits(x):
    """FP32 -> BF16 round-to-nearest-even, as int16 bits (what a BF16 cast does on the GPU).

    Done with integers because the interpreter's FP32->BF16 cast rounds half up and drops the
    carry into the exponent, which would break bit-identity with PyTorch on CPU.
    """
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, rounded).to(tl.int16)


@triton.jit
def _uniform(r):
    # 24 random bits / 2^24 - 1/2 is exact in FP32; the one rounding is the BF16 cast.
    return (r >> 8).to(tl.float32) * (1.0 / 16777216.0) - 0.5


@triton.jit
def _gen_diffq_kernel(out_ptr, numel, seed, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    r0, r1, r2, r3 = tl.randint4x(seed, offs)
    e = offs * 4
    tl.store(out_ptr + e, _bf16_bits(_uniform(r0)), mask=e < numel)
    tl.store(out_ptr + e + 1, _bf16_bits(_uniform(r1)), mask=e + 1 < numel)
    tl.store(out_ptr + e + 2, _bf16_bits(_uniform(r2)), mask=e + 2 < numel)
    tl.store(out_ptr + e + 3, _bf16_bits(_uniform(r3)), mask=e + 3 < numel)


@triton.jit
def _load_r(r_ptr, e, mask, GAUSSWS: tl.constexpr):
    if GAUSSWS:
        nib = (tl.load(r_ptr + e // 8, mask=mask, other=0) >> ((e % 8) * 4)) & 0xF
        r = ((nib & 7) * (1 - 2 * (nib >> 3))).to(tl.float32)
    else:
        r = tl.load(r_ptr + e, mask=mask, other=0.0).to(tl.float32)
    return r


@triton.jit
def _apply_kernel(w_ptr, r_ptr, scale_ptr, out_ptr, m, n, nbn, GAUSSWS: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BLK: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)[:, None]
    cols = tl.program_id(1) * BN + tl.arange(0, BN)[None, :]
    mask = (rows < m) & (cols < n)
    e = rows * n + cols
    r = _load_r(r_ptr, e, mask, GAUSSWS)
    scale = tl.load(scale_ptr + (rows // BLK) * nbn + cols // BLK, mask=mask, other=0.0)
    w = tl.load(w_ptr + e, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + e, _bf16_bits(w + r * scale), mask=mask)


@triton.jit
def _block_sums_kernel(g_ptr, r_ptr, out_ptr, m, n, nbn, GAUSSWS: tl.constexpr, BLK: tl.constexpr):
    bi, bj = tl.program_id(0), tl.program_id(1)
    rows = bi * BLK + tl.arange(0, BLK)[:, None]
    cols = bj * BLK + tl.arange(0, BLK)[None, :]
    mask = (rows < m) & (cols < n)
    e = rows * n + cols
    r = _load_r(r_ptr, e, mask, GAUSSWS)
    g = tl.load(g_ptr + e, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + bi * nbn + bj, tl.sum(g * r))


@triton.jit
def _bm_kernel(w_ptr, scale_ptr, out_ptr, m, n, nbn, seed, BM: tl.constexpr, BN: tl.constexpr,
               BLK: tl.constexpr):
    """Benchmark baseline (Fig. 6 'bm'): R = round(N(0,1) / 2) by Box-Muller, fused with Eq. 3."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)[:, None]
    cols = tl.program_id(1) * BN + tl.arange(0, BN)[None, :]
    mask = (rows < m) & (cols < n)
    e = rows * n + cols
    r = tl.floor(tl.randn(seed, e) * 0.5 + 0.5)  # round to nearest (ties have probability 0)
    scale = tl.load(scale_ptr + (rows // BLK) * nbn + cols // BLK, mask=mask, other=0.0)
    w = tl.load(w_ptr + e, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + e, _bf16_bits(w + r * scale), mask=mask)


def _check(t, name, dtypes):
    if t.dim() != 2 or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 2-D tensor, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be one of {dtypes}, got {t.dtype}")
    if t.numel() >= 2**31:
        raise ValueError(f"{name} has {t.numel()} elements; the kernels index with int32 (< 2^31)")


def gen(numel, seed, method, device):
    """Stored R for `numel` elements: int32 words of 8 nibbles (gaussws) or BF16 (diffq)."""
    if method == "gaussws":
        n_words = -(-numel // 8)
        out = torch.empty(n_words, dtype=torch.int32, device=device)
        _gen_gaussws_kernel[(triton.cdiv(n_words, GEN_BLOCK),)](out, n_words, seed, BLOCK=GEN_BLOCK)
    else:
        out = torch.empty(numel, dtype=torch.bfloat16, device=device)
        _gen_diffq_kernel[(triton.cdiv(numel, 4 * GEN_BLOCK),)](out.view(torch.int16), numel, seed, BLOCK=GEN_BLOCK)
    return out


def apply(w, r_store, scale_bl, method):
    """Eq. 3: BF16(w + R * broadcast(scale_bl)), arithmetic in FP32."""
    _check(w, "w", (torch.float32, torch.bfloat16, torch.float16))
    m, n = w.shape
    out = torch.empty((m, n), dtype=torch.bfloat16, device=w.device)
    grid = (triton.cdiv(m, TILE_M), triton.cdiv(n, TILE_N))
    _apply_kernel[grid](w, r_store, scale_bl.float().contiguous(), out.view(torch.int16), m, n, scale_bl.shape[1],
                        GAUSSWS=method == "gaussws", BM=TILE_M, BN=TILE_N, BLK=BL, enable_fp_fusion=False)
    return out


def block_sums(g, r_store, method):
    """sum_bl(g * R) per 32x32 block, FP32 (the sum in Eq. 4)."""
    _check(g, "g", (torch.float32, torch.bfloat16, torch.float16))
    m, n = g.shape
    nbm, nbn = triton.cdiv(m, BL), triton.cdiv(n, BL)
    out = torch.empty((nbm, nbn), dtype=torch.float32, device=g.device)
    _block_sums_kernel[(nbm, nbn)](g, r_store, out, m, n, nbn, GAUSSWS=method == "gaussws", BLK=BL)
    return out


def bm(w, scale_bl, seed):
    """Benchmark baseline: Eq. 3 with Box-Muller R = round(N(0,1)/2), one fused kernel."""
    _check(w, "w", (torch.float32, torch.bfloat16, torch.float16))
    m, n = w.shape
    out = torch.empty((m, n), dtype=torch.bfloat16, device=w.device)
    grid = (triton.cdiv(m, TILE_M), triton.cdiv(n, TILE_N))
    _bm_kernel[grid](w, scale_bl.float().contiguous(), out.view(torch.int16), m, n, scale_bl.shape[1], seed,
                     BM=TILE_M, BN=TILE_N, BLK=BL)
    return out
