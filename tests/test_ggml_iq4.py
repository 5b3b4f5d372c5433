"""quant.ggml_quants' IQ4_NL and IQ4_XS: llama.cpp's searched rule on its non-uniform 16-level grid, held
against a per-block re-computation of ggml-quants.c's quantize_row_iq4_nl_impl in numpy FP32 scalars and against
llama.cpp's own quantizer (llama-cpp-python's libggml), with and without importance weights (the other types:
tests/test_ggml_quants.py)."""
import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES

from ggml_cases import edge_weights, reference_blocks, weights
from quant import ggml_quants as G

T = G.T
f32 = np.float32


# --- IQ4_NL, IQ4_XS: llama.cpp's searched rule ------------------------------------------------------------

KVALUES = [f32(v) for v in (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)]  # written out


def best_index(x):
    """best_index_int8 of ggml-quants.c: early returns outside the levels, a bisection, then the nearer of the
    two levels around x (the upper where x - lower < upper - x fails), differences in FP32."""
    if x <= KVALUES[0]:
        return 0
    if x >= KVALUES[15]:
        return 15
    ml, mu = 0, 15
    while mu - ml > 1:
        mav = (ml + mu) // 2
        ml, mu = (ml, mav) if x < KVALUES[mav] else (mav, mu)
    return mu - 1 if f32(x - KVALUES[mu - 1]) < f32(KVALUES[mu] - x) else mu


def nearest_int(v):
    """ggml-quants.c's nearest_int: the float's bits after adding 1.5 * 2^23."""
    return (int(np.array(f32(f32(v) + f32(12582912.0))).view(np.int32)) & 0x7FFFFF) - 0x400000


def ref_iq4_scale(x, w):
    """The first loop of quantize_row_iq4_nl_impl (ntry 7) on one block of 32: its FP32 scale, 0 for a block
    whose largest magnitude is below 1e-15."""
    amax = mx = f32(0)
    for v in x:
        if abs(v) > amax:
            amax, mx = abs(v), v
    if amax < f32(1e-15):
        return f32(0)

    def sums(inverse):
        sumqx = sumq2 = f32(0)
        for v, wv in zip(x, w):
            q = KVALUES[best_index(f32(inverse * v))]
            sumqx, sumq2 = f32(sumqx + f32(f32(wv * q) * v)), f32(sumq2 + f32(f32(wv * q) * q))
        return sumqx, sumq2
    sumqx, sumq2 = sums(f32(f32(1) / f32(f32(-mx) / f32(-127))))
    d = f32(sumqx / sumq2) if sumq2 > 0 else f32(0)
    best = f32(d * sumqx)
    for itry in range(-7, 8):
        sumqx, sumq2 = sums(f32(f32(itry - 127) / mx))
        if sumq2 > 0 and f32(sumqx * sumqx) > f32(best * sumq2):
            d = f32(sumqx / sumq2)
            best = f32(d * sumqx)
    return d


def ref_iq4(x, t, qw=None):
    """quantize_iq4_nl (x: 32 weights) or quantize_iq4_xs (x: 256) of one block, in numpy FP32 scalars as the
    C computes: (FP16 d, [6-bit scale codes] (IQ4_XS), [level index of each weight])."""
    x = [f32(v) for v in x]
    sigma2 = f32(0)
    for v in x:
        sigma2 = f32(sigma2 + f32(v * v))
    sigma2 = f32(sigma2 * f32(2 / len(x)))
    if qw is None:
        w = [f32(v * v) for v in x]
    else:
        w = [f32(f32(q) * f32(np.sqrt(np.float64(f32(sigma2 + f32(v * v)))))) for q, v in zip(qw, x)]
    scales = [ref_iq4_scale(x[j:j + 32], w[j:j + 32]) for j in range(0, len(x), 32)]
    if t == T.IQ4_NL:
        inverse = f32(f32(1) / scales[0]) if scales[0] else f32(0)
        return np.float16(scales[0]), [], [best_index(f32(inverse * v)) for v in x]
    top = amax = f32(0)
    for sc in scales:
        if abs(sc) > amax:
            amax, top = abs(sc), sc
    d = f32(f32(-top) / f32(32))
    inverse = f32(f32(1) / d) if d else f32(0)
    codes, levels = [], []
    for j, sc in enumerate(scales):
        code = max(-32, min(31, nearest_int(f32(inverse * sc))))
        dl = f32(d * f32(code))
        idl = f32(f32(1) / dl) if dl else f32(0)
        codes.append(code + 32)
        levels += [best_index(f32(idl * v)) for v in x[32 * j:32 * j + 32]]
    return np.float16(d), codes, levels


def test_each_weight_takes_best_index_int8s_level_at_the_midpoints_and_beside_them():
    """The level the rule gives a value (here straight from the module's nearest-level step) is the C's
    best_index_int8 on every level, every midpoint between two (a tie goes up), the floats either side of
    each, beyond both ends, and random values."""
    points = [v for k in range(15) for v in (KVALUES[k], f32((KVALUES[k] + KVALUES[k + 1]) / 2))]
    points += [KVALUES[15], f32(-300), f32(300), f32(0)]
    x = np.array([np.nextafter(p, d, dtype=f32) for p in points for d in (-np.inf, np.inf)] + points, dtype=f32)
    x = np.concatenate([x, np.random.default_rng(8).uniform(-140, 140, 2000).astype(f32)])
    ours = G._iq4_codes(torch.from_numpy(x)).tolist()
    assert ours == [best_index(v) for v in x]


