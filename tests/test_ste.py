"""The STE baseline's grid and gradient: grids.fake_quantize is export.py's quantization bit for bit,
and the straight-through gradient is the identity (torchao's convention where its own QAT applies)."""
import pytest
import torch
import torch.nn as nn

import export as E
import gaussws
from files import lowbit
from quant import formats, grids, ste
from quant.formats import BY_NAME, FORMATS

SHAPES = [(70, 45), (33, 97), (5, 3), (64, 32)]  # partial edge blocks, a single partial block, whole blocks


def random_weight(shape, seed):
    """Gaussian weights whose 32x32 blocks span 2^-100 .. 2^20 (the scales' exponents), with an all-zero
    block, tiny weights of either sign (rounded to +-0) and weights at half their block's max."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen)
    m, n = shape
    for i in range(0, m, 32):
        for j in range(0, n, 32):
            block = w[i:i + 32, j:j + 32]
            block *= 2.0 ** torch.randint(-100, 21, (), generator=gen).item()
            flat = block.flatten().clone()
            flat[::7] *= 2.0 ** -30
            flat[1::11] = flat[1::11].sign() * flat.abs().max() / 2
            block.copy_(flat.view(block.shape))
    if m > 32 or n > 32:
        w[:32, :32] = 0.0
    return w


def exported(w, name):
    """The weight export.py writes for format `name` and reads back (export.quantize_weight, dequantize_weight)."""
    ids = torch.full((-(-w.shape[0] // 32), -(-w.shape[1] // 32)), BY_NAME[name], dtype=torch.uint8)
    return lowbit.dequantize_weight(lowbit.quantize_weight("w", w, ids), *w.shape)


def bits(t):
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("name", grids.STE_FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_ste_grid_is_exports_quantization_bit_for_bit(name, shape):
    w = random_weight(shape, seed=10 * grids.STE_FORMATS.index(name) + SHAPES.index(shape))
    got = grids.fake_quantize(w, name)
    assert got.dtype == torch.float32 and got.shape == w.shape
    assert torch.equal(bits(got), bits(exported(w, name)))  # signed zeros included
    assert not torch.equal(got, w)


def near_tie_blocks(levels):
    """One 32x32 block per BF16 scale s in [2^-10, 2^-9): its max L * s (so the int scale is s itself),
    then (k + 1/2) s and its FP32 neighbours for k < L: where w / s and w * (1/s) may round apart."""
    blocks = []
    for mantissa in range(128):
        s = (1 + mantissa / 128) * 2.0 ** -10
        ties = (torch.arange(levels, dtype=torch.float32) + 0.5) * s
        ties = torch.cat([ties, (ties.view(torch.int32) + 1).view(torch.float32),
                          (ties.view(torch.int32) - 1).view(torch.float32)])
        block = torch.zeros(32 * 32)
        block[0] = levels * s
        block[1:1 + 2 * len(ties)] = torch.cat([ties, -ties])
        blocks.append(block.view(32, 32))
    return torch.cat(blocks)


@pytest.mark.parametrize("name", ["int2", "int3", "int4", "int8"])
def test_int_grid_rounds_w_times_the_fp32_reciprocal_as_torchao_and_export_do(name):
    """torchao computes round(w * (1/s)) in FP32; export.py does the same, so near a half-integer both
    pick the same level where the exact quotient w / s (float64) picks the other one."""
    fmt = FORMATS[BY_NAME[name]]
    w = near_tie_blocks(fmt.levels)
    got = grids.fake_quantize(w, name)
    assert torch.equal(bits(got), bits(exported(w, name)))
    s = formats.int_scales(w.view(-1, 32, 32).abs().amax(dim=(1, 2)), fmt).double().repeat_interleave(32)[:, None]
    assert torch.equal(s[::32, 0] * fmt.levels, w[::32, 0].double())  # the scale is s, not rounded up
    exact = (w.double() / s).round().clamp(-fmt.levels, fmt.levels) * s
    assert (exact != got.double()).sum() > 10  # the blocks do hold such weights: the test can fail


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp8_e5m2"])
def test_fp8_grid_saturates_where_torchs_cast_would_give_inf(name):
    fmt = FORMATS[BY_NAME[name]]
    w = torch.randn(32, 32, generator=torch.Generator().manual_seed(0)).clamp(-1, 1)
    w[0, 0] = 1.9375  # the block max: X = 2^-emax, and w / X = 1.9375 * 2^emax lies beyond fmt.max
    if name == "mxfp8_e5m2":  # IEEE-like: torch's cast alone overflows to inf
        assert torch.isinf((w[0, 0] * 2.0 ** fmt.emax).to(torch.float8_e5m2).float())
    got = grids.fake_quantize(w, name)
    assert torch.isfinite(got).all() and got[0, 0] == fmt.max / 2.0 ** fmt.emax
    assert torch.equal(bits(got), bits(exported(w, name)))


@pytest.mark.parametrize("name", ["int3", "mxfp4"])
def test_ste_gradient_is_the_identity(name):
    """dL/dw = dL/dw_q exactly, for every weight: the gradient F.linear gives the fake-quantized weight."""
    gen = torch.Generator().manual_seed(1)
    layer = ste.STELinear(45, 70, fmt=name)
    with torch.no_grad():
        layer.weight.copy_(random_weight((70, 45), seed=2))
    x, g = torch.randn(6, 45, generator=gen), torch.randn(6, 70, generator=gen)
    with gaussws.TrainStep(layer, 0):
        layer(x).backward(g)
    w_q = grids.fake_quantize(layer.weight, name).requires_grad_()
    nn.functional.linear(x, w_q, layer.bias).backward(g)
    assert torch.equal(layer.weight.grad, w_q.grad) and layer.weight.grad.abs().sum() > 0


def test_int_gradient_is_torchaos_fake_quantization_gradient_which_never_clamps_at_the_absmax_scale():
    """torchao's affine fake quantization passes the gradient straight through round() and zeroes it
    where clamp() bites, times s * (1/s) ~ 1. With export's scale (absmax rounded up) nothing is clamped,
    so its gradient is the identity up to that product's rounding; a smaller scale shows the clamp."""
    from torchao.quantization.quant_primitives import ZeroPointDomain, _fake_quantize_affine
    fmt = FORMATS[BY_NAME["int3"]]
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(3))
    g = torch.randn(w.shape, generator=torch.Generator().manual_seed(4))
    s = formats.int_scales(gaussws.block_absmax(w), fmt).float()
    for scale in (s, s / 2):
        levels = (w * (1.0 / scale.repeat_interleave(32, 0).repeat_interleave(32, 1))).round()
        clamped = levels.abs() > fmt.levels
        w_ = w.clone().requires_grad_()
        _fake_quantize_affine(w_, (32, 32), scale, None, torch.int32, -fmt.levels, fmt.levels,
                              ZeroPointDomain.NONE).backward(g)
        torch.testing.assert_close(w_.grad[~clamped], g[~clamped], rtol=2 ** -22, atol=0)
        assert (w_.grad[clamped] == 0).all()
        assert clamped.any() == (scale is not s)  # the absmax scale clamps nothing
    # and STELinear's weight gradient is torchao's at that scale: F.linear's dL/dw_q through its backward
    layer = ste.STELinear(96, 64, bias=False, fmt="int3")
    with torch.no_grad():
        layer.weight.copy_(w)
    gen = torch.Generator().manual_seed(5)
    x, g_y = torch.randn(8, 96, generator=gen), torch.randn(8, 64, generator=gen)
    with gaussws.TrainStep(layer, 0):
        layer(x).backward(g_y)
    w_ = w.clone().requires_grad_()
    w_q = _fake_quantize_affine(w_, (32, 32), s, None, torch.int32, -fmt.levels, fmt.levels, ZeroPointDomain.NONE)
    nn.functional.linear(x, w_q).backward(g_y)
    torch.testing.assert_close(layer.weight.grad, w_.grad, rtol=2 ** -22, atol=0)


