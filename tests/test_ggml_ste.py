"""The STE on llama.cpp's block types (--target_format=q4_0 ... mxfp4_row, iq4_nl, iq4_xs) and one GGML type
per tensor at a GGUF budget (auto-gguf, error-gguf), held against truths outside the code: gguf's own
dequantizer for the grid, the gradient by hand, a naive re-measurement of the matched b_t levels, and a
budget's bits counted from gguf's block sizes."""
import math
import re
import statistics
import subprocess
import sys

import gguf
import gguf.quants
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.constants import GGML_QUANT_SIZES

import checkpoint
import gaussws
import phases
import train
from conftest import ROOT
from model import GPT, ROLES, ModelConfig
from quant import ggml_quants as G
from quant import ste
from quant import budget
from quant import formats
from test_phase import STEPS, curve, one_line, tiny, train_recording

E_R2 = gaussws.R_SECOND_MOMENT  # E[R^2] of each method's noise (Eq. 10): what budget's levels are matched to

TYPES = tuple(formats.GGML_FORMATS)
SHAPE = dict(n_layer=1, n_head=2, n_embd=256)  # every input width a multiple of 256: every type fits
CONFIG = ModelConfig(n_layer=1, n_head=2, n_embd=256, block_size=32, vocab_size=256)
LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


@pytest.fixture(scope="module")
def data_dir(tiny_corpus):
    return tiny_corpus


def gguf_type(name):
    return gguf.GGMLQuantizationType[formats.GGML_FORMATS[name]]


def gguf_grid(w, t):
    """w on GGML type t's grid as gguf's own numpy dequantizer reads the packed blocks."""
    raw = G.pack(G.quantize(w.detach().float(), t), t)
    return torch.from_numpy(gguf.quants.dequantize(raw, t).reshape(w.shape).astype(np.float32))


def bits_per_weight(t):
    """A type's bits per weight from gguf's block sizes (bytes per block * 8 / weights per block)."""
    weights, size = GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(t))]
    return size * 8 / weights


def ggml_types(state):
    return {k[:-len(".ggml_type")]: int(v) for k, v in state.items() if k.endswith(".ggml_type")}


def on_grid(state, types):
    """The state dict with every block Linear's weight on its GGML type's grid (gguf's dequantizer), and
    neither b_i nor STE buffers: what a plain model computes the STE's training forward with."""
    out = {k: v for k, v in state.items() if not k.endswith((".b_i",) + budget.FORMAT_STATE)}
    for layer, t in types.items():
        out[layer + ".weight"] = gguf_grid(state[layer + ".weight"], gguf.GGMLQuantizationType(t))
    return out


def training_forward(model, state, step, x):
    """The model's training-mode loss of step `step` (no dropout: deterministic) and the gradients."""
    model.load_state_dict(state)
    model.train()
    with gaussws.TrainStep(model, step):
        _, loss = model(x, x)
        loss.backward()
    return loss.detach(), {k: p.grad for k, p in model.named_parameters()}


# --- the matched b_t level ---------------------------------------------------------------------------

def splitmix64(x):
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return x ^ (x >> 31)


# E[R^2] of the noise (tests/test_phase.py holds these against the kernels' R)
SECOND_MOMENT = {"gaussws": 2 * (0.75 * 2 ** -9 * 4 + 9 / 64 * (1 - 0.75 * 2 ** -8)), "diffq": 1 / 12}


@pytest.fixture(scope="module")
def tile():
    """The 65,536 quantiles of N(0, 1) in splitmix64's order, as a 256x256 tile (pure Python)."""
    n, normal = 256 * 256, statistics.NormalDist()
    order = sorted(range(n), key=splitmix64)
    return np.array([normal.inv_cdf((i + 0.5) / n) for i in order], dtype=np.float32).reshape(256, 256)


def naive_relative_error(w, name):
    """Mean over the weights of (gguf's dequantized value - w)^2 / (max |w| of its 32x32 block)^2."""
    q = gguf_grid(torch.from_numpy(w), gguf_type(name)).numpy().astype(np.float64)
    total = 0.0
    for i in range(0, w.shape[0], 32):
        for j in range(0, w.shape[1], 32):
            block = w[i:i + 32, j:j + 32].astype(np.float64)
            total += ((q[i:i + 32, j:j + 32] - block) ** 2).sum() / np.abs(block).max() ** 2
    return total / w.size


@pytest.mark.parametrize("name", TYPES)
def test_the_matched_level_of_each_type_is_a_naive_measurement_on_a_shuffled_tile(tile, name):
    """b_t = 1 + log2(E[R^2] / r) / 2 with r measured on quantiles in a fixed pseudo-random order: in
    their sorted order each row block would hold neighbouring quantiles, almost equal, whose error is
    another (for the integer grids 10-100x smaller, 2x for Q8_0; for E2M1's 7x larger)."""
    r = naive_relative_error(tile, name)
    assert budget.rounding_error(name) == pytest.approx(r, rel=1e-6)
    for method, moment in SECOND_MOMENT.items():
        level = 1 + 0.5 * math.log2(moment / r)
        assert abs(budget.matched_b_t(E_R2[method], name) - level) <= 0.005 + 1e-9
    in_order = np.sort(tile.flatten()).reshape(256, 256)
    ratio = naive_relative_error(in_order, name) / r
    assert max(ratio, 1 / ratio) > 1.5


