"""python -m studies.sensitivity: each block Linear's val loss change on one of llama.cpp's types and
error-gguf's proxy of it, checked against the loss computed here from the model's logits, the importance
matrix from layer 0's attention input recomputed here (LayerNorm of the embeddings), the types' bits
from ggml-common.h's block sizes, and Spearman's correlation against its textbook formula."""
import contextlib
import io
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import util
from conftest import ROOT
from data import tokenizer
from data import loader
from model import GPT, ModelConfig
from quant import grids
from studies import sensitivity
from test_gguf import write_data
from test_gguf_grids import ARCHS, make_run


TYPES = ["q2_k", "q3_k", "q4_k"]
BITS = {"q2_k": 84 * 8 / 256, "q3_k": 110 * 8 / 256, "q4_k": 144 * 8 / 256}  # ggml-common.h: bytes per 256


def command(*argv):
    """sensitivity's main through util.cli in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = util.cli(sensitivity.main, list(map(str, argv)))
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """A one-layer GPT2 of width 256 (seeded, untrained) on the bytes of model.py, measured on TYPES."""
    d = tmp_path_factory.mktemp("sensitivity")
    write_data(str(d / "data"), tokenizer.Tokenizer("bytes", "bytes"))
    sd = make_run(d / "run", d / "data", "gpt2")
    rc, out, err = command(f"--checkpoint={d / 'run'}", f"--types={','.join(TYPES)}", f"--json={d / 's.json'}")
    assert rc == 0, err
    return d, sd, out, json.loads((d / "s.json").read_text())


def batches(d):
    """The run's one evaluation batch, drawn as train.py draws it."""
    config = dict(dataset=str(d / "data"), seed=1337, batch_size=4, eval_iters=1)
    return loader.eval_batches(config, 64, 0)


def val_loss(model, data):
    with torch.no_grad():
        return sum(F.cross_entropy(model(x, y)[0].flatten(0, 1), y.flatten()).item() for x, y in data) / len(data)


def test_each_loss_change_is_the_model_with_that_tensor_alone_rounded(measured):
    d, sd, _, result = measured
    model = GPT(ModelConfig(**ARCHS["gpt2"]))
    model.load_state_dict(sd)
    data = batches(d)
    base = val_loss(model, data)
    assert result["val_loss"] == pytest.approx(base, abs=1e-6) and result["batches"] == 1
    assert [r["tensor"] for r in result["tensors"]] == [k[:-len(".weight")] for k in sd
                                                        if k.startswith("transformer.h.") and k.endswith("weight")
                                                        and sd[k].dim() == 2]
    for r in result["tensors"]:
        weight = model.get_submodule(r["tensor"]).weight
        w = weight.detach().clone()
        for t in TYPES:
            with torch.no_grad():
                weight.copy_(grids.fake_quantize(w, t))
            assert r["loss"][t] == pytest.approx(val_loss(model, data) - base, abs=1e-6)
        with torch.no_grad():
            weight.copy_(w)
    # the coarser the type, the more an untrained tensor loses: the measure sees the rounding
    assert sum(r["loss"]["q2_k"] for r in result["tensors"]) > sum(r["loss"]["q4_k"] for r in result["tensors"])


def test_the_proxy_weighs_each_squared_error_by_its_input_columns_squares(measured):
    d, sd, _, result = measured
    model = GPT(ModelConfig(**ARCHS["gpt2"]))
    model.load_state_dict(sd)
    x = torch.cat([x for x, _ in batches(d)])
    with torch.no_grad():  # layer 0's attention reads the LayerNorm of token and position embeddings
        h = model.transformer.h[0].ln_1(model.transformer.wte(x) + model.transformer.wpe(torch.arange(x.shape[1])))
    row = next(r for r in result["tensors"] if r["tensor"] == "transformer.h.0.attn.c_attn")
    w = sd["transformer.h.0.attn.c_attn.weight"].double()
    for t in TYPES:
        e = grids.fake_quantize(w.float(), t).double() - w
        expected = torch.einsum("oi,bti->", e.square(), h.double().square()).item() / w.numel()
        assert row["proxy"][t] == pytest.approx(expected, rel=1e-9)


def test_what_a_bit_buys_is_the_drop_per_weight_over_the_types_bits(measured):
    _, _, out, result = measured
    for lo, hi in zip(TYPES, TYPES[1:]):
        step = result["upgrades"][f"{lo}->{hi}"]
        for i, r in enumerate(result["tensors"]):
            extra = BITS[hi] - BITS[lo]
            assert step["loss_per_bit"][i] == pytest.approx((r["loss"][lo] - r["loss"][hi]) / r["numel"] / extra)
            assert step["proxy_per_bit"][i] == pytest.approx((r["proxy"][lo] - r["proxy"][hi]) / extra)
        assert step["spearman"] == pytest.approx(rank_correlation(step["loss_per_bit"], step["proxy_per_bit"]))
    assert len(out.strip().splitlines()) == len(result["tensors"]) + 2