def test_mxfp4_gradient_is_torchaos_mx_qat_gradient_also_where_fp4_saturates():
    """torchao's MX QAT backward gives the weight dL/dy^T x, unmasked: the weights fp4 saturates
    (block max / X in (6, 8)) get the identity gradient too, as in STELinear."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.qat.mx import MXFakeQuantizeConfig, _MXQuantizedForwardFakeQuantizedBackward
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(64, 64, generator=gen)
    w[::32, ::32] = 7.5  # block max 7.5: X = 2^(2 - 2) = 1, 7.5 saturates at 6
    assert (grids.fake_quantize(w, "mxfp4")[::32, ::32] == 6.0).all()
    # activations on the fp4 grid with block max 6, so that torchao's quantization of them is exact
    x = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])[torch.randint(0, 8, (16, 64), generator=gen)]
    x[:, ::32] = 6.0
    g = torch.randn(16, 64, generator=gen)
    config = MXFakeQuantizeConfig(dtype=torch.float4_e2m1fn_x2, scaling_mode=ScaleCalculationMode.FLOOR)
    w_ao = w.clone().requires_grad_()
    _MXQuantizedForwardFakeQuantizedBackward.apply(x, w_ao, None, config, config).backward(g)
    layer = ste.STELinear(64, 64, bias=False, fmt="mxfp4")
    with torch.no_grad():
        layer.weight.copy_(w)
    with gaussws.TrainStep(layer, 0):
        layer(x).backward(g)
    assert torch.equal(layer.weight.grad, w_ao.grad) and (layer.weight.grad[::32, ::32] != 0).all()


def test_ste_layer_is_nn_linear_in_eval_and_before_its_start():
    gen = torch.Generator().manual_seed(6)
    plain = nn.Linear(40, 50)
    layer = ste.STELinear.from_linear(plain, fmt="int3", start=5)
    assert layer.weight is plain.weight and layer.bias is plain.bias
    x = torch.randn(3, 40, generator=gen)
    for step, quantized in ((4, False), (5, True)):
        with gaussws.TrainStep(layer, step):
            y = layer(x)
        want = nn.functional.linear(x, grids.fake_quantize(plain.weight, "int3") if quantized else plain.weight,
                                    plain.bias)
        assert torch.equal(y, want)
    assert torch.equal(layer.eval()(x), plain(x))
    with pytest.raises(RuntimeError, match="outside a step"):
        layer.train()(x)


def test_convert_makes_ste_layers_and_refuses_what_it_cannot():
    from model import GPT, ROLES, ModelConfig
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=64, block_size=16, vocab_size=64))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    gaussws.convert(model, "ste[od]", ROLES["gpt2"], fmt="mxfp4")
    assert torch.equal(torch.get_rng_state(), rng)
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if name.startswith("transformer.h.0.")}
    assert kinds["transformer.h.0.attn.c_proj"] == kinds["transformer.h.0.mlp.c_proj"] == "STELinear"
    assert kinds["transformer.h.0.attn.c_attn"] == "Linear"
    assert model.state_dict().keys() == before.keys()  # no new state: export reads it as a bf16 run's
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="target format 'int9'"):
        gaussws.convert(GPT(model.config), "ste[all]", ROLES["gpt2"], fmt="int9")
    with pytest.raises(ValueError, match="target format ''"):
        gaussws.convert(GPT(model.config), "ste[all]", ROLES["gpt2"])


@pytest.mark.parametrize("name", ["int3", "mxfp4"])
def test_compiled_ste_layer_computes_what_the_eager_one_does(name):
    """torch.compile must not move the grid: fused, inductor would keep the BF16 int scale unrounded."""
    assert_compiled_is_eager(ste.STELinear(96, 70, fmt=name), seed=7)


def assert_compiled_is_eager(layer, seed):
    """One training step of layer, eager and under torch.compile, on the same random input and output
    gradient: the outputs and the weight gradients are the same bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    x, g = torch.randn(4, layer.in_features, generator=gen), torch.randn(4, layer.out_features, generator=gen)
    results = []
    for model in (layer, torch.compile(layer)):
        with gaussws.TrainStep(layer, 0):
            y = model(x)
            y.backward(g)
        results.append((y.detach(), layer.weight.grad))
        layer.weight.grad = None
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_export_quantizes_the_layers_a_run_trained_for_it():
    """--layers=pqt: PQT layers by their b_t, an STE run's layers by its method, a bf16 run's every one."""
    linears = {f"transformer.h.{i}.{path}": role for i in range(2) for path, role in
               (("attn.c_attn", "qkv"), ("attn.c_proj", "out"), ("mlp.c_fc", "up"), ("mlp.c_proj", "down"))}
    od = {k: v for k, v in linears.items() if v in ("out", "down")}
    assert E.trained_layers(linears, {}, {"method": "ste[od]"}) == od
    assert E.trained_layers(linears, {}, {"method": "ste[all]"}) == linears
    assert E.trained_layers(linears, {}, {"method": "bf16"}) == linears
    assert E.trained_layers(linears, {k: None for k in od}, {"method": "gaussws[od]"}) == od
    with pytest.raises(lowbit.ExportError, match="method cannot be read"):
        E.trained_layers(linears, {}, {"method": "qat[od]"})