def test_the_gguf_budgets_level_lies_between_its_types_levels_by_their_bits():
    """At each type's bits the level is its own (IQ4_NL's 4.5 bits are Q4_K's, the first of the two in the
    ladder), between two types linear in bits: 4.0 lies between Q3_K (3.4375) and IQ4_XS (4.25)."""
    ladder = ("q2_k", "q3_k", "iq4_xs", "q4_k", "q5_k", "q6_k", "q8_0")  # a row of 256: every type but iq4_nl
    assert [t for t, _ in budget.budget_ladder(256)] == list(ladder)
    for method in SECOND_MOMENT:
        levels = {t: budget.matched_b_t(E_R2[method], t) for t in budget.GGUF_BUDGET_TYPES}
        for t in ladder:
            assert budget.budget_level(E_R2[method], bits_per_weight(gguf_type(t)), "error-gguf") == levels[t]
        assert budget.budget_level(E_R2[method], 4.5, "error-gguf") == levels["q4_k"] != levels["iq4_nl"]
        q3, xs = bits_per_weight(gguf_type("q3_k")), bits_per_weight(gguf_type("iq4_xs"))
        assert budget.budget_level(E_R2[method], 4.0, "auto-gguf") == pytest.approx(
            levels["q3_k"] + (4.0 - q3) / (xs - q3) * (levels["iq4_xs"] - levels["q3_k"]), abs=0.005)
    c = dict(pqt_start=50, ste_start=150, max_iters=200, target_format="auto-gguf", bits_per_weight=4.5, b_init=6.0,
             b_target=4.0)
    level = budget.matched_b_t(E_R2["gaussws"], "q4_k")
    assert phases.phase_settings("gaussws", c) == dict(pqt_start=50.0, ste_start=150.0, b_init=level + 1,
                                                      b_target=level)
    assert phases.phase_settings("gaussws", dict(c, ste_start=0.0, target_format="q3_k", bits_per_weight=0.0)) == \
        dict(pqt_start=50.0, ste_start=0.0, b_init=budget.matched_b_t(E_R2["gaussws"], "q3_k"),
             b_target=budget.matched_b_t(E_R2["gaussws"], "q3_k"))


# --- one layer: the grid and the straight-through gradient ------------------------------------------

@pytest.mark.parametrize("name", TYPES)
def test_a_layer_trains_on_the_types_grid_with_the_gradient_by_hand(name):
    """y = x w_q^T + b with w_q gguf's dequantization of the type's blocks along each row; dL/dw = g^T x."""
    gen = torch.Generator().manual_seed(TYPES.index(name))
    layer = ste.STELinear(512, 96, fmt=name)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(96, 512, generator=gen) * torch.linspace(0.01, 2, 512))
    x, g = torch.randn(6, 512, generator=gen), torch.randn(6, 96, generator=gen)
    with gaussws.TrainStep(layer, 0):
        y = layer(x)
        y.backward(g)
    w_q = gguf_grid(layer.weight, gguf_type(name))
    assert torch.equal(y, F.linear(x, w_q, layer.bias))  # the matmul as nn.Linear computes it
    assert torch.equal(layer.weight.grad, g.t() @ x)
    assert int(layer.ggml_type) == gguf_type(name).value and layer.ggml_type.dtype == torch.uint8
    assert torch.equal(layer.eval()(x), F.linear(x, layer.weight, layer.bias))  # eval: the master weights


def test_w_q_is_made_once_per_optimizer_step_and_its_gradient_is_the_micro_steps_sum(monkeypatch):
    calls = []
    fake_quantize = G.fake_quantize
    monkeypatch.setattr(G, "fake_quantize", lambda *a, **k: calls.append(a[1]) or fake_quantize(*a, **k))
    gen = torch.Generator().manual_seed(1)
    model = gaussws.convert(GPT(CONFIG), "ste[all]", ROLES["gpt2"], fmt="q4_k")
    xs = [torch.randint(0, 256, (2, 32), generator=gen) for _ in range(3)]
    with gaussws.TrainStep(model, 0):
        for x in xs:
            model(x, x)[1].backward()
    assert len(calls) == 4  # one per block Linear, for the three micro-steps
    plain = GPT(CONFIG)
    plain.load_state_dict(on_grid(model.state_dict(), ggml_types(model.state_dict())))
    for x in xs:
        plain(x, x)[1].backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, plain.get_parameter(k).grad, rtol=1e-6, atol=1e-9)
    layer = model.transformer.h[0].mlp.c_fc
    with pytest.raises(RuntimeError, match="stale w_q"), gaussws.TrainStep(model, 1):
        with torch.no_grad():
            layer.weight.add_(1.0)
        model(xs[0], xs[0])


# --- a tiny model trained on each type through train.py ----------------------------------------------

@pytest.fixture(scope="module")
def type_runs(data_dir, tmp_path_factory):
    """{type: (out_dir, {step: (model state, optimizer states)})}: ste[all] on each type, 20 steps."""
    out = {}
    for name in TYPES:
        d = tmp_path_factory.mktemp(name)
        out[name] = (d, train_recording(tiny(data_dir, d, method="ste[all]", target_format=name, **SHAPE)))
    return out