def rank_correlation(a, b):
    """Spearman's rho of distinct values: 1 - 6 sum(d^2) / (n (n^2 - 1)), d the rank differences."""
    n = len(a)
    rank = lambda v: {x: i for i, x in enumerate(sorted(v))}
    ra, rb = rank(a), rank(b)
    return 1 - 6 * sum((ra[x] - rb[y]) ** 2 for x, y in zip(a, b)) / (n * (n * n - 1))


def test_spearman_is_the_textbook_formula_and_ignores_monotone_maps():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(20, generator=g).tolist(), torch.randn(20, generator=g).tolist()
    assert sensitivity.spearman(a, b) == pytest.approx(rank_correlation(a, b), abs=1e-12)
    assert sensitivity.spearman(a, [x ** 3 + 5 for x in a]) == pytest.approx(1.0)
    assert sensitivity.spearman(a, [-x for x in a]) == pytest.approx(-1.0)


@pytest.mark.parametrize("case", ["one type", "unknown type", "a type twice", "not cheapest first", "no checkpoint",
                                  "json is a folder", "rows too short"])
def test_bad_input_is_one_line_and_writes_nothing(case, tmp_path):
    """Refused before any measurement: a type given twice would divide by the 0 bits between it and itself."""
    write_data(str(tmp_path / "data"), tokenizer.Tokenizer("bytes", "bytes"))
    make_run(tmp_path / "run", tmp_path / "data", "gpt2", n_embd=128)  # K-quant blocks of 256 do not fit 128
    make_run(tmp_path / "wide", tmp_path / "data", "gpt2")
    argv, says = {
        "one type": (["--checkpoint=RUN/wide", "--types=q4_k"], "expected two or more of"),
        "unknown type": (["--checkpoint=RUN/wide", "--types=q4_k,q9_k"], "expected two or more of"),
        "a type twice": (["--checkpoint=RUN/wide", "--types=q2_k,q2_k"], "each once, cheapest first"),
        "not cheapest first": (["--checkpoint=RUN/wide", "--types=q4_k,q2_k"], "each once, cheapest first"),
        "no checkpoint": (["--checkpoint=RUN/nowhere"], "no checkpoint at"),
        "json is a folder": (["--checkpoint=RUN/wide", "--json=RUN"], "give the path of the JSON file"),
        "rows too short": (["--checkpoint=RUN/run"], "reads 128 inputs, which q2_k's blocks of 256 do not divide"),
    }[case]
    before = sorted(p.name for p in tmp_path.rglob("*"))
    rc, out, err = command(*(a.replace("RUN", str(tmp_path)) for a in argv))
    assert rc == 1 and says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_help_lists_the_keys_and_an_unknown_key_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "studies.sensitivity", "--help"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m studies.sensitivity [--key=value ...]")
    assert "  types = 'q2_k,q3_k,q4_k'    # llama.cpp types, cheapest first" in r.stdout
    rc, _, err = command("--typos=q2_k")
    assert rc == 1 and err.strip() == "error: unknown config key 'typos'; did you mean --types?"


def test_the_study_keeps_a_checkpoints_measure_beside_its_records_and_reads_it_alone_later(measured, tmp_path):
    """studies.exports.sensitivity on a run directory holding ckpt_<step>.pt: python -m studies.sensitivity's
    record, the checkpoint named relative to the run, kept in sensitivity.json; with the checkpoint gone (a
    committed record), the kept record alone; for other types, and no checkpoint, a line saying why none."""
    import shutil

    import checkpoint
    from studies import exports
    d, _, _, result = measured
    step = checkpoint.read(str(d / "run"))["iter_num"]
    run = tmp_path / "runs" / "trunk"
    run.mkdir(parents=True)
    shutil.copy(d / "run" / "ckpt.pt", run / f"ckpt_{step}.pt")
    got = exports.sensitivity(str(run), step, TYPES)
    assert got == {**result, "checkpoint": f"ckpt_{step}.pt"}
    assert json.loads((run / "sensitivity.json").read_text()) == got
    (run / f"ckpt_{step}.pt").unlink()
    assert exports.sensitivity(str(run), step, TYPES) == got
    assert exports.sensitivity(str(run), step, TYPES[:2]) == \
        f"no sensitivity.json of step {step} and no ckpt_{step}.pt to measure"
