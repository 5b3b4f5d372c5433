"""A PQT or STE phase through train.py (--pqt_start): the bf16 run bit for bit until the switch, then
the method on those weights with the same optimizer state; exact resume across and after the switch;
b_t's level for a target format; an STE run exports as it was trained."""
import copy
import json
import math
import os
import re
import shlex

import numpy as np
import pytest
import torch

import checkpoint
import export as E
import gaussws
import phases
import train
import util
from configurator import ConfigError
from data import loader
from files import lowbit
from model import GPT, ROLES, ModelConfig
from quant import budget, grids, ste
from util import UserError
from conftest import untouched_state

E_R2 = gaussws.R_SECOND_MOMENT  # E[R^2] of each method's noise (Eq. 10): what budget's levels are matched to

START, STEPS = 10, 20
PHASES = {"gaussws": dict(method="gaussws[all]", target_format="int3"),
          "ste": dict(method="ste[all]", target_format="int3")}


@pytest.fixture(scope="module")
def data_dir(tiny_corpus):
    """conftest's corpus: Python-like text with structure to learn, byte tokens."""
    return tiny_corpus


def tiny(data_dir, out_dir, **kw):
    """A 2-layer GPT2 of 20 steps in FP32 (the same arithmetic on any CPU), evaluated and saved every 5."""
    args = dict(dataset=data_dir, out_dir=str(out_dir), n_layer=2, n_head=2, n_embd=64, block_size=32,
                batch_size=8, max_iters=STEPS, eval_interval=5, log_interval=1, eval_iters=2, warmup_iters=5,
                lr_decay_iters=STEPS, learning_rate=3e-3, device="cpu", dtype="float32", seed=7)
    args.update(kw)
    return [f"--{k}={v}" for k, v in args.items()]


def one_line(argv, capsys):
    """train.py's command line as a user meets it (util.cli): exit status 1 and one line on stderr."""
    capsys.readouterr()
    assert util.cli(train.main, argv) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    return err.strip()


def records(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def curve(out_dir, key="loss"):
    return {r["iter"]: r[key] for r in records(out_dir) if key in r}


def train_recording(argv):
    """train.main(argv) and {step: (model state, optimizer states)} of every checkpoint it wrote."""
    saved, save = {}, checkpoint.save_run

    def recording(out_dir, state, model, optimizers, sharded=False):
        saved[state["iter_num"]] = copy.deepcopy((model.state_dict(), [o.state_dict() for o in optimizers]))
        return save(out_dir, state, model, optimizers, sharded)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checkpoint, "save_run", recording)
        train.main(argv)
    return saved


@pytest.fixture(scope="module")
def runs(data_dir, tmp_path_factory):
    """The bf16 run and, from the same seed, each phase run switching at step START; {name: (dir, saved)}."""
    out = {}
    for name, kw in [("bf16", dict(method="bf16"))] + [(k, dict(v, pqt_start=START)) for k, v in PHASES.items()]:
        d = tmp_path_factory.mktemp(name)
        out[name] = (d, train_recording(tiny(data_dir, d, **kw)))
    return out


@pytest.mark.parametrize("phase", PHASES)
def test_phase_run_is_the_bf16_run_bit_for_bit_until_the_switch(runs, phase):
    (bf16_dir, bf16), (phase_dir, run) = runs["bf16"], runs[phase]
    a, b = curve(bf16_dir), curve(phase_dir)
    assert [a[i] for i in range(1, START + 1)] == [b[i] for i in range(1, START + 1)]  # losses of steps 0..START-1
    assert all(a[i] != b[i] for i in range(START + 1, STEPS + 1))  # the method from step START on
    assert curve(bf16_dir, "lr") == curve(phase_dir, "lr")  # one schedule over the whole run
    for key in ("val/loss", "train/loss"):
        assert {i: v for i, v in curve(bf16_dir, key).items() if i <= START} == \
               {i: v for i, v in curve(phase_dir, key).items() if i <= START}
    for step in (5, START):
        (w_bf16, opt_bf16), (w, opt) = bf16[step], run[step]
        assert all(torch.equal(w[k], v) for k, v in w_bf16.items())  # the same weights, bit for bit
        assert all(torch.equal(v, torch.ones_like(v)) for k, v in w.items() if k.endswith(".b_i"))  # untouched
        assert set(w) - set(w_bf16) == {k for k in w if k.endswith(".b_i")}
        # the same AdamW state for the same parameters, in the same groups and order; none for b_i yet
        (state_bf16, groups_bf16), (state, groups) = [(o[0]["state"], o[0]["param_groups"]) for o in (opt_bf16, opt)]
        assert groups[:2] == groups_bf16 and len(groups) == (3 if phase == "gaussws" else 2)
        assert state.keys() == state_bf16.keys()
        assert all(torch.equal(state[i][k], v) for i, s in state_bf16.items() for k, v in s.items())


