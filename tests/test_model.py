"""model.py: GPT2 is GPT-2, Llama2 is Llama 2, and ROLES with gaussws.convert puts PQT where the method
string says, from the same initial weights for every method (sample.py's tests: tests/test_sample.py)."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gaussws
from model import GPT, PRESETS, ROLES, ModelConfig, apply_rope, rope_cos_sin
from conftest import tiny_model

# The modules of a block that each layer name of the method switch denotes (docs/METHOD.md).
GPT2_MODULES = {"qkv": "attn.c_attn", "out": "attn.c_proj", "up": "mlp.c_fc", "down": "mlp.c_proj"}
LLAMA2_MODULES = {"q": "attn.q", "k": "attn.k", "v": "attn.v", "out": "attn.out",
                  "gate": "mlp.gate", "up": "mlp.up", "down": "mlp.down"}


# --- the method switch -----------------------------------------------------------------------------

@pytest.mark.parametrize("arch, spec, method, parts", [
    ("gpt2", "bf16", None, ()),
    ("gpt2", "diffq[all]", "diffq", ("qkv", "out", "up", "down")),
    ("gpt2", "gaussws[all]", "gaussws", ("qkv", "out", "up", "down")),
    ("gpt2", "gaussws[od]", "gaussws", ("out", "down")),
    ("gpt2", "gaussws[qkv]", "gaussws", ("qkv",)),
    ("llama2", "bf16", None, ()),
    ("llama2", "diffq[all]", "diffq", ("q", "k", "v", "out", "gate", "up", "down")),
    ("llama2", "gaussws[all]", "gaussws", ("q", "k", "v", "out", "gate", "up", "down")),
    ("llama2", "gaussws[od]", "gaussws", ("out", "down")),
    ("llama2", "gaussws[q,v]", "gaussws", ("q", "v")),
])
def test_pqt_layers_sit_exactly_where_the_method_says(arch, spec, method, parts):
    config = tiny_model(arch)
    model = gaussws.convert(GPT(config), spec, ROLES[arch], b_init=7.0, b_target=3.0, seed=1)
    table = GPT2_MODULES if arch == "gpt2" else LLAMA2_MODULES
    want = {f"transformer.h.{i}.{table[p]}" for i in range(config.n_layer) for p in parts}
    pqt = {n: m for n, m in model.named_modules() if isinstance(m, gaussws.PQTLinear)}
    assert set(pqt) == want
    for m in pqt.values():
        assert (m.method, m.b_init, m.b_target) == (method, 7.0, 3.0)
        assert m.b_i.shape == (math.ceil(m.out_features / 32), math.ceil(m.in_features / 32))
        assert torch.all(m.b_i == 1.0)  # Eq. 11's init survives the model's _init_weights
    # Every other Linear of the blocks, and the head, is a plain nn.Linear; nothing else changed type.
    plain = {n for n, m in model.named_modules() if type(m) is nn.Linear}
    all_block_linears = {f"transformer.h.{i}.{mod}" for i in range(config.n_layer) for mod in table.values()}
    assert plain == (all_block_linears - want) | {"lm_head"}
    assert model.get_num_bitwidth_params() == sum(m.b_i.numel() for m in pqt.values())


def test_roles_name_every_linear_of_a_block():
    for arch, table in (("gpt2", GPT2_MODULES), ("llama2", LLAMA2_MODULES)):
        assert ROLES[arch] == {module: role for role, module in table.items()}
        block = GPT(tiny_model(arch)).transformer.h[0]
        assert {n for n, m in block.named_modules() if isinstance(m, nn.Linear)} == set(table.values())
        # plain until converted
        assert not any(isinstance(m, gaussws.PQTLinear) for m in GPT(tiny_model(arch)).modules())


@pytest.mark.parametrize("arch", ["gpt2", "llama2"])
def test_every_method_starts_from_the_same_weights(arch):
    states = {}
    for spec in ("bf16", "gaussws[all]", "diffq[od]"):
        torch.manual_seed(1337)
        model = gaussws.convert(GPT(tiny_model(arch)), spec, ROLES[arch], seed=1337)
        states[spec] = {k: v for k, v in model.state_dict().items() if not k.endswith("b_i")}
        states[spec]["next draw"] = torch.rand(8)  # dropout draws from here next: also the same
    for spec in ("gaussws[all]", "diffq[od]"):
        assert states[spec].keys() == states["bf16"].keys()
        for k, v in states["bf16"].items():
            assert torch.equal(states[spec][k], v), (spec, k)


def test_a_bad_method_or_shape_is_a_value_error_that_says_what_is_wrong():
    with pytest.raises(ValueError, match="gaussws"):
        gaussws.convert(GPT(tiny_model("gpt2")), "gaussws[q]", ROLES["gpt2"])  # q is a Llama2 layer
    with pytest.raises(ValueError, match="arch"):
        tiny_model("gpt3")
    with pytest.raises(ValueError, match="n_kv_head"):
        tiny_model("llama2", n_kv_head=3)
    with pytest.raises(ValueError, match="n_head"):
        tiny_model("gpt2", n_embd=50)


# --- GPT2 is GPT-2 ---------------------------------------------------------------------------------

def test_gpt2_parameter_names_are_gpt2s():
    model = GPT(tiny_model("gpt2"))
    want = {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight", "transformer.ln_f.bias",
            "lm_head.weight"}
    for i in range(2):
        for mod in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"):
            want |= {f"transformer.h.{i}.{mod}.weight", f"transformer.h.{i}.{mod}.bias"}
    assert set(model.state_dict()) == want
    assert model.state_dict()["transformer.h.0.attn.c_attn.weight"].shape == (3 * 48, 48)
    assert model.state_dict()["transformer.h.0.mlp.c_fc.weight"].shape == (80, 48)


def test_gpt2_ties_the_head_to_wte_and_llama2_does_not():
    gpt2, llama2 = GPT(tiny_model("gpt2")), GPT(tiny_model("llama2"))
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    assert llama2.lm_head.weight is not llama2.transformer.wte.weight
    assert "wpe" not in llama2.transformer  # Llama2's positions are rotary
    assert all(m.bias is None for m in llama2.modules() if isinstance(m, nn.Linear))
    assert not any(isinstance(m, nn.LayerNorm) for m in llama2.modules())


def test_init_is_nanogpts_with_scaled_residual_projections():
    config = tiny_model("llama2", n_layer=3, n_embd=128, n_head=4, ffn_hidden=256)
    model = GPT(config)
    scaled = 0.02 / math.sqrt(2 * config.n_layer)
    for name, p in model.named_parameters():
        if name.endswith(("attn.out.weight", "mlp.down.weight")):
            assert p.std().item() == pytest.approx(scaled, rel=0.1), name
        elif name.endswith(("q.weight", "k.weight", "v.weight", "gate.weight", "up.weight", "lm_head.weight",
                            "wte.weight")):
            assert p.std().item() == pytest.approx(0.02, rel=0.1), name


@pytest.mark.parametrize("arch", ["gpt2", "llama2"])
def test_fresh_model_loss_is_log_vocab(arch):
    """Small init gives near-uniform logits, so the first loss is about ln(vocab_size)."""
    torch.manual_seed(0)
    model = GPT(tiny_model(arch))
    idx, targets = torch.randint(0, 97, (2, 4, 16))  # targets unrelated to the input: no copying to exploit
    logits, loss = model(idx, targets)
    assert logits.shape == (4, 16, 97)
    assert loss.item() == pytest.approx(math.log(97), abs=0.1)
    logits, loss = model(idx)
    assert logits.shape == (4, 1, 97) and loss is None


# --- preset sizes ------------------------------------------------------------------------------

def count_by_hand(c):
    """Parameters of a preset from its shape, written out layer by layer (tied head counted once)."""
    d, L, V, f = c["n_embd"], c["n_layer"], c["vocab_size"], c["ffn_hidden"] if "ffn_hidden" in c else 4 * c["n_embd"]
    if c["arch"] == "gpt2":
        block = (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d) + 2 * 2 * d
        return V * d + c["block_size"] * d + L * block + 2 * d
    kv = c.get("n_kv_head", c["n_head"]) * (d // c["n_head"])
    block = 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d
    return 2 * V * d + L * block + d


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_parameter_counts(name):
    with torch.device("meta"):
        model = GPT(ModelConfig(**PRESETS[name]))
    assert model.get_num_params(non_embedding=False) == count_by_hand(PRESETS[name])
    named = {"gpt2-124m": 124e6, "llama2-134m": 134e6}
    if name in named:
        assert abs(model.get_num_params(non_embedding=False) / named[name] - 1) < 0.01


def test_presets_build_on_the_meta_device_with_pqt_layers():
    """train.py's dry run builds big presets without memory: PQTLinear must allow the meta device."""
    with torch.device("meta"):
        model = gaussws.convert(GPT(ModelConfig(**PRESETS["llama2-134m"])), "gaussws[all]", ROLES["llama2"])
    # one b_i per 32x32 block: 768x768 attention (24x24 blocks), 768<->2048 MLP (64x24 blocks)
    assert model.get_num_bitwidth_params() == 12 * (4 * 24 * 24 + 3 * 64 * 24)


