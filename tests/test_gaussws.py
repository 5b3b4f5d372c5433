"""The method's properties (docs/METHOD.md), each checked against an independent computation."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gaussws
from kernels import torch_noise
from model import ROLES

BACKENDS = ["torch", "triton"]

# Eq. 10, exactly.
P2 = 3 / 4 * 2**-9  # Pr(R = +2) = Pr(R = -2)
P1 = (3 / 4) ** 2 * 2**-2 * (1 - 2 * P2)  # Pr(R = +1) = Pr(R = -1)
P0 = 1 - 2 * P1 - 2 * P2


def naive_eq3(w, b_t, r):
    """Eq. 3 with Python loops over the 32x32 blocks, FP32 arithmetic, one BF16 cast."""
    w32 = w.float()
    out = torch.empty_like(w32)
    for bi in range(b_t.shape[0]):
        for bj in range(b_t.shape[1]):
            blk = (slice(32 * bi, 32 * bi + 32), slice(32 * bj, 32 * bj + 32))
            scale = w32[blk].abs().max() * 2.0 ** (1 - b_t[bi, bj].item())
            out[blk] = w32[blk] + r[blk] * scale
    return out.bfloat16()


def naive_eq4(w, b_t, r, g):
    """dL/db_t = -ln2 * max_bl(|w|) * 2^(1 - b_t) * sum_bl(g * R), block by block."""
    out = torch.empty(b_t.shape, dtype=torch.float64)
    for bi in range(b_t.shape[0]):
        for bj in range(b_t.shape[1]):
            blk = (slice(32 * bi, 32 * bi + 32), slice(32 * bj, 32 * bj + 32))
            scale = w[blk].double().abs().max() * 2.0 ** (1 - b_t[bi, bj].double())
            out[bi, bj] = -math.log(2) * scale * (g[blk].double() * r[blk].double()).sum()
    return out


@pytest.mark.parametrize("lane", range(4))
def test_recipe_gives_exactly_the_probabilities_of_eq10(lane):
    # Every 16-bit input is equally likely, so counting patterns gives the exact distribution. All
    # 2^16 patterns go through one lane of nibbles() while the other lanes hold shuffled patterns,
    # so a lane that read its neighbours' bits (or the sign of the int64) would show here.
    patterns = torch.arange(2**16, dtype=torch.int64)
    lanes = [torch.randperm(2**16, generator=torch.Generator().manual_seed(k)) for k in range(4)]
    lanes[lane] = patterns
    codes = torch_noise.nibbles(sum(x << (16 * k) for k, x in enumerate(lanes)))
    assert ((codes >> (16 * torch.arange(4))[:, None]) & 0xFFF0).eq(0).all()  # 4-bit codes only
    codes = (codes >> (16 * lane)) & 0xF
    values = (codes & 7) * (1 - 2 * (codes >> 3))
    assert set(codes.unique().tolist()) == {0, 1, 2, 9, 10}  # sign-magnitude, no -0
    counts = {v: (values == v).sum().item() for v in (-2, -1, 0, 1, 2)}
    assert counts[2] == counts[-2] == P2 * 2**16
    assert counts[1] == counts[-1] == P1 * 2**16
    assert counts[0] == P0 * 2**16


@pytest.mark.parametrize("seed", [0, 2**62 + 17])
def test_r_has_the_frequencies_of_eq10(seed):
    r = gaussws.sample_r((1024, 1024), seed, backend="torch")  # 2^20 draws
    n = r.numel()
    expected = {-2: P2, -1: P1, 0: P0, 1: P1, 2: P2}
    observed = {v: (r == v).sum().item() for v in expected}
    assert sum(observed.values()) == n
    chi2 = sum((observed[v] - n * p) ** 2 / (n * p) for v, p in expected.items())
    assert chi2 < 23.51  # chi-square, 4 degrees of freedom, p = 1e-4
    sd = math.sqrt((4 * 2 * P2 + 2 * P1) / n)  # std of the sample mean
    assert abs(r.mean().item()) < 5 * sd


def test_diffq_r_is_uniform_on_minus_half_to_half():
    r = gaussws.sample_r((512, 1024), 11, "diffq", backend="torch")
    assert r.min() >= -0.5 and r.max() <= 0.5
    n = r.numel()
    counts = torch.histc(r, bins=16, min=-0.5, max=0.5)
    chi2 = ((counts - n / 16) ** 2 / (n / 16)).sum().item()
    assert chi2 < 44.26  # chi-square, 15 degrees of freedom, p = 1e-4
    assert abs(r.mean().item()) < 5 * math.sqrt(1 / 12 / n)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", ["gaussws", "diffq"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_is_eq3_and_backward_is_eq4(backend, method, dtype):
    torch.manual_seed(0)
    m, n = 70, 45  # partial edge blocks on both sides
    w = (torch.randn(m, n) * 0.05).to(dtype).requires_grad_()
    b_t = (3 + 6 * torch.rand(3, 2)).requires_grad_()
    r = gaussws.sample_r((m, n), 1234, method, backend=backend)
    w_hat = gaussws.pseudo_quantize(w, b_t, 1234, method, backend=backend)
    assert w_hat.dtype == torch.bfloat16
    assert torch.equal(w_hat, naive_eq3(w.detach(), b_t.detach(), r))
    g = torch.randn(m, n).bfloat16()
    w_hat.backward(g)
    assert w.grad.dtype == dtype and torch.equal(w.grad, g.to(dtype))  # dL/dw = dL/dw_hat
    torch.testing.assert_close(b_t.grad.double(), naive_eq4(w.detach(), b_t.detach(), r, g), rtol=1e-5, atol=1e-6)


def test_eq4_is_the_derivative_of_eq3_by_finite_differences():
    # Eq. 3 without the BF16 cast, in float64, differentiated numerically in b_t; the loss is <c, w_hat> with
    # the BF16 c that the backward gets, and the block maxima are taken here, block by block.
    torch.manual_seed(1)
    w = torch.randn(40, 40) * 0.1
    b_t = torch.tensor([[4.3, 5.1], [6.0, 3.2]], requires_grad=True)
    r = gaussws.sample_r(w.shape, 77, backend="torch").double()
    c = torch.randn(40, 40).bfloat16()
    max_bl = torch.tensor([[w[32 * i:32 * i + 32, 32 * j:32 * j + 32].abs().max().item() for j in range(2)]
                           for i in range(2)], dtype=torch.float64)

    def loss(b):
        scale = (max_bl * 2.0 ** (1 - b)).repeat_interleave(32, 0)[:40].repeat_interleave(32, 1)[:, :40]
        return (c.double() * (w.double() + r * scale)).sum()

    numeric = torch.zeros(2, 2, dtype=torch.float64)
    for i in range(2):
        for j in range(2):
            e = torch.zeros(2, 2, dtype=torch.float64)
            e[i, j] = 1e-6
            b = b_t.detach().double()
            numeric[i, j] = (loss(b + e) - loss(b - e)) / 2e-6
    gaussws.pseudo_quantize(w, b_t, 77, backend="torch").backward(c)
    torch.testing.assert_close(b_t.grad.double(), numeric, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lemma1_no_gaussws_noise_underflows_in_bf16_below_9_bits(backend):
    torch.manual_seed(2)
    w_bf16 = (torch.randn(128, 96) * 0.02).bfloat16()
    w_fp32 = torch.randn(128, 96) * 0.02
    r = gaussws.sample_r(w_bf16.shape, 5, backend=backend)
    for b in [1.0, 2.5, 4.0, 5.5, 7.0, 7.99, 8.5, 8.99]:
        b_t = torch.full((4, 3), b)
        w_hat = gaussws.pseudo_quantize(w_bf16, b_t, 5, backend=backend)
        assert (w_hat != w_bf16)[r != 0].all(), b
        if b < 8:  # an FP32 master weight keeps the guarantee one bit lower
            w_hat = gaussws.pseudo_quantize(w_fp32, b_t, 5, backend=backend)
            assert (w_hat != w_fp32.bfloat16())[r != 0].all(), b

    # The bound is tight: at b_t = 9 some noise is lost. There |R| = 1 adds max|w| * 2^-8, which is half
    # a unit in the last place of a weight equal to its block's max when that max is a power of two;
    # round-to-nearest-even then keeps the weight (its mantissa, all zeros, is even) when R pushes it
    # away from zero, and moves it when R pulls it into the binade below, where that noise is a whole
    # unit. Every other weight lies in a lower binade, where the same noise is a unit or more.
    top = 2.0**-6
    w = (torch.randn(128, 96) * 0.004).clamp(-0.99 * top, 0.99 * top)
    at_max = torch.rand(128, 96) < 0.2  # about 200 of each block's 1024 weights are +-max
    w = torch.where(at_max, top * torch.sign(torch.randn(128, 96)), w).bfloat16()
    assert torch.equal(gaussws.block_absmax(w).float(), torch.full((4, 3), top))
    kept_by_the_tie = at_max & (r * w.float().sign() == 1)
    assert kept_by_the_tie.any()
    for b, lost in ((8.99, torch.zeros_like(at_max)), (9.0, kept_by_the_tie)):
        w_hat = gaussws.pseudo_quantize(w, torch.full((4, 3), b), 5, backend=backend)
        assert torch.equal((w_hat == w) & (r != 0), lost), b


def test_lemma1_uniform_noise_keeps_fewer_bits():
    torch.manual_seed(3)
    w = (torch.randn(256, 256) * 0.02).bfloat16()
    # Uniform noise on a 1/16 grid (tau = -4): guaranteed only for b_t < 5.
    grid = (torch.randint(-8, 9, w.shape) / 16).float()
    lost = lambda r, b: ((naive_eq3(w, torch.full((8, 8), b), r) == w) & (r != 0)).float().sum() / (r != 0).sum()
    assert lost(grid, 4.9) == 0
    assert lost(grid, 6.0) > 0
    # Uniform noise held in BF16 (diffq) loses a share at every b_t, growing with b_t.
    r = gaussws.sample_r(w.shape, 9, "diffq", backend="torch")
    shares = [lost(r, b).item() for b in (2.0, 4.0, 6.0, 8.0)]
    assert shares[0] > 0 and shares == sorted(shares) and shares[-1] > 10 * shares[0]


def test_b_t_is_eq11_and_starts_at_b_init():
    layer = gaussws.PQTLinear(100, 70, b_init=6.0, b_target=4.0)
    assert layer.b_i.shape == (3, 4)  # (ceil(70/32), ceil(100/32)): PyTorch keeps (out, in)
    assert torch.equal(layer.b_t, torch.full((3, 4), 6.0))
    with torch.no_grad():
        layer.b_i.fill_(0.25)
    assert torch.allclose(layer.b_t, torch.full((3, 4), 4.0 + 0.25 * 2.0))


def test_pqt_linear_in_eval_mode_is_nn_linear():
    torch.manual_seed(4)
    layer = gaussws.PQTLinear(64, 48).eval()
    plain = nn.Linear(64, 48)
    plain.load_state_dict({k: v for k, v in layer.state_dict().items() if k != "b_i"})
    x = torch.randn(5, 64)
    assert torch.equal(layer(x), plain(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(layer(x), plain(x))


def test_pqt_linear_training_forward_uses_eq3():
    torch.manual_seed(5)
    layer = gaussws.PQTLinear(64, 48, method="diffq", backend="torch")
    gaussws.set_noise_seed(layer, 21)
    x = torch.randn(5, 64)
    with gaussws.TrainStep(layer, 3):
        r = gaussws.sample_r((48, 64), int(layer.noise_seed), "diffq", backend="torch")
        w_hat = naive_eq3(layer.weight.detach(), layer.b_t.detach(), r)
        torch.testing.assert_close(layer(x), x @ w_hat.float().T + layer.bias, rtol=1e-6, atol=1e-6)


def _model(seed):
    model = nn.Sequential(gaussws.PQTLinear(64, 64), nn.ReLU(), gaussws.PQTLinear(64, 64))
    gaussws.set_noise_seed(model, seed)
    return model


def noise_seeds(model, step):
    """The Philox seed each PQT layer draws R from in optimizer step `step`."""
    with gaussws.TrainStep(model, step):
        return [int(m.noise_seed) for m in gaussws.pqt_layers(model)]


def test_noise_depends_only_on_seed_layer_and_step():
    a, b = _model(7), _model(7)  # e.g. two data-parallel ranks, or a run and its resumption
    for step in (0, 1, 1000):
        assert noise_seeds(a, step) == noise_seeds(b, step)
    seeds = set()
    for step in range(50):
        seeds.update(noise_seeds(a, step))
    assert len(seeds) == 100  # every (layer, step) its own Philox seed
    assert all(0 <= s < 2**63 for s in seeds)
    gaussws.set_noise_seed(b, 8)
    assert noise_seeds(b, 0)[0] not in seeds


def test_r_of_other_layers_and_steps_is_independent():
    model = _model(3)
    r = {}
    for step in (0, 1):
        for i, seed in enumerate(noise_seeds(model, step)):
            r[i, step] = gaussws.sample_r((512, 512), seed, backend="torch").flatten()
    n = r[0, 0].numel()
    for x, y in [((0, 0), (1, 0)), ((0, 0), (0, 1)), ((1, 0), (1, 1))]:
        assert not torch.equal(r[x], r[y])
        corr = torch.corrcoef(torch.stack([r[x], r[y]]))[0, 1].item()
        assert abs(corr) < 5 / math.sqrt(n)
        # Joint frequencies factorise: Pr(R_x != 0 and R_y != 0) = Pr(R_x != 0) Pr(R_y != 0).
        both = ((r[x] != 0) & (r[y] != 0)).float().mean().item()
        p = 1 - P0
        assert abs(both - p * p) < 5 * math.sqrt(p * p * (1 - p * p) / n)


@pytest.mark.parametrize("recompute", [False, True])
def test_noise_is_fixed_within_a_step_and_redrawn_across_steps(recompute):
    torch.manual_seed(6)
    layer = gaussws.PQTLinear(64, 64, recompute=recompute)
    x = torch.randn(8, 64)
    with gaussws.TrainStep(layer, 10):
        y1, y2 = layer(x), layer(x)  # two micro-steps of one optimizer step
    assert torch.equal(y1, y2)
    with gaussws.TrainStep(layer, 11):
        assert not torch.equal(layer(x), y1)


@pytest.mark.parametrize("recompute", [False, True])
def test_compiled_layer_matches_eager_and_does_not_recompile_per_step(recompute):
    torch.manual_seed(7)
    torch._dynamo.reset()
    layer = gaussws.PQTLinear(64, 96, recompute=recompute)
    compiled = torch.compile(layer)
    x = torch.randn(4, 64)
    for step in range(4):
        # Step 0 compiles; later steps only change the seed's value (and w_hat) and must reuse that graph.
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            layer.zero_grad()
            with gaussws.TrainStep(layer, step):
                y = compiled(x)
                assert torch.equal(y, layer(x))
                y.sum().backward()
            assert layer.b_i.grad.abs().sum() > 0


def test_bitwidth_loss_is_eq12():
    """Eq. 12 (without lambda): sum over layers l of (1 / N_l) sum over blocks |b_t - b_target|, with
    b_t = b_target + b_i (b_init - b_target) (Eq. 11), written out element by element."""
    model = nn.Sequential(gaussws.PQTLinear(64, 40, b_init=6.0, b_target=4.0),
                          gaussws.PQTLinear(40, 96, b_init=7.0, b_target=2.5))
    with torch.no_grad():
        for layer in gaussws.pqt_layers(model):
            layer.b_i.uniform_(-1, 2)
    want = 0.0
    for layer in gaussws.pqt_layers(model):
        b_i = layer.b_i.detach().tolist()
        total = 0.0
        for row in b_i:
            for v in row:
                total += abs(layer.b_target + v * (layer.b_init - layer.b_target) - layer.b_target)
        want += total / (len(b_i) * len(b_i[0]))
    assert gaussws.bitwidth_loss(model).item() == pytest.approx(want, rel=1e-6)
    every_b_t = [layer.b_target + v * (layer.b_init - layer.b_target)
                 for layer in gaussws.pqt_layers(model) for row in layer.b_i.tolist() for v in row]
    stats = gaussws.bitwidth_stats(model)
    assert stats == pytest.approx({"mean": sum(every_b_t) / len(every_b_t), "min": min(every_b_t),
                                   "max": max(every_b_t)}, rel=1e-6)
    hists = gaussws.bitwidth_histograms(model)
    assert sorted(hists) == ["0", "1"] and [len(h) for h in hists.values()] == [2 * 2, 3 * 2]
    assert sorted(hists["1"].tolist()) == pytest.approx(sorted(every_b_t[4:]), rel=1e-6)


@pytest.mark.parametrize("spec,arch,want", [
    ("bf16", "gpt2", ("bf16", set())),
    ("gaussws[all]", "gpt2", ("gaussws", {"qkv", "out", "up", "down"})),
    ("diffq[od]", "gpt2", ("diffq", {"out", "down"})),
    ("gaussws[qkv,up]", "gpt2", ("gaussws", {"qkv", "up"})),
    ("gaussws[all]", "llama2", ("gaussws", {"q", "k", "v", "out", "gate", "up", "down"})),
    ("diffq[q, v, od]", "llama2", ("diffq", {"q", "v", "out", "down"})),
])
def test_parse_method(spec, arch, want):
    assert gaussws.parse_method(spec, ROLES[arch].values()) == (want[0], frozenset(want[1]))


@pytest.mark.parametrize("spec,arch", [
    ("gauss[all]", "gpt2"), ("gaussws", "gpt2"), ("gaussws[]", "gpt2"), ("bf16[all]", "gpt2"),
    ("gaussws[q]", "gpt2"), ("gaussws[qkv]", "llama2"), ("gaussws[all", "gpt2"),
])
def test_bad_method_names_the_valid_ones(spec, arch):
    with pytest.raises(ValueError, match=r"bad method .*bf16.*gaussws.*diffq.*out.*down"):
        gaussws.parse_method(spec, ROLES[arch].values())


def test_bad_seed_and_shapes_are_refused():
    with pytest.raises(ValueError, match="seed"):
        gaussws.sample_r((4, 4), 2**63)
    with pytest.raises(ValueError, match="b_t must have shape"):
        gaussws.pseudo_quantize(torch.zeros(40, 40), torch.zeros(1, 1), 0)


def _two_layer_net(recompute=False):
    torch.manual_seed(8)
    net = nn.Sequential(gaussws.PQTLinear(100, 70, recompute=recompute), nn.GELU(),
                        gaussws.PQTLinear(70, 64, method="diffq", recompute=recompute))
    gaussws.set_noise_seed(net, 3)
    return net


def test_step_mode_gives_the_gradients_of_per_micro_step_eq3_and_eq4():
    # TrainStep makes w_hat once and applies Eq. 4 once to the accumulated gradient. The reference
    # differentiates Eq. 3 (pseudo_quantize, itself checked against the naive Eq. 3 and 4 above)
    # in every micro-step, with the seeds the step selected.
    net, ref = _two_layer_net(), _two_layer_net()
    xs = [torch.randn(5, 100) for _ in range(3)]
    with gaussws.TrainStep(net, 7):
        seeds = [int(m.noise_seed) for m in gaussws.pqt_layers(net)]
        for x in xs:
            (net(x).square().mean() / 3).backward()
    l1, l2 = gaussws.pqt_layers(ref)
    for x in xs:
        h = F.gelu(F.linear(x, gaussws.pseudo_quantize(l1.weight, l1.b_t, seeds[0], "gaussws").float(), l1.bias))
        y = F.linear(h, gaussws.pseudo_quantize(l2.weight, l2.b_t, seeds[1], "diffq").float(), l2.bias)
        (y.square().mean() / 3).backward()
    for (name, a), (_, b) in zip(net.named_parameters(), ref.named_parameters()):
        if name.endswith("b_i"):
            assert a.grad.abs().sum() > 0
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-9)
        else:
            assert torch.equal(a.grad, b.grad), name  # the same w_hat, the same dL/dw
    assert all(layer.w_hat is None and not layer.in_step for layer in gaussws.pqt_layers(net))  # released


def _mixed_net(batched_b_i=True):
    """Layers of four kinds (FP32 / BF16 weights, gaussws / diffq, rows that start a word of R or not), b_t
    integers so that 2^(1 - b_t) is exact on every path (on a CPU ATen's exp2 gives a tensor's last
    elements another rounding than the rest; on a GPU every element the same)."""
    torch.manual_seed(8)
    kinds = [(100, 70, "gaussws", torch.float32), (70, 64, "diffq", torch.float32), (64, 48, "gaussws", torch.bfloat16),
             (48, 64, "gaussws", torch.float32), (64, 35, "diffq", torch.bfloat16), (35, 40, "gaussws", torch.float32)]
    layers = []
    for n_in, n_out, method, dtype in kinds:
        layers += [gaussws.PQTLinear(n_in, n_out, method=method, backend="triton", dtype=dtype), nn.GELU()]
    net = nn.Sequential(*layers[:-1])
    for layer in gaussws.pqt_layers(net):
        layer.b_i.data = torch.randint(-2, 4, layer.b_i.shape).float() / 2
    return gaussws.set_noise_seed(net, 3)


def test_batched_step_gives_the_bits_of_one_layer_at_a_time():
    """TrainStep's batches (one launch for Eq. 3 and one for Eq. 4 per kind of layer) against the per-layer
    step: the same w_hat, dL/dw and b_i.grad to the bit, with Eq. 12's gradient already in b_i.grad (added
    to), over two steps, the second accumulating onto the first's gradients."""
    nets = {batched: _mixed_net() for batched in (True, False)}
    xs = [torch.randn(5, 100) for _ in range(2)]
    for step in (7, 8):
        for batched, net in nets.items():
            with gaussws.TrainStep(net, step, batched=batched):
                seeds = [int(layer.noise_seed) for layer in gaussws.pqt_layers(net)]
                assert seeds == [gaussws._step_seed(layer.layer_seed, step) for layer in gaussws.pqt_layers(net)]
                for x in xs:
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = net(x).float().square().mean() + 0.1 * gaussws.bitwidth_loss(net)
                    (loss / 2).backward()
        for (name, a), (_, b) in zip(nets[True].named_parameters(), nets[False].named_parameters()):
            assert torch.equal(a.grad, b.grad), name
    assert all(not layer.in_step and layer.w_hat is None for layer in gaussws.pqt_layers(nets[True]))