def test_phase_b_t_starts_at_the_level_matched_to_the_target_format_and_stays(runs):
    phase_dir, run = runs["gaussws"]
    level = budget.matched_b_t(E_R2["gaussws"], "int3")
    with open(os.path.join(phase_dir, "config.json")) as f:
        config = json.load(f)
    assert config["pqt_start"] == START and config["b_init"] == config["b_target"] == level == 3.49
    b_t = curve(phase_dir, "b_t/mean")
    assert all(v == pytest.approx(level, abs=1e-6) for v in b_t.values())
    trained = run[STEPS][0]
    assert any(not torch.equal(v, torch.ones_like(v)) for k, v in trained.items() if k.endswith(".b_i"))


def first_step_loss(model, data_dir, step):
    """The loss of the training batch of `step` (train.py's micro-batch 0) through `model` in training mode."""
    meta = loader.read_meta(data_dir)
    data = loader.open_split(data_dir, "train", meta, 32)
    x, y = loader.get_batch(data, (7, "train", step, 0), batch_size=8, block_size=32, device="cpu")
    with torch.no_grad(), gaussws.TrainStep(model.train(), step):
        return model(x, y)[1].item()


def test_the_first_noisy_step_is_eq3_of_a_freshly_converted_model_on_the_bf16_weights(runs, data_dir):
    (_, bf16), (phase_dir, _) = runs["bf16"], runs["gaussws"]
    config = ModelConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=256)
    level = budget.matched_b_t(E_R2["gaussws"], "int3")
    model = gaussws.convert(GPT(config), "gaussws[all]", ROLES["gpt2"], b_init=level, b_target=level, seed=7)
    gaussws.load_weights(model, bf16[START][0])  # b_i as the converter makes them: 1
    assert first_step_loss(model, data_dir, START) == curve(phase_dir)[START + 1]


def test_the_first_ste_step_is_the_bf16_weights_on_exports_grid(runs, data_dir):
    """By independent means: a plain model holding the bf16 weights as export.py writes them in int3."""
    (_, bf16), (phase_dir, _) = runs["bf16"], runs["ste"]
    state = dict(bf16[START][0])
    for key, value in state.items():
        if key.startswith("transformer.h.") and key.endswith(".weight") and value.dim() == 2:
            blocks = (-(-value.shape[0] // 32), -(-value.shape[1] // 32))
            ids = torch.full(blocks, lowbit.BY_NAME["int3"], dtype=torch.uint8)
            state[key] = lowbit.dequantize_weight(lowbit.quantize_weight(key, value, ids), *value.shape)
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=256))
    model.load_state_dict(state)
    assert first_step_loss(model, data_dir, START) == curve(phase_dir)[START + 1]


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("stop", [START, 15])  # at the switch (its checkpoint has had no noisy step), after it
def test_a_phase_run_stopped_and_resumed_repeats_the_uninterrupted_losses(runs, data_dir, tmp_path, phase, stop):
    kw = dict(PHASES[phase], pqt_start=START)
    train.main(tiny(data_dir, tmp_path, max_iters=stop, **kw))
    train.main(tiny(data_dir, tmp_path, init_from="resume", **kw))
    whole = runs[phase][0]
    assert curve(tmp_path) == curve(whole) and curve(tmp_path, "val/loss") == curve(whole, "val/loss")
    assert len(curve(tmp_path)) == STEPS


