"""train.py end to end on tiny models: learning, exact resume, data parallelism, bad input."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import checkpoint
import train
import util
from configurator import ConfigError
from data import loader
from data.common import DataError
from util import UserError
from conftest import ROOT, TINY_RUN, copy_run, digest, divergence, run_cli, run_here, tiny, untouched_state


def losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return {r["iter"]: r["loss"] for r in records if "loss" in r}


def in_process(args, capsys):
    """train.py's command line run through its own cli() in this process: (exit status, stderr). Any
    error but the one-line UserError raises through cli() and fails the test; tests/test_util.py runs
    train.py's from the shell, where that would be a traceback."""
    status = util.cli(train.main, args)
    return status, capsys.readouterr().err


@pytest.mark.parametrize("arch", ["gpt2", "llama2"])
@pytest.mark.parametrize("method", ["bf16", "diffq[all]", "gaussws[all]"])
def test_loss_falls(tiny_corpus, tmp_path, arch, method):
    train.main(tiny(tiny_corpus, tmp_path, arch=arch, method=method, bias=arch == "gpt2"))
    curve = losses(tmp_path)
    first, last = np.mean([curve[i] for i in (1, 2, 3)]), np.mean([curve[i] for i in (28, 29, 30)])
    assert last < first - 1.0, (first, last)
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    logged = [r for r in records if "loss" in r][-1]
    assert {"lr", "ms_per_iter", "tokens_per_s"} <= set(logged)
    if method != "bf16":
        assert {"b_t/mean", "b_t/min", "b_t/max"} <= set(logged)


def test_bitwidths_move_toward_target_under_decay(tiny_corpus, tmp_path):
    train.main(tiny(tiny_corpus, tmp_path, max_iters=20, bitwidth_weight_decay=5.0, learning_rate=1e-2))
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f if "b_t/mean" in line]
    assert records[-1]["b_t/mean"] < 6.0 - 0.1 and records[-1]["b_t/max"] < 6.0


def test_resume_continues_the_same_losses(tiny_corpus, tmp_path):
    whole, part = tmp_path / "whole", tmp_path / "part"
    train.main(tiny(tiny_corpus, whole, max_iters=20, lr_decay_iters=20))
    train.main(tiny(tiny_corpus, part, max_iters=10, lr_decay_iters=20))
    train.main(tiny(tiny_corpus, part, max_iters=20, lr_decay_iters=20, init_from="resume"))
    assert losses(part) == losses(whole)
    assert len(losses(part)) == 20


def test_compiled_run_trains_as_eager_and_saves_the_same_model(tiny_corpus, tmp_path):
    import torch
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    train.main(tiny(tiny_corpus, eager, max_iters=4, eval_interval=4, dtype="float32"))
    train.main(tiny(tiny_corpus, compiled, max_iters=4, eval_interval=4, dtype="float32", compile=True))
    a, b = losses(eager), losses(compiled)
    np.testing.assert_allclose([a[k] for k in a], [b[k] for k in a], rtol=1e-4)
    ckpt, ref = (torch.load(d / "ckpt.pt", weights_only=True) for d in (compiled, eager))
    assert {"model", "optimizer", "model_args", "pqt", "iter_num", "config", "rng_state"} <= set(ckpt)
    assert ckpt["iter_num"] == 4 and ckpt["pqt"] == {"method": "gaussws[all]", "b_init": 6.0, "b_target": 4.0,
                                                       "pqt_start": 0.0, "target_format": "", "ste_start": 0.0,
                                                       "bits_per_weight": 0.0}
    # The same parameters under the same names, and the same values to a tenth of one step's change
    # (lr 3e-3 after the 5-step warmup's first 4 steps: an Adam step moves a weight by at most ~lr).
    assert ckpt["model"].keys() == ref["model"].keys()
    for k, v in ref["model"].items():
        torch.testing.assert_close(ckpt["model"][k], v, rtol=0, atol=1e-4, msg=lambda m: f"{k}: {m}")


def _originals():
    import gaussws
    return {"build_optimizers": gaussws.build_optimizers, "get_batch": loader.get_batch,
            "load_state": checkpoint.load_state}


ORIGINAL = _originals()  # before any test patches them


def snapshot_start(monkeypatch):
    """Record the weights train.main starts from (when it builds the optimizers) and every batch it draws."""
    import gaussws
    seen = {"batches": []}
    build, get_batch = ORIGINAL["build_optimizers"], ORIGINAL["get_batch"]

    def recording_build(model, *args, **kw):
        seen["weights"] = {k: v.clone() for k, v in model.state_dict().items()}
        return build(model, *args, **kw)

    def recording_get_batch(data, key, **kw):
        x, y = get_batch(data, key, **kw)
        seen["batches"].append((key, x.clone(), y.clone()))
        return x, y
    monkeypatch.setattr(gaussws, "build_optimizers", recording_build)
    monkeypatch.setattr(loader, "get_batch", recording_get_batch)
    return seen


