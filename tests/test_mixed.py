"""Learned mixed precision through train.py: STE on per-block int2/int3/int4 chosen by a bit budget.

A gaussws run is bf16 until pqt_start, PQT (b_t free per block) until ste_start, then STE on the
formats the budget chooses at that step from the blocks' b_t (auto-int) or their own error (error-int);
an ste[...] run chooses them by error at its pqt_start. The grid of each block is export.py's for its
format, the allocation is export.py's of that step's checkpoint, the exported model is the trained
one, and a run stopped at or after a switch resumes to the same losses on the same formats."""
import json
import os

import pytest
import torch

import checkpoint
import export as E
import gaussws
import phases
import sample
import train
import util
from configurator import ConfigError
from files import lowbit
from model import GPT, ROLES, ModelConfig
from quant import budget, grids, ste
from quant.formats import BY_NAME, FORMATS, block_weights
from conftest import untouched_state
from test_phase import curve, tiny, train_recording
from test_ste import assert_compiled_is_eager, random_weight
from util import UserError

E_R2 = gaussws.R_SECOND_MOMENT  # E[R^2] of each method's noise (Eq. 10): what budget's levels are matched to

PQT_START, STE_START, STEPS = 5, 10, 20
SHAPE = dict(n_embd=48)  # 48 = 32 + 16: every block Linear has partial edge blocks
RUNS = {  # the arms; "pqt" is the gaussws phase alone, the run "auto" is until its ste_start
    "pqt": dict(method="gaussws[all]", pqt_start=PQT_START, target_format="auto-int", bits_per_weight=2.75),
    "auto": dict(method="gaussws[all]", pqt_start=PQT_START, ste_start=STE_START, target_format="auto-int",
                 bits_per_weight=2.75),
    "error": dict(method="gaussws[all]", pqt_start=PQT_START, ste_start=STE_START, target_format="error-int",
                  bits_per_weight=3.25),
    "ste": dict(method="ste[all]", pqt_start=STE_START, target_format="error-int", bits_per_weight=3.0),
}
MIXED = ("auto", "error", "ste")  # the runs that train on per-block formats from step STE_START
CONFIG = ModelConfig(n_layer=2, n_head=2, n_embd=48, block_size=32, vocab_size=256)


@pytest.fixture(scope="module")
def data_dir(tiny_corpus):
    """conftest's corpus: Python-like text with structure to learn, byte tokens."""
    return tiny_corpus


def argv(data_dir, out_dir, name, **kw):
    return tiny(data_dir, out_dir, **{**SHAPE, **RUNS[name], **kw})


@pytest.fixture(scope="module")
def runs(data_dir, tmp_path_factory):
    """{name: (out_dir, {step: (model state, optimizer states)})} of every arm, uninterrupted."""
    out = {}
    for name in RUNS:
        d = tmp_path_factory.mktemp(name)
        out[name] = (d, train_recording(argv(data_dir, d, name)))
    return out


def format_ids(state):
    return {k[:-len(".format_ids")]: v for k, v in state.items() if k.endswith(".format_ids")}


def bits_of(ids):
    return torch.tensor([int(FORMATS[i].name[3:]) for i in ids.flatten().tolist()], dtype=torch.float64)


def exported(w, ids):
    """The weight export.py writes with these per-block format ids and reads back."""
    return lowbit.dequantize_weight(lowbit.quantize_weight("w", w, ids), *w.shape)


