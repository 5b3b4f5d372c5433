"""The two noise backends: Philox as specified, the same bits from Triton and PyTorch."""
import math

import pytest
import torch

import gaussws
from kernels import torch_noise, triton_noise

SHAPES = [(1, 1), (33, 65), (3000, 11), (70, 40), (40, 48), (128, 272)]  # 16 | n: the row-wise path
# (eager below 2^15 elements, compiled above: 3000x11 on the element-wise path, 128x272 row-wise)
SEEDS = [0, 1, 2**40 + 3, 2**63 - 1]
# Above 2^15 elements, where Triton's interpreter is slow: one seed and BF16 weights (the smaller
# shapes above cover every seed and both dtypes on the same code paths of the kernels).
LARGE_SEEDS, LARGE_DTYPES = [2**63 - 1], (torch.bfloat16,)


def philox_reference(counter, key):
    """Philox-4x32-10 with Python integers, from the Random123 paper's definition."""
    c, k, m = list(counter), list(key), 2**32 - 1
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k[0], p1 & m, (p0 >> 32) ^ c[3] ^ k[1], p0 & m]
        k = [(k[0] + 0x9E3779B9) & m, (k[1] + 0xBB67AE85) & m]
    return c


def test_philox_reference_matches_random123_known_answer():
    assert philox_reference([0, 0, 0, 0], [0, 0]) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


@pytest.mark.parametrize("seed", SEEDS)
def test_torch_philox_equals_reference(seed):
    offsets = [0, 1, 7, 12345, 2**31 + 9, 2**33 + 5]
    got = torch_noise.philox4x32(torch.tensor(offsets), torch.tensor(seed))
    for i, o in enumerate(offsets):
        want = philox_reference([o & 0xFFFFFFFF, o >> 32, 0, 0], [seed & 0xFFFFFFFF, seed >> 32])
        assert [int(x[i]) for x in got] == want


def _bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


@pytest.mark.parametrize("method", ["gaussws", "diffq"])
@pytest.mark.parametrize("shape", SHAPES)
def test_backends_give_identical_r_and_w_hat(method, shape):
    m, n = shape
    gen = torch.Generator().manual_seed(m * 1000 + n)
    large = m * n >= 2**15
    for seed in LARGE_SEEDS if large else SEEDS:
        stored_triton = triton_noise.gen(m * n, seed, method, "cpu")
        stored_torch = torch_noise.gen(m * n, seed, method, "cpu")
        assert stored_triton.dtype == stored_torch.dtype
        assert torch.equal(_bits(stored_triton), _bits(stored_torch))
        r_triton = gaussws.sample_r(shape, seed, method, backend="triton")
        r_torch = gaussws.sample_r(shape, seed, method, backend="torch")
        assert torch.equal(r_triton, r_torch)
        for dtype in LARGE_DTYPES if large else (torch.float32, torch.bfloat16):
            w = (torch.randn(shape, generator=gen) * 0.02).to(dtype)
            b_t = 2 + 10 * torch.rand(-(-m // 32), -(-n // 32), generator=gen)
            w_hat_triton = gaussws.pseudo_quantize(w, b_t, seed, method, backend="triton")
            w_hat_torch = gaussws.pseudo_quantize(w, b_t, seed, method, backend="torch")
            assert torch.equal(_bits(w_hat_triton), _bits(w_hat_torch))


def _block_sums_float64(p):
    """Per 32x32 block: (sum of p, sum of |p|), in float64, for an FP32 (m, n) tensor p."""
    m, n = p.shape
    p = torch.nn.functional.pad(p.double(), (0, -n % 32, 0, -m % 32))
    blocks = p.view(p.shape[0] // 32, 32, p.shape[1] // 32, 32)
    return blocks.sum(dim=(1, 3)), blocks.abs().sum(dim=(1, 3))


# Any order of summing k FP32 numbers x_i gives s with |s - sum x_i| <= gamma_(k-1) * sum |x_i|,
# gamma_j = j u / (1 - j u), u = 2^-24 (Higham, Accuracy and Stability of Numerical Algorithms,
# eq. 4.4). A block has 1024 products; the float64 reference adds its own, far smaller, gamma.
GAMMA_1023 = 1023 * 2.0**-24 / (1 - 1023 * 2.0**-24) + 1023 * 2.0**-53 / (1 - 1023 * 2.0**-53)


@pytest.mark.parametrize("method", ["gaussws", "diffq"])
@pytest.mark.parametrize("shape", [(97, 70), (64, 256), (40, 48)])  # 8 does not divide 70: a word per element
def test_block_sums_are_sums_of_the_same_products_within_the_order_bound(method, shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(shape[1]))
    r_store = torch_noise.gen(g.numel(), 99, method, "cpu")
    products = g * gaussws.sample_r(shape, 99, method, backend="torch")  # FP32, as both backends form them
    exact, total_abs = _block_sums_float64(products)
    for backend in (triton_noise, torch_noise):
        sums = backend.block_sums(g, r_store, method)
        assert sums.dtype == torch.float32 and sums.shape == exact.shape
        assert ((sums.double() - exact).abs() <= GAMMA_1023 * total_abs).all()


@pytest.mark.parametrize("shape", [(97, 70), (64, 256)])
def test_block_sums_are_bit_identical_when_every_order_is_exact(shape):
    """g integer-valued, |g| <= 8: gaussws products are integers of magnitude <= 16 and every partial
    sum of a block (< 2^14) is exact in FP32, so both backends must give the same bits."""
    g = torch.randint(-8, 9, shape, generator=torch.Generator().manual_seed(1)).float()
    r_store = torch_noise.gen(g.numel(), 7, "gaussws", "cpu")
    a = triton_noise.block_sums(g, r_store, "gaussws")
    b = torch_noise.block_sums(g, r_store, "gaussws")
    exact, _ = _block_sums_float64(g * gaussws.sample_r(shape, 7, backend="torch"))
    assert torch.equal(a, b) and torch.equal(a.double(), exact)


def test_packing_is_eight_sign_magnitude_nibbles_per_word():
    shape = (61, 37)  # 2257 elements: the last word is partly unused
    words = torch_noise.gen(61 * 37, 5, "gaussws", "cpu")
    assert words.dtype == torch.int32 and words.numel() == math.ceil(61 * 37 / 8)
    unpacked = []
    for word in words.tolist():
        word &= 0xFFFFFFFF
        for j in range(8):
            nib = (word >> (4 * j)) & 0xF
            assert nib in (0, 1, 2, 9, 10)  # +-1, +-2 and a single zero (no -0)
            unpacked.append(-(nib & 7) if nib & 8 else nib)
    r = gaussws.sample_r(shape, 5, backend="torch")
    assert r.flatten().tolist() == unpacked[: 61 * 37]


def test_bm_baseline_draws_rounded_normal_over_two():
    w = torch.zeros(64, 1024)
    r = triton_noise.bm(w, torch.ones(2, 32), seed=3).float()
    n = r.numel()
    assert set(r.unique().tolist()) <= {-3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0}
    # round(x/2) = 0 iff |x| < 1; +-1 iff 1 < |x| < 3 (normal CDF values).
    for value, p in [(0.0, 0.682689), (1.0, 0.157305), (-1.0, 0.157305)]:
        freq = (r == value).float().mean().item()
        assert abs(freq - p) < 5 * math.sqrt(p * (1 - p) / n)