@pytest.mark.parametrize("name", TYPES)
def test_a_trained_model_computes_with_its_master_weights_on_the_types_grid(type_runs, name):
    """The training forward of the saved model equals a plain model's on gguf's dequantization of the
    master weights, loss and gradients bit for bit; every block Linear records the type."""
    _, run = type_runs[name]
    state = run[STEPS][0]
    types = ggml_types(state)
    assert types == {f"transformer.h.0.{k}": gguf_type(name).value for k in LINEARS}
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    model = gaussws.convert(GPT(CONFIG), "ste[all]", ROLES["gpt2"], fmt=name)
    loss, grads = training_forward(model, state, STEPS, x)
    plain = GPT(CONFIG)
    plain_loss, plain_grads = training_forward(plain, on_grid(state, types), STEPS, x)
    assert torch.equal(loss, plain_loss) and grads.keys() == plain_grads.keys()
    assert all(torch.equal(g, plain_grads[k]) for k, g in grads.items())
    assert not torch.equal(model.eval()(x, x)[1], plain_loss)  # eval mode: the master weights


@pytest.mark.parametrize("name", TYPES)
def test_a_stopped_run_resumes_to_the_uninterrupted_run_bit_for_bit(type_runs, data_dir, tmp_path, name):
    whole_dir, whole = type_runs[name]
    train.main(tiny(data_dir, tmp_path, method="ste[all]", target_format=name, max_iters=10, **SHAPE))
    train.main(tiny(data_dir, tmp_path, method="ste[all]", target_format=name, init_from="resume", **SHAPE))
    assert curve(tmp_path) == curve(whole_dir) and curve(tmp_path, "val/loss") == curve(whole_dir, "val/loss")
    state = checkpoint.load_model(str(tmp_path / "ckpt.pt"))["model"]
    assert state.keys() == whole[STEPS][0].keys()
    assert all(torch.equal(v, whole[STEPS][0][k]) for k, v in state.items())


@pytest.mark.parametrize("args, message", [
    (dict(target_format="q4_k", n_embd=96),
     r"transformer\.h\.0\.attn\.c_attn has input width 96 \(and 3 more Linears\), which target_format='q4_k' "
     r"cannot hold \(q4_k's blocks are 256 weights of a row\): .*q4_0, q8_0 or mxfp4_row"),
    (dict(method="gaussws[all]", target_format="q3_k", n_embd=288),
     r"input width 288 .*target_format='q3_k' cannot hold .*multiples of 256"),
    (dict(target_format="q8_0", n_embd=48), r"input width 48 .*multiples of 32"),
    (dict(target_format="q4_k", n_embd=48), r"input width 48 .*: use input widths \(n_embd, ffn_hidden\) that are "
                                            r"multiples of 256, or one of our 32x32-block formats"),
    (dict(method="ste[down]", target_format="q2_k", n_embd=256, ffn_hidden=320),
     r"^error: transformer\.h\.0\.mlp\.c_proj has input width 320, which target_format='q2_k'"),
    (dict(target_format="error-gguf", bits_per_weight=4.0, pqt_start=5, n_embd=288),
     r"bits_per_weight=4 is below what these Linears can take at the least, 4\.5 bits per weight \(Q2_K, or "
     r"IQ4_NL where"),
    (dict(target_format="error-gguf", bits_per_weight=4.0),
     r"error-gguf' weights each tensor's error by its input activations of the 16 steps before the switch, and "
     r"this one is at step 0"),
    (dict(target_format="auto-gguf", bits_per_weight=4.0, pqt_start=5),
     r"auto-gguf' ranks tensors by their learned b_t, and method ste learns none: use error-gguf"),
    (dict(method="gaussws[all]", target_format="auto-gguf", bits_per_weight=4.0, pqt_start=5),
     r"^error: target_format='auto-gguf' chooses one GGML type per tensor when the STE starts, and this gaussws run "
     r"has no ste_start: .* set ste_start"),
    (dict(method="diffq[all]", target_format="error-gguf", bits_per_weight=4.0), r"this diffq run has no ste_start"),
    (dict(method="gaussws[all]", target_format="auto-gguf", bits_per_weight=2.5, pqt_start=5, ste_start=10),
     r"bits_per_weight=2\.5: expected 2\.625 \(every tensor Q2_K\) to 8\.5"),
    (dict(target_format="q4_k", bits_per_weight=4.0), r"or auto-gguf or error-gguf .*not target_format='q4_k'"),
    (dict(method="gaussws[all]", target_format="q4_k", pqt_start=5, ste_start=10),
     r"ste_start=10 trains on .*or per-tensor GGML types"),
    (dict(target_format="q5"), r"target format 'q5': expected one of .*q4_0, q8_0, q4_k"),
])
def test_a_width_or_budget_the_types_cannot_take_is_one_line_before_anything_is_written(data_dir, tmp_path, args,
                                                                                         message, capsys):
    out = tmp_path / "out"
    err = one_line(tiny(data_dir, out, **{"method": "ste[all]", "n_layer": 1, **args}), capsys)
    assert re.search(message, err), err
    assert not out.exists()


# --- the per-tensor budget: allocation --------------------------------------------------------------

def spent(types, weights):
    """Bits per weight of a choice, counted from gguf's block sizes."""
    n = {k: w.numel() for k, w in weights.items()}
    return sum(bits_per_weight(gguf_type(types[k])) * n[k] for k in n) / sum(n.values())


