"""step.py: the one optimizer step train.py takes and bench.py times is gradient accumulation as
written out by hand, clipped, checked for finite values before anything is applied; the sane-model
rule train.py applies at every evaluation holds at its bounds."""
import copy

import pytest
import torch

import gaussws
from model import GPT, ROLES, ModelConfig
from step import NonFinite, all_finite, insanity, train_step


def tiny(method="bf16", seed=0):
    torch.manual_seed(seed)
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=64, block_size=16))
    return gaussws.convert(model, method, ROLES["gpt2"], seed=seed).train()


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(64, (n, 4, 17), generator=g)
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]


def test_the_step_is_accumulation_clipping_and_the_update_by_hand():
    model, accum, clip = tiny(), 3, 0.5
    reference = copy.deepcopy(model)
    micro = batches(accum + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    seen = []

    def micro_batch(step, m):
        seen.append((step, m))
        return micro[m]
    loss, norm, nxt = train_step(model, [opt], 7, micro[0], micro_batch, accum, grad_clip=clip)

    total = 0.0  # by hand: the mean of the micro-steps' losses, one backward each, then clip and step
    for x, y in micro[:accum]:
        _, ref_loss = reference(x, y)
        (ref_loss / accum).backward()
        total += (ref_loss / accum).item()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
    ref_opt.step()
    assert seen == [(7, 1), (7, 2), (8, 0)]  # each fetched before the backward; the last is the next step's
    assert nxt[0] is micro[0][0] and loss == pytest.approx(total, rel=1e-6) and norm == pytest.approx(ref_norm.item())
    assert norm > clip  # so the clipping mattered
    for (k, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=k)
        assert p.grad is None  # zero_grad(set_to_none=True)


def grads_at_the_update(model, lam, micro, accum):
    """(the step's loss, {name: gradient} as train_step hands them to the optimizer) of one step with
    bitwidth_lambda=lam over micro-batches micro[0..accum-1]."""
    opt, names, seen = torch.optim.SGD(model.parameters(), lr=0.0), {p: n for n, p in model.named_parameters()}, {}
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.update(
        {names[p]: p.grad.clone() for g in o.param_groups for p in g["params"] if p.grad is not None}))
    loss, _, _ = train_step(model, [opt], 0, micro[0], lambda s, m: micro[m], accum, bitwidth_lambda=lam)
    return loss, seen


def test_bitwidth_lambda_adds_eq12_and_its_gradient_to_every_micro_step():
    """Eq. 12 by hand: with lambda the step's loss grows by lambda x sum over layers of the mean |b_t -
    b_target| of their m_i blocks (each of the accum micro-steps adds it over accum), each b_i's gradient
    by lambda x sign(b_i) x |b_init - b_target| / m_i (d|b_t - b_target|/db_i through Eq. 11), and every
    other gradient is the same bit for bit."""
    accum, lam = 3, 0.25
    micro = batches(accum + 1)
    runs = {}
    for l in (0.0, lam):
        model = tiny("gaussws[all]")
        with torch.no_grad():  # b_t on both sides of b_target: both signs of Eq. 12's gradient
            for layer in gaussws.pqt_layers(model):
                layer.b_i.copy_(torch.linspace(-1.5, 1.4, layer.b_i.numel()).view_as(layer.b_i))
        runs[l] = (model, *grads_at_the_update(model, l, micro, accum))
    (model, loss_0, g_0), (_, loss, g) = runs[0.0], runs[lam]
    layers = {f"{n}.b_i": layer for n, layer in model.named_modules() if isinstance(layer, gaussws.PQTLinear)}
    eq12 = sum((layer.b_i.double() * (layer.b_init - layer.b_target)).abs().mean().item() for layer in layers.values())
    assert lam * eq12 > 0.1 and loss == pytest.approx(loss_0 + lam * eq12, rel=1e-6)
    assert g.keys() == g_0.keys() and set(layers) <= set(g)
    for name in g:
        if name in layers:
            layer = layers[name]
            by_hand = lam * torch.sign(layer.b_i.double()) * abs(layer.b_init - layer.b_target) / layer.b_i.numel()
            torch.testing.assert_close(g[name].double() - g_0[name].double(), by_hand, rtol=1e-4, atol=1e-7, msg=name)
        else:
            assert torch.equal(g[name], g_0[name]), name


@pytest.mark.parametrize("poison", ["loss", "gradient"])
def test_a_non_finite_loss_or_gradient_is_refused_before_the_update(poison):
    model = tiny("gaussws[all]")
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = batches(1)[0]
    if poison == "loss":
        model.lm_head.register_forward_hook(lambda m, a, out: out * float("nan"))
    else:  # one gradient element turns inf; the loss stays finite
        model.lm_head.weight.register_hook(lambda g: g.index_fill(0, torch.tensor([3]), float("inf")))
    with pytest.raises(NonFinite, match="loss is nan" if poison == "loss" else r"gradient norm is inf \(loss \d"):
        train_step(model, [opt], 0, (x, y), lambda s, m: (x, y), 1, grad_clip=1.0)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not opt.state  # the optimizer never stepped
    assert all(not layer.in_step for layer in gaussws.pqt_layers(model))  # the TrainStep was released


def test_all_finite_sees_every_parameter_b_i_included():
    model = tiny("gaussws[od]")
    assert all_finite(model, distributed=False)
    with torch.no_grad():
        gaussws.pqt_layers(model)[0].b_i.view(-1)[0] = float("inf")
    assert not all_finite(model, distributed=False)


def test_the_sane_model_rule_at_its_bounds():
    """ln(256) + 1 = 6.5452 nats; b_t at least min(b_init, b_target) - 8."""
    ok, nan = {"train": 2.0, "val": 2.0}, float("nan")
    assert insanity(ok, {"min": -3.99}, 256, 4.0, trained=True) is None
    assert insanity(ok, {"min": -4.01}, 256, 4.0, trained=True) == ("b_t", -4.01, -4.0)
    assert insanity(ok, {"min": nan}, 256, 4.0, trained=True)[0] == "b_t"
    assert insanity(ok, None, 256, 4.0, trained=True) is None  # bf16: no b_t
    assert insanity({"train": 9.0, "val": 6.545}, None, 256, 4.0, trained=True) is None
    assert insanity({"train": 2.0, "val": 6.546}, None, 256, 4.0, trained=True)[0] == "val_loss"
    assert insanity({"train": 2.0, "val": 50.0}, None, 256, 4.0, trained=False) is None  # nothing trained yet
    assert insanity({"train": nan, "val": 2.0}, None, 256, 4.0, trained=False)[0] == "eval_loss"