def test_batched_step_skips_what_gets_no_gradient_and_refuses_a_stale_weight():
    net = _mixed_net()
    first, second = gaussws.pqt_layers(net)[:2]
    second.b_i.requires_grad_(False)
    with gaussws.TrainStep(net, 1), torch.autocast("cpu", dtype=torch.bfloat16):
        net[0](torch.randn(3, 100)).sum().backward()  # only the first layer's weight gets a gradient
    assert first.b_i.grad is not None and first.b_i.grad.abs().sum() > 0
    assert all(layer.b_i.grad is None for layer in gaussws.pqt_layers(net)[1:])
    with pytest.raises(RuntimeError, match="stale R"):
        with gaussws.TrainStep(net, 2), torch.autocast("cpu", dtype=torch.bfloat16):
            net[0](torch.randn(3, 100)).sum().backward()
            with torch.no_grad():
                first.weight.add_(1.0)  # as an optimizer step inside the step would
    assert not first.in_step and first.w_hat is None


def test_step_seeds_of_all_layers_at_once_are_step_seed():
    layer_seeds = [0, 1, 2**62 + 11, 2**63 - 1, 12345678901234567]
    for step in (0, 1, 999, 2**40):
        want = [gaussws._step_seed(s, step) for s in layer_seeds]
        assert gaussws._step_seeds(layer_seeds, step).tolist() == want