def iq4_blocks(t):
    """reference_blocks' rows as blocks of t: each row for IQ4_NL; for IQ4_XS super-blocks of eight of them, a
    zero one (d = -0) and one with a single non-zero block."""
    rows = reference_blocks()
    if t == T.IQ4_NL:
        return rows
    lone = torch.zeros(256)
    lone[96:128] = rows[9]
    return torch.stack([rows[:8].flatten(), rows[2:].flatten(), torch.zeros(256), lone])


@pytest.mark.parametrize("importance", [False, True], ids=["plain", "importance"])
@pytest.mark.parametrize("t", G.IQ4, ids=lambda t: t.name)
def test_iq4_is_llama_cpps_rule_with_and_without_importance_weights(t, importance):
    """Each block's FP16 d (its bits: -0 too), scale codes and levels are the C's, recomputed here in numpy FP32
    scalars; the importance weights random, with a block of zeros (its fit has no weight: d 0)."""
    w = iq4_blocks(t)
    qw = None
    if importance:
        qw = torch.from_numpy(np.random.default_rng(4).random(w.shape[1]).astype(f32) * 2)
        qw[:32] = 0
    q = G.quantize(w, t, weights=qw)
    size = G.block_size(t)
    for i, x in enumerate(w.numpy()):
        for b in range(w.shape[1] // size):
            at = slice(b * size, (b + 1) * size)
            d, codes, levels = ref_iq4(x[at], t, None if qw is None else qw[at])
            assert q["d"][i, b].numpy().view(np.uint16) == d.view(np.uint16), (i, b)
            assert q["q"][i, at].tolist() == levels, (i, b)
            if t == T.IQ4_XS:
                assert q["sc"][i, b].tolist() == codes, (i, b)
    if t == T.IQ4_XS:
        assert q["d"][2, 0].numpy().view(np.uint16) == 0x8000  # a zero super-block's d: -(+0) / 32


def llama_cpp_quantizer(t):
    """llama.cpp's quantize_iq4_nl / quantize_iq4_xs in process (the libggml llama-cpp-python loads), as a
    function (w, importance or None) -> the blocks' bytes; None where llama-cpp-python is not installed."""
    try:
        from llama_cpp._ggml import libggml
    except (ImportError, OSError):
        return None
    import ctypes
    f = getattr(libggml, f"quantize_{t.name.lower()}")
    f.restype, f.argtypes = ctypes.c_size_t, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                              ctypes.c_void_p]

    def quantize(w, importance):
        x = np.ascontiguousarray(w.numpy(), dtype=f32)
        out = np.zeros((x.shape[0], x.shape[1] // GGML_QUANT_SIZES[t][0] * GGML_QUANT_SIZES[t][1]), np.uint8)
        qw = None if importance is None else np.ascontiguousarray(importance.numpy(), dtype=f32)
        f(x.ctypes.data, out.ctypes.data, x.shape[0], x.shape[1], None if qw is None else qw.ctypes.data)
        return out
    return quantize


@pytest.mark.skipif(llama_cpp_quantizer(T.IQ4_NL) is None,
                    reason="llama-cpp-python not installed: its in-process quantizer is the oracle of this test")
@pytest.mark.parametrize("t", G.IQ4, ids=lambda t: t.name)
def test_llama_cpps_own_quantizer_writes_our_iq4_bytes_with_and_without_its_importance_matrix(t):
    """quantize_iq4_nl / _xs of the llama.cpp llama-cpp-python runs (what llama-quantize calls, with an imatrix
    or none) writes pack(quantize(w, weights=...)) byte for byte, on weights made to reach the rule's edges
    (zero blocks, tiny, huge and subnormal scales, ties, a grid, dominant weights) and on Gaussian ones."""
    theirs = llama_cpp_quantizer(t)
    w = torch.cat([edge_weights(), weights("gauss", 16, 1024, seed=9)])
    importance = torch.from_numpy(np.random.default_rng(6).random(1024).astype(f32) ** 2 * 10)
    importance[256:288] = 0
    for qw in (None, importance):
        assert np.array_equal(G.pack(G.quantize(w, t, weights=qw), t), theirs(w, qw)), qw is None


@pytest.mark.parametrize("t", [T.Q4_K, T.Q4_0], ids=lambda t: t.name)
def test_importance_weights_are_for_the_iq4_types_and_one_per_column(t):
    w = weights("gauss", 2, 256)
    with pytest.raises(ValueError, match=rf"^{t.name} takes no importance weights .*; IQ4_NL and IQ4_XS do$"):
        G.quantize(w, t, weights=torch.ones(256))
    for bad in (torch.ones(255), torch.full((256,), -1.0), torch.full((256,), float("nan"))):
        with pytest.raises(ValueError, match=r"^IQ4_XS: importance weights are one finite value >= 0 per input "
                                             r"column \(256\)"):
            G.quantize(w, "iq4_xs", weights=bad)
