"""quant.lattice's IQ3_XXS, held against independent truth: gguf-py's IQ3_XXS dequantizer decodes our bytes to our
values bit for bit, and llama.cpp's own quantizer (quantize_iq3_xxs of the libggml llama-cpp-python loads, what
llama-quantize calls) writes the same blocks for nearly all of the weights, with and without an importance
matrix; the STE layer trains on the grid along each row; widths that are not multiples of 256 are refused."""
import ctypes

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from ggml_cases import edge_weights, weights
from quant import lattice, ste
from quant.ggml_quants import QuantError

f32 = np.float32


def iq3_weights():
    """(104, 1024): the GGML types' edge rows (zero rows and blocks, tiny and huge scales, ties, grids, dominant
    weights) and Gaussian ones, plus a zero sub-block inside a non-zero super-block, an odd number of negative
    weights in every 8, and weights already on the lattice."""
    w = torch.cat([edge_weights(), weights("gauss", 32, 1024, seed=9)])
    w[-1, 32:64] = 0  # llama.cpp leaves this sub-block's bytes zero: it dequantizes to d, not 0
    w[-2, :8] = torch.tensor([-1, 2, 3, 4, 5, 6, 7, 8]) * 0.01
    values = lattice.tables()[0]
    w[-3] = values[torch.arange(256) % 256].flatten() * 1e-3  # every grid point, one scale
    return w


def llama_cpp_iq3_xxs():
    """llama.cpp's quantize_iq3_xxs in process, as (w, importance or None) -> the blocks' bytes; None where
    llama-cpp-python is not installed."""
    try:
        from llama_cpp._ggml import libggml
    except (ImportError, OSError):
        return None
    libggml.ggml_quantize_init(ctypes.c_int(int(T.IQ3_XXS)))  # builds the grid's map and neighbours
    f = libggml.quantize_iq3_xxs
    f.restype, f.argtypes = ctypes.c_size_t, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                              ctypes.c_void_p]

    def quantize(w, importance):
        x = np.ascontiguousarray(w.numpy(), dtype=f32)
        out = np.zeros((x.shape[0], x.shape[1] // 256 * lattice.BYTES), np.uint8)
        qw = None if importance is None else np.ascontiguousarray(importance.numpy(), dtype=f32)
        f(x.ctypes.data, out.ctypes.data, x.shape[0], x.shape[1], None if qw is None else qw.ctypes.data)
        return out
    return quantize


def decoded(raw, shape):
    return torch.from_numpy(gguf_dequantize(raw, T.IQ3_XXS)).reshape(shape)


@pytest.mark.parametrize("trials", [lattice.TRIALS, lattice.STE_TRIALS], ids=["llama.cpp's", "the STE's"])
def test_gguf_decodes_our_blocks_to_our_values_bit_for_bit(trials):
    """pack(quantize(w)) through gguf-py's IQ3_XXS dequantizer gives dequantize(quantize(w)) exactly: the bytes
    (d, grid indices, 7 signs of 8 and the parity's 8th, 4-bit scales) hold what the STE trains on."""
    w = iq3_weights()
    q = lattice.quantize(w, trials=trials)
    raw = lattice.pack(q)
    assert raw.shape == (w.shape[0], 4 * 98)
    ours = lattice.dequantize(q)
    assert np.array_equal(ours.numpy().view(np.uint32), decoded(raw, w.shape).numpy().view(np.uint32))
    assert torch.equal(lattice.fake_quantize(w, trials=trials), ours)
    assert (ours[-1, 32:64] == ours[-1, 32:64][0]).all() and ours[-1, 32] > 0  # d * 0.25 * 4: the zero sub-block


@pytest.mark.skipif(llama_cpp_iq3_xxs() is None,
                    reason="llama-cpp-python not installed: its in-process quantizer is the oracle of this test")
def test_llama_cpps_own_quantizer_writes_the_same_blocks_for_nearly_all_weights():
    """llama.cpp's quantize_iq3_xxs, without and with an importance matrix, writes our bytes for at least 97% of
    the 256-weight blocks (the rest: a trial scale or neighbour chosen differently at an FP32 near-tie, the sums
    being in torch's order), and its values' RMS error against w is ours within 0.5%. A wrong sign, parity, scale
    code, fudge, trial or neighbour rule moves most blocks."""
    theirs = llama_cpp_iq3_xxs()
    w = iq3_weights()
    importance = torch.from_numpy(np.random.default_rng(6).random(1024).astype(f32) ** 2 * 10)
    for qw in (None, importance):
        mine, ref = lattice.pack(lattice.quantize(w, weights=qw)), theirs(w, qw)
        same = (mine.reshape(-1, lattice.BYTES) == ref.reshape(-1, lattice.BYTES)).all(1)
        assert same.mean() >= 0.97, (qw is None, same.mean())
        rms = [(decoded(raw, w.shape) - w).square().mean().sqrt().item() for raw in (mine, ref)]
        assert abs(rms[0] / rms[1] - 1) < 5e-3, rms


def test_the_ste_layer_trains_on_iq3_xxs_along_each_row():
    """An STELinear on iq3_xxs multiplies by the weight on the lattice with blocks along its input dimension (the
    STE's trial scales), and a width that is not a multiple of 256 is refused in one line."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 8))
    ste.convert(model, "iq3_xxs")
    w = model[0].weight.detach().clone()
    assert torch.equal(model[0].quantized_weight(), lattice.fake_quantize(w, trials=lattice.STE_TRIALS))
    with pytest.raises(ValueError, match=r"input width 128, which target_format='iq3_xxs' cannot hold \(iq3_xxs's "
                                         r"blocks are 256 weights of a row\)"):
        ste.convert(torch.nn.Sequential(torch.nn.Linear(128, 8)), "iq3_xxs")
    with pytest.raises(QuantError, match=r"^IQ3_XXS needs a row width .* multiple of 256; this weight's is 128$"):
        lattice.quantize(torch.zeros(2, 128))
