"""The noise R in plain PyTorch, bit for bit the same as kernels/triton_noise.py.

Triton's `tl.randint4x(seed, offset)` is Philox-4x32-10 with counter (offset, 0, 0, 0) and key
(seed_lo, seed_hi). We replay it with int64 tensors that hold uint32 values: a 32x32-bit product
would overflow int64, so each multiplication splits the constant into 16-bit halves (every partial
product stays below 2^48). The seed enters as a 0-dim tensor so that torch.compile does not
specialise (and recompile) on its value.

Every function here is elementwise or a blockwise sum, so torch.compile turns each into one loop.
Where compile is unavailable (no C compiler) the same code runs eagerly.
"""
import warnings

import torch

from kernels import BL, PHILOX_ROUND_A, PHILOX_ROUND_B, PHILOX_KEY_A, PHILOX_KEY_B, PHILOX_ROUNDS

_M32 = 0xFFFFFFFF


def _mul_hi_lo(a, const):
    """(hi, lo) 32-bit halves of a * const for uint32 `a` in int64 and a uint32 constant."""
    p_lo = a * (const & 0xFFFF)
    p_hi = a * (const >> 16)
    hi = (p_hi + (p_lo >> 16)) >> 16
    lo = (p_lo + ((p_hi & 0xFFFF) << 16)) & _M32
    return hi, lo


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


def nibble(bits):
    """Sign-magnitude 4-bit code of R from 16 random bits (Eq. 10).

    bit 0: sign; bits 1-2: f, g; bits 3-10: h1..h8; bits 11-15: a, b, c, d, e.
    |R| = 2 when (f|g) & h1 & ... & h8          Pr = 3/4 * 2^-8
    |R| = 1 when not 2 and (a|b) & (c|d) & e    Pr = 9/32 * (1 - 3/4 * 2^-8)
    """
    fg = ((bits >> 1) | (bits >> 2)) & 1
    h = ((bits >> 3) & 0xFF) == 0xFF
    mag2 = fg & h.to(bits.dtype)
    mag1 = ((bits >> 11) | (bits >> 12)) & ((bits >> 13) | (bits >> 14)) & (bits >> 15) & 1 & (1 - mag2)
    mag = 2 * mag2 + mag1
    sign = bits & 1 & (mag != 0).to(bits.dtype)
    return sign * 8 + mag


