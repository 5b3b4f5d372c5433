"""train.py end to end on tiny models: learning, exact resume, data parallelism, bad input."""
import hashlib
import json
import os
import platform
import subprocess
import sys

import numpy as np
import pytest

import train
from configurator import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A small corpus with structure to learn: repeated lines of Python-like text, byte tokens."""
    d = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    words = [b"def ", b"return ", b"self", b"(x)", b": ", b"\n", b"    ", b"import os", b" = ", b"1"]
    text = b"".join(words[i] for i in rng.integers(0, len(words), 40000))
    ids = np.frombuffer(text, dtype=np.uint8).astype(np.uint16)
    ids[: len(ids) * 9 // 10].tofile(d / "train.bin")
    ids[len(ids) * 9 // 10:].tofile(d / "val.bin")
    (d / "meta.json").write_text(json.dumps({"vocab_size": 256, "tokenizer": "bytes", "dtype": "uint16"}))
    return str(d)


def tiny(data_dir, out_dir, **kw):
    args = dict(dataset=data_dir, out_dir=str(out_dir), n_layer=2, n_head=2, n_embd=64, block_size=32,
                batch_size=8, max_iters=30, eval_interval=10, log_interval=1, eval_iters=2, warmup_iters=5,
                lr_decay_iters=30, learning_rate=3e-3, device="cpu")
    args.update(kw)
    return [f"--{k}={v}" for k, v in args.items()]


def losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return {r["iter"]: r["loss"] for r in records if "loss" in r}


def run_cli(args, **kw):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, **kw)


@pytest.mark.parametrize("arch", ["gpt2", "llama2"])
@pytest.mark.parametrize("method", ["bf16", "diffq[all]", "gaussws[all]"])
def test_loss_falls(data_dir, tmp_path, arch, method):
    train.main(tiny(data_dir, tmp_path, arch=arch, method=method, bias=arch == "gpt2"))
    curve = losses(tmp_path)
    first, last = np.mean([curve[i] for i in (1, 2, 3)]), np.mean([curve[i] for i in (28, 29, 30)])
    assert last < first - 1.0, (first, last)
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    logged = [r for r in records if "loss" in r][-1]
    assert {"lr", "ms_per_iter", "tokens_per_s"} <= set(logged)
    if method != "bf16":
        assert {"b_t/mean", "b_t/min", "b_t/max"} <= set(logged)


def test_bitwidths_move_toward_target_under_decay(data_dir, tmp_path):
    train.main(tiny(data_dir, tmp_path, max_iters=20, bitwidth_weight_decay=5.0, learning_rate=1e-2))
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f if "b_t/mean" in line]
    assert records[-1]["b_t/mean"] < 6.0 - 0.1 and records[-1]["b_t/max"] < 6.0


def test_resume_continues_the_same_losses(data_dir, tmp_path):
    whole, part = tmp_path / "whole", tmp_path / "part"
    train.main(tiny(data_dir, whole, max_iters=20, lr_decay_iters=20))
    train.main(tiny(data_dir, part, max_iters=10, lr_decay_iters=20))
    train.main(tiny(data_dir, part, max_iters=20, lr_decay_iters=20, init_from="resume"))
    assert losses(part) == losses(whole)
    assert len(losses(part)) == 20


def test_compiled_run_trains_as_eager_and_saves_a_loadable_model(data_dir, tmp_path):
    import torch
    import gaussws
    from model import GPT, ROLES, ModelConfig
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    train.main(tiny(data_dir, eager, max_iters=4, eval_interval=4, dtype="float32"))
    train.main(tiny(data_dir, compiled, max_iters=4, eval_interval=4, dtype="float32", compile=True))
    a, b = losses(eager), losses(compiled)
    np.testing.assert_allclose([a[k] for k in a], [b[k] for k in a], rtol=1e-4)
    ckpt = torch.load(compiled / "ckpt.pt", weights_only=True)
    assert {"model", "optimizer", "model_args", "pqt", "iter_num", "config", "rng_state"} <= set(ckpt)
    assert ckpt["iter_num"] == 4 and ckpt["pqt"] == {"method": "gaussws[all]", "b_init": 6.0, "b_target": 4.0,
                                                       "pqt_start": 0.0, "target_format": "", "ste_start": 0.0,
                                                       "bits_per_weight": 0.0}
    model = gaussws.convert(GPT(ModelConfig(**ckpt["model_args"])), "gaussws[all]", ROLES["gpt2"])
    model.load_state_dict(ckpt["model"])  # strict: the same names as a fresh model, whatever compiled it


def _originals():
    import gaussws
    return {"build_optimizers": gaussws.build_optimizers, "get_batch": train.get_batch, "load_state": train.load_state}


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
    monkeypatch.setattr(train, "get_batch", recording_get_batch)
    return seen


@pytest.mark.parametrize("arch", ["gpt2", "llama2"])
def test_every_method_starts_from_the_same_weights_and_batches(data_dir, tmp_path, monkeypatch, arch):
    import torch
    runs = {}
    for method in ("bf16", "gaussws[all]", "diffq[od]"):
        seen = snapshot_start(monkeypatch)
        train.main(tiny(data_dir, tmp_path / method, arch=arch, bias=arch == "gpt2", method=method, max_iters=2,
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


def test_pqt_run_started_from_a_bf16_checkpoint_keeps_its_weights(data_dir, tmp_path, monkeypatch):
    import torch
    bf16, pqt, back = tmp_path / "bf16", tmp_path / "pqt", tmp_path / "back"
    train.main(tiny(data_dir, bf16, method="bf16", max_iters=10))
    source = torch.load(bf16 / "ckpt.pt", weights_only=True)
    seen = snapshot_start(monkeypatch)
    train.main(tiny(data_dir, pqt, method="gaussws[od]", init_from=str(bf16), max_iters=4, eval_interval=4))
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
    train.main(tiny(data_dir, back, method="bf16", init_from=str(pqt / "ckpt.pt"), max_iters=1, eval_interval=1))
    assert set(seen["weights"]) == set(source["model"])
    assert all(torch.equal(seen["weights"][k], v) for k, v in ckpt["model"].items() if not k.endswith("b_i"))


def test_init_from_refuses_another_shape_in_one_line(data_dir, trained, tmp_path):
    r = run_cli(tiny(data_dir, tmp_path / "new", init_from=str(trained), n_layer=3))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "has another shape" in line and "n_layer" in line


def torchrun(args):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           os.path.join(ROOT, "train.py"), *args], capture_output=True, text=True, timeout=600, cwd=ROOT)


@pytest.mark.parametrize("parallel,optimizer", [("ddp", "adamw"), ("ddp", "adam_mini"), ("fsdp", "adamw")])
def test_two_processes_match_one_with_the_same_global_batch(data_dir, tmp_path, parallel, optimizer):
    import shutil
    import checkpoint
    one, two, three = tmp_path / "one", tmp_path / "two", tmp_path / "three"
    args = dict(max_iters=6, eval_interval=3, gradient_accumulation_steps=2, dtype="float32", optimizer=optimizer,
                lr_decay_iters=6)
    r1 = run_cli(tiny(data_dir, one, **args))
    assert r1.returncode == 0, r1.stderr
    if parallel == "fsdp":
        # 3 steps on 2 processes save a sharded checkpoint (ckpt.dcp); it is resumed for the other
        # 3 steps by 2 processes, and, from a copy, by 1 process
        r2 = torchrun(tiny(data_dir, two, **{**args, "max_iters": 3}, parallel=parallel))
        assert r2.returncode == 0, r2.stderr[-3000:]
        assert os.path.islink(two / "ckpt.dcp") and not os.path.exists(two / "ckpt.pt")
        shutil.copytree(two, three, symlinks=True)
        r2 = torchrun(tiny(data_dir, two, **args, parallel=parallel, init_from="resume"))
        r3 = run_cli(tiny(data_dir, three, **args, init_from="resume"))
        assert r3.returncode == 0, r3.stderr[-3000:]
        assert (three / "ckpt.pt").exists() and not os.path.lexists(three / "ckpt.dcp")  # one checkpoint per out_dir
    else:
        r2 = torchrun(tiny(data_dir, two, **args, parallel=parallel))
    assert r2.returncode == 0, r2.stderr[-3000:]
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
        c2 = {**checkpoint.load_model(two / "ckpt.dcp"), "optimizer": torch.load(three / "ckpt.pt", weights_only=True)["optimizer"]}
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


@pytest.mark.parametrize("arch", ["gpt2", "llama2"])
def test_adam_mini_trains_with_gaussws(data_dir, tmp_path, arch):
    train.main(tiny(data_dir, tmp_path, arch=arch, bias=arch == "gpt2", optimizer="adam_mini", max_iters=20,
                    lr_decay_iters=20, bitwidth_weight_decay=1.0, learning_rate=1e-2))
    curve = losses(tmp_path)
    assert np.mean([curve[i] for i in (18, 19, 20)]) < np.mean([curve[i] for i in (1, 2, 3)]) - 0.5
    with open(tmp_path / "metrics.jsonl") as f:
        b_t = [json.loads(line) for line in f if "b_t/mean" in line]
    assert b_t[0]["b_t/min"] < b_t[0]["b_t/max"]  # b_i are trained from the first step
    assert b_t[-1]["b_t/mean"] < b_t[0]["b_t/mean"]  # and decay pulls b_t toward b_target


def digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    train.main(tiny(data_dir, out, max_iters=10))
    return out


@pytest.mark.parametrize("args,message", [
    (["--n_layr=3"], "unknown config key 'n_layr'; did you mean --n_layer"),
    (["--batch_size=big"], "expected a int"),
    (["--learning_rate=True"], "takes a float"),
    (["--method=gaussws[qkv,foo]"], "bad method"),
    (["--method=gaussws[all]", "--arch=llama2", "--bias=False", "--init_from=resume"], "holds another model"),
    (["--max_iters=20"], "holds another run"),
    (["--dataset=/nonexistent/data"], "not found; prepare the data first"),
    (["config/does_not_exist.py"], "config file"),
])
def test_bad_input_is_one_line_and_keeps_the_checkpoint(data_dir, trained, args, message):
    before = digest(trained / "ckpt.pt")
    r = run_cli(tiny(data_dir, trained, max_iters=10) + args)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert digest(trained / "ckpt.pt") == before


def test_corrupt_data_and_checkpoint_are_reported(data_dir, trained, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "meta.json").write_text("{not json")
    r = run_cli(tiny(str(bad), tmp_path / "o"))
    assert r.returncode == 1 and "corrupt" in r.stderr and "Traceback" not in r.stderr
    (bad / "meta.json").write_text(json.dumps({"vocab_size": 256, "dtype": "uint16"}))
    (bad / "train.bin").write_bytes(b"\x01")
    r = run_cli(tiny(str(bad), tmp_path / "o"))
    assert r.returncode == 1 and "train.bin holds 1 bytes, not a whole number" in r.stderr
    assert "Traceback" not in r.stderr
    for split in ("train", "val"):  # whole files again: only the vocabulary is wrong now
        (bad / f"{split}.bin").write_bytes(np.arange(1000, dtype=np.uint16).tobytes())
    (bad / "meta.json").write_text(json.dumps({"vocab_size": 50257, "dtype": "uint16", "tokenizer": "tiktoken:gpt2"}))
    r = run_cli(tiny(str(bad), tmp_path / "o", vocab_size=32000))
    assert r.returncode == 1 and "vocabulary of 50257" in r.stderr and "Traceback" not in r.stderr
    out = tmp_path / "garbage"
    out.mkdir()
    (out / "ckpt.pt").write_bytes(b"not a checkpoint")
    r = run_cli(tiny(data_dir, out, init_from="resume"))
    assert r.returncode == 1 and "not a checkpoint" in r.stderr and "Traceback" not in r.stderr
    assert (out / "ckpt.pt").read_bytes() == b"not a checkpoint"


def test_a_second_run_on_a_locked_out_dir_is_one_line_and_changes_nothing(data_dir, trained):
    import checkpoint
    before = digest(trained / "ckpt.pt")
    with checkpoint.lock(str(trained)):  # as a run that holds the directory does
        r = run_cli(tiny(data_dir, trained, max_iters=20, init_from="resume"))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "is in use by another run" in lines[0] and f"pid {os.getpid()}" in lines[0], lines
    assert digest(trained / "ckpt.pt") == before


def test_a_checkpoint_with_flipped_bytes_is_refused_in_one_line(data_dir, trained, tmp_path):
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
    r = run_cli(tiny(data_dir, out, max_iters=20, init_from="resume"))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "corrupt" in lines[0] and "CRC" in lines[0], lines
    assert (out / "ckpt.pt").read_bytes() == bytes(data)


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(data_dir, trained, tmp_path):
    out = copy_run(trained, tmp_path)
    before = digest(out / "ckpt.pt")
    r = run_cli(tiny(data_dir, out, max_iters=40, init_from="resume", learning_rate=1e30, grad_clip=0.0,
                     warmup_iters=0, decay_lr=False, dtype="float32", eval_interval=1000))
    assert r.returncode == train.EXIT_DIVERGED == 3, r.stderr
    assert "loss is nan" in r.stderr or "loss is inf" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert digest(out / "ckpt.pt") == before
    assert divergence(out) == {"step": 11, "what": "loss", "checkpoint_step": 10}  # step 10 updated with lr 1e30


def test_dry_run_prints_config_and_exits(tmp_path):
    r = run_cli(["--model=gpt2-124m", "--dry_run=True", f"--out_dir={tmp_path}"])
    assert r.returncode == 0, r.stderr
    assert "tokens per optimizer step" in r.stdout and "124" in r.stdout
    assert not os.listdir(tmp_path)


def test_wandb_gets_config_metrics_and_bitwidth_histograms(data_dir, tmp_path, monkeypatch):
    import types
    calls = {"init": [], "log": []}
    fake = types.SimpleNamespace(init=lambda **kw: calls["init"].append(kw),
                                 log=lambda record, step: calls["log"].append((step, record)),
                                 Histogram=lambda values: ("histogram", len(values)))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    train.main(tiny(data_dir, tmp_path, max_iters=4, eval_interval=2, wandb_log=True, wandb_mode="offline"))
    (init,) = calls["init"]
    assert init["mode"] == "offline" and init["config"]["method"] == "gaussws[all]" and "model_args" in init["config"]
    keys = set().union(*(record for _, record in calls["log"]))
    assert {"loss", "lr", "ms_per_iter", "tokens_per_s", "b_t/mean", "val/loss"} <= keys
    # n_embd 64: c_attn is 192 x 64, 6 x 2 blocks of 32 x 32
    hists = [record for _, record in calls["log"] if "b_t/transformer.h.0.attn.c_attn" in record]
    assert len(hists) == 3 and hists[0]["b_t/transformer.h.0.attn.c_attn"] == ("histogram", 12)
    assert sum(k.startswith("b_t/transformer.") for k in hists[0]) == 8  # 2 blocks x 4 PQT layers


def test_wandb_offline_mode_runs_without_network(data_dir, tmp_path):
    r = run_cli(tiny(data_dir, tmp_path, max_iters=2, eval_interval=2, wandb_log=True, wandb_mode="offline"),
                env={**os.environ, "WANDB_SILENT": "true"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert any(name.startswith("offline-run") for name in os.listdir(tmp_path / "wandb"))


def test_recomputing_w_hat_trains_the_same(data_dir, tmp_path):
    kept, recomputed = tmp_path / "kept", tmp_path / "recomputed"
    train.main(tiny(data_dir, kept, max_iters=8, eval_interval=100))
    train.main(tiny(data_dir, recomputed, max_iters=8, eval_interval=100, recompute_w_hat=True))
    a, b = losses(kept), losses(recomputed)
    # The same forward; only b_t's gradient is summed in another order (once per step vs per micro-step).
    np.testing.assert_allclose([a[k] for k in a], [b[k] for k in a], rtol=1e-4)


_MALLOC_CHECK = """
import ctypes, torch, train
class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = Mallinfo2
def mmapped_by_a_large_tensor():
    before = mallinfo2().hblkhd
    t = torch.empty(64 * 2**20, dtype=torch.uint8)  # above glibc's largest mmap threshold (32 MB)
    return mallinfo2().hblkhd - before
