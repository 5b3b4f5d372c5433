"""Triton kernels for the noise R and Eq. 3 / Eq. 4 (GPU; CPU tensors under TRITON_INTERPRET=1).

The pattern is Triton's seeded-dropout tutorial: R is a pure function of (seed, element index),
so the backward regenerates it instead of storing it. Arithmetic is FP32 with a cast at the
store (the interpreter's BF16 arithmetic is wrong, and FP32 is what we want anyway), and FMA
contraction is off so that w + R * scale rounds exactly as in PyTorch.

The memory-bound kernels (apply, block sums, bm) work on TILE_M x TILE_N tiles: one block row of
32 x 32 blocks, four blocks wide. Each stream is loaded as a tile of its own storage unit, so
every global access is a wide vector: for gaussws R a (TILE_M, TILE_N / 8) tile of int32 words
unpacked with shifts (not a word per element), for the scale one value per block of the tile,
broadcast (not a scale per element). tests/test_triton_compile.py compiles every kernel for
sm_80, sm_90, sm_100 and gfx942 from kernel_specs() below and checks these properties in the code.
"""
import dataclasses
import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice as cuda_libdevice

from kernels import BL

GEN_BLOCK = 1024  # Philox calls per program: 8K gaussws elements; enough work to hide launch cost
TILE_M, TILE_N = BL, 4 * BL  # one block row, four blocks wide; 4K elements per program
NUM_WARPS = 4  # Triton's default, stated so that the compile tests use what the launchers use


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
def _gaussws_word(seed, k):
    """Word k of gaussws' stored R (uint32): the codes of elements 8k .. 8k+7, from Philox call k
    (counter (k, 0, 0, 0), int32 k; key: the seed)."""
    r0, r1, r2, r3 = tl.randint4x(seed, k)
    word = _nibble(r0 & 0xFFFF) | (_nibble(r0 >> 16) << 4)
    word |= (_nibble(r1 & 0xFFFF) << 8) | (_nibble(r1 >> 16) << 12)
    word |= (_nibble(r2 & 0xFFFF) << 16) | (_nibble(r2 >> 16) << 20)
    word |= (_nibble(r3 & 0xFFFF) << 24) | (_nibble(r3 >> 16) << 28)
    return word