def test_pqt_start_as_a_fraction_is_a_step_of_max_iters_and_resume_holds_it(runs, data_dir, tmp_path):
    kw = PHASES["ste"]
    train.main(tiny(data_dir, tmp_path, pqt_start=START / STEPS, **kw))
    assert curve(tmp_path) == curve(runs["ste"][0])
    before = untouched_state(tmp_path / "ckpt.pt")
    with pytest.raises(UserError, match=r"pqt_start: checkpoint 10\.0, config 15\.0"):  # checkpoint.resume
        train.main(tiny(data_dir, tmp_path, pqt_start=START / STEPS, max_iters=30, init_from="resume", **kw))
    assert untouched_state(tmp_path / "ckpt.pt") == before


@pytest.mark.parametrize("args, message", [
    (dict(method="bf16", pqt_start=0.5), r"pqt_start=0\.5 is for a method .* but method is bf16"),
    (dict(method="bf16", target_format="int3"), r"target_format='int3' is for a method .* but method is bf16"),
    (dict(method="ste[all]"), r"ste\[\.\.\.\] needs --target_format"),
    (dict(method="ste[all]", target_format="int9"), r"target format 'int9': expected one of int2, .*mxfp4"),
    (dict(method="gaussws[all]", target_format="fp16"), r"target format 'fp16'"),
    (dict(pqt_start=1.5), r"pqt_start=1\.5: expected 0 .* a fraction in \(0, 1\) of max_iters, or a whole step"),
    (dict(pqt_start=-0.5), r"pqt_start=-0\.5: expected"),
    (dict(target_format="int3", b_target=3.0), r"b_target=3 and target_format='int3' both set"),
])
def test_a_bad_phase_is_one_line_before_anything_is_written(data_dir, tmp_path, args, message, capsys):
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=message):
        train.main(tiny(data_dir, out, **args))
    assert re.search(message, one_line(tiny(data_dir, out, **args), capsys))
    assert not out.exists()


@pytest.mark.parametrize("args, message", [
    (dict(pqt_start=25), r"pqt_start=25 is at or past max_iters=20: the run would end before its switch and "
                         r"train bf16 throughout"),
    (dict(pqt_start=20), r"pqt_start=20 is at or past max_iters=20"),
    (dict(pqt_start=0.99), r"pqt_start=0\.99 \(step 20\) is at or past max_iters=20"),
    (dict(method="ste[all]", pqt_start=20), r"pqt_start=20 is at or past max_iters=20"),
    (dict(pqt_start=5, ste_start=30, target_format="auto-int", bits_per_weight=3.0),
     r"ste_start=30 is at or past max_iters=20: the run would end before its switch and train PQT throughout"),
])
def test_a_switch_the_run_never_reaches_is_refused_in_one_line(data_dir, tmp_path, args, message, capsys):
    """A run whose switch is at or past its end (max_iters, lr_decay_iters here too) would train
    what it switches from throughout, yet record the method it names: refused, nothing written."""
    out = tmp_path / "out"
    line = one_line(tiny(data_dir, out, **{**PHASES["gaussws"], **args}), capsys)
    assert re.search(message, line) and "lr_decay_iters" in line, line
    assert not out.exists()


def test_a_run_stopped_before_its_switch_says_so_and_resumed_it_trains_the_method(runs, data_dir, tmp_path, capsys):
    """max_iters before the switch, but the schedule set for the whole run (lr_decay_iters past the
    switch): the first part of a longer run. It says that it stops before its switch, trains bf16, and
    resumed to the whole run's max_iters it is the uninterrupted phase run, loss for loss."""
    kw = dict(PHASES["gaussws"], pqt_start=START)
    train.main(tiny(data_dir, tmp_path, max_iters=START - 5, **kw))  # stopped at an evaluation
    out = capsys.readouterr().out
    assert (f"note: pqt_start={START} is at or past max_iters={START - 5}: this run stops before its switch, bf16 "
            f"throughout; resume it (--init_from=resume) with max_iters up to lr_decay_iters={STEPS}") in out
    bf16 = curve(runs["bf16"][0])
    assert curve(tmp_path) == {i: bf16[i] for i in range(1, START - 4)}
    train.main(tiny(data_dir, tmp_path, init_from="resume", **kw))
    whole = runs["gaussws"][0]
    assert curve(tmp_path) == curve(whole) and curve(tmp_path, "val/loss") == curve(whole, "val/loss")