print(mmapped_by_a_large_tensor(), train.keep_freed_cpu_memory(), mmapped_by_a_large_tensor())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt and mallinfo2 are glibc's")
def test_keep_freed_cpu_memory_puts_large_tensors_in_the_heap():
    # A fresh process: bench.main (tests/test_bench.py) already changed this one's malloc.
    out = subprocess.run([sys.executable, "-c", _MALLOC_CHECK], cwd=ROOT, capture_output=True, text=True, check=True)
    default, changed, after = out.stdout.split()
    assert int(default) >= 64 * 2**20  # by default its own mmap, given back at free (and faulted in again)
    assert changed == "True" and int(after) == 0  # now in the heap, where a freed block is reused


# --- runs that end, checkpoints that stay good, configs refused before anything is written ---------

def copy_run(trained, tmp_path):
    import shutil
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    return out


def divergence(out_dir):
    """diverged.json read by hand: its step, what went wrong and the step of the checkpoint kept."""
    with open(os.path.join(out_dir, "diverged.json")) as f:
        record = json.load(f)
    return {k: record[k] for k in ("step", "what", "checkpoint_step")}


@pytest.mark.parametrize("max_iters", [5, 10, 0])
def test_resume_at_or_past_max_iters_ends_at_once(data_dir, trained, tmp_path, capsys, max_iters):
    out = copy_run(trained, tmp_path)
    before, metrics = digest(out / "ckpt.pt"), (out / "metrics.jsonl").read_text()
    train.main(tiny(data_dir, out, max_iters=max_iters, init_from="resume"))
    printed = capsys.readouterr().out
    assert "is at step 10" in printed and "nothing to train" in printed
    assert digest(out / "ckpt.pt") == before and (out / "metrics.jsonl").read_text() == metrics