def test_non_embedding_count_leaves_out_lookup_tables():
    gpt2, llama2 = GPT(tiny_model("gpt2")), GPT(tiny_model("llama2"))
    assert gpt2.get_num_params() == gpt2.get_num_params(False) - 16 * 48  # wpe only: wte is the head too
    assert llama2.get_num_params() == llama2.get_num_params(False) - 97 * 48  # wte


# --- Llama2 pieces -----------------------------------------------------------------------------

def test_rotary_embedding_equals_pairwise_rotation():
    T, hd, theta = 11, 8, 10000.0
    x = torch.randn(2, 3, T, hd)
    got = apply_rope(x, *rope_cos_sin(T, hd, theta, "cpu"))
    want = torch.empty_like(x, dtype=torch.float64)
    xd = x.double()
    for t in range(T):
        for i in range(hd // 2):
            a = t * theta ** (-2 * i / hd)
            rot = torch.tensor([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]], dtype=torch.float64)
            want[..., t, 2 * i:2 * i + 2] = xd[..., t, 2 * i:2 * i + 2] @ rot.T
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_rotary_scores_depend_only_on_relative_position():
    T, hd = 12, 16
    q = torch.randn(hd).expand(1, 1, T, hd)
    k = torch.randn(hd).expand(1, 1, T, hd)
    cos, sin = rope_cos_sin(T, hd, 10000.0, "cpu")
    s = (apply_rope(q, cos, sin) @ apply_rope(k, cos, sin).transpose(-1, -2))[0, 0]
    for shift in (1, 5):
        torch.testing.assert_close(s[shift:, shift:], s[:-shift, :-shift], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(s[0, 0], s[3, 0])  # different distances do differ


def test_grouped_query_attention_shares_each_kv_head_among_its_query_heads():
    torch.manual_seed(0)
    config = tiny_model("llama2", n_head=4, n_kv_head=2, n_embd=64)
    attn = GPT(config).transformer.h[0].attn
    assert attn.q.weight.shape == (64, 64)
    assert attn.k.weight.shape == attn.v.weight.shape == (2 * 16, 64)
    assert attn.out.weight.shape == (64, 64)
    B, T = 2, 7
    x = torch.randn(B, T, 64)
    cos, sin = rope_cos_sin(T, 16, config.rope_theta, "cpu")
    q = apply_rope((x @ attn.q.weight.T).view(B, T, 4, 16).transpose(1, 2), cos, sin)
    k = apply_rope((x @ attn.k.weight.T).view(B, T, 2, 16).transpose(1, 2), cos, sin)
    v = (x @ attn.v.weight.T).view(B, T, 2, 16).transpose(1, 2)
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)  # query heads 0,1 -> kv 0; 2,3 -> kv 1
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(16)
    scores = scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    y = (F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(B, T, 64)
    torch.testing.assert_close(attn(x, (cos, sin)), y @ attn.out.weight.T, atol=1e-5, rtol=1e-5)


# --- both archs ------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["gpt2", "llama2"])
def test_causal_output_at_t_ignores_tokens_after_t(arch):
    torch.manual_seed(0)
    model = GPT(tiny_model(arch)).eval()
    idx = torch.randint(0, 97, (2, 16))
    t = 9
    later = idx.clone()
    later[:, t + 1:] = (later[:, t + 1:] + 1) % 97
    at_t = idx.clone()
    at_t[:, t] = (at_t[:, t] + 1) % 97
    logits, _ = model(idx, idx)
    logits_later, _ = model(later, later)
    logits_at_t, _ = model(at_t, at_t)
    torch.testing.assert_close(logits[:, :t + 1], logits_later[:, :t + 1])
    assert not torch.allclose(logits[:, t + 1:], logits_later[:, t + 1:])  # later outputs do see them
    assert not torch.allclose(logits[:, t], logits_at_t[:, t])  # and position t sees token t


@pytest.mark.parametrize("arch", ["gpt2", "llama2"])
def test_dropout_acts_in_training_only(arch):
    model = GPT(tiny_model(arch, dropout=0.5))
    idx = torch.randint(0, 97, (2, 16))
    assert not torch.equal(model(idx, idx)[0], model(idx, idx)[0])
    model.eval()
    assert torch.equal(model(idx, idx)[0], model(idx, idx)[0])


@pytest.mark.parametrize("arch", ["gpt2", "llama2"])
def test_generate_returns_prompt_plus_new_tokens(arch):
    torch.manual_seed(0)
    model = gaussws.convert(GPT(tiny_model(arch)), "gaussws[all]", ROLES[arch]).eval()
    idx = torch.randint(0, 97, (2, 5))
    out = model.generate(idx, 7, temperature=0.8, top_k=10)
    assert out.shape == (2, 12) and torch.equal(out[:, :5], idx)
    assert 0 <= out.min() and out.max() < 97
    greedy = model.generate(idx, 1, temperature=0)
    assert torch.equal(greedy[:, -1], model(idx)[0][:, -1].argmax(-1))
    assert torch.equal(model.generate(idx, 3, top_k=1), model.generate(idx, 3, temperature=0))
    long = torch.randint(0, 97, (1, 20))  # longer than block_size: generate crops the context
    assert model.generate(long, 4).shape == (1, 24)


def test_generate_never_picks_the_ids_a_padded_vocab_adds():
    """With the logits of ids >= 90 raised by 1e4, an unrestricted argmax picks them; the
    tokenizer's vocab_size (90 of the model's 97) keeps every new id below it, greedy or sampled."""
    torch.manual_seed(0)
    model = GPT(tiny_model("gpt2")).eval()
    padded = torch.zeros(97)
    padded[90:] = 1e4
    model.lm_head.register_forward_hook(lambda module, args, out: out + padded)
    idx = torch.randint(0, 90, (2, 5))
    assert (model.generate(idx, 4, temperature=0)[:, 5:] >= 90).all()  # the padded ids do win unrestricted
    for kw in (dict(temperature=0), dict(temperature=1.0), dict(temperature=1.0, top_k=5)):
        out = model.generate(idx, 6, vocab_size=90, **kw)
        assert out[:, 5:].max() < 90, kw
