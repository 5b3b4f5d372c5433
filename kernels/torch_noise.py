"""The noise R in plain PyTorch, bit for bit the same as kernels/triton_noise.py (block sums:
the same products, summed in another order; see kernels/__init__.py).

Triton's `tl.randint4x(seed, offset)` is Philox-4x32-10 with counter (offset, 0, 0, 0) and key
(seed_lo, seed_hi). We replay it with int64 tensors that hold uint32 values (see _mul_hi_lo for
the 32x32-bit products), then turn each element's 16 bits into its code four elements at a time
(nibbles: SWAR, one int64 op does the work of four). No C++ this compiles to overflows a signed
integer. The seed enters as a 0-dim tensor so that torch.compile does not specialise (and
recompile) on its value.

Every function here is elementwise or a blockwise sum, so torch.compile turns each into one loop.
Where compile is unavailable (no C compiler) the same code runs eagerly.
"""
import warnings

import torch

from kernels import BL, PHILOX_ROUND_A, PHILOX_ROUND_B, PHILOX_KEY_A, PHILOX_KEY_B, PHILOX_ROUNDS

_M32 = 0xFFFFFFFF
assert PHILOX_ROUND_A & PHILOX_ROUND_B & 1, "_mul_hi_lo needs odd multipliers"


def _mul_hi_lo(a, const):
    """(hi, lo) 32-bit halves of a * const for uint32 `a` in int64 and an odd uint32 constant.

    The product needs 64 unsigned bits and int64 overflow is undefined in the C++ that inductor
    writes, so multiply by const >> 1 instead: a * const = 2q + (a & 1) with q = a * (const >> 1) +
    (a >> 1) < 2^63. One multiplication, and no partial product can overflow.
    """
    q = a * (const >> 1) + (a >> 1)
    return q >> 31, ((q & 0x7FFFFFFF) << 1) | (a & 1)


def philox4x32(offset, seed):
    """Four uint32 streams (as int64) for int64 counters `offset` and a 0-dim int64 `seed`."""
    c0 = offset & _M32
    c1 = offset >> 32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0 = seed & _M32
    k1 = (seed >> 32) & _M32
    for _ in range(PHILOX_ROUNDS):
        hi_b, lo_b = _mul_hi_lo(c2, PHILOX_ROUND_B)
        hi_a, lo_a = _mul_hi_lo(c0, PHILOX_ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + PHILOX_KEY_A) & _M32
        k1 = (k1 + PHILOX_KEY_B) & _M32
    return c0, c1, c2, c3


_LANES = 0x0001000100010001  # bit 0 of each 16-bit lane of an int64


def nibbles(x):
    """Sign-magnitude 4-bit codes of R (Eq. 10) for the four 16-bit lanes of int64 `x` at once.

    Each lane's code lands in its low 4 bits. Per lane, bit 0: sign; bits 1-2: f, g; bits 3-10:
    h1..h8; bits 11-15: a, b, c, d, e.
    |R| = 2 when (f|g) & h1 & ... & h8          Pr = 3/4 * 2^-8
    |R| = 1 when not 2 and (a|b) & (c|d) & e    Pr = 9/32 * (1 - 3/4 * 2^-8)
    The lanes never mix: a lane only reads its own bits (right shifts of at most 15, masked to
    bit 0 of each lane), so the sign-extended top of a negative x never reaches a result.
    """
    fg = (x >> 1) | (x >> 2)
    h = x >> 3
    h = h & (h >> 1)
    h = h & (h >> 2)
    h = h & (h >> 4)  # bit 0 of each lane: h1 & ... & h8
    mag2 = fg & h & _LANES
    mag1 = ((x >> 11) | (x >> 12)) & ((x >> 13) | (x >> 14)) & (x >> 15) & (mag2 ^ _LANES)
    return (mag2 << 1) | mag1 | ((x & (mag2 | mag1)) << 3)  # no sign on a zero: no -0


def _gather_lanes(codes):
    """The codes of nibbles() (bits 0, 16, 32, 48) side by side in bits 0-15."""
    codes = (codes | (codes >> 12)) & 0x000000FF000000FF
    return (codes | (codes >> 24)) & 0xFFFF


def _join(lo, hi):
    """The int64 whose bits are uint32 `hi` above uint32 `lo`. `hi << 32` could overflow int64, which
    C++ leaves undefined, so `hi` is first made signed: [-2^31, 2^31) * 2^32 always fits."""
    return ((hi ^ 0x80000000) - 0x80000000) * 2**32 + lo