def rungs(width):
    """The positions in GGUF_BUDGET_TYPES of the types a row of `width` weights can be (gguf's block sizes),
    each of more bits than the one below (of two of equal bits the first): the ladder a budget climbs."""
    out = []
    types = budget.GGUF_BUDGET_TYPES
    for j, t in enumerate(types):
        if width % GGML_QUANT_SIZES[gguf_type(t)][0] == 0 and (
                not out or bits_per_weight(gguf_type(t)) > bits_per_weight(gguf_type(types[out[-1]]))):
            out.append(j)
    return out


def naive_allocation(proxy, numel, allowed, per_bit=True, width=512):
    """The allocation budget.gguf_types' docstring states, written out as a plain loop: every tensor starts at
    its ladder's first type (rungs of its row width; Q2_K for rows of 256s); then, again and again, of the
    tensors whose next type's extra bits still fit in what the budget has left, the one whose upgrade drops its
    proxy error per weight the most per extra bit (but never more than an upgrade of it before: the running
    minimum) goes up one type, ties to the tensor first in order. proxy: {tensor: its proxy error per weight at
    each type of GGUF_BUDGET_TYPES}; numel: {tensor: weights}; per_bit False: the drop itself ranks (what
    budget.gguf_types must not do)."""
    order = [budget.GGUF_BUDGET_TYPES[j] for j in rungs(width)]
    bits = [bits_per_weight(gguf_type(t)) for t in order]
    proxy = {k: [p[j] for j in rungs(width)] for k, p in proxy.items()}
    level, ceiling = dict.fromkeys(proxy, 0), dict.fromkeys(proxy, math.inf)
    left = allowed * sum(numel.values()) - bits[0] * sum(numel.values())
    while True:
        options = [(min(ceiling[k], (p[j] - p[j + 1]) / ((bits[j + 1] - bits[j]) if per_bit else 1)), k)
                   for k, p in proxy.items() for j in [level[k]]
                   if j + 1 < len(order) and (bits[j + 1] - bits[j]) * numel[k] <= left]
        if not options:
            return {k: order[j] for k, j in level.items()}
        best = max(p for p, _ in options)
        k = next(k for p, k in options if p == best)
        left -= (bits[level[k] + 1] - bits[level[k]]) * numel[k]
        ceiling[k], level[k] = best, level[k] + 1


@pytest.fixture(scope="module")
def tile_errors(tile):
    """Each budget type's rounding error, measured naively on the tile (rounding_error's definition)."""
    return [naive_relative_error(tile, t) for t in budget.GGUF_BUDGET_TYPES]


def test_a_tensors_b_t_is_log4_of_its_weights_mean_4_to_the_b_t():
    gen = torch.Generator().manual_seed(2)
    b_t = 3 + 4 * torch.rand(2, 3, generator=gen, dtype=torch.float64)
    total = count = 0.0
    for i in range(2):
        for j in range(3):
            n = min(32, 48 - 32 * i) * min(32, 70 - 32 * j)  # the 48 x 70 weight's block (i, j)
            total, count = total + n * 4.0 ** b_t[i, j].item(), count + n
    assert budget.tensor_b_t(b_t, (48, 70)) == pytest.approx(math.log(total / count, 4), rel=1e-12)
    assert budget.tensor_b_t(torch.full((2, 3), 5.25, dtype=torch.float64), (48, 70)) == pytest.approx(5.25)
    # one block that needs precision lifts its tensor above one of a higher plain mean of b_t
    spiky, flat = torch.tensor([[7.0, 4.0, 4.0, 4.0]]), torch.tensor([[5.0, 5.0, 5.0, 5.0]])
    assert spiky.mean() < flat.mean() and budget.tensor_b_t(spiky, (32, 128)) > budget.tensor_b_t(flat, (32, 128))
    weights = {"spiky": torch.zeros(32, 256), "flat": torch.zeros(32, 256)}
    one_upgrade = 2.625 + (3.4375 - 2.625) / 2
    b_t = {k: budget.tensor_b_t(v, (32, 128)) for k, v in (("spiky", spiky), ("flat", flat))}
    assert budget.gguf_types("auto-gguf", weights, one_upgrade, b_t=b_t) == {"spiky": "q3_k", "flat": "q2_k"}


def test_auto_gguf_upgrades_tensors_in_the_order_of_their_b_t_within_the_budget(tile_errors):
    weights = {k: torch.zeros(64, 512) for k in "abcd"}
    b_t = {"a": 5.0, "b": 6.5, "c": 4.0, "d": 5.5}
    q2, q3 = bits_per_weight(gguf_type("q2_k")), bits_per_weight(gguf_type("q3_k"))
    assert budget.gguf_types("auto-gguf", weights, q2, b_t=b_t) == dict.fromkeys("abcd", "q2_k")
    assert budget.gguf_types("auto-gguf", weights, q2 + (q3 - q2) / 4, b_t=b_t) == dict(a="q2_k", b="q3_k", c="q2_k",
                                                                                        d="q2_k")
    # two upgrades of Q3_K's extra bits: b's second (to IQ4_XS, as many bits again) buys more per bit than d's
    # first, 4^6.5 (r(q3_k) - r(iq4_xs)) > 4^5.5 (r(q2_k) - r(q3_k)), the proxies auto-gguf ranks by
    r = {t: budget.rounding_error(t) for t in ("q2_k", "q3_k", "iq4_xs")}
    assert 4 ** 6.5 * (r["q3_k"] - r["iq4_xs"]) > 4 ** 5.5 * (r["q2_k"] - r["q3_k"])
    assert bits_per_weight(gguf_type("iq4_xs")) - q3 == q3 - q2
    assert budget.gguf_types("auto-gguf", weights, q2 + (q3 - q2) / 2, b_t=b_t) == dict(a="q2_k", b="iq4_xs", c="q2_k",
                                                                                        d="q2_k")
    rank = sorted(b_t, key=b_t.get)
    order = ["q2_k", "q3_k", "iq4_xs", "q4_k", "q5_k", "q6_k", "q8_0"]  # a row of 512: iq4_nl has q4_k's bits
    proxy = {k: [4.0 ** b * r for r in tile_errors] for k, b in b_t.items()}
    numel = {k: w.numel() for k, w in weights.items()}
    for allowed in np.linspace(q2, 8.5, 41):
        types = budget.gguf_types("auto-gguf", weights, allowed, b_t=b_t)
        assert spent(types, weights) <= allowed + 1e-12
        levels = [order.index(types[k]) for k in rank]
        assert levels == sorted(levels)  # the higher b_t, the type at least as fine
        assert types == naive_allocation(proxy, numel, allowed), allowed
    assert budget.gguf_types("auto-gguf", weights, 8.5, b_t=b_t) == dict.fromkeys("abcd", "q8_0")