def test_step_mode_compiles_once():
    torch._dynamo.reset()
    net = _two_layer_net()
    compiled = torch.compile(net)
    x = torch.randn(4, 100)
    for step in range(3):
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            with gaussws.TrainStep(net, step):
                y = compiled(x)
                torch.testing.assert_close(y, net(x))  # the same w_hat; compiled GELU may round differently
                y.sum().backward()


def test_a_compiled_model_in_step_mode_is_one_graph_whose_inputs_hold_no_seed():
    """torch.compile of a gaussws[all] Llama2 trained in step mode (the batched path): the whole model is one
    graph (no graph break), compiled once over three steps, and what the graph takes holds no noise seed (its
    only int64 input is the tokens): under CUDA graphs no CPU scalar can make inductor skip them."""
    from model import GPT, ROLES, ModelConfig

    torch._dynamo.reset()
    torch.manual_seed(0)
    config = ModelConfig(arch="llama2", n_layer=2, n_head=4, n_embd=64, vocab_size=97, block_size=16, ffn_hidden=128)
    model = gaussws.convert(GPT(config), "gaussws[all]", ROLES["llama2"], backend="triton")
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([t for t in example_inputs if isinstance(t, torch.Tensor)])
        return gm.forward

    compiled = torch.compile(model, backend=backend)
    x = torch.randint(97, (2, 16))
    for step in range(3):
        with gaussws.TrainStep(model, step):
            compiled(x, x)[1].backward()
    assert len(graphs) == 1
    assert [tuple(t.shape) for t in graphs[0] if t.dtype == torch.int64] == [(2, 16)]