def as_int32(t):
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("shape", [(70, 45), (33, 97), (5, 3), (64, 32), (100, 130)])
def test_each_block_trains_on_exports_grid_for_its_own_format(shape):
    """int2/int3/int4 mixed over the blocks (edge blocks included) as export.py writes them, bit for bit,
    and the straight-through gradient: dL/dw is the gradient F.linear gives the fake-quantized weight."""
    w = random_weight(shape, seed=sum(shape))
    nb = (-(-shape[0] // 32), -(-shape[1] // 32))
    choice = torch.tensor([BY_NAME[f] for f in ("int2", "int3", "int4")], dtype=torch.uint8)
    ids = choice[torch.randint(0, 3, nb, generator=torch.Generator().manual_seed(1))]
    if ids.numel() > 1:
        ids.view(-1)[:2] = choice[[0, 2]]  # at least two formats in a weight of more than one block
    got = grids.fake_quantize_blocks(w, ids)
    assert torch.equal(as_int32(got), as_int32(exported(w, ids)))
    assert not torch.equal(got, w)

    layer = ste.STELinear(shape[1], shape[0], fmt="error-int", bits_per_weight=3.0)
    with torch.no_grad():
        layer.weight.copy_(w)
    layer.set_formats(ids)  # chosen already: TrainStep keeps them
    gen = torch.Generator().manual_seed(2)
    x, g = torch.randn(4, shape[1], generator=gen), torch.randn(4, shape[0], generator=gen)
    with gaussws.TrainStep(layer, 0):
        y = layer(x)
        y.backward(g)
    assert torch.equal(layer.format_ids, ids)
    w_q = exported(w, ids).requires_grad_()
    want = torch.nn.functional.linear(x, w_q, layer.bias)
    want.backward(g)
    assert torch.equal(y, want) and torch.equal(layer.weight.grad, w_q.grad)


def test_a_compiled_layer_trains_on_the_same_per_block_grid():
    layer = ste.STELinear(96, 70, fmt="error-int", bits_per_weight=3.0)
    layer.set_formats(torch.tensor([[BY_NAME["int2"], BY_NAME["int4"], BY_NAME["int3"]]] * 3, dtype=torch.uint8))
    assert_compiled_is_eager(layer, seed=3)


def test_the_mixed_run_is_the_gaussws_phase_run_bit_for_bit_until_ste_start(runs):
    (pqt_dir, pqt), (mixed_dir, mixed) = runs["pqt"], runs["auto"]
    a, b = curve(pqt_dir), curve(mixed_dir)
    assert [a[i] for i in range(1, STE_START + 1)] == [b[i] for i in range(1, STE_START + 1)]  # steps 0..9
    assert all(a[i] != b[i] for i in range(STE_START + 1, STEPS + 1))  # STE from step 10 on
    assert curve(pqt_dir, "lr") == curve(mixed_dir, "lr")
    for step in (PQT_START, STE_START):
        (w_pqt, opt_pqt), (w, opt) = pqt[step], mixed[step]
        assert set(w) - set(w_pqt) == set(k + ".format_ids" for k in format_ids(w))
        assert all(torch.equal(w[k], v) for k, v in w_pqt.items())  # weights and b_i, bit for bit
        assert all((v == budget.UNCHOSEN).all() for v in format_ids(w).values())  # nothing chosen before the switch
        (s_pqt, g_pqt), (s, g) = [(o[0]["state"], o[0]["param_groups"]) for o in (opt_pqt, opt)]
        assert g == g_pqt and s.keys() == s_pqt.keys()
        assert all(torch.equal(s[i][k], v) for i, st in s_pqt.items() for k, v in st.items())


def test_b_t_is_free_per_block_in_the_phase_and_fixed_from_ste_start(runs):
    """The budget's level b_target (int3's for 3.0) and b_init one bit above: b_t spreads over the blocks
    during PQT. From ste_start b_i gets no gradient, so AdamW leaves b_i and its state as they were."""
    mixed_dir, mixed = runs["auto"]
    with open(os.path.join(mixed_dir, "config.json")) as f:
        config = json.load(f)
    level = budget.budget_level(E_R2["gaussws"], 2.75)
    assert config["b_target"] == level and config["b_init"] == level + 1 and config["ste_start"] == STE_START
    lo, hi = curve(mixed_dir, "b_t/min"), curve(mixed_dir, "b_t/max")
    assert all(lo[i] == hi[i] == pytest.approx(level + 1, abs=1e-6) for i in range(1, PQT_START + 1))  # b_i = 1
    assert hi[STE_START] > lo[STE_START]  # the blocks took different b_t
    mean = curve(mixed_dir, "b_t/mean")
    assert all(mean[i] == mean[STE_START] for i in range(STE_START, STEPS + 1))
    (w10, opt10), (w20, opt20) = mixed[STE_START], mixed[STEPS]
    assert all(torch.equal(w20[k], v) for k, v in w10.items() if k.endswith(".b_i"))
    n_b_i = sum(k.endswith(".b_i") for k in w10)
    state10, state20 = opt10[0]["state"], opt20[0]["state"]
    ids = opt20[0]["param_groups"][-1]["params"]  # the b_i group, last
    assert len(ids) == n_b_i and all(torch.equal(state20[i]["exp_avg"], state10[i]["exp_avg"]) for i in ids)
    assert all(state20[i]["step"] == state10[i]["step"] for i in ids)
    weights = opt20[0]["param_groups"][0]["params"]
    assert all(state20[i]["step"] == STEPS for i in weights)  # the weights' AdamW went on


def export_files(out_dir, name, capsys):
    """export.py of a run at its own target_format and budget: {layer weight: the file's tensors}."""
    from safetensors.torch import load_file
    fmt, allowed = RUNS[name]["target_format"], RUNS[name]["bits_per_weight"]
    assert util.cli(E.main, [f"--out_dir={out_dir}", f"--format={fmt}", f"--bits_per_weight={allowed}",
                             "--other_dtype=float32", "--evaluate=False", "--plot=False", "--overwrite=True"]) == 0
    printed = capsys.readouterr().out
    return load_file(str(out_dir / f"model-{fmt}.safetensors")), printed


def meets_the_budget(ids, shapes, allowed):
    """The bits spent are within the budget, and short of it by less than one block's upgrade."""
    weights = torch.cat([block_weights(*shapes[k]).flatten() for k in ids])
    bits = torch.cat([bits_of(v) for v in ids.values()])
    spent, total = (bits * weights).sum().item(), weights.sum().item()
    return allowed * total - weights.max().item() < spent <= allowed * total


@pytest.mark.parametrize("name", MIXED)
def test_the_allocation_at_the_switch_is_exports_budget_of_that_steps_checkpoint(runs, data_dir, tmp_path, name,
                                                                                 capsys):
    """A run stopped at the switch leaves the checkpoint of that step, its formats not chosen yet:
    export.py's --bits_per_weight of it is the allocation the resumed run trains on, as the uninterrupted
    one did; it meets the budget; and the resumed run repeats the uninterrupted losses."""
    train.main(argv(data_dir, tmp_path, name, max_iters=STE_START))
    at_switch = checkpoint.load_model(str(tmp_path / "ckpt.pt"))["model"]
    assert all((v == budget.UNCHOSEN).all() for v in format_ids(at_switch).values())
    files, _ = export_files(tmp_path, name, capsys)
    train.main(argv(data_dir, tmp_path, name, init_from="resume"))
    whole_dir, whole = runs[name]
    assert curve(tmp_path) == curve(whole_dir) and curve(tmp_path, "val/loss") == curve(whole_dir, "val/loss")
    trained = format_ids(checkpoint.load_model(str(tmp_path / "ckpt.pt"))["model"])
    uninterrupted = format_ids(whole[STEPS][0])
    assert trained.keys() == uninterrupted.keys() and len(trained) == 8  # every block Linear of both layers
    for layer, ids in trained.items():
        assert torch.equal(ids, files[layer + ".weight.format"]) and torch.equal(ids, uninterrupted[layer])
    shapes = {k: at_switch[k + ".weight"].shape for k in trained}
    allowed = RUNS[name]["bits_per_weight"]
    assert meets_the_budget(trained, shapes, allowed)
    if allowed != int(allowed):  # a fractional budget cannot be one format
        assert len({i for v in trained.values() for i in v.flatten().tolist()}) >= 2
    if RUNS[name]["target_format"] == "auto-int":  # by b_t: of two whole blocks, the higher b_t has no fewer bits
        level = budget.budget_level(E_R2["gaussws"], allowed)
        b_t = torch.cat([level + at_switch[k + ".b_i"].double().flatten() * 1.0 for k in trained])  # Eq. 11
        bits = torch.cat([bits_of(v) for v in trained.values()])
        whole_block = torch.cat([block_weights(*shapes[k]).flatten() == 1024 for k in trained])
        b_t, bits = b_t[whole_block], bits[whole_block]
        assert not ((b_t[:, None] < b_t[None, :]) & (bits[:, None] > bits[None, :])).any()
        assert bits.unique().numel() >= 2


@pytest.mark.parametrize("name", MIXED)
def test_the_exported_model_is_the_trained_one(runs, name, capsys):
    """export.py at the run's own target_format and budget writes each block in the format it trained on,
    and its model computes what the trained model computed in its last training step, bit for bit."""
    out_dir, run = runs[name]
    files, printed = export_files(out_dir, name, capsys)
    master = run[STEPS][0]
    kw = dict(RUNS[name])
    method, fmt, allowed = kw.pop("method"), kw.pop("target_format"), kw.pop("bits_per_weight")
    with open(out_dir / "config.json") as f:
        config = json.load(f)
    trained = gaussws.convert(GPT(CONFIG), method, ROLES["gpt2"], b_init=config["b_init"], b_target=config["b_target"],
                              start=kw["pqt_start"], ste_start=kw.get("ste_start", 0), fmt=fmt,
                              bits_per_weight=allowed, seed=7)
    trained.load_state_dict(master)  # strict: the run's state is the converted model's
    exported_model, _ = lowbit.load(str(out_dir / f"model-{fmt}.safetensors"))
    for layer, ids in format_ids(master).items():
        assert torch.equal(files[layer + ".weight.format"], ids)
        assert torch.equal(exported_model.get_submodule(layer).weight, exported(master[layer + ".weight"], ids))
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), gaussws.TrainStep(trained.train(), STEPS):
        logits = trained(x, x)[0]
    assert torch.equal(exported_model(x, x)[0], logits)
    assert not torch.equal(trained.eval()(x, x)[0], logits)  # eval mode: the FP32 master weights
    assert "the per-block formats the run trained on" in printed


@pytest.mark.parametrize("name, stop", [("auto", PQT_START), ("auto", 15), ("ste", 15)])
def test_a_run_stopped_at_or_after_a_switch_resumes_on_the_formats_chosen_at_it(runs, data_dir, tmp_path, name,
                                                                                stop):
    """The same losses as the uninterrupted run; after ste_start the formats are the saved ones, never
    chosen again (the allocation is not called)."""
    train.main(argv(data_dir, tmp_path, name, max_iters=stop))
    with pytest.MonkeyPatch.context() as mp:
        if stop > STE_START:
            mp.setattr(budget, "budget_format_ids", lambda *a: pytest.fail("the formats were chosen again"))
        train.main(argv(data_dir, tmp_path, name, init_from="resume"))
    whole_dir, whole = runs[name]
    assert curve(tmp_path) == curve(whole_dir) and curve(tmp_path, "val/loss") == curve(whole_dir, "val/loss")
    assert len(curve(tmp_path)) == STEPS
    ckpt = checkpoint.load_model(str(tmp_path / "ckpt.pt"))
    assert all(torch.equal(v, format_ids(whole[STEPS][0])[k]) for k, v in format_ids(ckpt["model"]).items())
    assert {k: ckpt["pqt"][k] for k in ("ste_start", "bits_per_weight")} == \
        {"ste_start": RUNS[name].get("ste_start", 0.0), "bits_per_weight": RUNS[name]["bits_per_weight"]}
    before = untouched_state(tmp_path / "ckpt.pt")
    other = dict(bits_per_weight=3.5) if name == "ste" else dict(ste_start=12)
    with pytest.raises(UserError, match="bits_per_weight: checkpoint 3.0, config 3.5" if name == "ste" else
                       r"ste_start: checkpoint 10\.0, config 12\.0"):
        train.main(argv(data_dir, tmp_path, name, init_from="resume", **other))
    assert untouched_state(tmp_path / "ckpt.pt") == before


def test_a_new_run_from_another_runs_weights_chooses_its_own_formats(runs, data_dir, tmp_path):
    """init_from takes weights (and b_i), never a budget's format_ids: nothing is chosen before the new
    run's switch, from a checkpoint whose formats were chosen and from one that has none."""
    for source in ("auto", "pqt"):
        saved = train_recording(argv(data_dir, tmp_path / source, "auto", init_from=str(runs[source][0] / "ckpt.pt"),
                                     max_iters=PQT_START))
        assert all((v == budget.UNCHOSEN).all() for v in format_ids(saved[PQT_START][0]).values())


@pytest.mark.parametrize("name", ["auto", "ste"])
def test_sample_and_hf_read_a_mixed_runs_checkpoint(runs, name, tmp_path):
    """sample.py rebuilds the run's model (its layers hold format_ids); hf.py writes its weights alone."""
    from files import pretrained
    model, ckpt = sample.load_checkpoint(str(runs[name][0]), "cpu")
    assert all(torch.equal(v, ckpt["model"][k]) for k, v in model.state_dict().items())
    assert format_ids(model.state_dict()).keys() == format_ids(ckpt["model"]).keys() != set()
    files, _ = pretrained.save_pretrained(ckpt["model_args"], ckpt["model"], str(tmp_path / "hf"))
    assert "model.safetensors" in files


@pytest.mark.parametrize("args, message", [
    (dict(pqt_start=10, ste_start=5), r"ste_start=5 \(step 5\) must come after pqt_start=10 \(step 10\)"),
    (dict(pqt_start=10, ste_start=10), r"ste_start=10 \(step 10\) must come after pqt_start=10"),
    (dict(pqt_start=0.5, ste_start=0.25), r"ste_start=0\.25 \(step 5\) must come after pqt_start=0\.5 \(step 10\)"),
    (dict(ste_start=10, target_format="int3", bits_per_weight=0.0),
     r"ste_start=10 trains on per-block formats a bit budget chooses .* not target_format='int3'"),
    (dict(ste_start=10, target_format="", bits_per_weight=0.0), r"ste_start=10 trains on per-block formats"),
    (dict(bits_per_weight=4.5), r"bits_per_weight=4\.5: expected a mean of 2 to 4 element bits per weight"),
    (dict(bits_per_weight=1.5), r"bits_per_weight=1\.5: expected a mean of 2 to 4"),
    (dict(bits_per_weight=0.0), r"bits_per_weight=0: expected a mean of 2 to 4 .* for target_format='auto-int'"),
    (dict(target_format="int3"),
     r"bits_per_weight=3 is for target_format auto-int or error-int .* not target_format='int3'"),
    (dict(method="ste[all]", target_format="error-int", ste_start=15),
     r"an ste\[\.\.\.\] run is STE from pqt_start on"),
    (dict(method="ste[all]", target_format="auto-int", ste_start=0),
     r"auto-int' ranks blocks by their learned b_t, and method ste"),
    (dict(method="bf16", target_format="", ste_start=15, pqt_start=0, bits_per_weight=0.0),
     r"ste_start=15 is for a method"),
    (dict(ste_start=1.5), r"ste_start=1\.5: expected 0 \(no STE phase\), a fraction"),
])
def test_a_bad_mixed_run_is_one_line_before_anything_is_written(data_dir, tmp_path, args, message):
    out = tmp_path / "out"
    kw = dict(method="gaussws[all]", pqt_start=5, ste_start=10, target_format="auto-int", bits_per_weight=3.0)
    with pytest.raises(ConfigError, match=message) as e:
        train.main(tiny(data_dir, out, **{**kw, **args}))
    assert "\n" not in str(e.value) and not out.exists()


def test_the_budgets_level_is_int3s_at_3_bits_and_b_init_is_one_bit_above_in_a_phase():
    c = dict(pqt_start=0.5, ste_start=0.75, max_iters=200, target_format="auto-int", bits_per_weight=3.0,
             b_init=6.0, b_target=4.0)
    level = budget.matched_b_t(E_R2["gaussws"], "int3")
    assert phases.phase_settings("gaussws", c) == dict(pqt_start=100.0, ste_start=150.0, b_init=level + 1,
                                                      b_target=level)
    assert phases.phase_settings("gaussws", c, explicit={"b_init"})["b_init"] == 6.0
    assert phases.phase_settings("gaussws", dict(c, pqt_start=0.0))["b_init"] == 6.0  # from scratch: the paper's
    assert phases.phase_settings("ste", dict(c, ste_start=0.0, target_format="error-int")) == \
        dict(pqt_start=100.0, ste_start=0.0, b_init=6.0, b_target=4.0)
    for method in ("gaussws", "diffq"):
        int2, int3, int4 = (budget.matched_b_t(E_R2[method], f"int{b}") for b in (2, 3, 4))
        assert [budget.budget_level(E_R2[method], b) for b in (2.0, 3.0, 4.0)] == [int2, int3, int4]
        assert budget.budget_level(E_R2[method], 3.5) == pytest.approx((int3 + int4) / 2, abs=0.005)
        assert budget.budget_level(E_R2[method], 2.25) == pytest.approx(int2 + (int3 - int2) / 4, abs=0.005)