def test_auto_ggufs_base_4_and_its_priority_per_bit_decide_a_hand_computed_allocation(tile_errors):
    """Three tensors of 32,768 weights, b_t 3, 4 and 6, at 4.25 bits per weight: from Q2_K each (2.625) the
    budget leaves 3 x 1.625 = 4.875 bits per tensor weight. The ladder of a row of 512 is Q2_K 2.625, Q3_K
    3.4375, IQ4_XS 4.25, Q4_K 4.5, Q5_K 5.5, Q6_K 6.5625 (IQ4_NL has Q4_K's bits). An upgrade's priority is
    4^b_t times the drop in rounding error r (measured on the tile: Q2_K 6.626e-3, Q3_K 1.894e-3, IQ4_XS
    5.070e-4, Q4_K 4.761e-4, Q5_K 1.179e-4) per bit it adds, never above the tensor's upgrade before:
        c Q2->Q3     4096 * 4.732e-3 / 0.8125 = 23.9   takes 0.8125, 4.0625 left
        c Q3->IQ4_XS 4096 * 1.387e-3 / 0.8125 = 6.99   takes 0.8125, 3.25 left
        b Q2->Q3      256 * 4.732e-3 / 0.8125 = 1.49   takes 0.8125, 2.4375 left
        c IQ4_XS->Q4 4096 * 3.08e-5 / 0.25    = 0.505  takes 0.25, 2.1875 left
        c Q4->Q5     4096 * 3.58e-4 / 1 = 1.47, held to 0.505, above b's and a's next: takes 1, 1.1875 left
        b Q3->IQ4_XS  256 * 1.387e-3 / 0.8125 = 0.437  takes 0.8125, 0.375 left
        b IQ4_XS->Q4  256 * 3.08e-5 / 0.25    = 0.032  takes 0.25, 0.125 left: nothing else fits
    so a Q2_K, b Q4_K, c Q5_K. With 2^b_t (8, 16, 64) the three rank too close for c's upgrades to stand out:
    IQ4_XS each; without the division by the bits the 0.25-bit step IQ4_XS->Q4_K ranks low and the bits go
    to a and b: Q3_K, Q4_K, Q4_K."""
    weights = {k: torch.zeros(64, 512) for k in "abc"}
    b_t = {"a": 3.0, "b": 4.0, "c": 6.0}
    r = dict(zip(budget.GGUF_BUDGET_TYPES, tile_errors))
    assert 256 * (r["q3_k"] - r["iq4_xs"]) / 0.8125 < 4096 * (r["iq4_xs"] - r["q4_k"]) / 0.25 < \
        4096 * (r["q4_k"] - r["q5_k"])  # c's IQ4_XS->Q4_K step comes before b's second upgrade, per bit
    assert budget.gguf_types("auto-gguf", weights, 4.25, b_t=b_t) == dict(a="q2_k", b="q4_k", c="q5_k")
    numel = dict.fromkeys("abc", 64 * 512)
    assert naive_allocation({k: [4.0 ** b * x for x in tile_errors] for k, b in b_t.items()}, numel, 4.25) == \
        dict(a="q2_k", b="q4_k", c="q5_k")
    for base, per_bit, other in ((2.0, True, ("iq4_xs",) * 3), (4.0, False, ("q3_k", "q4_k", "q4_k"))):
        proxy = {k: [base ** b * x for x in tile_errors] for k, b in b_t.items()}
        assert tuple(naive_allocation(proxy, numel, 4.25, per_bit).values()) == other