def _gen_gaussws(seed, n_words: int):
    # Element 8k + j of word k draws bits 16j..16j+15 of Philox call k's 128-bit output.
    c0, c1, c2, c3 = philox4x32(torch.arange(n_words, device=seed.device), seed)
    word = _gather_lanes(nibbles(_join(c0, c1))) | (_gather_lanes(nibbles(_join(c2, c3))) << 16)
    return ((word ^ 0x80000000) - 0x80000000).to(torch.int32)  # uint32 bits -> int32


def _gen_diffq(seed, n_calls: int):
    r = philox4x32(torch.arange(n_calls, device=seed.device), seed)
    # 24 random bits / 2^24 - 1/2 is exact in FP32; the one rounding is the BF16 cast.
    u = torch.stack([(x >> 8).to(torch.float32) * 2.0**-24 - 0.5 for x in r], dim=-1)
    return u.to(torch.bfloat16).flatten()


def _decode(codes):
    """R in FP32 from its sign-magnitude codes."""
    return ((codes & 7) * (1 - 2 * (codes >> 3))).to(torch.float32)


def _unpack(r_store, numel, method):
    """R as FP32 for the first `numel` elements, row-major."""
    if method == "gaussws":
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=r_store.device)
        return _decode((r_store[:, None] >> shifts) & 0xF).flatten()[:numel]
    return r_store[:numel].to(torch.float32)


def _unpack16(r_store, method):
    """R as FP32 rows of 16 elements, shape (numel / 16, 16); for gaussws a row is the 16 nibbles
    of two words, read as one int64 (little-endian: the first word is the low half)."""
    if method == "gaussws":
        shifts = torch.arange(0, 64, 4, dtype=torch.int64, device=r_store.device)
        return _decode((r_store.view(torch.int64)[:, None] >> shifts) & 0xF)
    return r_store.view(-1, 16).to(torch.float32)


def _broadcast_bl(scale_bl, m, n):
    """broadcast_bl: each block's value repeated over its (up to) 32x32 elements."""
    return scale_bl.repeat_interleave(BL, dim=0)[:m].repeat_interleave(BL, dim=1)[:, :n]


# When 16 divides n, rows of 16 elements lie in one row of w and one block, and torch.compile
# vectorises the loop over them (one FP32 vector per row on AVX-512); other shapes index element
# by element, several times slower. Both give the same bits (tests/test_kernels.py).

