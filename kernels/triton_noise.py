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


@triton.jit(do_not_specialize=["seed"])
def _gen_gaussws_kernel(out_ptr, n_words, seed: tl.int64, BLOCK: tl.constexpr):
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
def _interleave4(a, b, c, d):
    """Rows of 4 (a[i], b[i], c[i], d[i]) in a tensor 4x as long in its last dimension."""
    x = tl.join(tl.join(a, c), tl.join(b, d))  # [..., i, k] = (a, b, c, d)[2 * i + k]
    return tl.reshape(x, a.shape[:-1] + (4 * a.shape[-1],))


@triton.jit(do_not_specialize=["seed"])
def _gen_diffq_kernel(out_ptr, numel, seed: tl.int64, BLOCK: tl.constexpr):
    # Philox call k makes elements 4k .. 4k+3; the four are interleaved so that the store is one
    # contiguous run of 4 * BLOCK BF16 values (vector stores) instead of four strided ones.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    r0, r1, r2, r3 = tl.randint4x(seed, offs)
    bits = _interleave4(_bf16_bits(_uniform(r0))[None, :], _bf16_bits(_uniform(r1))[None, :],
                        _bf16_bits(_uniform(r2))[None, :], _bf16_bits(_uniform(r3))[None, :])
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
def _load_scale(scale_ptr, pid_m, pid_n, nbn, BN: tl.constexpr, BLK: tl.constexpr):
    """The tile's row of BN / BLK block scales, each repeated over its BLK columns: shape (1, BN)."""
    cb = pid_n * (BN // BLK) + tl.arange(0, BN // BLK)
    s = tl.load(scale_ptr + pid_m * nbn + cb, mask=cb < nbn, other=0.0)
    return tl.reshape(tl.broadcast_to(s[:, None], (BN // BLK, BLK)), (BN,))[None, :]


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


def _tile_args(r_type):
    return {"r_ptr": r_type, "m": "i32", "n": "i32", "n_words_row": "i32", "nbn": "i32"}


@functools.lru_cache(maxsize=None)  # the launchers read it at every call
def kernel_specs(backend):
    """{variant: KernelSpec} for a device backend: 'cuda', 'hip' or 'interpreter'."""
    tiles = {"BM": TILE_M, "BN": TILE_N, "BLK": BL}
    fp32 = {"enable_fp_fusion": False, "num_warps": NUM_WARPS}  # no FMA: w + R * scale rounds as in PyTorch
    specs = {
        "gen_gaussws": KernelSpec(_gen_gaussws_kernel, {"out_ptr": "*i32", "n_words": "i32", "seed": "i64"},
                                  {"BLOCK": GEN_BLOCK}, 8 * GEN_BLOCK, fp32),
        "gen_diffq": KernelSpec(_gen_diffq_kernel, {"out_ptr": "*i16", "numel": "i32", "seed": "i64"},
                                {"BLOCK": GEN_BLOCK}, 4 * GEN_BLOCK, fp32),
        "bm": KernelSpec(_bm_kernel, {"w_ptr": W_TYPES, "scale_ptr": "*fp32", "out_ptr": "*i16", "m": "i32",
                                      "n": "i32", "nbn": "i32", "seed": "i64"},
                         {"FAST_TRIG": backend == "cuda", **tiles}, TILE_M * TILE_N, fp32),
    }
    for method, r_type in (("gaussws", "*i32"), ("diffq", "*bf16")):
        for word_rows in ((True, False) if method == "gaussws" else (True,)):
            suffix = method + ("" if word_rows else "_unaligned")
            const = {"GAUSSWS": method == "gaussws", "WORD_ROWS": word_rows, **tiles}
            specs["apply_" + suffix] = KernelSpec(
                _apply_kernel, {"w_ptr": W_TYPES, "scale_ptr": "*fp32", "out_ptr": "*i16", **_tile_args(r_type)},
                const, TILE_M * TILE_N, fp32)
            specs["block_sums_" + suffix] = KernelSpec(
                _block_sums_kernel, {"g_ptr": W_TYPES, "out_ptr": "*fp32", **_tile_args(r_type)},
                const, TILE_M * TILE_N, fp32)
    return specs


_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int32: "*i32",
          torch.int16: "*i16"}


def _backend(device):
    device = torch.device(device)
    if device.type != "cuda":
        return "interpreter"
    return "hip" if torch.version.hip else "cuda"


def _launch(variant, grid, **args):
    """kernel[grid](**args) with the constexprs and options of kernel_specs(); the argument types
    must be those stated there."""
    first = next(v for v in args.values() if isinstance(v, torch.Tensor))
    spec = kernel_specs(_backend(first.device))[variant]
    if set(args) != set(spec.signature):
        raise TypeError(f"{variant}: arguments {sorted(args)}, specified {sorted(spec.signature)}")
    for name, value in args.items():
        got = _TYPES.get(value.dtype) if isinstance(value, torch.Tensor) else ("i64" if name == "seed" else "i32")
        allowed = spec.signature[name]
        if got not in (allowed if isinstance(allowed, tuple) else (allowed,)):
            raise TypeError(f"{variant}: {name} is {got}, specified {allowed}")
    spec.kernel[grid](**args, **spec.constexprs, **spec.options)


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
        _launch("gen_gaussws", (triton.cdiv(n_words, GEN_BLOCK),), out_ptr=out, n_words=n_words, seed=seed)
    else:
        out = torch.empty(numel, dtype=torch.bfloat16, device=device)
        _launch("gen_diffq", (triton.cdiv(numel, 4 * GEN_BLOCK),), out_ptr=out.view(torch.int16), numel=numel,
                seed=seed)
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
