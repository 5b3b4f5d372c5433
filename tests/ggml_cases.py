"""The weights the GGML type tests share (tests/test_ggml_quants.py, tests/test_ggml_iq4.py): random kinds and
scales, blocks at the reference rules' edges, rows at the scale rules' edges."""
import numpy as np
import torch

f32 = np.float32


def weights(kind, m, n, scale=0.02, seed=0):
    """Random float32 (m, n) weights: Gaussian, heavy-tailed (Student's t, 2 degrees of freedom), Gaussian
    with 1 % outliers 10x larger, or Gaussian with all-zero rows (the first and the last)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_t(2, (m, n)) if kind == "heavy" else rng.standard_normal((m, n))
    if kind == "outliers":
        w[rng.random((m, n)) < 0.01] *= 10
    if kind == "zero_rows":
        w[0] = w[-1] = 0
    return torch.from_numpy((w * scale).astype(f32))


def bits(a):
    return np.ascontiguousarray(np.asarray(a, dtype=f32)).view(np.uint32)


CASES = [("gauss", 2, 512, 0.02), ("heavy", 3, 256, 1.0), ("outliers", 1, 1024, 0.02), ("zero_rows", 4, 512, 3e-3),
         ("gauss", 2, 256, 1e-5), ("gauss", 1, 256, 300.0)]


def reference_blocks():
    """Blocks that exercise the reference rules: ties of the largest magnitude (+/-), all zeros (+0 and -0),
    exact half-way codes (weights on a grid of 1/16), a subnormal and an underflowing FP16 d, random."""
    rng = np.random.default_rng(3)
    rows = [np.tile([0.5, -0.5], 16), np.tile([-0.5, 0.5], 16), np.zeros(32), -np.zeros(32),
            rng.integers(-16, 17, 32) / 16, rng.integers(-40, 41, 32) / 8, rng.standard_normal(32) * 3e-5,
            rng.standard_normal(32) * 1e-7, rng.standard_normal(32) * 0.02, rng.standard_t(2, 32)]
    return torch.from_numpy(np.stack(rows).astype(f32))


def edge_weights():
    """(64, 1024) rows made to reach the scale rules' edges: every CASES kind and scale, zero rows and blocks,
    -0s and tiny negatives in non-negative blocks, subnormal K-quant scales, +a/-a ties, weights already on a
    grid, one dominant weight per block."""
    rows = [weights(kind, 4, 1024, scale, seed=i) for i, (kind, _, _, scale) in enumerate(CASES)]
    rng = np.random.default_rng(5)
    odd = rng.random((40, 1024)).astype(f32) * 0.02
    odd[0:4, 1::7], odd[0:4, 3::11] = -1e-9, -0.0
    odd[4:8] = 0
    odd[8:12, 256:512] = 0
    odd[12:16] *= 1e-6 / 0.02  # K-quant d below FP16's normal range
    odd[16:20, ::2] = -odd[16:20, 1::2]  # ties of +a and -a
    odd[20:24] = np.round(odd[20:24] * 8 / 0.02) * 0.02 / 8  # on a grid of 1/8 steps
    odd[24:28, ::32] = 1.0  # one weight per 32 dominates its block
    odd[28:40] = rng.standard_normal((12, 1024)).astype(f32) * 0.02
    return torch.cat(rows + [torch.from_numpy(odd)])