def _saved_bytes(fn, net_params):
    """Bytes of the tensors autograd keeps for the backward, the parameters net_params not counted."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    params = {p.untyped_storage().data_ptr() for p in net_params}
    return out, sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in saved}.values()
                    if t.untyped_storage().data_ptr() not in params)


def test_recompute_gives_the_same_gradients_and_keeps_no_w_hat():
    standard, recompute = _two_layer_net(), _two_layer_net(recompute=True)
    net_params = list(standard.parameters()) + list(recompute.parameters())
    x = torch.randn(3, 5, 100, requires_grad=True)  # as inside a model: every layer needs dL/dx
    kept = {}
    for name, net in (("standard", standard), ("recompute", recompute)):
        with gaussws.TrainStep(net, 4):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y, kept[name] = _saved_bytes(lambda: net(x), net_params)
            y.float().square().mean().backward()
    for (name, a), (_, b) in zip(standard.named_parameters(), recompute.named_parameters()):
        if name.endswith("b_i"):  # Eq. 4 once per step vs in the backward: the same sums, another order
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-9)
        else:
            assert torch.equal(a.grad, b.grad), name
    w_hat_bytes = 2 * (100 * 70 + 70 * 64)  # both w_hat, BF16, are no longer kept ...
    # ... only per-block FP32 tensors for scale_bl's backward (max_bl, 2^(1 - b_t), the scale) and the seeds
    per_block = 3 * 4 * (3 * 4 + 2 * 3) + 2 * 8
    assert kept["recompute"] <= kept["standard"] - w_hat_bytes + per_block


# --- convert, TrainStep, build_optimizers ------------------------------------------------------

class NanoBlock(nn.Module):
    """A model we did not write: nanoGPT's block layout, with a Conv1d where a Linear could be."""

    def __init__(self):
        super().__init__()
        self.attn = nn.ModuleDict(dict(c_attn=nn.Linear(64, 192), c_proj=nn.Linear(64, 64)))
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(64, 256), c_proj=nn.Linear(256, 64, bias=False)))
        self.conv = nn.Conv1d(64, 64, 1)