def test_phase_settings_resolve_the_start_and_b_t():
    c = dict(pqt_start=0.85, max_iters=200, target_format="int3", b_init=6.0, b_target=4.0)
    assert phases.phase_settings("gaussws", c) == dict(pqt_start=170.0, ste_start=0.0, b_init=3.49, b_target=3.49)
    assert phases.phase_settings("gaussws", c, explicit={"b_init"}) == \
        dict(pqt_start=170.0, ste_start=0.0, b_init=6.0, b_target=3.49)
    scratch = dict(c, pqt_start=0.0)  # the paper's way: b_t from b_init pulled to the level
    assert phases.phase_settings("diffq", scratch) == dict(pqt_start=0.0, ste_start=0.0, b_init=6.0, b_target=2.58)
    assert phases.phase_settings("gaussws", dict(c, pqt_start=170, target_format="")) == \
        dict(pqt_start=170.0, ste_start=0.0, b_init=6.0, b_target=4.0)
    assert phases.phase_settings("ste", dict(c, pqt_start=0.5)) == \
        dict(pqt_start=100.0, ste_start=0.0, b_init=6.0, b_target=4.0)


def test_matched_b_t_gives_pqn_the_variance_of_the_int_grids_rounding_error():
    """For int-b, rounding error ~ U(-step/2, step/2) with step = max_bl / L: PQN variance E[R^2] max_bl^2
    4^(1 - b_t) = max_bl^2 / (12 L^2) at b_t = log2(L) + log2(48 E[R^2]) / 2; E[R^2] of the kernels' R."""
    for method in ("gaussws", "diffq"):
        r = gaussws.sample_r((1024, 512), seed=3, method=method, backend="torch").double()
        second_moment = r.square().mean().item()
        assert second_moment == pytest.approx(gaussws.R_SECOND_MOMENT[method], rel=0.01)
        for bits in (3, 4, 8):
            levels = 2 ** (bits - 1) - 1
            closed = math.log2(levels) + 0.5 * math.log2(48 * second_moment)
            assert budget.matched_b_t(E_R2[method], f"int{bits}") == pytest.approx(closed, abs=0.02)
    assert gaussws.R_SECOND_MOMENT["gaussws"] == 2 * (0.75 * 2 ** -9 * 4 + 9 / 64 * (1 - 0.75 * 2 ** -8))


def test_an_ste_run_exports_as_it_was_trained(runs, data_dir, capsys):
    """export.py's int3 file holds the STE's trained weights, and its model computes what the trained
    model computed in its last training step (no noise, no dropout: the same logits, bit for bit)."""
    phase_dir, run = runs["ste"]
    assert util.cli(E.main, [f"--out_dir={phase_dir}", "--format=int3", "--other_dtype=float32",
                             "--evaluate=False"]) == 0
    exported, _ = lowbit.load(str(phase_dir / "model-int3.safetensors"))
    master = run[STEPS][0]
    config = ModelConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=256)
    trained = gaussws.convert(GPT(config), "ste[all]", ROLES["gpt2"], fmt="int3")
    trained.load_state_dict(master)
    for name, layer in trained.named_modules():
        if isinstance(layer, ste.STELinear):
            assert torch.equal(exported.get_submodule(name).weight, grids.fake_quantize(layer.weight, "int3"))
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), gaussws.TrainStep(trained.train(), STEPS):
        logits = trained(x, x)[0]  # with targets: the logits of every position
    assert torch.equal(exported(x, x)[0], logits)
    assert not torch.equal(trained.eval()(x, x)[0], logits)  # eval mode: the FP32 master weights


def test_ste_from_the_first_step_learns(data_dir, tmp_path):
    train.main(tiny(data_dir, tmp_path, method="ste[all]", target_format="int4", max_iters=30, lr_decay_iters=30))
    losses = curve(tmp_path)
    assert np.mean([losses[i] for i in (28, 29, 30)]) < np.mean([losses[i] for i in (1, 2, 3)]) - 1.0