def _apply(w, r_store, scale_bl, method: str):
    m, n = w.shape
    if n % 16:
        r = _unpack(r_store, m * n, method).view(m, n)
        return (w.to(torch.float32) + r * _broadcast_bl(scale_bl, m, n)).to(torch.bfloat16)
    scale = scale_bl.repeat_interleave(BL, dim=0)[:m].repeat_interleave(BL // 16, dim=1)[:, : n // 16]
    # Cast before the view back to (m, n): the other order stops inductor from vectorising.
    w_hat = w.view(-1, 16).to(torch.float32) + _unpack16(r_store, method) * scale.reshape(-1, 1)
    return w_hat.to(torch.bfloat16).view(m, n)


def _block_sums(g, r_store, method: str):
    m, n = g.shape
    nbm, nbn = -(-m // BL), -(-n // BL)
    if n % 16:
        prod = g.to(torch.float32) * _unpack(r_store, m * n, method).view(m, n)
        prod = torch.nn.functional.pad(prod, (0, nbn * BL - n, 0, nbm * BL - m))
        return prod.view(nbm, BL, nbn, BL).sum(dim=(1, 3))
    per_row = (g.view(-1, 16).to(torch.float32) * _unpack16(r_store, method)).sum(-1)
    per_row = torch.nn.functional.pad(per_row.view(m, n // 16), (0, nbn * BL // 16 - n // 16, 0, nbm * BL - m))
    return per_row.view(nbm, BL, nbn, BL // 16).sum(dim=(1, 3))


COMPILE_MIN_NUMEL = 2**15  # smaller tensors run eagerly: compiling would cost more than it saves
RECOMPILE_LIMIT = 64  # one compiled loop per tensor shape; a model has a handful of shapes


def is_compile_failure(e):
    """True when torch.compile itself could not build the loop: its backend failed (no working C++
    compiler, no Triton, a GPU too old for Triton, an inductor bug). False for anything else, e.g. a
    bug in the function or an out-of-memory error, which must reach the caller as it would eagerly."""
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor import exc as inductor_exc

    if isinstance(e, BackendCompilerFailed):  # InductorError is one; the cause is in inner_exception
        return not isinstance(getattr(e, "inner_exception", None), (torch.OutOfMemoryError, MemoryError))
    # The same causes, should one escape unwrapped (e.g. a kernel compiled lazily at its first call).
    return isinstance(e, (inductor_exc.InvalidCxxCompiler, inductor_exc.CppCompileError,
                          inductor_exc.TritonMissing, inductor_exc.GPUTooOldForTriton))


class Compiled:
    """torch.compile'd per shape (static shapes vectorise best) for large tensors, eager otherwise.

    `numel(*args)` is the number of elements the call works on (default: those of the first
    argument); below `min_numel` it runs eagerly. `options` are inductor's (torch.compile's options),
    `what` names the work in the warning.
    Falls back to eager, warned once, where compile does not work (an unsupported Python, no C++
    compiler, ...: see is_compile_failure); every other error propagates.
    """

    def __init__(self, fn, numel=lambda first, *rest: first.numel(), min_numel=None, options=None, what="the noise"):
        self.fn, self.numel, self.min_numel, self.options, self.what = fn, numel, min_numel, options, what
        self.compiled = None

    def _fall_back(self, why):
        warnings.warn(f"torch.compile unavailable for {self.what} ({why}); running eager")
        self.compiled = False

    @torch.no_grad()
    def __call__(self, *args):
        min_numel = COMPILE_MIN_NUMEL if self.min_numel is None else self.min_numel
        if self.numel(*args) < min_numel or self.compiled is False:
            return self.fn(*args)
        if self.compiled is None:
            if not torch._dynamo.is_dynamo_supported():  # e.g. a Python version torch.compile refuses
                self._fall_back("torch._dynamo does not support this platform")
                return self.fn(*args)
            self.compiled = torch.compile(self.fn, dynamic=False, options=self.options)
        try:
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                return self.compiled(*args)
        except Exception as e:
            if not is_compile_failure(e):
                raise
            self._fall_back(f"{type(e).__name__}: {e}")
            return self.fn(*args)


# The counters are made inside the compiled loop (an index, never a tensor in memory); their
# count is a Python int, so each weight shape gets its own static loop like the other functions.
_gen = {"gaussws": Compiled(_gen_gaussws, numel=lambda seed, n_words: 8 * n_words),
        "diffq": Compiled(_gen_diffq, numel=lambda seed, n_calls: 4 * n_calls)}
_apply_c = Compiled(_apply)
_block_sums_c = Compiled(_block_sums)


def gen(numel, seed, method, device):
    """Stored R for `numel` elements: int32 words of 8 nibbles (gaussws) or BF16 (diffq)."""
    per_call = 8 if method == "gaussws" else 4
    seed_t = torch.tensor(int(seed), dtype=torch.int64, device=device)  # int(): also a one-element tensor
    r_store = _gen[method](seed_t, -(-numel // per_call))
    return r_store if method == "gaussws" else r_store[:numel]


def apply(w, r_store, scale_bl, method):
    """Eq. 3: BF16(w + R * broadcast(scale_bl)), arithmetic in FP32."""
    return _apply_c(w.detach(), r_store, scale_bl.detach(), method)


def block_sums(g, r_store, method):
    """sum_bl(g * R) per 32x32 block, FP32 (the sum in Eq. 4)."""
    return _block_sums_c(g.detach(), r_store, method)


def eq3(w, e, seed, method):
    """Eq. 3 with e = 2^(1 - b_t) of each block: (BF16 w_hat, R stored as gen stores it, max_bl(|w|)), the
    Triton backend's one pass (triton_noise.eq3) in three: block_absmax, gen and apply."""
    max_bl = block_absmax(w)
    r_store = gen(w.numel(), seed, method, w.device)
    return apply(w, r_store, max_bl * e, method), r_store, max_bl


def _block_absmax(w):
    m, n = w.shape
    nbm, nbn = -(-m // BL), -(-n // BL)
    a = torch.nn.functional.pad(w.abs(), (0, nbn * BL - n, 0, nbm * BL - m))  # zeros never win a max of |w|
    return a.view(nbm, BL, nbn, BL).amax(dim=(1, 3)).float()


_block_absmax_c = Compiled(_block_absmax)  # one fused pass over w for large weights


def block_absmax(w):
    """max_bl(|w|): FP32 max of |w| over each 32x32 block, shape (ceil(m/32), ceil(n/32)), partial
    blocks at the edges. The scale of Eq. 3's noise (gaussws.py) and of the STE's grids (quant/ste.py), for
    either backend: here because both of those import it, and it draws no noise. Eager on a GPU, where
    its three kernels cost the host less than a compiled call's guards (about 50 against 110-150 us on
    an H200); compiled on the CPU, where one fused pass is faster. Either gives the same bits (a max)."""
    return (_block_absmax if w.is_cuda else _block_absmax_c)(w.detach())