NANO_ROLES = {"attn.c_attn": "qkv", "attn.c_proj": "out", "mlp.c_fc": "up", "mlp.c_proj": "down"}


def test_convert_keeps_the_weights_and_draws_no_random_numbers():
    torch.manual_seed(0)
    model = nn.ModuleDict(dict(h=nn.ModuleList([NanoBlock(), NanoBlock()]), head=nn.Linear(64, 10))).to(torch.bfloat16)
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    assert gaussws.convert(model, "gaussws[od]", NANO_ROLES, b_init=7.0, b_target=3.0, seed=5) is model
    assert torch.equal(torch.get_rng_state(), rng)
    pqt = {n for n, m in model.named_modules() if isinstance(m, gaussws.PQTLinear)}
    assert pqt == {"h.0.attn.c_proj", "h.0.mlp.c_proj", "h.1.attn.c_proj", "h.1.mlp.c_proj"}
    after = dict(model.named_parameters())
    assert set(after) == set(before) | {f"{n}.b_i" for n in pqt}
    for name, (param, value) in before.items():  # the same Parameter objects, values, dtype
        assert after[name] is param and torch.equal(param, value) and param.dtype == torch.bfloat16
    layer = model.h[1].mlp.c_proj
    assert layer.bias is None and (layer.method, layer.b_init, layer.b_target) == ("gaussws", 7.0, 3.0)
    assert torch.equal(layer.b_t, torch.full((2, 8), 7.0))  # b_i = 1: b_t = b_init, one per 32x32 block
    assert type(model.h[0].attn.c_attn) is nn.Linear and type(model.head) is nn.Linear