@triton.jit
def _gen_gaussws_kernel(out_ptr, n_words, seed_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    word = _gaussws_word(tl.load(seed_ptr), offs)
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
def _interleave4(a, b, c, d):
    """Rows of 4 (a[i], b[i], c[i], d[i]) in a tensor 4x as long in its last dimension."""
    x = tl.join(tl.join(a, c), tl.join(b, d))  # [..., i, k] = (a, b, c, d)[2 * i + k]
    return tl.reshape(x, a.shape[:-1] + (4 * a.shape[-1],))


@triton.jit
def _diffq_codes(seed, k):
    """The BF16 bits (int16) of diffq's R at elements 4k .. 4k+3, from Philox call k."""
    r0, r1, r2, r3 = tl.randint4x(seed, k)
    return _bf16_bits(_uniform(r0)), _bf16_bits(_uniform(r1)), _bf16_bits(_uniform(r2)), _bf16_bits(_uniform(r3))


@triton.jit
def _gen_diffq_kernel(out_ptr, numel, seed_ptr, BLOCK: tl.constexpr):
    # Philox call k makes elements 4k .. 4k+3; the four are interleaved so that the store is one
    # contiguous run of 4 * BLOCK BF16 values (vector stores) instead of four strided ones.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    b0, b1, b2, b3 = _diffq_codes(tl.load(seed_ptr), offs)
    bits = _interleave4(b0[None, :], b1[None, :], b2[None, :], b3[None, :])
    e = tl.program_id(0) * 4 * BLOCK + tl.arange(0, 4 * BLOCK)[None, :]
    tl.store(out_ptr + e, bits, mask=e < numel)


@triton.jit
def _load_r(r_ptr, rows, cols, mask, pid_n, m, n, n_words_row, GAUSSWS: tl.constexpr,
            WORD_ROWS: tl.constexpr, BN: tl.constexpr):
    """R of the tile (rows, cols) in FP32.

    gaussws with WORD_ROWS (8 | n, so a row of w starts a word): a (BM, BN / 8) tile of words,
    each loaded once, its 8 nibbles taken with shifts. Otherwise a word may straddle two rows and
    each element loads the word that holds it. diffq: one BF16 per element.
    """
    if GAUSSWS:
        if WORD_ROWS:
            wc = pid_n * (BN // 8) + tl.arange(0, BN // 8)[None, :]
            words = tl.load(r_ptr + rows * n_words_row + wc, mask=(rows < m) & (wc < n_words_row), other=0)
            nib = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF
            nib = tl.reshape(nib, (rows.shape[0], BN))
        else:
            e = rows * n + cols
            nib = (tl.load(r_ptr + e // 8, mask=mask, other=0) >> ((e % 8) * 4)) & 0xF
        r = ((nib & 7) * (1 - 2 * (nib >> 3))).to(tl.float32)
    else:
        r = tl.load(r_ptr + rows * n + cols, mask=mask, other=0.0).to(tl.float32)
    return r


@triton.jit
def _broadcast_blocks(s, BN: tl.constexpr, BLK: tl.constexpr):
    """A tile's BN / BLK block values, each repeated over its BLK columns: shape (1, BN)."""
    return tl.reshape(tl.broadcast_to(s[:, None], (BN // BLK, BLK)), (BN,))[None, :]


@triton.jit
def _load_scale(scale_ptr, pid_m, pid_n, nbn, BN: tl.constexpr, BLK: tl.constexpr):
    """The tile's row of BN / BLK block scales, each repeated over its BLK columns: shape (1, BN)."""
    cb = pid_n * (BN // BLK) + tl.arange(0, BN // BLK)
    s = tl.load(scale_ptr + pid_m * nbn + cb, mask=cb < nbn, other=0.0)
    return _broadcast_blocks(s, BN, BLK)


@triton.jit
def _apply_kernel(w_ptr, r_ptr, scale_ptr, out_ptr, m, n, n_words_row, nbn, GAUSSWS: tl.constexpr,
                  WORD_ROWS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BLK: tl.constexpr):
    tl.static_assert(BM == BLK, "a tile is one block row: its scales are one row of scale_bl")
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)[:, None]
    cols = pid_n * BN + tl.arange(0, BN)[None, :]
    mask = (rows < m) & (cols < n)
    r = _load_r(r_ptr, rows, cols, mask, pid_n, m, n, n_words_row, GAUSSWS, WORD_ROWS, BN)
    scale = _load_scale(scale_ptr, pid_m, pid_n, nbn, BN, BLK)
    w = tl.load(w_ptr + rows * n + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows * n + cols, _bf16_bits(w + r * scale), mask=mask)


@triton.jit
def _block_sums_kernel(g_ptr, r_ptr, out_ptr, m, n, n_words_row, nbn, GAUSSWS: tl.constexpr,
                       WORD_ROWS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BLK: tl.constexpr):
    tl.static_assert(BM == BLK, "a tile is one block row: its sums are one row of the output")
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)[:, None]
    cols = pid_n * BN + tl.arange(0, BN)[None, :]
    mask = (rows < m) & (cols < n)
    r = _load_r(r_ptr, rows, cols, mask, pid_n, m, n, n_words_row, GAUSSWS, WORD_ROWS, BN)
    g = tl.load(g_ptr + rows * n + cols, mask=mask, other=0.0).to(tl.float32)
    sums = tl.sum(tl.sum(tl.reshape(g * r, (BM, BN // BLK, BLK)), axis=2), axis=0)
    cb = pid_n * (BN // BLK) + tl.arange(0, BN // BLK)
    tl.store(out_ptr + pid_m * nbn + cb, sums, mask=cb < nbn)


@triton.jit(do_not_specialize=["seed"])
def _bm_kernel(w_ptr, scale_ptr, out_ptr, m, n, nbn, seed: tl.int64, FAST_TRIG: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BLK: tl.constexpr):
    """Benchmark baseline (Fig. 6 'bm'): Eq. 3 with R = round(N(0,1) / 2), N(0,1) by Box-Muller.

    As fair as `ours`: the same tiles, w / scale / out accessed as in _apply_kernel, and every
    Philox call used whole (its four 32-bit outputs give two Box-Muller pairs, four elements), as
    cuRAND's curand_normal4 does. FAST_TRIG (CUDA): the hardware sine and cosine, as cuRAND's
    Box-Muller (__sincosf); libdevice's sinf keeps a large-argument path with a local-memory array
    that an angle in [0, 2 pi) never needs.
    """
    tl.static_assert(BM == BLK, "a tile is one block row: its scales are one row of scale_bl")
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)[:, None]
    cols = pid_n * BN + tl.arange(0, BN)[None, :]
    mask = (rows < m) & (cols < n)
    # Philox call per 4 consecutive elements of a row: counter = row * ceil(n / 4) + column / 4.
    quads = rows * ((n + 3) // 4) + pid_n * (BN // 4) + tl.arange(0, BN // 4)[None, :]
    r0, r1, r2, r3 = tl.randint4x(seed, quads)
    # u in (0, 1) (never 0: log(u) is finite), angle in [0, 2 pi); both exact from 24 bits.
    rad01 = tl.sqrt(-2.0 * tl.log(((r0 >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)))
    rad23 = tl.sqrt(-2.0 * tl.log(((r2 >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)))
    th01 = (r1 >> 8).to(tl.float32) * (6.283185307179586 / 16777216.0)
    th23 = (r3 >> 8).to(tl.float32) * (6.283185307179586 / 16777216.0)
    if FAST_TRIG:
        z0, z1 = rad01 * cuda_libdevice.fast_cosf(th01), rad01 * cuda_libdevice.fast_sinf(th01)
        z2, z3 = rad23 * cuda_libdevice.fast_cosf(th23), rad23 * cuda_libdevice.fast_sinf(th23)
    else:
        z0, z1 = rad01 * tl.cos(th01), rad01 * tl.sin(th01)
        z2, z3 = rad23 * tl.cos(th23), rad23 * tl.sin(th23)
    r = tl.floor(_interleave4(z0, z1, z2, z3) * 0.5 + 0.5)  # round to nearest (ties have probability 0)
    scale = _load_scale(scale_ptr, pid_m, pid_n, nbn, BN, BLK)
    w = tl.load(w_ptr + rows * n + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows * n + cols, _bf16_bits(w + r * scale), mask=mask)


# --- one pass per weight: Eq. 3 and Eq. 4 of an optimizer step -----------------------------------------
# The begin of a step reads w once and writes BF16 w_hat, R (for the end) and max_bl: 6.5 bytes per FP32
# weight where block maxima, gen and apply move 27. The end reads dL/dw and R once and writes Eq. 4 into
# b_i.grad. The _many kernels do it for every step-mode layer of a group in one launch: program p works on
# tile p of the layers' tiles laid end to end, finding its layer in a per-tile table and the layer's sizes,
# addresses and offsets in a per-layer one (LAYER_FIELDS). Each element, maximum and block sum is the one
# of gen + apply and block_sums to the bit: the same Philox counters and keys, the same FP32 operations in
# the same order, the same tiles; the sizes a launcher's call would have specialised as multiples of 16
# are hinted so (tests/test_triton_compile.py compares the layouts of the reductions).

# A layer's row of the per-layer table (int64): its weight's address, sizes, first tile, and offsets into
# the flat w_hat and R buffers (multiples of 64 elements) and the flat per-block ones (max_bl, e).
LAYER_FIELDS = ("w", "m", "n", "n_words_row", "nbn", "tile0", "out", "r", "blk")
# A layer's row of the per-step table (int64): the addresses of dL/dw and b_i.grad, and what to do there.
STEP_FIELDS = ("g", "grad", "mode")
# modes: no gradient; write Eq. 4 into b_i.grad; add it to the gradient there
SKIP, STORE, ADD = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
_F_W, _F_M, _F_N, _F_NWR, _F_NBN, _F_TILE0, _F_OUT, _F_R, _F_BLK = (tl.constexpr(i) for i in range(9))
_LAYER_ROW, _STEP_ROW = tl.constexpr(len(LAYER_FIELDS)), tl.constexpr(len(STEP_FIELDS))
# float32(ln 2): autograd's exp2 backward multiplies by M_LN2, a double that ATen casts to the FP32 of
# the tensor (0.6931471824645996 is that float exactly, so Triton's constant rounds nothing)
LN2_F32 = tl.constexpr(0.6931471824645996)


@triton.jit
def _block_max(a, BM: tl.constexpr, BN: tl.constexpr, BLK: tl.constexpr):
    """The max of each BLK x BLK block of a (BM, BN) tile of |w|, NaN where the block holds one, as torch.amax
    gives it (a reduction's max skips NaN on a GPU; NumPy's, in the interpreter, keeps it)."""
    blocks = tl.reshape(a, (BM, BN // BLK, BLK))
    nan = tl.max(tl.max((blocks != blocks).to(tl.int32), axis=2), axis=0)
    return tl.where(nan > 0, float("nan"), tl.max(tl.max(blocks, axis=2), axis=0))


@triton.jit
def _lane(seed, k, j):
    """Bits 32 j .. 32 j + 31 of Philox call k's 128 (j in 0..3, per element)."""
    r0, r1, r2, r3 = tl.randint4x(seed, k)
    return tl.where(j == 0, r0, tl.where(j == 1, r1, tl.where(j == 2, r2, r3)))


@triton.jit
def _draw_r(r_ptr, seed, rows, cols, mask, pid_n, tile, m, n, n_words_row, GAUSSWS: tl.constexpr,
            ALIGNED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """R of the tile in FP32, drawn from the seed with gen's counters, its storage written where gen
    writes it (gaussws' words, diffq's BF16) for the end of the step. `tile`: the tile's number in the
    weight, row-major."""
    if GAUSSWS:
        if ALIGNED:  # 8 | n: the tile's words are a (BM, BN / 8) tile
            wc = pid_n * (BN // 8) + tl.arange(0, BN // 8)[None, :]
            k = rows * n_words_row + wc
            word = _gaussws_word(seed, k)
            tl.store(r_ptr + k, word.to(tl.int32, bitcast=True), mask=(rows < m) & (wc < n_words_row))
            nib = (word[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF
            nib = tl.reshape(nib, (rows.shape[0], BN))
        else:
            # a word may straddle two rows: each element takes its 16 bits of its word's Philox call; the
            # words are stored as gen makes them, BM * BN / 8 per tile (the tiles hold at least m * n / 8)
            k = tile * (BM * BN // 8) + tl.arange(0, BM * BN // 8)
            tl.store(r_ptr + k, _gaussws_word(seed, k).to(tl.int32, bitcast=True), mask=k < tl.cdiv(m * n, 8))
            e = rows * n + cols
            nib = _nibble((_lane(seed, e // 8, e % 8 // 2) >> (16 * (e % 2))) & 0xFFFF)
        nib = nib.to(tl.int32)
        r = ((nib & 7) * (1 - 2 * (nib >> 3))).to(tl.float32)
    else:
        if ALIGNED:  # 4 | n: the tile's Philox calls are a (BM, BN / 4) tile
            q = rows * (n // 4) + pid_n * (BN // 4) + tl.arange(0, BN // 4)[None, :]
            b0, b1, b2, b3 = _diffq_codes(seed, q)
            bits = _interleave4(b0, b1, b2, b3)
        else:
            e = rows * n + cols
            bits = _bf16_bits(_uniform(_lane(seed, e // 4, e % 4)))
        tl.store(r_ptr + rows * n + cols, bits, mask=mask)
        r = (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)  # BF16 bits -> FP32, exact
    return r


@triton.jit
def _eq3_tile(w_ptr, e_ptr, out_ptr, r_ptr, max_ptr, seed, m, n, n_words_row, nbn, pid_m, pid_n,
              GAUSSWS: tl.constexpr, ALIGNED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BLK: tl.constexpr):
    """Eq. 3 on one tile: max_bl(|w|) of its blocks (kept for Eq. 4), the scale max_bl * e with
    e = 2^(1 - b_t), R (kept), and BF16 w_hat = w + R * scale."""
    tl.static_assert(BM == BLK, "a tile is one block row: its blocks lie whole in it")
    rows = pid_m * BM + tl.arange(0, BM)[:, None]
    cols = pid_n * BN + tl.arange(0, BN)[None, :]
    mask = (rows < m) & (cols < n)
    w = tl.load(w_ptr + rows * n + cols, mask=mask, other=0.0).to(tl.float32)
    # masked lanes are 0, as block_absmax's zero padding: a 0 never wins a max of |w|
    max_bl = _block_max(tl.abs(w), BM, BN, BLK)
    cb = pid_n * (BN // BLK) + tl.arange(0, BN // BLK)
    tl.store(max_ptr + pid_m * nbn + cb, max_bl, mask=cb < nbn)
    e = tl.load(e_ptr + pid_m * nbn + cb, mask=cb < nbn, other=0.0)
    r = _draw_r(r_ptr, seed, rows, cols, mask, pid_n, pid_m * tl.cdiv(n, BN) + pid_n, m, n, n_words_row, GAUSSWS,
                ALIGNED, BM, BN)
    scale = _broadcast_blocks(max_bl * e, BN, BLK)
    tl.store(out_ptr + rows * n + cols, _bf16_bits(w + r * scale), mask=mask)


@triton.jit
def _eq3_kernel(w_ptr, e_ptr, out_ptr, r_ptr, max_ptr, m, n, n_words_row, nbn, seed_ptr,
                GAUSSWS: tl.constexpr, ALIGNED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BLK: tl.constexpr):
    _eq3_tile(w_ptr, e_ptr, out_ptr, r_ptr, max_ptr, tl.load(seed_ptr), m, n, n_words_row, nbn, tl.program_id(0),
              tl.program_id(1), GAUSSWS, ALIGNED, BM, BN, BLK)


@triton.jit
def _layer(table_ptr, tile_layer_ptr, BN: tl.constexpr, M16: tl.constexpr, N16: tl.constexpr,
           NWR16: tl.constexpr, NBN16: tl.constexpr):
    """This program's layer, its row of the per-layer table, its sizes (int32, hinted as multiples of 16
    where the launcher's call on the layer alone would have specialised them so) and tile (pid_m, pid_n)."""
    layer = tl.load(tile_layer_ptr + tl.program_id(0))
    row = table_ptr + layer * _LAYER_ROW
    m, n = tl.load(row + _F_M).to(tl.int32), tl.load(row + _F_N).to(tl.int32)
    n_words_row, nbn = tl.load(row + _F_NWR).to(tl.int32), tl.load(row + _F_NBN).to(tl.int32)
    if M16:
        m = tl.multiple_of(m, 16)
    if N16:
        n = tl.multiple_of(n, 16)
    if NWR16:
        n_words_row = tl.multiple_of(n_words_row, 16)
    if NBN16:
        nbn = tl.multiple_of(nbn, 16)
    local = tl.program_id(0) - tl.load(row + _F_TILE0).to(tl.int32)
    tiles_n = tl.cdiv(n, BN)
    return layer, row, m, n, n_words_row, nbn, local // tiles_n, local % tiles_n


@triton.jit
def _eq3_many_kernel(table_ptr, tile_layer_ptr, seeds_ptr, e_ptr, out_ptr, r_ptr, max_ptr, W_DTYPE: tl.constexpr,
                     GAUSSWS: tl.constexpr, ALIGNED: tl.constexpr, M16: tl.constexpr, N16: tl.constexpr,
                     NWR16: tl.constexpr, NBN16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BLK: tl.constexpr):
    """_eq3_tile on every tile of a group's layers, each layer's w at its address (a multiple of 16 bytes,
    checked by the launcher), its e and max_bl, w_hat and R at its offsets, its seed at seeds_ptr[layer]."""
    layer, row, m, n, n_words_row, nbn, pid_m, pid_n = _layer(table_ptr, tile_layer_ptr, BN, M16, N16, NWR16, NBN16)
    w_ptr = tl.multiple_of(tl.load(row + _F_W).to(tl.pointer_type(W_DTYPE)), 16)
    blk = tl.load(row + _F_BLK)
    _eq3_tile(w_ptr, e_ptr + blk, out_ptr + tl.multiple_of(tl.load(row + _F_OUT), 64),
              r_ptr + tl.multiple_of(tl.load(row + _F_R), 64), max_ptr + blk, tl.load(seeds_ptr + layer), m, n,
              n_words_row, nbn, pid_m, pid_n, GAUSSWS, ALIGNED, BM, BN, BLK)


@triton.jit
def _eq4_many_kernel(table_ptr, tile_layer_ptr, step_ptr, r_ptr, max_ptr, e_ptr, c, W_DTYPE: tl.constexpr,
                     GAUSSWS: tl.constexpr, WORD_ROWS: tl.constexpr, M16: tl.constexpr, N16: tl.constexpr,
                     NWR16: tl.constexpr, NBN16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BLK: tl.constexpr):
    """Eq. 4 on every tile of a group's layers: sum_bl(dL/dw_hat * R) summed as _block_sums_kernel sums it,
    then the chain autograd evaluated through scale_bl and Eq. 11 (mul, exp2, rsub, add and mul backward:
    ((sum * max_bl) * e) * ln2, negated, times c = b_init - b_target), each product rounded to FP32, into
    the layer's b_i.grad: written (STORE) or added to the gradient there (ADD), as AccumulateGrad does."""
    layer, row, m, n, n_words_row, nbn, pid_m, pid_n = _layer(table_ptr, tile_layer_ptr, BN, M16, N16, NWR16, NBN16)
    step = step_ptr + layer * _STEP_ROW
    mode = tl.load(step + 2)
    if mode != SKIP:
        g_ptr = tl.multiple_of(tl.load(step).to(tl.pointer_type(W_DTYPE)), 16)
        rows = pid_m * BM + tl.arange(0, BM)[:, None]
        cols = pid_n * BN + tl.arange(0, BN)[None, :]
        mask = (rows < m) & (cols < n)
        r = _load_r(r_ptr + tl.multiple_of(tl.load(row + _F_R), 64), rows, cols, mask, pid_n, m, n, n_words_row,
                    GAUSSWS, WORD_ROWS, BN)
        g = tl.load(g_ptr + rows * n + cols, mask=mask, other=0.0).to(tl.float32)
        sums = tl.sum(tl.sum(tl.reshape(g * r, (BM, BN // BLK, BLK)), axis=2), axis=0)
        cb = pid_n * (BN // BLK) + tl.arange(0, BN // BLK)
        keep, b = cb < nbn, pid_m * nbn + cb  # the tile's blocks, numbered within the layer
        blk = tl.load(row + _F_BLK) + b
        d = -(((sums * tl.load(max_ptr + blk, mask=keep)) * tl.load(e_ptr + blk, mask=keep)) * LN2_F32) * c
        grad_ptr = tl.load(step + 1).to(tl.pointer_type(tl.float32)) + b
        if mode == ADD:
            d = tl.load(grad_ptr, mask=keep) + d
        tl.store(grad_ptr, d, mask=keep)


# --- launch specification ---------------------------------------------------------------------------
# Each kernel variant with the argument types and constexprs its launcher passes. The launchers go
# through _launch, which refuses anything not stated here, and tests/test_triton_compile.py compiles
# exactly these for the GPU targets, so the two cannot drift apart.

W_TYPES = ("*fp32", "*bf16", "*fp16")  # w of apply / bm and g of block_sums: any float master weight


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    kernel: object  # the @triton.jit function
    signature: dict  # argument -> Triton type, or a tuple of the types it may take
    constexprs: dict
    elements: int  # elements of R (of w) one program covers; the launcher's grid is numel / elements
    options: dict = dataclasses.field(default_factory=dict)
    per_call: tuple = ()  # constexprs the launcher gives at each call (PER_CALL): what the many kernels' tables hide


# The many kernels' per-call constexprs: the weights' element type (their pointers come from a table) and
# which sizes are multiples of 16 in every layer of the launch (hints).
PER_CALL = {"W_DTYPE": (tl.float32, tl.bfloat16, tl.float16), "M16": (False, True), "N16": (False, True),
            "NWR16": (False, True), "NBN16": (False, True)}


def _tile_args(r_type):
    return {"r_ptr": r_type, "m": "i32", "n": "i32", "n_words_row": "i32", "nbn": "i32"}


@functools.lru_cache(maxsize=None)  # the launchers read it at every call
def kernel_specs(backend):
    """{variant: KernelSpec} for a device backend: 'cuda', 'hip' or 'interpreter'."""
    tiles = {"BM": TILE_M, "BN": TILE_N, "BLK": BL}
    fp32 = {"enable_fp_fusion": False, "num_warps": NUM_WARPS}  # no FMA: w + R * scale rounds as in PyTorch
    specs = {
        "gen_gaussws": KernelSpec(_gen_gaussws_kernel, {"out_ptr": "*i32", "n_words": "i32", "seed_ptr": "*i64"},
                                  {"BLOCK": GEN_BLOCK}, 8 * GEN_BLOCK, fp32),
        "gen_diffq": KernelSpec(_gen_diffq_kernel, {"out_ptr": "*i16", "numel": "i32", "seed_ptr": "*i64"},
                                {"BLOCK": GEN_BLOCK}, 4 * GEN_BLOCK, fp32),
        "bm": KernelSpec(_bm_kernel, {"w_ptr": W_TYPES, "scale_ptr": "*fp32", "out_ptr": "*i16", "m": "i32",
                                      "n": "i32", "nbn": "i32", "seed": "i64"},
                         {"FAST_TRIG": backend == "cuda", **tiles}, TILE_M * TILE_N, fp32),
    }
    tile = TILE_M * TILE_N
    for method, r_type in (("gaussws", "*i32"), ("diffq", "*bf16")):
        for word_rows in ((True, False) if method == "gaussws" else (True,)):
            suffix = method + ("" if word_rows else "_unaligned")
            const = {"GAUSSWS": method == "gaussws", "WORD_ROWS": word_rows, **tiles}
            specs["apply_" + suffix] = KernelSpec(
                _apply_kernel, {"w_ptr": W_TYPES, "scale_ptr": "*fp32", "out_ptr": "*i16", **_tile_args(r_type)},
                const, tile, fp32)
            specs["block_sums_" + suffix] = KernelSpec(
                _block_sums_kernel, {"g_ptr": W_TYPES, "out_ptr": "*fp32", **_tile_args(r_type)}, const, tile, fp32)
            specs["eq4_many_" + suffix] = KernelSpec(
                _eq4_many_kernel, {"table_ptr": "*i64", "tile_layer_ptr": "*i32", "step_ptr": "*i64", "r_ptr": r_type,
                                   "max_ptr": "*fp32", "e_ptr": "*fp32", "c": "fp32"},
                const, tile, fp32, tuple(PER_CALL))
        # the one pass writes R: gaussws' words, diffq's BF16 bits (int16); aligned: 8 | n (gaussws), 4 | n (diffq)
        r_out = "*i32" if method == "gaussws" else "*i16"
        for aligned in (True, False):
            suffix = method + ("" if aligned else "_unaligned")
            const = {"GAUSSWS": method == "gaussws", "ALIGNED": aligned, **tiles}
            # unaligned, every element makes a Philox call: 4x the threads keep their state in registers
            options = fp32 if aligned else {**fp32, "num_warps": 4 * NUM_WARPS}
            specs["eq3_" + suffix] = KernelSpec(
                _eq3_kernel, {"w_ptr": W_TYPES, "e_ptr": "*fp32", "out_ptr": "*i16", "r_ptr": r_out, "max_ptr": "*fp32",
                              "m": "i32", "n": "i32", "n_words_row": "i32", "nbn": "i32", "seed_ptr": "*i64"},
                const, tile, options)
            specs["eq3_many_" + suffix] = KernelSpec(
                _eq3_many_kernel, {"table_ptr": "*i64", "tile_layer_ptr": "*i32", "seeds_ptr": "*i64",
                                   "e_ptr": "*fp32", "out_ptr": "*i16", "r_ptr": r_out, "max_ptr": "*fp32"},
                const, tile, options, tuple(PER_CALL))
    return specs


_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int64: "*i64",
          torch.int32: "*i32", torch.int16: "*i16"}


def _backend(device):
    device = torch.device(device)
    if device.type != "cuda":
        return "interpreter"
    return "hip" if torch.version.hip else "cuda"


def _scalar_type(name, value):
    return "fp32" if isinstance(value, float) else "i64" if name == "seed" else "i32"


def _launch(variant, grid, per_call=None, **args):
    """kernel[grid](**args) with the constexprs and options of kernel_specs() and, for the many kernels,
    the per-call constexprs (PER_CALL); the argument types and values must be those stated there."""
    first = next(v for v in args.values() if isinstance(v, torch.Tensor))
    spec = kernel_specs(_backend(first.device))[variant]
    if set(args) != set(spec.signature):
        raise TypeError(f"{variant}: arguments {sorted(args)}, specified {sorted(spec.signature)}")
    for name, value in args.items():
        got = _TYPES.get(value.dtype) if isinstance(value, torch.Tensor) else _scalar_type(name, value)
        allowed = spec.signature[name]
        if got not in (allowed if isinstance(allowed, tuple) else (allowed,)):
            raise TypeError(f"{variant}: {name} is {got}, specified {allowed}")
    per_call = per_call or {}
    if set(per_call) != set(spec.per_call) or any(per_call[k] not in PER_CALL[k] for k in per_call):
        raise TypeError(f"{variant}: per-call constexprs {per_call}, specified {spec.per_call}")
    spec.kernel[grid](**args, **spec.constexprs, **per_call, **spec.options)


def _check(t, name, dtypes):
    if t.dim() != 2 or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 2-D tensor, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be one of {dtypes}, got {t.dtype}")
    if t.numel() >= 2**31:
        raise ValueError(f"{name} has {t.numel()} elements; the kernels index with int32 (< 2^31)")


@functools.lru_cache(maxsize=256)
def _seed_tensor(seed, device):
    """An int seed as the one-element int64 tensor on `device` the kernels read it from (one copy a value)."""
    return torch.tensor([seed], dtype=torch.int64).to(device)


def seed_arg(seed, device):
    """The kernels' seed: an int in [0, 2^63), or an int64 tensor of one element (the layers' step seeds, on
    their device already: read by the kernel, never by the host, so no GPU waits for it)."""
    device = torch.device(device)
    if not isinstance(seed, torch.Tensor):
        return _seed_tensor(int(seed), device)
    if seed.dtype != torch.int64 or seed.numel() != 1:
        raise ValueError(f"a seed tensor must hold one int64, got {seed.dtype} of shape {tuple(seed.shape)}")
    return seed.reshape(1).to(device)


def gen(numel, seed, method, device):
    """Stored R for `numel` elements: int32 words of 8 nibbles (gaussws) or BF16 (diffq)."""
    seed = seed_arg(seed, device)
    if method == "gaussws":
        n_words = -(-numel // 8)
        out = torch.empty(n_words, dtype=torch.int32, device=device)
        _launch("gen_gaussws", (triton.cdiv(n_words, GEN_BLOCK),), out_ptr=out, n_words=n_words, seed_ptr=seed)
    else:
        out = torch.empty(numel, dtype=torch.bfloat16, device=device)
        _launch("gen_diffq", (triton.cdiv(numel, 4 * GEN_BLOCK),), out_ptr=out.view(torch.int16), numel=numel,
                seed_ptr=seed)
    return out


def _variant(kind, method, n):
    return f"{kind}_{method}" + ("_unaligned" if method == "gaussws" and n % 8 else "")


def apply(w, r_store, scale_bl, method):
    """Eq. 3: BF16(w + R * broadcast(scale_bl)), arithmetic in FP32."""
    _check(w, "w", (torch.float32, torch.bfloat16, torch.float16))
    m, n = w.shape
    out = torch.empty((m, n), dtype=torch.bfloat16, device=w.device)
    grid = (triton.cdiv(m, TILE_M), triton.cdiv(n, TILE_N))
    _launch(_variant("apply", method, n), grid, w_ptr=w, r_ptr=r_store, scale_ptr=scale_bl.float().contiguous(),
            out_ptr=out.view(torch.int16), m=m, n=n, n_words_row=n // 8, nbn=scale_bl.shape[1])
    return out


def block_sums(g, r_store, method):
    """sum_bl(g * R) per 32x32 block, FP32 (the sum in Eq. 4)."""
    _check(g, "g", (torch.float32, torch.bfloat16, torch.float16))
    m, n = g.shape
    nbm, nbn = triton.cdiv(m, BL), triton.cdiv(n, BL)
    out = torch.empty((nbm, nbn), dtype=torch.float32, device=g.device)
    grid = (triton.cdiv(m, TILE_M), triton.cdiv(n, TILE_N))
    _launch(_variant("block_sums", method, n), grid, g_ptr=g, r_ptr=r_store, out_ptr=out, m=m, n=n,
            n_words_row=n // 8, nbn=nbn)
    return out


def bm(w, scale_bl, seed):
    """Benchmark baseline: Eq. 3 with Box-Muller R = round(N(0,1)/2), one fused kernel."""
    _check(w, "w", (torch.float32, torch.bfloat16, torch.float16))
    m, n = w.shape
    out = torch.empty((m, n), dtype=torch.bfloat16, device=w.device)
    grid = (triton.cdiv(m, TILE_M), triton.cdiv(n, TILE_N))
    _launch("bm", grid, w_ptr=w, scale_ptr=scale_bl.float().contiguous(), out_ptr=out.view(torch.int16), m=m,
            n=n, nbn=scale_bl.shape[1], seed=seed)
    return out


# --- one pass per weight ------------------------------------------------------------------------------

def _aligned(method, n):
    """Whether a row of w starts a word of R (gaussws: 8 | n) or a Philox call (diffq: 4 | n): the one pass
    then draws a tile's R as a tile of words or calls, else element by element."""
    return n % (8 if method == "gaussws" else 4) == 0


def r_storage(numel, method, device):
    """Uninitialised storage of R for `numel` elements, as gen returns it: int32 words or BF16."""
    if method == "gaussws":
        return torch.empty(-(-numel // 8), dtype=torch.int32, device=device)
    return torch.empty(numel, dtype=torch.bfloat16, device=device)


def _r_arg(r_store):
    return r_store.view(torch.int16) if r_store.dtype == torch.bfloat16 else r_store


def eq3(w, e, seed, method):
    """Eq. 3 on w in one pass, e = 2^(1 - b_t) of each block (FP32): (BF16 w_hat, R stored as gen stores it,
    max_bl(|w|) in FP32), the bits of block_absmax, gen and apply (tests/test_kernels.py)."""
    _check(w, "w", (torch.float32, torch.bfloat16, torch.float16))
    m, n = w.shape
    nbm, nbn = triton.cdiv(m, BL), triton.cdiv(n, BL)
    if tuple(e.shape) != (nbm, nbn) or e.dtype != torch.float32 or not e.is_contiguous():
        raise ValueError(f"e must be a contiguous FP32 tensor of shape {(nbm, nbn)}, got {e.dtype} {tuple(e.shape)}")
    out = torch.empty((m, n), dtype=torch.bfloat16, device=w.device)
    r_store = r_storage(m * n, method, w.device)
    max_bl = torch.empty((nbm, nbn), dtype=torch.float32, device=w.device)
    _launch(f"eq3_{method}" + ("" if _aligned(method, n) else "_unaligned"), (nbm, triton.cdiv(n, TILE_N)),
            w_ptr=w, e_ptr=e, out_ptr=out.view(torch.int16), r_ptr=_r_arg(r_store), max_ptr=max_bl, m=m, n=n,
            n_words_row=n // 8, nbn=nbn, seed_ptr=seed_arg(seed, w.device))
    return out, r_store, max_bl


_W_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_ALIGN = 64  # elements: where each layer's part of the flat w_hat and R buffers starts (128 bytes of w_hat)


def _hints(m, n):
    """Which sizes a launcher's call on an (m, n) weight alone would specialise as multiples of 16."""
    return {"M16": m % 16 == 0, "N16": n % 16 == 0, "NWR16": n // 8 % 16 == 0, "NBN16": -(-n // BL) % 16 == 0}


def many_key(w, method):
    """What the weights of one launch of the many kernels share: device, dtype, method, how R is drawn
    (_aligned) and the hints (_hints)."""
    m, n = w.shape
    return (w.device, w.dtype, method, _aligned(method, n), tuple(_hints(m, n).items()))


def _up(x, k=_ALIGN):
    return -(-x // k) * k


class Many:
    """The many kernels' tables for a fixed list of weights of one many_key, built once: begin (eq3) and
    end (eq4) of each optimizer step are then one launch each, whatever the number of weights.

    Per-block values (e, max_bl, b_i.grad) of all layers lie in one flat FP32 vector in the order of the
    layers, unpadded (torch.cat of their b_i); w_hat and R in flat buffers, each layer's part starting at
    a multiple of 64 elements. The weights' addresses are read at each call (a moved weight updates the
    table); each must be a contiguous tensor at a multiple of 16 bytes."""

    def __init__(self, weights, method):
        keys = {many_key(w, method) for w in weights}
        if len(keys) != 1:
            raise ValueError(f"the weights of one launch must share their many_key, got {sorted(map(str, keys))}")
        (self.device, self.dtype, self.method, self.aligned, hints), = keys
        self.per_call = {"W_DTYPE": _W_DTYPE[self.dtype], **dict(hints)}
        self.shapes = [tuple(w.shape) for w in weights]
        self.blocks = [(-(-m // BL), -(-n // BL)) for m, n in self.shapes]
        tiles = [-(-m // TILE_M) * -(-n // TILE_N) for m, n in self.shapes]
        r_len = [-(-m * n // 8) if method == "gaussws" else m * n for m, n in self.shapes]
        self.tile0, self.out0, self.r0, self.blk0 = ([0] for _ in range(4))
        for (m, n), t, r, (bm, bn) in zip(self.shapes, tiles, r_len, self.blocks):
            self.tile0.append(self.tile0[-1] + t)
            self.out0.append(self.out0[-1] + _up(m * n))
            self.r0.append(self.r0[-1] + _up(r))
            self.blk0.append(self.blk0[-1] + bm * bn)
        rows = [[0, m, n, n // 8, -(-n // BL), self.tile0[i], self.out0[i], self.r0[i], self.blk0[i]]
                for i, (m, n) in enumerate(self.shapes)]
        # split sizes of the flat buffers: each layer's part, then its padding to the next (views in one call)
        self.out_sizes = [x for (m, n), a, b in zip(self.shapes, self.out0, self.out0[1:])
                          for x in (m * n, b - a - m * n)]
        self.r_sizes = [x for r, a, b in zip(r_len, self.r0, self.r0[1:]) for x in (r, b - a - r)]
        self.host_table = torch.tensor(rows, dtype=torch.int64)
        self.table = self.host_table.to(self.device)
        self.tile_layer = torch.repeat_interleave(torch.arange(len(weights), dtype=torch.int32),
                                                  torch.tensor(tiles)).to(self.device)
        self.max_bl = torch.empty(self.blk0[-1], dtype=torch.float32, device=self.device)
        self.e = self.r_store = None  # this step's 2^(1 - b_t) and R, flat, from eq3 to eq4
        self.addresses = None

    def _set_addresses(self, weights):
        addresses = [w.data_ptr() for w in weights]
        if addresses == self.addresses:
            return
        for w, shape in zip(weights, self.shapes):
            if tuple(w.shape) != shape or not w.is_contiguous() or w.data_ptr() % 16:
                raise ValueError(f"a weight of the launch changed: {tuple(w.shape)} (was {shape}), contiguous "
                                 f"{w.is_contiguous()}, address % 16 = {w.data_ptr() % 16}")
        self.host_table[:, 0] = torch.tensor(addresses, dtype=torch.int64)
        self.table.copy_(self.host_table)
        self.addresses = addresses

    def eq3(self, weights, seeds, e):
        """Eq. 3 on every weight: seeds (int64, one per weight, on the device) and e (the flat FP32
        2^(1 - b_t)) -> ([BF16 w_hat], [stored R]), views of this step's flat buffers; max_bl and e kept."""
        self._set_addresses(weights)
        w_hat = torch.empty(self.out0[-1], dtype=torch.bfloat16, device=self.device)
        r_store = r_storage(8 * self.r0[-1] if self.method == "gaussws" else self.r0[-1], self.method, self.device)
        self.e, self.r_store = e, r_store
        _launch(f"eq3_many_{self.method}" + ("" if self.aligned else "_unaligned"), (self.tile0[-1],),
                self.per_call, table_ptr=self.table, tile_layer_ptr=self.tile_layer, seeds_ptr=seeds, e_ptr=e,
                out_ptr=w_hat.view(torch.int16), r_ptr=_r_arg(r_store), max_ptr=self.max_bl)
        return ([v.view(shape) for v, shape in zip(w_hat.split(self.out_sizes)[::2], self.shapes)],
                r_store.split(self.r_sizes)[::2])

    def eq4(self, step_table, c, r_store=None, e=None, g_dtype=None):
        """Eq. 4 into every b_i.grad, as step_table (int64 (weights, 3) on the device: STEP_FIELDS) says,
        from R and e (the last eq3's, or those given: a per-micro-step forward's), max_bl and c = b_init -
        b_target; the gradients dL/dw_hat the table points to are of the weights' dtype or g_dtype. Then the
        last eq3's R is let go."""
        word_rows = self.method != "gaussws" or self.aligned
        per_call = self.per_call if g_dtype is None else {**self.per_call, "W_DTYPE": _W_DTYPE[g_dtype]}
        _launch(f"eq4_many_{self.method}" + ("" if word_rows else "_unaligned"), (self.tile0[-1],), per_call,
                table_ptr=self.table, tile_layer_ptr=self.tile_layer, step_ptr=step_table,
                r_ptr=self.r_store if r_store is None else r_store, max_ptr=self.max_bl,
                e_ptr=self.e if e is None else e, c=float(c))
        self.r_store = None