@pytest.mark.parametrize("arch", ["gpt2", "llama2"])
def test_every_method_starts_from_the_same_weights_and_batches(tiny_corpus, tmp_path, monkeypatch, arch):
    import torch
    runs = {}
    for method in ("bf16", "gaussws[all]", "diffq[od]"):
        seen = snapshot_start(monkeypatch)
        train.main(tiny(tiny_corpus, tmp_path / method, arch=arch, bias=arch == "gpt2", method=method, max_iters=2,
                        eval_interval=2))
        runs[method] = seen
    base = runs["bf16"]
    for method in ("gaussws[all]", "diffq[od]"):
        run = runs[method]
        assert {k for k in run["weights"] if not k.endswith("b_i")} == set(base["weights"])
        for k, v in base["weights"].items():
            assert torch.equal(run["weights"][k], v), (method, k)
        assert len(run["batches"]) == len(base["batches"]) > 2
        for (key_a, xa, ya), (key_b, xb, yb) in zip(base["batches"], run["batches"]):
            assert key_a == key_b and torch.equal(xa, xb) and torch.equal(ya, yb)


def test_pqt_run_started_from_a_bf16_checkpoint_keeps_its_weights(tiny_corpus, tmp_path, monkeypatch):
    import torch
    bf16, pqt, back = tmp_path / "bf16", tmp_path / "pqt", tmp_path / "back"
    train.main(tiny(tiny_corpus, bf16, method="bf16", max_iters=10))
    source = torch.load(bf16 / "ckpt.pt", weights_only=True)
    seen = snapshot_start(monkeypatch)
    train.main(tiny(tiny_corpus, pqt, method="gaussws[od]", init_from=str(bf16), max_iters=4, eval_interval=4))
    start = seen["weights"]
    assert set(source["model"]) == {k for k in start if not k.endswith("b_i")}
    for k, v in source["model"].items():
        assert torch.equal(start[k], v), k
    b_i = [v for k, v in start.items() if k.endswith("b_i")]
    assert len(b_i) == 4 and all(torch.equal(v, torch.ones_like(v)) for v in b_i)  # fresh: b_t = b_init
    # Evaluation runs without noise: the new run's step-0 losses are the bf16 run's last ones.
    with open(bf16 / "metrics.jsonl") as f:
        last = [json.loads(line) for line in f if "val/loss" in line][-1]
    with open(pqt / "metrics.jsonl") as f:
        first = [json.loads(line) for line in f if "val/loss" in line][0]
    assert first["iter"] == 0 and first["val/loss"] == last["val/loss"]
    ckpt = torch.load(pqt / "ckpt.pt", weights_only=True)
    assert ckpt["iter_num"] == 4 and ckpt["pqt"]["method"] == "gaussws[od]"  # a new run: its own steps
    # And back: a bf16 run from the PQT checkpoint drops the b_i.
    seen = snapshot_start(monkeypatch)
    train.main(tiny(tiny_corpus, back, method="bf16", init_from=str(pqt / "ckpt.pt"), max_iters=1, eval_interval=1))
    assert set(seen["weights"]) == set(source["model"])
    assert all(torch.equal(seen["weights"][k], v) for k, v in ckpt["model"].items() if not k.endswith("b_i"))


def test_init_from_refuses_another_shape_in_one_line(tiny_corpus, trained, tmp_path, capsys):
    r = run_here(tiny(tiny_corpus, tmp_path / "new", init_from=str(trained), n_layer=3), capsys)
    assert r.returncode == 1
    (line,) = r.stderr.strip().splitlines()
    assert "has another shape" in line and "n_layer" in line


def ranks_said(r):
    """torchrun's stderr as a failure message: the lines of every rank that name an error first (its own
    summary at the end names the rank that failed, not why, and would push the why out of a tail), then
    the tail."""
    errors = [line for line in r.stderr.splitlines() if "rank" in line and "Error" in line]
    return "\n".join(errors[:40]) + "\n...\n" + r.stderr[-2000:]


def torchrun(args):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           os.path.join(ROOT, "train.py"), *args], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)