def test_resume_keeps_metrics_up_to_its_checkpoint(data_dir, trained, tmp_path):
    out = copy_run(trained, tmp_path)
    with open(out / "metrics.jsonl", "a") as f:  # records of a crashed continuation, the last cut short
        f.write(json.dumps({"iter": 11, "loss": 1.0}) + "\n" + '{"iter": 12, "lo')
    train.main(tiny(data_dir, out, max_iters=12, init_from="resume"))
    with open(out / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    steps = [(r["iter"], "val/loss" in r) for r in records]
    assert len(steps) == len(set(steps))  # no step logged twice (the eval at 10 not again)
    assert [i for i, ev in steps if not ev] == list(range(1, 13))
    assert [i for i, ev in steps if ev] == [0, 10, 12]
    assert all(r["loss"] != 1.0 for r in records if "loss" in r)


def test_a_new_run_starts_its_metrics_afresh(data_dir, trained, tmp_path):
    out = copy_run(trained, tmp_path)
    train.main(tiny(data_dir, out, max_iters=2, eval_interval=2, overwrite=True))
    with open(out / "metrics.jsonl") as f:
        assert [json.loads(line)["iter"] for line in f] == [0, 1, 2, 2]


def test_nan_at_an_eval_step_keeps_the_good_checkpoint(data_dir, trained, tmp_path):
    import torch
    out = copy_run(trained, tmp_path)
    before = digest(out / "ckpt.pt")
    # step 10 is finite and updates with lr 1e30: the model evaluated (and due to be saved) at step 11 is not
    with pytest.raises(ConfigError) as error:
        train.main(tiny(data_dir, out, max_iters=20, init_from="resume", learning_rate=1e30, grad_clip=0.0,
                        warmup_iters=0, decay_lr=False, dtype="float32", eval_interval=1))
    message = str(error.value)
    assert "at step 11" in message and f"the last good checkpoint is {out / 'ckpt.pt'}, step 10" in message
    assert isinstance(error.value, train.Diverged)
    assert divergence(out) == {"step": 11, "what": "eval_loss", "checkpoint_step": 10}
    assert digest(out / "ckpt.pt") == before
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert ckpt["iter_num"] == 10 and all(torch.isfinite(v).all() for v in ckpt["model"].values())


def test_an_inf_gradient_with_a_finite_loss_is_not_applied(data_dir, trained, tmp_path, monkeypatch):
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
    monkeypatch.setattr(train, "load_state", lambda model, o, ckpt, fsdp: (ORIGINAL["load_state"](model, o, ckpt, fsdp),
                                                                            weights.update(ckpt["model"])))
    for grad_clip in (1.0, 0.0):  # clipped or not, the norm is checked
        with pytest.raises(ConfigError, match=r"gradient norm is (inf|nan) \(loss \d"):
            train.main(tiny(data_dir, out, max_iters=20, init_from="resume", grad_clip=grad_clip))
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
def test_a_bad_config_is_one_line_before_anything_is_written(data_dir, tmp_path, arg, message):
    out = tmp_path / "out"
    with pytest.raises(ConfigError) as error:
        train.main(tiny(data_dir, out) + [arg])
    assert message in str(error.value) and "\n" not in str(error.value)
    assert not out.exists()


def test_out_dir_must_be_a_writable_directory(data_dir, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        train.main(tiny(data_dir, tmp_path / "file"))
    with pytest.raises(ConfigError, match="not a writable directory"):  # a directory that cannot be made
        train.main(tiny(data_dir, tmp_path / "file" / "out"))


def test_data_messages_point_at_the_cause(data_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"too few for block_size=100000: use --block_size below"):
        train.main(tiny(data_dir, tmp_path / "o", block_size=100000))
    empty = tmp_path / "mydata"
    empty.mkdir()
    with pytest.raises(ConfigError) as error:
        train.main(tiny(str(empty), tmp_path / "o"))
    assert "has no prepare.py" in str(error.value) and "data/" not in str(error.value).replace(str(empty), "")


@pytest.mark.parametrize("damage,message", [
    (lambda ckpt: ckpt["model_args"].update(n_expert=4), "'n_expert', which this code's model does not have"),
    (lambda ckpt: ckpt.pop("optimizer"), "lacks optimizer: it cannot be resumed"),
])
def test_a_checkpoint_this_code_cannot_continue_is_one_line(data_dir, trained, tmp_path, damage, message):
    import torch
    out = copy_run(trained, tmp_path)
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    damage(ckpt)
    torch.save(ckpt, out / "ckpt.pt")
    with pytest.raises(ConfigError, match=message):
        train.main(tiny(data_dir, out, max_iters=20, init_from="resume"))


# --- a run's record: what diverged, what is kept, what an evaluation or a crash leaves ------------

HUGE_LR = dict(init_from="resume", grad_clip=0.0, warmup_iters=0, decay_lr=False, dtype="float32", eval_interval=1)


def test_a_finite_but_diverged_model_never_replaces_the_good_checkpoint(data_dir, trained, tmp_path):
    """lr 1e3: the model after step 10 is finite, its val loss about 1.8e7 nats, far above ln(256) + 1."""
    import math
    import torch
    out = copy_run(trained, tmp_path)
    before = digest(out / "ckpt.pt")
    r = run_cli(tiny(data_dir, out, max_iters=20, learning_rate=1e3, **HUGE_LR))
    assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "val loss is" in line and "above ln(vocab_size) + 1" in line and "step 11" in line
    assert digest(out / "ckpt.pt") == before
    record = json.load(open(out / "diverged.json"))
    assert record["what"] == "val_loss" and record["step"] == 11 and record["checkpoint_step"] == 10
    assert record["value"] > record["limit"] == pytest.approx(math.log(256) + 1)
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert ckpt["iter_num"] == 10


def test_b_t_far_below_b_target_stops_the_run_before_a_save(data_dir, trained, tmp_path):
    """b_i = -5 by hand: b_t = 4 + (-5)(6 - 4) = -6, more than 8 bits below min(b_init 6, b_target 4)."""
    import torch
    out = copy_run(trained, tmp_path)
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    for k in ckpt["model"]:
        if k.endswith(".b_i"):
            ckpt["model"][k].fill_(-5.0)
    torch.save(ckpt, out / "ckpt.pt")
    before = digest(out / "ckpt.pt")
    with pytest.raises(train.Diverged, match=r"b_t fell to -6.*below min\(b_init, b_target\) - 8 = -4 at step 11"):
        train.main(tiny(data_dir, out, max_iters=20, eval_interval=1, init_from="resume"))
    assert divergence(out) == {"step": 11, "what": "b_t", "checkpoint_step": 10}
    assert digest(out / "ckpt.pt") == before


def test_non_finite_weights_the_eval_does_not_see_stop_the_run(data_dir, tmp_path):
    """A NaN row of Llama2's (untied) embedding for byte 255, which the data never holds: the loss
    stays finite, the weights are not."""
    import torch
    out = tmp_path / "llama"
    train.main(tiny(data_dir, out, max_iters=10, arch="llama2", bias=False))
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    ckpt["model"]["transformer.wte.weight"][255] = float("nan")
    torch.save(ckpt, out / "ckpt.pt")
    before = digest(out / "ckpt.pt")
    with pytest.raises(train.Diverged, match="the model holds non-finite values at step 11"):
        train.main(tiny(data_dir, out, max_iters=20, eval_interval=1, arch="llama2", bias=False, init_from="resume"))
    assert divergence(out) == {"step": 11, "what": "model", "checkpoint_step": 10}
    assert digest(out / "ckpt.pt") == before


def test_a_resumed_run_that_no_longer_diverges_drops_the_old_record(data_dir, trained, tmp_path):
    out = copy_run(trained, tmp_path)
    (out / "diverged.json").write_text(json.dumps({"step": 11, "what": "loss"}))
    train.main(tiny(data_dir, out, max_iters=12, init_from="resume"))
    assert not (out / "diverged.json").exists()


def test_an_evaluation_leaves_the_runs_config_and_metrics_as_they_are(data_dir, trained, tmp_path, capsys):
    out = copy_run(trained, tmp_path)
    files = {f: (out / f).read_bytes() for f in ("config.json", "metrics.jsonl", "ckpt.pt")}
    train.main(tiny(data_dir, out, max_iters=10, init_from="resume", eval_only=True, learning_rate=0.5))
    assert "step 10: train loss" in capsys.readouterr().out
    assert {f: (out / f).read_bytes() for f in files} == files


class Killed(BaseException):
    """What a kill -9 at that point leaves, in this process: nothing after it runs."""


def test_an_overwrite_killed_before_its_first_save_leaves_no_checkpoint_to_resume(data_dir, trained, tmp_path,
                                                                                   monkeypatch):
    out = copy_run(trained, tmp_path)

    def killed(*args, **kwargs):
        raise Killed()
    monkeypatch.setattr(train, "save_checkpoint", killed)
    with pytest.raises(Killed):  # the new run (another lr) is killed at its first save, step 4
        train.main(tiny(data_dir, out, max_iters=10, eval_interval=4, learning_rate=1e-3, overwrite=True))
    monkeypatch.undo()
    assert not (out / "ckpt.pt").exists()  # the replaced run's checkpoint went before the new run began
    with open(out / "metrics.jsonl") as f:
        assert [json.loads(line)["iter"] for line in f] == [0, 1, 2, 3, 4, 4]  # the new run's only (log, eval at 4)
    with pytest.raises(ConfigError, match="holds no checkpoint"):
        train.main(tiny(data_dir, out, max_iters=10, init_from="resume"))


def full_disk_open(monkeypatch, marker):
    """open() as on a full disk for text that holds `marker`: the file is opened (a "w" truncates it),
    the write raises ENOSPC. Every open of any module goes through it, old code's and new code's."""
    import builtins
    import errno
    real_open = builtins.open

    class Full:
        def __init__(self, f):
            self._f = f

        def write(self, text):
            if marker in text:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self._f.write(text)

        def writelines(self, lines):
            for line in lines:
                self.write(line)

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

    def patched(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return Full(f) if "w" in mode or "a" in mode else f
    monkeypatch.setattr(builtins, "open", patched)


def test_a_crash_while_resuming_rewrites_no_metrics_in_place(data_dir, trained, tmp_path, monkeypatch):
    """The kept lines go to a temporary file renamed over metrics.jsonl: a write that fails there
    (here a full disk) leaves every record up to the checkpoint."""
    out = copy_run(trained, tmp_path)
    with open(out / "metrics.jsonl", "a") as f:  # a crashed continuation's record, to be dropped
        f.write(json.dumps({"iter": 11, "loss": 1.0}) + "\n")
    before = (out / "metrics.jsonl").read_bytes()
    full_disk_open(monkeypatch, '"iter"')
    with pytest.raises(ConfigError) as error:
        train.main(tiny(data_dir, out, max_iters=12, init_from="resume"))
    monkeypatch.undo()
    assert "No space left on device" in str(error.value) and "\n" not in str(error.value)
    assert (out / "metrics.jsonl").read_bytes() == before
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]


def test_a_full_disk_at_config_json_is_one_line_and_keeps_the_old_one(data_dir, trained, tmp_path, monkeypatch):
    out = copy_run(trained, tmp_path)
    files = {f: (out / f).read_bytes() for f in ("config.json", "metrics.jsonl", "ckpt.pt")}
    full_disk_open(monkeypatch, '"model_args"')
    with pytest.raises(ConfigError) as error:
        train.main(tiny(data_dir, out, max_iters=12, init_from="resume"))
    monkeypatch.undo()
    assert "config.json: No space left on device" in str(error.value) and "\n" not in str(error.value)
    assert {f: (out / f).read_bytes() for f in files} == files
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]


def test_a_full_disk_at_a_metrics_line_is_one_line_and_keeps_the_checkpoint(data_dir, trained, tmp_path,
                                                                           monkeypatch):
    out = copy_run(trained, tmp_path)
    before = digest(out / "ckpt.pt")
    full_disk_open(monkeypatch, '"iter": 12')  # the log line of step 12 finds the disk full
    with pytest.raises(ConfigError) as error:
        train.main(tiny(data_dir, out, max_iters=14, eval_interval=2, init_from="resume"))
    monkeypatch.undo()
    message = str(error.value)
    assert "metrics.jsonl: No space left on device" in message and "\n" not in message
    assert f"the last good checkpoint is {out / 'ckpt.pt'}, step 10" in message
    assert digest(out / "ckpt.pt") == before
    with open(out / "metrics.jsonl") as f:
        assert max(json.loads(line)["iter"] for line in f) == 11


def test_a_full_disk_at_the_locks_pid_is_one_line_and_releases_the_lock(data_dir, trained, tmp_path, monkeypatch):
    import errno
    import checkpoint
    out = copy_run(trained, tmp_path)
    files = {f: (out / f).read_bytes() for f in ("config.json", "metrics.jsonl", "ckpt.pt")}

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(ConfigError) as error:
        train.main(tiny(data_dir, out, max_iters=12, init_from="resume"))
    monkeypatch.undo()
    assert ".lock: No space left on device" in str(error.value) and "\n" not in str(error.value)
    assert {f: (out / f).read_bytes() for f in files} == files
    checkpoint.lock(str(out)).release()  # not held any more


def test_a_full_disk_inside_torch_save_is_one_line_and_keeps_the_checkpoint(data_dir, trained, tmp_path,
                                                                           monkeypatch):
    """torch.save turns the file's ENOSPC into RuntimeError "unexpected pos N vs M"."""
    import errno
    import io
    import checkpoint
    out = copy_run(trained, tmp_path)
    before = digest(out / "ckpt.pt")

    class FillsUp(io.FileIO):
        written = 0

        def write(self, b):
            FillsUp.written += len(b)
            if FillsUp.written > 100_000:
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().write(b)
    monkeypatch.setattr(checkpoint.os, "fdopen", lambda fd, mode: FillsUp(fd, "wb"))
    with pytest.raises(ConfigError) as error:
        train.main(tiny(data_dir, out, max_iters=12, eval_interval=2, init_from="resume"))
    monkeypatch.undo()
    message = str(error.value)
    assert "No space left on device" in message and "unchanged" in message and "\n" not in message
    assert digest(out / "ckpt.pt") == before
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]


def dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_the_next_run_removes_the_temporaries_of_dead_writers_only(data_dir, trained, tmp_path):
    out = copy_run(trained, tmp_path)
    dead, live = dead_pid(), os.getpid()
    stale = [f".ckpt.pt.{dead}.0123abcd.tmp", f".metrics.jsonl.{dead}.89abcdef.tmp"]
    kept = [f".ckpt.pt.{live}.0123abcd.tmp", "notes.tmp", "ckpt.dcp.0123abcd"]  # a live writer's; not ours
    for name in stale + kept[:2]:
        (out / name).write_bytes(b"partial")
    (out / "ckpt.dcp.0badf00d").mkdir()  # a sharded save killed before its symlink swap
    (out / "ckpt.dcp.0badf00d" / ".metadata").write_bytes(b"partial")
    (out / "ckpt.dcp.0123abcd").mkdir()  # a directory of the same name, but nothing DCP wrote
    train.main(tiny(data_dir, out, max_iters=12, init_from="resume"))
    left = set(os.listdir(out))
    assert not left & set(stale + ["ckpt.dcp.0badf00d"]) and set(kept) <= left


def test_weights_that_do_not_fit_the_checkpoints_model_args_are_one_line(data_dir, trained, tmp_path):
    import torch
    out = copy_run(trained, tmp_path)
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    ckpt["model"]["transformer.wte.weight"] = ckpt["model"]["transformer.wte.weight"][:, :32].clone()
    torch.save(ckpt, out / "ckpt.pt")
    before = digest(out / "ckpt.pt")
    r = run_cli(tiny(data_dir, out, max_iters=20, init_from="resume"))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "do not fit the model its model_args describe" in line and "size mismatch for transformer.wte.weight" in line
    assert digest(out / "ckpt.pt") == before


def test_the_sane_model_rule_at_its_bounds():
    """ln(256) + 1 = 6.5452 nats; b_t at least min(b_init, b_target) - 8."""
    ok, nan = {"train": 2.0, "val": 2.0}, float("nan")
    assert train.insanity(ok, {"min": -3.99}, 256, 4.0, trained=True) is None
    assert train.insanity(ok, {"min": -4.01}, 256, 4.0, trained=True) == ("b_t", -4.01, -4.0)
    assert train.insanity(ok, {"min": nan}, 256, 4.0, trained=True)[0] == "b_t"
    assert train.insanity(ok, None, 256, 4.0, trained=True) is None  # bf16: no b_t
    assert train.insanity({"train": 9.0, "val": 6.545}, None, 256, 4.0, trained=True) is None
    assert train.insanity({"train": 2.0, "val": 6.546}, None, 256, 4.0, trained=True)[0] == "val_loss"
    assert train.insanity({"train": 2.0, "val": 50.0}, None, 256, 4.0, trained=False) is None  # nothing trained yet
    assert train.insanity({"train": nan, "val": 2.0}, None, 256, 4.0, trained=False)[0] == "eval_loss"