def test_error_gguf_weights_each_tensors_error_by_its_input_activations():
    """Two equal weights: the one whose inputs are larger takes the one upgrade there is; a width that
    no K-quant takes (a multiple of 32, not of 256) is IQ4_NL at the least, Q8_0 above, its bits counted."""
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(3))
    weights = {"quiet": w, "loud": w.clone()}
    imatrix = {"quiet": torch.ones(512), "loud": torch.full((512,), 100.0)}
    q2, q3 = bits_per_weight(gguf_type("q2_k")), bits_per_weight(gguf_type("q3_k"))
    assert budget.gguf_types("error-gguf", weights, q2 + (q3 - q2) / 2, imatrix=imatrix) == dict(quiet="q2_k",
                                                                                                 loud="q3_k")
    # one column that carries all the input: the tensor whose error there is larger is upgraded
    a, b = w.clone(), w.clone()
    a[:, 0] *= 8.0  # a large weight in column 0 widens its sub-blocks' scales, hence their error
    columns = torch.zeros(512)
    columns[:16] = 1.0
    got = budget.gguf_types("error-gguf", {"a": a, "b": b}, q2 + (q3 - q2) / 2, imatrix={"a": columns, "b": columns})
    error = {k: ((gguf_grid(v, gguf_type("q2_k")) - v) ** 2).sum(0)[:16].sum() for k, v in (("a", a), ("b", b))}
    assert error["a"] > error["b"] and got == dict(a="q3_k", b="q2_k")
    narrow = {"wide": torch.zeros(64, 256), "narrow": torch.zeros(64, 96)}
    columns = {"wide": torch.ones(256), "narrow": torch.ones(96)}
    least = (2.625 * 256 + 4.5 * 96) / (256 + 96)  # Q2_K and IQ4_NL, by their bits
    assert budget.gguf_types("error-gguf", narrow, least, imatrix=columns) == dict(wide="q2_k", narrow="iq4_nl")
    assert budget.gguf_types("error-gguf", narrow, 8.5, imatrix=columns) == dict(wide="q8_0", narrow="q8_0")
    types = budget.gguf_types("error-gguf", narrow, 8.0, imatrix=columns)
    assert types["narrow"] in ("iq4_nl", "q8_0") and spent(types, narrow) <= 8.0


# --- the per-tensor budget through train.py: one switch, kept on resume --------------------------------

BUDGETS = {  # 2 layers: each Linear of block 0 has a twin of the same shape in block 1
    "auto": dict(method="gaussws[all]", pqt_start=5, ste_start=10, target_format="auto-gguf", bits_per_weight=4.0),
    "error": dict(method="ste[all]", pqt_start=18, target_format="error-gguf", bits_per_weight=4.5),
    "error-pqt": dict(method="gaussws[all]", pqt_start=2, ste_start=18, target_format="error-gguf",
                      bits_per_weight=3.5),
}
SWITCH = {name: int(kw.get("ste_start") or kw["pqt_start"]) for name, kw in BUDGETS.items()}
BUDGET_SHAPE = dict(n_layer=2, n_head=2, n_embd=256)
BUDGET_CONFIG = ModelConfig(n_layer=2, n_head=2, n_embd=256, block_size=32, vocab_size=256)


def budget_argv(data_dir, out_dir, name, **kw):
    return tiny(data_dir, out_dir, **{**BUDGET_SHAPE, **BUDGETS[name], **kw})


class Inputs:
    """Each converted Linear's inputs in the training forwards of steps `steps`: the squares summed per
    column in float64, seen by a global forward hook (outside the code under test); and the weights the
    converted Linears hold as step `switch` begins."""

    def __init__(self, steps, switch):
        self.steps, self.switch, self.step, self.sums, self.weights = steps, switch, None, {}, {}

    def __enter__(self):
        names = {}

        def hook(module, args):
            if isinstance(module, (ste.STELinear, gaussws.PQTLinear)) and module.training \
                    and self.step in self.steps:
                name = names.setdefault(id(module), module._path)
                x = args[0].detach().double()
                self.sums[name] = self.sums.get(name, 0) + x.square().reshape(-1, x.shape[-1]).sum(0)
        self.handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
        begin = gaussws.TrainStep.begin

        def tracking(step_self):
            self.step = step_self.step
            if self.step == self.switch:
                self.weights = {m._path: m.weight.detach().clone() for m in step_self.layers}
            return begin(step_self)
        self.patch = pytest.MonkeyPatch()
        self.patch.setattr(gaussws.TrainStep, "begin", tracking)
        convert = gaussws.convert

        def naming(model, *a, **k):  # each converted layer learns its module path
            out = convert(model, *a, **k)
            for path, m in out.named_modules():
                m._path = path
            return out
        self.patch.setattr(gaussws, "convert", naming)
        return self

    def __exit__(self, *exc):
        self.handle.remove()
        self.patch.undo()


@pytest.fixture(scope="module")
def budget_runs(data_dir, tmp_path_factory):
    """{name: (out_dir, {step: states}, what it printed, Inputs of the steps imatrix sums)}, uninterrupted."""
    out = {}
    for name in BUDGETS:
        d = tmp_path_factory.mktemp(name)
        with Inputs(range(max(0, SWITCH[name] - budget.IMATRIX_STEPS), SWITCH[name]), SWITCH[name]) as inputs:
            with pytest.MonkeyPatch.context() as mp:
                printed = []
                mp.setattr(ste, "_say", printed.append)
                saved = train_recording(budget_argv(data_dir, d, name))
        out[name] = (d, saved, printed, inputs)
    return out