@pytest.mark.parametrize("parallel,optimizer", [("ddp", "adamw"), ("ddp", "adam_mini"), ("fsdp", "adamw")])
def test_two_processes_match_one_with_the_same_global_batch(tiny_corpus, tmp_path, parallel, optimizer):
    import shutil
    import checkpoint
    one, two, three = tmp_path / "one", tmp_path / "two", tmp_path / "three"
    args = dict(max_iters=6, eval_interval=3, gradient_accumulation_steps=2, dtype="float32", optimizer=optimizer,
                lr_decay_iters=6)
    r1 = run_cli(tiny(tiny_corpus, one, **args))
    assert r1.returncode == 0, r1.stderr
    if parallel == "fsdp":
        # 3 steps on 2 processes save a sharded checkpoint (ckpt.dcp); it is resumed for the other
        # 3 steps by 2 processes, and, from a copy, by 1 process
        r2 = torchrun(tiny(tiny_corpus, two, **{**args, "max_iters": 3}, parallel=parallel))
        assert r2.returncode == 0, ranks_said(r2)
        assert os.path.islink(two / "ckpt.dcp") and not os.path.exists(two / "ckpt.pt")
        shutil.copytree(two, three, symlinks=True)
        r2 = torchrun(tiny(tiny_corpus, two, **args, parallel=parallel, init_from="resume"))
        r3 = run_cli(tiny(tiny_corpus, three, **args, init_from="resume"))
        assert r3.returncode == 0, ranks_said(r3)
        assert (three / "ckpt.pt").exists() and not os.path.lexists(three / "ckpt.dcp")  # one checkpoint per out_dir
    else:
        r2 = torchrun(tiny(tiny_corpus, two, **args, parallel=parallel))
    assert r2.returncode == 0, ranks_said(r2)
    a, b = losses(one), losses(two)
    assert a.keys() == b.keys() and len(a) == 6
    np.testing.assert_allclose([a[k] for k in a], [b[k] for k in a], rtol=1e-4)
    if parallel == "fsdp":
        c = losses(three)
        np.testing.assert_allclose([a[k] for k in a], [c[k] for k in a], rtol=1e-4)
    # The losses hardly see a gradient scale (Adam divides it out); b_i and Adam's moments after 6
    # steps do (exp_avg is linear in the gradient). The weights agree to a small part of one Adam
    # step: where a gradient is near zero, Adam's division amplifies the summation order's rounding.
    import torch
    c1 = torch.load(one / "ckpt.pt", weights_only=True)
    if parallel == "fsdp":  # the model as 2 processes saved it; the optimizer as 1 process resumed it
        c2 = {**checkpoint.load_model(two / "ckpt.dcp"),
              "optimizer": torch.load(three / "ckpt.pt", weights_only=True)["optimizer"]}
    else:
        c2 = torch.load(two / "ckpt.pt", weights_only=True)
    assert c1["model"].keys() == c2["model"].keys() and any(k.endswith("b_i") for k in c1["model"])
    for k, v in c1["model"].items():
        tol = dict(rtol=1e-5, atol=1e-6) if k.endswith("b_i") else dict(rtol=1e-4, atol=0.01 * 3e-3)
        torch.testing.assert_close(c2["model"][k], v, **tol, msg=lambda m: f"{k}: {m}")

    def moments(ckpt):  # every optimizer's tensors, in the order of its parameter groups
        return [t for o in ckpt["optimizer"] for g in o["param_groups"] for p in g["params"]
                for _, t in sorted(o["state"][p].items()) if torch.is_tensor(t) and t.numel() > 1]
    m1, m2 = moments(c1), moments(c2)
    assert len(m1) == len(m2) > 0
    for x, y in zip(m1, m2):
        # a wrong gradient scale (2x) is off by the tensor's own size; summation order, by far less
        torch.testing.assert_close(y, x, rtol=1e-3, atol=5e-3 * x.abs().max().item())


def test_processes_adding_the_micro_steps_in_another_order_agree_within_its_rounding(tiny_corpus, tmp_path):
    """gradient_accumulation_steps=4 on 2 processes, 2 micro-steps each: a step adds the 4 micro-step
    losses l_m / 4 (and gradients) of one process in another order, (l0 + l1) + (l2 + l3) instead of
    ((l0 + l1) + l2) + l3 (each halving exact). The first step starts from the same weights on the same
    micro-batches, so the l_m are the same bits, and each order's sum is within gamma_3 of the exact
    one (gamma_k = k u / (1 - k u), u = 2^-24: FP32): the two losses at most 2 gamma_3 L apart. Later
    steps carry the gradient's rounding on (README, "Multi-GPU"). A process that took another's
    micro-step would be a whole micro-batch's loss away."""
    one, two = tmp_path / "one", tmp_path / "two"
    args = dict(max_iters=3, eval_interval=3, gradient_accumulation_steps=4, dtype="float32", lr_decay_iters=3)
    r1 = run_cli(tiny(tiny_corpus, one, **args))
    assert r1.returncode == 0, r1.stderr
    r2 = torchrun(tiny(tiny_corpus, two, **args))
    assert r2.returncode == 0, ranks_said(r2)
    assert "2 process(es) on cpu, each taking 2 micro-step(s) of 8 sequences a step" in r2.stdout
    a, b = losses(one), losses(two)
    gamma = 3 * 2.0**-24 / (1 - 3 * 2.0**-24)
    assert abs(a[1] - b[1]) <= 2 * gamma * a[1] / (1 - gamma)
    np.testing.assert_allclose([b[k] for k in a], [a[k] for k in a], rtol=1e-5)


def test_two_processes_split_each_micro_batch_where_there_is_one_micro_step(tiny_corpus, tmp_path):
    """gradient_accumulation_steps=1 on 2 processes: each takes half the sequences of the one
    micro-batch, and the losses are the 1-process run's (a wrong half on either rank would not be)."""
    one, two = tmp_path / "one", tmp_path / "two"
    args = dict(max_iters=4, eval_interval=4, gradient_accumulation_steps=1, dtype="float32")
    r1 = run_cli(tiny(tiny_corpus, one, **args))
    assert r1.returncode == 0, r1.stderr
    r2 = torchrun(tiny(tiny_corpus, two, **args))
    assert r2.returncode == 0, ranks_said(r2)
    assert "2 process(es) on cpu, each taking 1 micro-step(s) of 4 sequences a step" in r2.stdout
    a, b = losses(one), losses(two)
    assert a.keys() == b.keys() and len(a) == 4
    np.testing.assert_allclose([b[k] for k in a], [a[k] for k in a], rtol=1e-5)