def test_a_run_ends_with_the_export_that_measures_its_model_beside_its_master_weights_val_loss(data_dir, tmp_path,
                                                                                              capsys):
    """train.py's val losses are the master weights' (eval mode: no noise, no rounding). A PQT or STE run's last
    line says so and gives export.py's command for the model it trained toward; that command, run as printed,
    measures the run's last val loss as the unquantized one and the int3 model's beside it. A bf16 run has no
    such line."""
    capsys.readouterr()
    train.main(tiny(data_dir, tmp_path / "ste", method="ste[all]", target_format="int3", max_iters=10,
                    lr_decay_iters=10))
    last = capsys.readouterr().out.strip().splitlines()[-1]
    command = f"python export.py --out_dir={tmp_path / 'ste'} --format=int3"
    assert last == f"val losses: of the master weights; the int3 model export writes: {command}"
    summary = tmp_path / "export.json"
    assert util.cli(E.main, [*command.split()[2:], f"--json={summary}"]) == 0
    (measured,) = json.loads(summary.read_text())["exports"]
    assert measured["val_loss_unquantized"] == pytest.approx(curve(tmp_path / "ste", "val/loss")[10], rel=1e-6)
    assert measured["val_loss"] != pytest.approx(measured["val_loss_unquantized"], rel=1e-6)
    train.main(tiny(data_dir, tmp_path / "bf16", method="bf16", max_iters=5, lr_decay_iters=5))
    assert "val losses: " not in capsys.readouterr().out


def test_the_export_command_of_a_runs_last_line_gives_its_budget_exactly_and_its_directory_quoted():
    """export takes a run's own bit budget only exactly: 3.16666667 printed with 6 digits would be refused."""
    c = dict(method="gaussws[all]", target_format="auto-gguf", bits_per_weight=3.16666667, out_dir="out/a run")
    (line,) = train.exported_hint(c)
    argv = shlex.split(line.split(": ", 2)[2])
    assert argv[:3] == ["python", "export.py", "--out_dir=out/a run"]
    assert argv[3:] == ["--format=auto-gguf", "--bits_per_weight=3.16666667"]
    assert float(argv[4].split("=")[1]) == c["bits_per_weight"]


@pytest.fixture(scope="module")
def trunk(data_dir, tmp_path_factory):
    """The bf16 run stopped at the switch step (its schedule still that of STEPS): its ckpt.pt is the
    one a phase run forks from (--fork_from)."""
    d = tmp_path_factory.mktemp("trunk")
    train.main(tiny(data_dir, d, method="bf16", max_iters=START))
    return d


@pytest.mark.parametrize("phase", PHASES)
def test_a_phase_run_forked_from_the_bf16_run_at_its_switch_is_the_whole_phase_run(runs, trunk, data_dir, tmp_path,
                                                                                   phase):
    """Until its switch a phase run is the bf16 run, so one that continues the bf16 run's checkpoint of
    that step (weights, AdamW state, step, RNG) has every loss and the final weights of the whole run."""
    whole_dir, whole = runs[phase]
    forked = train_recording(tiny(data_dir, tmp_path, **PHASES[phase], pqt_start=START,
                                  fork_from=os.path.join(trunk, "ckpt.pt")))
    for key in ("loss", "train/loss", "val/loss"):
        assert curve(tmp_path, key) == {k: v for k, v in curve(whole_dir, key).items()}, key
    model, optimizer = forked[STEPS]
    for k, v in whole[STEPS][0].items():
        assert torch.equal(model[k], v), k
    assert same_state(optimizer, whole[STEPS][1])  # the AdamW state, b_i's group included