@pytest.mark.parametrize("name", BUDGETS)
def test_the_switch_chooses_once_within_the_budget_and_the_run_trains_on_its_types(budget_runs, name):
    out_dir, run, printed, _ = budget_runs[name]
    switch, kw = SWITCH[name], BUDGETS[name]
    before = [ggml_types(run[s][0]) for s in run if s <= switch]
    assert before and all(set(t.values()) == {budget.UNCHOSEN} and len(t) == 8 for t in before)
    chosen = ggml_types(run[STEPS][0])
    assert all(ggml_types(run[s][0]) == chosen for s in run if s > switch)
    assert budget.UNCHOSEN not in chosen.values()
    shapes = {k: run[STEPS][0][k + ".weight"].shape for k in chosen}
    n = {k: shape.numel() for k, shape in shapes.items()}
    bits = sum(bits_per_weight(t) * n[k] for k, t in chosen.items()) / sum(n.values())
    assert bits <= kw["bits_per_weight"] and len(set(chosen.values())) >= 2
    assert len(printed) == 1 and printed[0].startswith(f"note: step {switch}: {kw['target_format']} chose")
    assert f"= {bits:.4f} bits per weight of the 8 Linears (budget {kw['bits_per_weight']:g})" in printed[0]
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    model = gaussws.convert(GPT(BUDGET_CONFIG), kw["method"], ROLES["gpt2"], start=kw["pqt_start"],
                            ste_start=kw.get("ste_start", 0), fmt=kw["target_format"],
                            bits_per_weight=kw["bits_per_weight"])
    loss, grads = training_forward(model, run[STEPS][0], STEPS, x)
    plain_loss, plain_grads = training_forward(GPT(BUDGET_CONFIG), on_grid(run[STEPS][0], chosen), STEPS, x)
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(plain_grads[k], g) for k, g in grads.items() if not k.endswith(".b_i"))
    assert all(g is None for k, g in grads.items() if k.endswith(".b_i"))  # b_t stays as learned