def test_a_batch_that_does_not_share_out_is_one_line_printed_once(tiny_corpus, tmp_path):
    r = torchrun(tiny(tiny_corpus, tmp_path / "o", gradient_accumulation_steps=1, batch_size=3))
    assert r.returncode != 0
    ours = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("error: ")]
    assert len(ours) == 1, r.stderr[-3000:]
    assert "--gradient_accumulation_steps=2 or --batch_size=4" in ours[0] and "--nproc_per_node=1" in ours[0]
    assert "ConfigError" not in r.stderr and not (tmp_path / "o").exists()  # no traceback of ours, nothing written


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6, 8])
def test_share_out_takes_every_sequence_of_the_global_batch_once(world_size):
    """For every (accum, batch_size) up to 12 x 12: where some split of the processes into groups of
    micro-steps times groups of rows exists (found by brute force), share_out's ranks together take
    every (micro-step, row) exactly once; where none exists, it refuses."""
    from step import share_out
    for accum in range(1, 13):
        for batch_size in range(1, 13):
            possible = any(accum % a == 0 and batch_size % (world_size // a) == 0
                           for a in range(1, world_size + 1) if world_size % a == 0)
            if not possible:
                with pytest.raises(ConfigError, match=f"do not share out over {world_size} processes"):
                    share_out(accum, batch_size, world_size, 0)
                continue
            taken = []
            for rank in range(world_size):
                first, count, rows = share_out(accum, batch_size, world_size, rank)
                taken += [(m, row) for m in range(first, first + count) for row in range(batch_size)[rows]]
            assert sorted(taken) == [(m, row) for m in range(accum) for row in range(batch_size)], (accum, batch_size)


def test_a_process_share_of_a_batch_is_its_rows_of_the_whole_batch(tiny_corpus):
    import torch
    data = loader.open_split(tiny_corpus, "train", {"dtype": "uint16"}, 32)
    whole = loader.get_batch(data, (1, "train", 3, 0), batch_size=8, block_size=32, device="cpu")
    half = loader.get_batch(data, (1, "train", 3, 0), batch_size=8, block_size=32, device="cpu", rows=slice(4, 8))
    assert all(torch.equal(h, w[4:8]) for h, w in zip(half, whole))


def hand_lr(it, c):
    """The schedule as train.py's docstring of get_lr states it: linear warmup, cosine to min_lr."""
    import math
    if it < c["warmup_iters"]:
        return c["learning_rate"] * (it + 1) / (c["warmup_iters"] + 1)
    if it > c["lr_decay_iters"]:
        return c["min_lr"]
    ratio = (it - c["warmup_iters"]) / (c["lr_decay_iters"] - c["warmup_iters"])
    return c["min_lr"] + 0.5 * (1 + math.cos(math.pi * ratio)) * (c["learning_rate"] - c["min_lr"])


def test_the_cosine_follows_max_iters_unless_lr_decay_iters_is_set(tiny_corpus, tmp_path, capsys):
    args = {k: v for k, v in TINY_RUN.items() if k != "lr_decay_iters"}
    args.update(max_iters=12, eval_interval=12, warmup_iters=2)
    train.main([f"--dataset={tiny_corpus}", f"--out_dir={tmp_path / 'a'}"] + [f"--{k}={v}" for k, v in args.items()])
    assert "note:" not in capsys.readouterr().out
    with open(tmp_path / "a" / "metrics.jsonl") as f:
        lrs = {r["iter"]: r["lr"] for r in map(json.loads, f) if "lr" in r}
    c = dict(train.DEFAULTS, **args, lr_decay_iters=12)
    assert lrs == pytest.approx({k: hand_lr(k - 1, c) for k in range(1, 13)}, rel=1e-12)  # step k logs lr of k - 1
    assert lrs[12] < 0.1 * c["learning_rate"]  # the cosine ends with the run, not at step 400
    config = json.load(open(tmp_path / "a" / "config.json"))
    assert config["lr_decay_iters"] == 12
    # the run names the commit its numbers came from (git's own answer, not ours)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    assert config["versions"]["commit"].partition("+")[0] == head
    assert config["versions"]["threads"] == torch.get_num_threads()  # a CPU run's reduction order depends on it
    assert config["versions"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()  # and its SIMD level
    assert config["versions"]["cpu_id"] == util.cpu_id()  # and the CPU's family, model and stepping
    # an explicit lr_decay_iters before max_iters is said once, and the run goes on
    train.main([f"--dataset={tiny_corpus}", f"--out_dir={tmp_path / 'b'}", "--lr_decay_iters=8"]
               + [f"--{k}={v}" for k, v in args.items()])
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert notes == [f"note: the cosine ends at lr_decay_iters=8, before max_iters=12: the last 4 steps run at "
                     f"min_lr={c['min_lr']:g}"]
    assert max(losses(tmp_path / "b")) == 12


def test_a_warmup_as_long_as_the_run_is_said(tiny_corpus, tmp_path, capsys):
    train.main(tiny(tiny_corpus, tmp_path, max_iters=4, eval_interval=4, warmup_iters=10, dry_run=True))
    assert "note: warmup_iters=10 is not below max_iters=4: the whole run warms up" in capsys.readouterr().out


@pytest.mark.parametrize("arch", ["gpt2", "llama2"])
def test_adam_mini_trains_with_gaussws(tiny_corpus, tmp_path, arch):
    records = {}
    for decay in (1.0, 0.0):  # the run, and its twin without the decay of b_i
        out = tmp_path / f"decay{decay:g}"
        train.main(tiny(tiny_corpus, out, arch=arch, bias=arch == "gpt2", optimizer="adam_mini", max_iters=20,
                        lr_decay_iters=20, bitwidth_weight_decay=decay, learning_rate=1e-2))
        with open(out / "metrics.jsonl") as f:
            records[decay] = [json.loads(line) for line in f]
    curve = losses(tmp_path / "decay1")
    assert np.mean([curve[i] for i in (18, 19, 20)]) < np.mean([curve[i] for i in (1, 2, 3)]) - 0.5
    b_t = {decay: [r for r in rs if "b_t/mean" in r] for decay, rs in records.items()}
    assert b_t[1.0][0]["b_t/min"] < b_t[1.0][0]["b_t/max"]  # b_i are trained from the first step
    # and decay pulls b_t toward b_target: by itself it scales b_t - b_target = 2 b_i (from 2) by prod(1 - lr x
    # 1.0) over the steps, which the twin's b_t less the run's shows within 10 % (the gradients' steps differ)
    pull = 2 * (1 - np.prod([1 - r["lr"] for r in records[1.0] if "lr" in r]))
    assert pull > 0.1 and b_t[0.0][-1]["b_t/mean"] - b_t[1.0][-1]["b_t/mean"] == pytest.approx(pull, rel=0.1)


def files_of(out):
    """{name: (inode, digest)} of every file of a run directory: whether anything in it was written."""
    return {p.name: untouched_state(p) for p in out.iterdir() if p.is_file()}


@pytest.mark.parametrize("args,message", [
    (["--n_layr=3"], "unknown config key 'n_layr'; did you mean --n_layer"),
    (["--batch_size=big"], "expected an int"),
    (["--out_dir="], "out_dir='': give the directory"),
    (["--learning_rate=True"], "takes a float"),
    (["--method=gaussws[qkv,foo]"], "bad method"),
    (["--method=gaussws[all]", "--arch=llama2", "--bias=False", "--init_from=resume"], "holds another model"),
    (["--max_iters=20"], "holds another run"),
    (["--dataset=/nonexistent/data"], "not found; prepare the data first"),
    (["config/does_not_exist.py"], "config file"),
])
def test_bad_input_is_one_line_and_keeps_the_checkpoint(tiny_corpus, trained, tmp_path, args, message, capsys):
    out = copy_run(trained, tmp_path)
    before = files_of(out)
    status, err = in_process(tiny(tiny_corpus, out, max_iters=10) + args, capsys)
    assert status != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err
    assert files_of(out) == before  # the checkpoint, config.json, metrics.jsonl: nothing written


def test_corrupt_data_and_checkpoint_are_reported(tiny_corpus, trained, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "meta.json").write_text("{not json")
    status, err = in_process(tiny(str(bad), tmp_path / "o"), capsys)
    assert status == 1 and "corrupt" in err
    (bad / "meta.json").write_text(json.dumps({"vocab_size": 256, "dtype": "uint16"}))
    (bad / "train.bin").write_bytes(b"\x01")
    status, err = in_process(tiny(str(bad), tmp_path / "o"), capsys)
    assert status == 1 and "train.bin holds 1 bytes, not a whole number" in err
    for split in ("train", "val"):  # whole files again: only the vocabulary is wrong now
        (bad / f"{split}.bin").write_bytes(np.arange(1000, dtype=np.uint16).tobytes())
    (bad / "meta.json").write_text(json.dumps({"vocab_size": 50257, "dtype": "uint16", "tokenizer": "tiktoken:gpt2"}))
    status, err = in_process(tiny(str(bad), tmp_path / "o", vocab_size=32000), capsys)
    assert status == 1 and "vocabulary of 50257" in err
    out = tmp_path / "garbage"
    out.mkdir()
    (out / "ckpt.pt").write_bytes(b"not a checkpoint")
    status, err = in_process(tiny(tiny_corpus, out, init_from="resume"), capsys)
    assert status == 1 and "not a checkpoint" in err
    assert (out / "ckpt.pt").read_bytes() == b"not a checkpoint"


def test_a_second_run_on_a_locked_out_dir_is_one_line_and_changes_nothing(tiny_corpus, trained, tmp_path):
    import checkpoint
    out = copy_run(trained, tmp_path)
    with checkpoint.lock(str(out)):  # as a run that holds the directory does
        before = files_of(out)
        r = run_cli(tiny(tiny_corpus, out, max_iters=20, init_from="resume"))
        after = files_of(out)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "is in use by another run" in lines[0] and f"pid {os.getpid()}" in lines[0], lines
    assert after == before


def test_a_checkpoint_with_flipped_bytes_is_refused_in_one_line(tiny_corpus, trained, tmp_path, capsys):
    import shutil
    import zipfile
    out = tmp_path / "flipped"
    shutil.copytree(trained, out)
    data = bytearray((out / "ckpt.pt").read_bytes())
    with zipfile.ZipFile(out / "ckpt.pt") as z:  # a byte in the middle of the largest tensor's data
        info = max(z.infolist(), key=lambda i: i.file_size)
    local = info.header_offset  # the local file header: 30 bytes, then the name and its own extra field
    name_len, extra_len = (int.from_bytes(data[local + i:local + i + 2], "little") for i in (26, 28))
    offset = local + 30 + name_len + extra_len + info.file_size // 2
    data[offset] ^= 0x10
    (out / "ckpt.pt").write_bytes(bytes(data))
    r = run_here(tiny(tiny_corpus, out, max_iters=20, init_from="resume"), capsys)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "corrupt" in lines[0] and "CRC" in lines[0], lines
    assert (out / "ckpt.pt").read_bytes() == bytes(data)


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tiny_corpus, trained, tmp_path):
    out = copy_run(trained, tmp_path)
    before = digest(out / "ckpt.pt")
    r = run_cli(tiny(tiny_corpus, out, max_iters=40, init_from="resume", learning_rate=1e30, grad_clip=0.0,
                     warmup_iters=0, decay_lr=False, dtype="float32", eval_interval=1000))
    assert r.returncode == train.EXIT_DIVERGED == 3, r.stderr
    assert "loss is nan" in r.stderr or "loss is inf" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert digest(out / "ckpt.pt") == before
    assert divergence(out) == {"step": 11, "what": "loss", "checkpoint_step": 10}  # step 10 updated with lr 1e30


def test_dry_run_prints_config_and_exits(tmp_path, capsys):
    r = run_here(["--model=gpt2-124m", "--dry_run=True", f"--out_dir={tmp_path}"], capsys)
    assert r.returncode == 0, r.stderr
    assert "tokens per optimizer step" in r.stdout and "124" in r.stdout
    assert not os.listdir(tmp_path)
    shown = json.loads(r.stdout[:r.stdout.index("\n}\n") + 2])
    # GPT-2 small (Radford et al. 2019): 12 layers, 12 heads, 768 wide, 1024 tokens; not the defaults' 4 x 128
    assert (shown["n_layer"], shown["n_head"], shown["n_embd"], shown["block_size"]) == (12, 12, 768, 1024)


def test_dry_run_says_when_the_dataset_is_not_prepared(tiny_corpus, tmp_path, capsys):
    unprepared = tmp_path / "corpus"
    unprepared.mkdir()
    (unprepared / "prepare.py").write_text("")
    r = run_here(["--dry_run=True", f"--dataset={unprepared}"], capsys)
    assert r.returncode == 0, r.stderr
    assert (f"dataset '{unprepared}' is not prepared yet ({unprepared} has no meta.json): python "
            f"{unprepared / 'prepare.py'}") in r.stdout
    r = run_here(["--dry_run=True", f"--dataset={tiny_corpus}"], capsys)
    assert r.returncode == 0 and "not prepared" not in r.stdout
    assert json.loads(r.stdout[:r.stdout.index("\n}\n") + 2])["vocab_size"] == 256  # its meta.json's


def test_wandb_gets_config_metrics_and_bitwidth_histograms(tiny_corpus, tmp_path, monkeypatch):
    import types
    calls = {"init": [], "log": []}
    fake = types.SimpleNamespace(init=lambda **kw: calls["init"].append(kw),
                                 log=lambda record, step: calls["log"].append((step, record)),
                                 Histogram=lambda values: ("histogram", len(values)))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    train.main(tiny(tiny_corpus, tmp_path, max_iters=4, eval_interval=2, wandb_log=True, wandb_mode="offline"))
    (init,) = calls["init"]
    assert init["mode"] == "offline" and init["config"]["method"] == "gaussws[all]" and "model_args" in init["config"]
    keys = set().union(*(record for _, record in calls["log"]))
    assert {"loss", "lr", "ms_per_iter", "tokens_per_s", "b_t/mean", "val/loss"} <= keys
    # n_embd 64: c_attn is 192 x 64, 6 x 2 blocks of 32 x 32
    hists = [record for _, record in calls["log"] if "b_t/transformer.h.0.attn.c_attn" in record]
    assert len(hists) == 3 and hists[0]["b_t/transformer.h.0.attn.c_attn"] == ("histogram", 12)
    assert sum(k.startswith("b_t/transformer.") for k in hists[0]) == 8  # 2 blocks x 4 PQT layers


def test_wandb_offline_mode_runs_without_network(tiny_corpus, tmp_path):
    r = run_cli(tiny(tiny_corpus, tmp_path, max_iters=2, eval_interval=2, wandb_log=True, wandb_mode="offline"),
                env={**os.environ, "WANDB_SILENT": "true"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert any(name.startswith("offline-run") for name in os.listdir(tmp_path / "wandb"))


def test_recomputing_w_hat_trains_the_same(tiny_corpus, tmp_path):
    kept, recomputed = tmp_path / "kept", tmp_path / "recomputed"
    train.main(tiny(tiny_corpus, kept, max_iters=8, eval_interval=100))
    train.main(tiny(tiny_corpus, recomputed, max_iters=8, eval_interval=100, recompute_w_hat=True))
    a, b = losses(kept), losses(recomputed)
    # The same forward; only b_t's gradient is summed in another order (once per step vs per micro-step).
    np.testing.assert_allclose([a[k] for k in a], [b[k] for k in a], rtol=1e-4)


# --- runs that end, checkpoints that stay good, configs refused before anything is written ---------

@pytest.mark.parametrize("max_iters", [5, 10, 0])
def test_resume_at_or_past_max_iters_ends_at_once(tiny_corpus, trained, tmp_path, capsys, max_iters):
    out = copy_run(trained, tmp_path)
    before, metrics = digest(out / "ckpt.pt"), (out / "metrics.jsonl").read_text()
    train.main(tiny(tiny_corpus, out, max_iters=max_iters, init_from="resume"))
    printed = capsys.readouterr().out
    assert "is at step 10" in printed and "nothing to train" in printed
    assert digest(out / "ckpt.pt") == before and (out / "metrics.jsonl").read_text() == metrics


def test_resume_keeps_metrics_up_to_its_checkpoint(tiny_corpus, trained, tmp_path):
    out = copy_run(trained, tmp_path)
    with open(out / "metrics.jsonl", "a") as f:  # records of a crashed continuation, the last cut short
        f.write(json.dumps({"iter": 11, "loss": 1.0}) + "\n" + '{"iter": 12, "lo')
    train.main(tiny(tiny_corpus, out, max_iters=12, init_from="resume"))
    with open(out / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    steps = [(r["iter"], "val/loss" in r) for r in records]
    assert len(steps) == len(set(steps))  # no step logged twice (the eval at 10 not again)
    assert [i for i, ev in steps if not ev] == list(range(1, 13))
    assert [i for i, ev in steps if ev] == [0, 10, 12]
    assert all(r["loss"] != 1.0 for r in records if "loss" in r)


def test_a_new_run_starts_its_metrics_afresh(tiny_corpus, trained, tmp_path):
    out = copy_run(trained, tmp_path)
    train.main(tiny(tiny_corpus, out, max_iters=2, eval_interval=2, overwrite=True))
    with open(out / "metrics.jsonl") as f:
        assert [json.loads(line)["iter"] for line in f] == [0, 1, 2, 2]


def test_nan_at_an_eval_step_keeps_the_good_checkpoint(tiny_corpus, trained, tmp_path):
    import torch
    out = copy_run(trained, tmp_path)
    before = digest(out / "ckpt.pt")
    # step 10 is finite and updates with lr 1e30: the model evaluated (and due to be saved) at step 11 is not
    with pytest.raises(ConfigError) as error:
        train.main(tiny(tiny_corpus, out, max_iters=20, init_from="resume", learning_rate=1e30, grad_clip=0.0,
                        warmup_iters=0, decay_lr=False, dtype="float32", eval_interval=1))
    message = str(error.value)
    assert "at step 11" in message and f"the last good checkpoint is {out / 'ckpt.pt'}, step 10" in message
    assert isinstance(error.value, train.Diverged)
    assert divergence(out) == {"step": 11, "what": "eval_loss", "checkpoint_step": 10}
    assert digest(out / "ckpt.pt") == before
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert ckpt["iter_num"] == 10 and all(torch.isfinite(v).all() for v in ckpt["model"].values())


def test_an_inf_gradient_with_a_finite_loss_is_not_applied(tiny_corpus, trained, tmp_path, monkeypatch):
    import torch
    import gaussws
    out = copy_run(trained, tmp_path)
    before = digest(out / "ckpt.pt")
    build, seen = ORIGINAL["build_optimizers"], {}

    def poisoned(model, *args, **kw):  # one gradient element turns inf in the backward; the loss stays finite
        seen["model"] = model
        model.lm_head.weight.register_hook(lambda g: g.index_fill(0, torch.tensor([3]), float("inf")))
        return build(model, *args, **kw)
    monkeypatch.setattr(gaussws, "build_optimizers", poisoned)
    weights = {}
    monkeypatch.setattr(checkpoint, "load_state", lambda model, o, ckpt, fsdp: (
        ORIGINAL["load_state"](model, o, ckpt, fsdp), weights.update(ckpt["model"])))
    for grad_clip in (1.0, 0.0):  # clipped or not, the norm is checked
        with pytest.raises(ConfigError, match=r"gradient norm is (inf|nan) \(loss \d"):
            train.main(tiny(tiny_corpus, out, max_iters=20, init_from="resume", grad_clip=grad_clip))
        for k, v in seen["model"].state_dict().items():  # no update reached the weights
            assert torch.equal(v, weights[k]), k
        assert divergence(out) == {"step": 10, "what": "grad_norm", "checkpoint_step": 10}
    assert digest(out / "ckpt.pt") == before


BAD_CONFIG = [
    ("--max_iters=None", "max_iters=None"),
    ("--grad_clip=-1", "grad_clip=-1.0: expected a number >= 0"),
    ("--block_size=0", "block_size=0: expected an integer >= 1"),
    ("--block_size=-3", "block_size=-3"),
    ("--n_layer=-1", "n_layer=-1: expected an integer >= 1"),
    ("--n_embd=0", "n_embd=0"),
    ("--n_head=0", "n_head=0"),
    ("--eval_interval=0", "eval_interval=0"),
    ("--log_interval=0", "log_interval=0"),
    ("--learning_rate=-1", "learning_rate=-1.0: expected a number >= 0"),
    ("--beta1=1.5", "beta1=1.5: expected a number in [0, 1)"),
    ("--beta2=1.0", "beta2=1.0"),
    ("--dropout=2.0", "dropout=2.0"),
    ("--wandb_mode=foo", "wandb_mode='foo': expected one of online, offline, disabled"),
    ("--device=tpu", "device='tpu'"),
] + ([("--device=cuda", "no CUDA GPU")] if not __import__("torch").cuda.is_available() else [])


@pytest.mark.parametrize("arg,message", BAD_CONFIG, ids=[a for a, _ in BAD_CONFIG])
def test_a_bad_config_is_one_line_before_anything_is_written(tiny_corpus, tmp_path, arg, message):
    out = tmp_path / "out"
    with pytest.raises(ConfigError) as error:
        train.main(tiny(tiny_corpus, out) + [arg])
    assert message in str(error.value) and "\n" not in str(error.value)
    assert not out.exists()


def test_out_dir_must_be_a_writable_directory(tiny_corpus, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        train.main(tiny(tiny_corpus, tmp_path / "file"))
    with pytest.raises(UserError, match="not a writable directory"):  # a directory that cannot be made
        train.main(tiny(tiny_corpus, tmp_path / "file" / "out"))


def test_data_messages_point_at_the_cause(tiny_corpus, tmp_path):
    with pytest.raises(DataError, match=r"too few for block_size=100000: use --block_size below"):
        train.main(tiny(tiny_corpus, tmp_path / "o", block_size=100000))
    empty = tmp_path / "mydata"
    empty.mkdir()
    with pytest.raises(DataError) as error:
        train.main(tiny(str(empty), tmp_path / "o"))
    assert "has no prepare.py" in str(error.value) and "data/" not in str(error.value).replace(str(empty), "")
    assert not (tmp_path / "o").exists()  # a run that failed before writing leaves no folder with a .lock in it


@pytest.mark.parametrize("damage,message", [
    (lambda ckpt: ckpt["model_args"].update(n_expert=4), "'n_expert', which this code's model does not have"),
    (lambda ckpt: ckpt.pop("optimizer"), "lacks optimizer: it cannot be resumed"),
])
def test_a_checkpoint_this_code_cannot_continue_is_one_line(tiny_corpus, trained, tmp_path, damage, message):
    import torch
    out = copy_run(trained, tmp_path)
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    damage(ckpt)
    torch.save(ckpt, out / "ckpt.pt")
    with pytest.raises(UserError, match=message):
        train.main(tiny(tiny_corpus, out, max_iters=20, init_from="resume"))


def test_a_new_run_in_another_tools_folder_is_one_line_and_writes_nothing(tiny_corpus, tmp_path, capsys):
    """A Hugging Face folder (hf.py's: config.json without train.py's model_args) as --out_dir: refused in one
    line, its files as they were; --overwrite=True is the way to replace them."""
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_layer": 2}))
    (out / "model.safetensors").write_bytes(b"weights")
    before = files_of(out)
    status, err = in_process(tiny(tiny_corpus, out, max_iters=2, eval_interval=2), capsys)
    assert status == 1 and err.count("\n") == 1 and "is not a record of a run of train.py" in err, err
    after = files_of(out)
    after.pop(".lock")  # the lock every run takes on its out_dir before it reads anything there
    assert "--overwrite=True" in err and after == before


def test_a_missing_init_from_says_it_is_missing_in_one_line(tiny_corpus, tmp_path, capsys):
    missing = str(tmp_path / "missing" / "ckpt.pt")
    status, err = in_process(tiny(tiny_corpus, tmp_path / "new", init_from=missing), capsys)
    assert status == 1 and err.count("\n") == 1 and "(no such file or directory)" in err, err