def same_state(a, b):
    """Whether two optimizer state dicts (or lists of them) hold the same keys, settings and tensors, the
    tensors bit for bit (their printed form rounds and elides: it would hide a changed moment)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and \
            torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("kw, message", [
    (dict(learning_rate=1e-3), "other settings"),  # a run that is not this one's bf16 run
    (dict(pqt_start=START - 1), "at step 10"),  # the bf16 run past the switch
    (dict(init_from="TRUNK"), "goes with --init_from=scratch"),  # a fork is a new run, not init_from's weights
])
def test_a_fork_from_another_run_or_past_the_switch_is_one_line(trunk, data_dir, tmp_path, kw, message, capsys):
    kw = {k: os.path.join(trunk, "ckpt.pt") if v == "TRUNK" else v for k, v in kw.items()}
    args = tiny(data_dir, tmp_path, **{**PHASES["gaussws"], "pqt_start": START,
                                       "fork_from": os.path.join(trunk, "ckpt.pt"), **kw})
    with pytest.raises(UserError, match=message):  # train.py's config check, or checkpoint.read_fork's
        train.main(args)
    assert message in one_line(args, capsys)
    assert not os.path.exists(tmp_path / "ckpt.pt") and not os.path.exists(tmp_path / "metrics.jsonl")


def test_a_fork_from_a_phase_run_is_one_line(runs, data_dir, tmp_path, capsys):
    d, _ = runs["ste"]
    args = tiny(data_dir, tmp_path, **PHASES["gaussws"], pqt_start=STEPS, max_iters=STEPS + 5,
                fork_from=os.path.join(d, "ckpt.pt"))
    with pytest.raises(UserError, match="forks from a bf16 run"):
        train.main(args)
    assert "forks from a bf16 run" in one_line(args, capsys)


# --- end to end: a diffq phase, and Llama2's phase, STE and mixed runs --------------------------------
# Each proves what a phase is: the bf16 run of the same seed bit for bit until its switch (losses,
# weights, AdamW state), the method from the switch (its first step computed here by other means), and
# a model that export.py writes and loads as it was trained.

LLAMA = dict(arch="llama2", n_layer=2, n_head=2, n_kv_head=1, n_embd=48, ffn_hidden=80)  # GQA, partial blocks
LLAMA_CONFIG = ModelConfig(block_size=32, vocab_size=256, **LLAMA)
MIXED = dict(method="gaussws[all]", pqt_start=5, ste_start=START, target_format="error-int", bits_per_weight=3.25)


def same_until(switch, bf16_dir, bf16, phase_dir, run):
    """The phase run is the bf16 run bit for bit until `switch` (losses, evaluations, weights, the
    weights' AdamW state) and another run from there."""
    a, b = curve(bf16_dir), curve(phase_dir)
    assert [a[i] for i in range(1, switch + 1)] == [b[i] for i in range(1, switch + 1)]
    assert all(a[i] != b[i] for i in range(switch + 1, STEPS + 1))
    assert {i: v for i, v in curve(bf16_dir, "val/loss").items() if i <= switch} == \
           {i: v for i, v in curve(phase_dir, "val/loss").items() if i <= switch}
    (w_bf16, opt_bf16), (w, opt) = bf16[switch], run[switch]
    assert all(torch.equal(w[k], v) for k, v in w_bf16.items())
    assert set(w) - set(w_bf16) == {k for k in w if k.endswith((".b_i", ".format_ids"))}
    state_bf16, state = opt_bf16[0]["state"], opt[0]["state"]
    assert state.keys() == state_bf16.keys()
    assert all(torch.equal(state[i][k], v) for i, s in state_bf16.items() for k, v in s.items())


def export_and_load(run_dir, fmt, budget=0.0):
    """export.py's file of the run at fmt (and budget) through its command line, loaded back."""
    args = [f"--out_dir={run_dir}", f"--format={fmt}", "--other_dtype=float32", "--evaluate=False",
            "--plot=False", "--overwrite=True"] + ([f"--bits_per_weight={budget}"] if budget else [])
    assert util.cli(E.main, args) == 0
    return lowbit.load(str(run_dir / f"model-{fmt}.safetensors"))[0]


def test_a_diffq_phase_is_the_bf16_run_then_eq3_with_uniform_noise_and_exports(runs, data_dir, tmp_path):
    (bf16_dir, bf16) = runs["bf16"]
    run = train_recording(tiny(data_dir, tmp_path, method="diffq[all]", target_format="int3", pqt_start=START))
    same_until(START, bf16_dir, bf16, tmp_path, run)
    level = budget.matched_b_t(E_R2["diffq"], "int3")
    assert level == 2.58 and all(v == pytest.approx(level, abs=1e-6) for v in curve(tmp_path, "b_t/mean").values())
    config = ModelConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=256)
    model = gaussws.convert(GPT(config), "diffq[all]", ROLES["gpt2"], b_init=level, b_target=level, seed=7)
    gaussws.load_weights(model, bf16[START][0])
    assert first_step_loss(model, data_dir, START) == curve(tmp_path)[START + 1]  # Eq. 3, U(-1/2, 1/2) noise
    exported, master = export_and_load(tmp_path, "int3"), run[STEPS][0]
    for name in gaussws.method_linears(GPT(config), "diffq[all]", ROLES["gpt2"]):
        assert torch.equal(exported.get_submodule(name).weight, grids.fake_quantize(master[name + ".weight"], "int3"))