def _gen_gaussws(offset, seed):
    r = philox4x32(offset, seed)
    word = torch.zeros_like(offset)
    for j in range(8):
        word = word | (nibble((r[j // 2] >> (16 * (j % 2))) & 0xFFFF) << (4 * j))
    return ((word ^ 0x80000000) - 0x80000000).to(torch.int32)  # uint32 bits -> int32


def _gen_diffq(offset, seed):
    r = philox4x32(offset, seed)
    # 24 random bits / 2^24 - 1/2 is exact in FP32; the one rounding is the BF16 cast.
    u = torch.stack([(x >> 8).to(torch.float32) * 2.0**-24 - 0.5 for x in r], dim=-1)
    return u.to(torch.bfloat16).flatten()


def _unpack_words(r_store, n_words, method):
    """R as FP32 of shape (n_words, 8): row k holds elements 8k..8k+7, the nibbles of word k."""
    if method == "gaussws":
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=r_store.device)
        nib = (r_store[:, None] >> shifts) & 0xF
        return ((nib & 7) * (1 - 2 * (nib >> 3))).to(torch.float32)
    return r_store[: 8 * n_words].view(n_words, 8).to(torch.float32)


def _unpack(r_store, numel, method):
    """R as FP32 for the first `numel` elements, row-major."""
    if method == "gaussws":
        return _unpack_words(r_store, -(-numel // 8), method).flatten()[:numel]
    return r_store[:numel].to(torch.float32)


def _broadcast_bl(scale_bl, m, n):
    """broadcast_bl: each block's value repeated over its (up to) 32x32 elements."""
    return scale_bl.repeat_interleave(BL, dim=0)[:m].repeat_interleave(BL, dim=1)[:, :n]


# When 8 divides n, the 8 elements of a word lie in one row and one block. Working on (words, 8)
# then lets torch.compile vectorise the whole loop; the general shapes index element by element,
# several times slower. Both give the same bits (tests/test_kernels.py).

def _apply(w, r_store, scale_bl, method: str):
    m, n = w.shape
    if n % 8:
        r = _unpack(r_store, m * n, method).view(m, n)
        return (w.to(torch.float32) + r * _broadcast_bl(scale_bl, m, n)).to(torch.bfloat16)
    scale = scale_bl.repeat_interleave(BL, dim=0)[:m].repeat_interleave(BL // 8, dim=1)[:, : n // 8]
    r = _unpack_words(r_store, m * n // 8, method)
    # Cast before the view back to (m, n): the other order stops inductor from vectorising.
    return (w.view(-1, 8).to(torch.float32) + r * scale.reshape(-1, 1)).to(torch.bfloat16).view(m, n)


def _block_sums(g, r_store, method: str):
    m, n = g.shape
    nbm, nbn = -(-m // BL), -(-n // BL)
    if n % 8:
        prod = g.to(torch.float32) * _unpack(r_store, m * n, method).view(m, n)
        prod = torch.nn.functional.pad(prod, (0, nbn * BL - n, 0, nbm * BL - m))
        return prod.view(nbm, BL, nbn, BL).sum(dim=(1, 3))
    per_word = (g.view(-1, 8).to(torch.float32) * _unpack_words(r_store, m * n // 8, method)).sum(-1)
    per_word = torch.nn.functional.pad(per_word.view(m, n // 8), (0, nbn * BL // 8 - n // 8, 0, nbm * BL - m))
    return per_word.view(nbm, BL, nbn, BL // 8).sum(dim=(1, 3))


COMPILE_MIN_NUMEL = 2**15  # smaller tensors run eagerly: compiling would cost more than it saves
RECOMPILE_LIMIT = 64  # one compiled loop per tensor shape; a model has a handful of shapes


class Compiled:
    """torch.compile'd per shape (static shapes vectorise best) for large tensors, eager otherwise.

    Falls back to eager, warned once, where compile does not work (no C compiler, ...).
    """

    def __init__(self, fn):
        self.fn = fn
        self.compiled = None

    @torch.no_grad()
    def __call__(self, *args):
        if args[0].numel() < COMPILE_MIN_NUMEL or self.compiled is False:
            return self.fn(*args)
        try:
            if self.compiled is None:
                self.compiled = torch.compile(self.fn, dynamic=False)
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                return self.compiled(*args)
        except Exception as e:  # no C compiler, unsupported platform, ...
            warnings.warn(f"torch.compile unavailable for the noise ({type(e).__name__}: {e}); running eager")
            self.compiled = False
            return self.fn(*args)


_gen = {"gaussws": Compiled(_gen_gaussws), "diffq": Compiled(_gen_diffq)}
_apply_c = Compiled(_apply)
_block_sums_c = Compiled(_block_sums)


def gen(numel, seed, method, device):
    """Stored R for `numel` elements: int32 words of 8 nibbles (gaussws) or BF16 (diffq)."""
    per_call = 8 if method == "gaussws" else 4
    offset = torch.arange(-(-numel // per_call), device=device, dtype=torch.int64)
    seed_t = torch.tensor(seed, dtype=torch.int64, device=device)
    r_store = _gen[method](offset, seed_t)
    return r_store if method == "gaussws" else r_store[:numel]


def apply(w, r_store, scale_bl, method):
    """Eq. 3: BF16(w + R * broadcast(scale_bl)), arithmetic in FP32."""
    return _apply_c(w.detach(), r_store, scale_bl.detach(), method)


def block_sums(g, r_store, method):
    """sum_bl(g * R) per 32x32 block, FP32 (the sum in Eq. 4)."""
    return _block_sums_c(g.detach(), r_store, method)