def test_convert_works_on_the_meta_device():
    with torch.device("meta"):
        model = NanoBlock()
    gaussws.convert(model, "diffq[all]", NANO_ROLES, seed=1)
    assert all(p.is_meta for p in model.parameters())
    assert model.mlp.c_fc.b_i.shape == (8, 2)


def test_layer_noise_depends_on_its_path_not_on_the_other_layers():
    od, every = NanoBlock(), NanoBlock()
    gaussws.convert(od, "gaussws[od]", NANO_ROLES, seed=9)
    gaussws.convert(every, "gaussws[all]", NANO_ROLES, seed=9)
    assert od.attn.c_proj.layer_seed == every.attn.c_proj.layer_seed
    assert every.attn.c_proj.layer_seed != every.mlp.c_proj.layer_seed


@pytest.mark.parametrize("method,roles,message", [
    ("gaussws[qkv]", {"conv": "qkv"}, "is a Conv1d, not an nn.Linear"),
    ("gaussws[qkv]", {"attn.qkv": "qkv"}, "no nn.Linear of the model plays role"),
    ("gaussws[q]", NANO_ROLES, "no layer 'q'"),
])
def test_convert_refuses_what_it_cannot_convert(method, roles, message):
    with pytest.raises(ValueError, match=message):
        gaussws.convert(NanoBlock(), method, roles)