@pytest.fixture(scope="module")
def llama_runs(data_dir, tmp_path_factory):
    """Llama2's bf16 run and, from the same seed, its gaussws and STE phases from START and a mixed
    run (gaussws from 5, STE from START on the per-block formats of a 3.25-bit budget)."""
    out = {}
    for name, kw in [("bf16", dict(method="bf16")), ("gaussws", dict(PHASES["gaussws"], pqt_start=START)),
                     ("ste", dict(PHASES["ste"], pqt_start=START)), ("mixed", MIXED)]:
        d = tmp_path_factory.mktemp(f"llama_{name}")
        out[name] = (d, train_recording(tiny(data_dir, d, **LLAMA, **kw)))
    return out


def trained_logits(run_dir, master, x):
    """The logits the trained model computes in a training step after its last (STE: on its grid)."""
    with open(run_dir / "config.json") as f:
        c = json.load(f)
    model = gaussws.convert(GPT(LLAMA_CONFIG), c["method"], ROLES["llama2"], **phases.method_args(c))
    model.load_state_dict(master)  # strict: the run's state is the converted model's
    with torch.no_grad(), gaussws.TrainStep(model.train(), STEPS):
        return model(x, x)[0]


def test_a_llama2_gaussws_phase_is_the_bf16_run_then_eq3_and_exports(llama_runs, data_dir):
    (bf16_dir, bf16), (phase_dir, run) = llama_runs["bf16"], llama_runs["gaussws"]
    same_until(START, bf16_dir, bf16, phase_dir, run)
    level = budget.matched_b_t(E_R2["gaussws"], "int3")
    model = gaussws.convert(GPT(LLAMA_CONFIG), "gaussws[all]", ROLES["llama2"], b_init=level, b_target=level, seed=7)
    gaussws.load_weights(model, bf16[START][0])
    assert first_step_loss(model, data_dir, START) == curve(phase_dir)[START + 1]
    exported, master = export_and_load(phase_dir, "int3"), run[STEPS][0]
    linears = gaussws.method_linears(GPT(LLAMA_CONFIG), "gaussws[all]", ROLES["llama2"])
    assert len(linears) == 14  # q, k, v, out, gate, up, down of both blocks
    for name in linears:
        assert torch.equal(exported.get_submodule(name).weight, grids.fake_quantize(master[name + ".weight"], "int3"))


def test_a_llama2_ste_phase_is_the_bf16_run_then_its_grid_and_exports_as_trained(llama_runs, data_dir):
    (bf16_dir, bf16), (phase_dir, run) = llama_runs["bf16"], llama_runs["ste"]
    same_until(START, bf16_dir, bf16, phase_dir, run)
    plain = GPT(LLAMA_CONFIG)
    linears = gaussws.method_linears(plain, "ste[all]", ROLES["llama2"])
    plain.load_state_dict({k: grids.fake_quantize(v, "int3") if k[:-len(".weight")] in linears else v
                           for k, v in bf16[START][0].items()})
    assert first_step_loss(plain, data_dir, START) == curve(phase_dir)[START + 1]  # the bf16 weights on the grid
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    exported = export_and_load(phase_dir, "int3")
    assert torch.equal(exported(x, x)[0], trained_logits(phase_dir, run[STEPS][0], x))


def test_a_llama2_mixed_run_trains_a_budgets_formats_from_its_switch_and_exports_as_trained(llama_runs):
    (bf16_dir, bf16), (mixed_dir, run) = llama_runs["bf16"], llama_runs["mixed"]
    same_until(MIXED["pqt_start"], bf16_dir, bf16, mixed_dir, run)
    ids = {k: v for k, v in run[STEPS][0].items() if k.endswith(".format_ids")}
    assert len(ids) == 14 and all((v == budget.UNCHOSEN).all() for k, v in run[5][0].items() if k in ids)
    chosen = {i for v in ids.values() for i in v.flatten().tolist()}
    assert chosen <= {lowbit.BY_NAME[f] for f in ("int2", "int3", "int4")} and len(chosen) >= 2
    assert all(torch.equal(run[15][0][k], v) for k, v in ids.items())  # chosen once, at START
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    exported = export_and_load(mixed_dir, MIXED["target_format"], MIXED["bits_per_weight"])
    assert torch.equal(exported(x, x)[0], trained_logits(mixed_dir, run[STEPS][0], x))