def test_auto_gguf_ranks_the_tensors_by_their_learned_b_t(budget_runs, tile_errors):
    """Of two Linears of the same shape, the one of higher tensor b_t (from the switch's b_i by Eq. 11,
    aggregated naively) has a type at least as fine; the choice is naive_allocation's of that step's b_t with
    the types' errors measured on the tile."""
    _, run, _, _ = budget_runs["auto"]
    state, chosen = run[SWITCH["auto"]][0], ggml_types(run[STEPS][0])
    config = phases.phase_settings("gaussws", {**BUDGETS["auto"], "max_iters": STEPS, "b_init": 6.0, "b_target": 4.0})
    tensor_b_t = {}
    for layer in chosen:
        b_t = config["b_target"] + state[layer + ".b_i"].double() * (config["b_init"] - config["b_target"])
        w = state[layer + ".weight"]
        blocks = [(b_t[i // 32, j // 32].item(), min(32, w.shape[0] - i) * min(32, w.shape[1] - j))
                  for i in range(0, w.shape[0], 32) for j in range(0, w.shape[1], 32)]
        tensor_b_t[layer] = math.log(sum(n * 4 ** b for b, n in blocks) / sum(n for _, n in blocks), 4)
    assert len(set(tensor_b_t.values())) == 8
    order = [gguf_type(t).value for t in budget.GGUF_BUDGET_TYPES]
    for k in LINEARS:
        low, high = sorted((f"transformer.h.{i}.{k}" for i in (0, 1)), key=tensor_b_t.get)
        assert order.index(chosen[low]) <= order.index(chosen[high])
    proxy = {k: [4.0 ** b * r for r in tile_errors] for k, b in tensor_b_t.items()}
    expected = naive_allocation(proxy, {k: state[k + ".weight"].numel() for k in chosen}, 4.0)
    assert {k: gguf_type(t).value for k, t in expected.items()} == chosen


@pytest.mark.parametrize("name", ["error", "error-pqt"])
def test_error_gguf_sums_the_squared_inputs_of_the_steps_before_the_switch(budget_runs, name):
    """imatrix holds, per input column, the squared input activations of the training forwards of the
    IMATRIX_STEPS steps before the switch (a hook outside the code saw them); the switch's choice is
    naive_allocation's of the weights' squared errors on gguf's grid, each column weighted by those sums."""
    _, run, _, inputs = budget_runs[name]
    state, chosen = run[STEPS][0], ggml_types(run[STEPS][0])
    assert inputs.sums.keys() == chosen.keys()
    for layer in chosen:
        torch.testing.assert_close(state[layer + ".imatrix"].double(), inputs.sums[layer], rtol=1e-5, atol=0)
    proxy = {k: [float((((gguf_grid(inputs.weights[k], gguf_type(t)).double() - inputs.weights[k].double()) ** 2)
                       .sum(0) * inputs.sums[k].float().double()).sum()) / inputs.weights[k].numel()
                 for t in budget.GGUF_BUDGET_TYPES] for k in chosen}
    numel = {k: inputs.weights[k].numel() for k in chosen}
    expected = naive_allocation(proxy, numel, BUDGETS[name]["bits_per_weight"])
    assert {k: gguf_type(t).value for k, t in expected.items()} == chosen


@pytest.mark.parametrize("name", BUDGETS)
def test_a_budget_run_exports_to_gguf_in_the_types_it_trained_on(budget_runs, name):
    """export.py of a budget run's checkpoint (an error-gguf one holds its imatrix sums too): every block
    Linear of the GGUF file has the type it trained on, as gguf's reader reads the file."""
    from test_gguf import our_key
    out_dir, run, _, _ = budget_runs[name]
    kw = BUDGETS[name]
    assert any(k.endswith(".imatrix") for k in run[STEPS][0]) == kw["target_format"].startswith("error")
    r = subprocess.run([sys.executable, "export.py", f"--out_dir={out_dir}", f"--format={kw['target_format']}",
                        f"--bits_per_weight={kw['bits_per_weight']}", "--gguf=True", "--evaluate=False",
                        "--plot=False"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    path = out_dir / f"model-{kw['target_format']}.gguf"
    types = {our_key(t.name, "gpt2"): int(t.tensor_type) for t in gguf.GGUFReader(str(path)).tensors}
    chosen = ggml_types(run[STEPS][0])
    assert {k: types[k + ".weight"] for k in chosen} == chosen


@pytest.mark.parametrize("name, stop", [("auto", 10), ("auto", 15), ("error", 10), ("error", 19), ("error-pqt", 5)])
def test_a_budget_run_stopped_before_or_after_its_switch_resumes_as_the_uninterrupted_one(budget_runs, data_dir,
                                                                                          tmp_path, name, stop):
    """Stopped inside the imatrix's steps, at the switch or after it: the same losses, imatrix and types
    (after the switch the types are the saved ones: the allocation is not called again)."""
    whole_dir, whole, _, _ = budget_runs[name]
    train.main(budget_argv(data_dir, tmp_path, name, max_iters=stop, lr_decay_iters=STEPS))
    with pytest.MonkeyPatch.context() as mp:
        printed = []
        mp.setattr(ste, "_say", printed.append)
        if stop > SWITCH[name]:
            mp.setattr(budget, "gguf_types", lambda *a, **k: pytest.fail("the types were chosen again"))
        train.main(budget_argv(data_dir, tmp_path, name, init_from="resume"))
    assert len(printed) == (stop <= SWITCH[name])
    evaluations = {i: v for i, v in curve(tmp_path, "val/loss").items() if i != 19}  # 19: the stopped run's end
    assert curve(tmp_path) == curve(whole_dir) and evaluations == curve(whole_dir, "val/loss")
    state = checkpoint.load_model(str(tmp_path / "ckpt.pt"))["model"]
    assert all(torch.equal(v, whole[STEPS][0][k]) for k, v in state.items())


def test_a_fork_inside_error_ggufs_steps_is_refused_in_one_line(budget_runs, data_dir, tmp_path, capsys):
    bf16 = tmp_path / "bf16"
    train.main(tiny(data_dir, bf16, **BUDGET_SHAPE, method="bf16", max_iters=10))
    err = one_line(budget_argv(data_dir, tmp_path / "fork", "error", fork_from=str(bf16 / "ckpt.pt")), capsys)
    assert "is at step 10, and error-gguf sums the input activations of the 16 steps before its switch at step 18" \
        in err and "fork from a checkpoint at step 2 or earlier" in err


def test_two_processes_sum_imatrix_over_both_and_choose_the_same_types(data_dir, tmp_path, budget_runs):
    """Each process sees its half of a step's sequences; their sums are added at each step's end, so
    the two choose the types one process chooses, from the same imatrix up to the summation order."""
    args = dict(gradient_accumulation_steps=2, max_iters=20)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "train.py", *budget_argv(data_dir, tmp_path, "error", **args)], capture_output=True,
                         text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("note: step 18: error-gguf chose") == 1
    one = tmp_path / "one"
    train.main(budget_argv(data_dir, one, "error", **args))
    a, b = (checkpoint.load_model(str(d / "ckpt.pt"))["model"] for d in (one, tmp_path))
    assert ggml_types(a) == ggml_types(b)
    for k in (k for k in a if k.endswith(".imatrix")):
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=0)


def test_a_compiled_model_trains_on_the_same_grid_and_sums_the_same_imatrix():
    """w_q is made outside the compiled graph (TrainStep's begin), the imatrix sums in eager code: a
    compiled layer computes and collects what the eager one does, bit for bit."""
    gen = torch.Generator().manual_seed(4)
    x, g = torch.randn(2, 4, 256, generator=gen), torch.randn(2, 4, 64, generator=gen)
    results = []
    for compiled in (False, True):
        torch.manual_seed(6)  # the bias
        layer = ste.STELinear(256, 64, fmt="error-gguf", start=1, bits_per_weight=4.0)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(64, 256, generator=torch.Generator().manual_seed(5)))
        forward = torch.compile(layer) if compiled else layer
        for step in (0, 1):
            with gaussws.TrainStep(layer, step):
                y = forward(x)
                y.backward(g)
        results.append((y.detach(), layer.weight.grad, layer.imatrix.clone(), int(layer.ggml_type)))
    (y, grad, imatrix, t), (y_c, grad_c, imatrix_c, t_c) = results
    assert torch.equal(y, y_c) and torch.equal(grad, grad_c) and torch.equal(imatrix, imatrix_c) and t == t_c
    assert torch.equal(imatrix, x.square().sum((0, 1))) and t != budget.UNCHOSEN


@pytest.mark.parametrize("name", ["auto", "error"])
def test_sample_and_hf_read_a_gguf_budget_runs_checkpoint(budget_runs, name, tmp_path):
    """sample.py rebuilds the run's model (its layers hold ggml_type and imatrix); hf.py writes its weights alone."""
    from files import pretrained
    import sample
    model, ckpt = sample.load_checkpoint(str(budget_runs[name][0]), "cpu")
    assert all(torch.equal(v, ckpt["model"][k]) for k, v in model.state_dict().items())
    assert ggml_types(model.state_dict()) == ggml_types(ckpt["model"]) != {}
    files, _ = pretrained.save_pretrained(ckpt["model_args"], ckpt["model"], str(tmp_path / "hf"))
    assert "model.safetensors" in files