def test_convert_refuses_a_model_converted_already():
    model = gaussws.convert(NanoBlock(), "gaussws[od]", NANO_ROLES)
    with pytest.raises(ValueError, match="PQT layers already"):
        gaussws.convert(model, "gaussws[up]", NANO_ROLES)


def test_train_step_refuses_misuse():
    layer = gaussws.PQTLinear(64, 64)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="outside a step"):
        layer(x)
    step = gaussws.TrainStep(layer, 0).begin()
    with pytest.raises(RuntimeError, match="already open"):
        gaussws.TrainStep(layer, 1).begin()
    step.end()
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="stale w_hat"):
        with gaussws.TrainStep(layer, 1):
            layer(x).sum().backward()
            optimizer.step()  # inside the step: the w_hat of this step no longer belongs to w
            layer(x)
    assert not layer.in_step and layer.w_hat is None  # the error released the step
    layer.eval()
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))  # eval needs no step


@pytest.mark.parametrize("optimizer", ["adamw", "adam_mini"])
def test_build_optimizers_gives_b_i_a_group_of_their_own(optimizer):
    model = gaussws.convert(NanoBlock(), "gaussws[all]", NANO_ROLES)
    optimizers = gaussws.build_optimizers(model, optimizer, NANO_ROLES, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
                                          bitwidth_weight_decay=0.7, n_embd=64, n_head=2, n_kv_head=2)
    b_i = {id(m.b_i) for m in gaussws.pqt_layers(model)}
    groups = [g for o in optimizers for g in o.param_groups]
    own = [g for g in groups if {id(p) for p in g["params"]} & b_i]
    assert len(own) == 1 and {id(p) for p in own[0]["params"]} == b_i and own[0]["weight_decay"] == 0.7
    assert isinstance(optimizers[-1], torch.optim.AdamW)
    others = {id(p) for g in groups if g is not own[0] for p in g["params"]}
    assert others == {id(p) for n, p in model.named_parameters() if not n.endswith("b_i")}
    if optimizer == "adam_mini":
        assert {"attn.c_attn."} <= optimizers[0].wqk_names and "attn.c_proj." in optimizers[0].attn_proj_names
    assert sorted(gaussws.ddp_ignored_parameters(model)) == sorted(
        n for n, _ in model.named_parameters() if n.endswith("b_i"))
    recomputed = gaussws.convert(NanoBlock(), "gaussws[all]", NANO_ROLES, recompute=True)
    assert gaussws.ddp_ignored_parameters(recomputed) == []  # their b_t gradient comes in the backward
