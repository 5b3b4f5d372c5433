"""bench.py measures the real thing: the timed callables are the method, the baseline is the paper's,
the memory accounting sees w_hat, and bad arguments fail in one line. No timing is asserted here:
speed targets are bench.py's to show, not the tests'."""
import inspect
import json
import math
import os
import subprocess
import sys
import types

import pytest
import torch
import torch.nn as nn

import bench
import gaussws
import train
import util
from benchmarks import fig6, options, table1
from conftest import ROOT
from quant import ggml_quants as G
from quant import ste
from quant import budget

KERNEL_KEYS = {"shape", "impl", "gelem_per_s", "speedup_vs_torch", "share_of_copy", "device"}
TRAIN_KEYS = {"method", "grad_accum", "tokens_per_s", "overhead_pct", "extra_bytes_per_param", "model", "device"}


def _bits(t):
    return t.view(torch.int16)


def test_kernel_writes_a_record_per_shape_and_impl(tmp_path):
    path = tmp_path / "kernel.json"
    bench.main(["kernel", "--shapes=64x96,33x65", "--repeats=1", f"--json={path}", "--device=cpu"])
    records = json.loads(path.read_text())
    assert {(tuple(r["shape"]), r["impl"]) for r in records} == {
        (s, i) for s in [(64, 96), (33, 65)] for i in ("copy", "torch", "ours", "diffq")}  # bm: GPU only
    speed = {(tuple(r["shape"]), r["impl"]): r["gelem_per_s"] for r in records}
    for r in records:
        assert KERNEL_KEYS <= r.keys() and r["device"] == "cpu"
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("gelem_per_s", "speedup_vs_torch", "share_of_copy"))
        # each ratio is taken against the torch and copy figures of the same shape
        shape = tuple(r["shape"])
        assert r["speedup_vs_torch"] == pytest.approx(r["gelem_per_s"] / speed[shape, "torch"])
        assert r["share_of_copy"] == pytest.approx(r["gelem_per_s"] / speed[shape, "copy"])


@pytest.mark.parametrize("method", ["gaussws", "diffq"])
def test_timed_callable_is_pseudo_quantize(method):
    w = torch.randn(33, 65) * 0.02
    b_t = 4 + 4 * torch.rand(2, 3)
    impls = fig6.kernel_impls(w, b_t, seed=77, device="cpu")
    fn, _ = impls["ours" if method == "gaussws" else "diffq"]
    assert torch.equal(_bits(fn()), _bits(gaussws.pseudo_quantize(w, b_t, 77, method)))
    assert impls["bm"][0] is None and "GPU" in impls["bm"][1]


def test_torch_baseline_is_eq3_with_its_r():
    """w + R * broadcast(max_bl|w| * 2^(1-b_t)), block by block, partial edge blocks included."""
    w = torch.randn(33, 65)
    b_t = torch.randint(2, 9, (2, 3)).float()
    got = fig6.torch_w_hat(w, b_t, torch.Generator().manual_seed(5))
    r = fig6.torch_r(w.shape, torch.Generator().manual_seed(5))
    want = torch.empty_like(w)
    for i in range(2):
        for j in range(3):
            rows, cols = slice(32 * i, 32 * i + 32), slice(32 * j, 32 * j + 32)
            scale = w[rows, cols].abs().max() * 2.0 ** (1 - b_t[i, j])
            want[rows, cols] = w[rows, cols] + r[rows, cols] * scale
    assert torch.equal(_bits(got), _bits(want.to(torch.bfloat16)))


def _normal(z):
    return 0.5 * (1 + math.erf(z / math.sqrt(2)))


def _max_z_against_rounded_normal(r):
    """Largest |z| of the counts of R = 0, +-1, +-2 against round(N(0,1)/2): R = k for N in (2k-1, 2k+1)."""
    n = r.numel()
    worst = 0.0
    for k in (-2, -1, 0, 1, 2):
        p = _normal(2 * k + 1) - _normal(2 * k - 1)
        count = (r == k).sum().item()
        worst = max(worst, abs(count - n * p) / math.sqrt(n * p * (1 - p)))
    return worst


def test_torch_baseline_draws_rounded_normal():
    # A w whose every 32x32 block has max |w| = 1 and b_t = 1 makes the scale 1, so w_hat - w is R
    # exactly (all values are small integers in BF16): the whole baseline is checked, not a helper.
    w = torch.zeros(1024, 1024)
    w[::32, ::32] = 1.0
    b_t = torch.ones(32, 32)
    r = fig6.torch_w_hat(w, b_t, torch.Generator().manual_seed(0)).float() - w
    assert torch.equal(r, r.round()) and r.abs().max() <= 3
    assert _max_z_against_rounded_normal(r) < 5
    # The check has power: Eq. 10's R (Pr(0) = 0.717, not 0.683) fails it by far.
    assert _max_z_against_rounded_normal(gaussws.sample_r((1024, 1024), 3)) > 20


TINY = ["--n_layer=1", "--n_embd=64", "--n_head=2", "--vocab_size=128", "--block_size=32", "--batch_size=2",
        "--rounds=1", "--warmup=1", "--device=cpu"]


# Step times the test makes, per method and round: (wall seconds, CPU seconds, TrainStep seconds).
MADE = {"bf16": [(1.0, 1.0, 0.0), (2.0, 1.0, 0.0), (1.0, 1.0, 0.0)],
        "gaussws[all]": [(1.25, 1.5, 0.1), (2.5, 1.5, 0.3), (2.0, 1.5, 0.2)],
        "diffq[od]": [(1.1, 1.0, 0.05), (2.2, 1.25, 0.1), (1.1, 1.0, 0.05)]}
# What the figures are by their definitions (README, bench.py's docstring), worked out by hand:
# tokens/s: the median over rounds of 64 tokens (2 x 32) / wall seconds; overhead: the median over
# rounds of 100 (1 - bf16's seconds / the method's); TrainStep's share: 100 * its seconds / bf16's step.
EXPECTED = {"bf16": dict(tokens_per_s=64.0, overhead_pct=0.0, overhead_cpu_time_pct=0.0, pqt_share_pct=0.0),
            "gaussws[all]": dict(tokens_per_s=32.0, overhead_pct=20.0, overhead_cpu_time_pct=100 / 3,
                                 pqt_share_pct=15.0),
            "diffq[od]": dict(tokens_per_s=64 / 1.1, overhead_pct=100 / 11, overhead_cpu_time_pct=0.0,
                              pqt_share_pct=5.0)}


def test_train_figures_are_those_of_the_step_times(tmp_path, monkeypatch):
    """bench.py train on a tiny GPT2: every method's real steps run, but the figures are computed
    from the step times the test makes (MADE), and must be their definitions' (EXPECTED)."""
    real_timed_step, real_pqt, rounds = table1.Runner.timed_step, {}, {}

    def made_timed_step(self, batches):
        _, _, peak = real_timed_step(self, batches)  # the real step: state, memory, TrainStep's real time
        real_pqt.setdefault(self.method, []).append(self.pqt_seconds)
        k = rounds[self.method] = rounds.get(self.method, -1) + 1
        wall, cpu, self.pqt_seconds = MADE[self.method][k % 3]
        return wall, cpu, peak
    monkeypatch.setattr(table1.Runner, "timed_step", made_timed_step)
    path = tmp_path / "train.json"
    bench.main(["train", "--methods=gaussws[all],diffq[od]", "--grad_accum=1", "--rounds=3", f"--json={path}"]
               + [a for a in TINY if not a.startswith("--rounds")])
    records = json.loads(path.read_text())
    assert [r["method"] for r in records] == ["bf16", "gaussws[all]", "diffq[od]"]
    for r in records:
        assert TRAIN_KEYS <= r.keys() and r["model"] == "gpt2-124m" and r["device"] == "cpu"
        assert r["step_s"] == [w for w, _, _ in MADE[r["method"]]]
        assert {k: r[k] for k in EXPECTED[r["method"]]} == pytest.approx(EXPECTED[r["method"]])
        if r["method"] != "bf16":
            assert r["extra_bytes_per_param"] > 0
    by_method = {r["method"]: r for r in records}
    # 1 layer of 64 wide: qkv 3*64*64 + out 64*64 + up 4*64*64 + down 4*64*64; [od]: out and down only.
    assert by_method["gaussws[all]"]["pqt_weight_params"] == 12 * 64 * 64
    assert by_method["diffq[od]"]["pqt_weight_params"] == 5 * 64 * 64
    # TrainStep's begin and end do nothing without PQT layers; with them they make w_hat and apply Eq. 4: the
    # medians of the rounds (one step preempted on a busy machine must not decide it)
    assert sorted(real_pqt["bf16"])[len(real_pqt["bf16"]) // 2] < \
        sorted(real_pqt["gaussws[all]"])[len(real_pqt["gaussws[all]"]) // 2]


def test_the_table_of_a_cuda_run_has_no_cpu_time_column(capsys):
    """On CUDA the step's CPU time is not recorded (None): the table leaves its column out rather than
    format a None."""
    args = types.SimpleNamespace(model="llama2-134m", batch_size=24, block_size=2048, device="cuda",
                                 recompute_w_hat=False, rounds=5)
    records = [dict(method=m, grad_accum=1, tokens_per_s=t, overhead_pct=o, overhead_cpu_time_pct=None,
                    pqt_share_pct=s, extra_bytes_per_param=b, switch_s=None, memory_measure="cuda_max_memory_allocated")
               for m, t, o, s, b in (("bf16", 303248.5, 0.0, 54.74, 0.0),
                                     ("gaussws[all]", 246003.2, 19.17, 77.44, 0.489))]
    table1.print_train_table(records, args)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert [c.strip() for c in lines[0].strip("|").split("|")] == [
        "method", "grad_accum", "tokens/s", "overhead vs bf16", "begin+end_step / bf16 step", "extra bytes/param"]
    assert [c.strip() for c in lines[3].strip("|").split("|")] == [
        "gaussws[all]", "1", "246003.2", "+19.17 %", "77.44 %", "0.489"]


def test_train_writes_a_record_per_method_and_grad_accum(tmp_path):
    path = tmp_path / "train.json"
    bench.main(["train", "--methods=gaussws[all],diffq[od]", "--grad_accum=1,2", f"--json={path}"] + TINY)
    records = json.loads(path.read_text())
    assert [(r["method"], r["grad_accum"]) for r in records] == [
        (m, a) for a in (1, 2) for m in ("bf16", "gaussws[all]", "diffq[od]")]
    assert all(r["tokens_per_s"] > 0 and math.isfinite(r["overhead_pct"]) for r in records)


class OneLayer(nn.Module):
    """A model of one Linear with the GPT interface; sum() saves nothing, so only the Linear's tensors count."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, y):
        out = self.layer(x)
        return out, out.float().sum()


def test_recomputed_w_hat_is_not_held():
    batch, n_in, n_out = 8, 96, 64
    layer = gaussws.PQTLinear(n_in, n_out, method="gaussws", recompute=True)
    x = torch.randn(batch, n_in, requires_grad=True)
    measured = table1.held_bytes(OneLayer(layer), x, None, "cpu")
    # x (FP32 at most), the block max and scale, the seed: nothing the size of the weight.
    assert 2 * batch * n_in <= measured <= 4 * batch * n_in + 16 * layer.b_i.numel() + 64 < 2 * n_out * n_in


@pytest.mark.parametrize("pqt", [False, True])
def test_held_bytes_of_one_layer_equals_independent_count(pqt):
    batch, n_in, n_out = 8, 96, 64
    layer = gaussws.PQTLinear(n_in, n_out, method="gaussws") if pqt else nn.Linear(n_in, n_out)
    x = torch.randn(batch, n_in, requires_grad=True)  # an activation, as inside a model
    measured = table1.held_bytes(OneLayer(layer), x, None, "cpu")
    # The Linear keeps BF16 copies of x and of its weight (bf16: autocast's cast; PQT: w_hat).
    expected = 2 * batch * n_in + 2 * n_out * n_in
    if not pqt:
        assert measured == expected
    else:
        # At most also R, packed at 0.5 byte per element, if the method keeps it for Eq. 4, and a few
        # FP32 values per 32x32 block (the block max) and the 8-byte seed: the 12 KiB w_hat must count.
        assert expected <= measured <= expected + n_out * n_in // 2 + 16 * layer.b_i.numel() + 64
        layer.cached = (torch.empty(1000),)  # what the method holds between forward and backward counts
        assert table1.held_bytes(OneLayer(layer), x, None, "cpu") == measured + 4000


def test_an_ste_layer_holds_its_w_q_beside_what_autocast_keeps():
    batch, n_in, n_out = 8, 256, 64
    x = torch.randn(batch, n_in, requires_grad=True)
    measured = table1.held_bytes(OneLayer(ste.STELinear(n_in, n_out, fmt="q4_k")), x, None, "cpu")
    # BF16 copies of x and of w_q (autocast's casts), and the step's FP32 w_q the layer holds
    assert measured == 2 * batch * n_in + 2 * n_out * n_in + 4 * n_out * n_in


STE_TINY = [a for a in TINY if not a.startswith("--n_embd")] + ["--n_embd=256"]


def test_ste_arms_time_steps_on_their_grids_after_a_budgets_switch(tmp_path, monkeypatch):
    """Each arm trains on its format (one fake quantization per layer and step: w_q made once); a budget
    chose its types at step 1, before any timed step, and its choice's seconds are reported."""
    path = tmp_path / "train.json"
    arms = ["ste[all]@q4_k", "ste[all]@error-gguf:4.5", "gaussws[all]@auto-gguf:3.5", "ste[all]@int3"]
    bench.main(["train", f"--methods={','.join(arms)}", f"--json={path}"] + STE_TINY)
    records = {r["method"]: r for r in json.loads(path.read_text())}
    assert list(records) == ["bf16"] + arms
    assert all(r["pqt_weight_params"] == 12 * 256 * 256 for m, r in records.items() if m != "bf16")
    assert [m for m, r in records.items() if r["switch_s"] is not None] == arms[1:3]
    assert all(r["extra_bytes_per_param"] > 0 and r["pqt_share_pct"] > 0 for m, r in records.items() if m != "bf16")
    args = options.parse_args(["train"] + STE_TINY)[1]
    runner = table1.Runner(args, "ste[all]@error-gguf:4.5")
    x = torch.randint(128, (2, 32))
    runner.past_switch([(x, x)])
    layers = gaussws.method_layers(runner.model)
    assert runner.step_count == 2 and runner.switch_seconds > 0 and len(layers) == 4
    assert all(layer.ggml() != budget.UNCHOSEN for layer in layers)
    calls = []
    fake_quantize = G.fake_quantize
    monkeypatch.setattr(G, "fake_quantize", lambda *a, **k: calls.append(a[1]) or fake_quantize(*a, **k))
    runner.step([(x, x), (x, x)])
    assert sorted(int(t) for t in calls) == sorted(layer.ggml() for layer in layers)


def test_train_steps_with_train_pys_optimizers_and_clipping(monkeypatch):
    assert table1.STEP_SETTINGS.items() <= train.DEFAULTS.items()  # train.py's defaults
    convert = inspect.signature(gaussws.convert).parameters  # the method's settings: convert's, train.py's too
    assert {k: convert[k].default for k in ("b_init", "b_target")}.items() <= train.DEFAULTS.items()
    args = options.parse_args(["train"] + TINY)[1]
    runner = table1.Runner(args, "gaussws[od]")
    groups = [g for o in runner.optimizers for g in o.param_groups]
    b_i = {id(layer.b_i) for layer in gaussws.pqt_layers(runner.model)}
    (own,) = [g for g in groups if {id(p) for p in g["params"]} & b_i]
    assert {id(p) for p in own["params"]} == b_i
    assert own["weight_decay"] == train.DEFAULTS["bitwidth_weight_decay"]
    others = [g for g in groups if g is not own]
    assert {g["weight_decay"] for g in others if g["params"][0].dim() == 1} == {0.0}  # biases, norms: no decay
    assert {g["weight_decay"] for g in others if g["params"][0].dim() == 2} == {train.DEFAULTS["weight_decay"]}
    assert all(g["lr"] == train.DEFAULTS["learning_rate"] for g in groups)
    clipped = []
    clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda params, max_norm: clipped.append(max_norm)
                        or clip(params, max_norm))
    x = torch.randint(128, (2, 32))
    before = {n: p.detach().clone() for n, p in runner.model.named_parameters()}
    runner.step([(x, x)])
    assert clipped == [train.DEFAULTS["grad_clip"]]
    changed = {n for n, p in runner.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == set(before)  # every parameter, b_i included, took the step


def test_host_counts_the_launches_of_both_paths_and_fits_their_slopes(tmp_path):
    """bench.py host on 2, 3 and 5 Linears: one layer at a time 17 launches a Linear (gen, apply, block sums;
    the block maxima, the scale, autograd's Eq. 4: benchmarks.host's LaunchCounter), batched a constant 9; the
    fitted lines (three points, so a fit can miss them) have those slopes and intercepts."""
    path = tmp_path / "host.json"
    records = bench.main(["host", "--layers=2,3,5", "--repeats=3", "--threads=1", f"--json={path}"])
    assert json.loads(path.read_text()) == records
    launches = {(r["batched"], r["linears"]): r["torch_launches"] + r["triton_launches"] for r in records}
    assert launches == {(False, 2): 34, (False, 3): 51, (False, 5): 85, (True, 2): 9, (True, 3): 9, (True, 5): 9}
    for r in records:
        fit = r["fit"]
        a, b = (fit["torch_launches"][k] + fit["triton_launches"][k] for k in (0, 1))
        assert (a, b) == (pytest.approx(9 if r["batched"] else 0, abs=1e-9), pytest.approx(0 if r["batched"] else 17))
        assert r["host_us"] > 0


def test_host_runs_from_the_shell_without_triton_interpret_set():
    """bench.py host takes the Triton path on CPU tensors: it must choose Triton's interpreter itself (without
    it Triton finds no driver on a machine with no GPU and the command died in a traceback)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "bench.py", "host", "--layers=2", "--repeats=1", "--threads=1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "2 Linears, batched" in proc.stdout


@pytest.mark.parametrize("argv, words", [
    (["kernel", "--shapes=12by4"], "bad shape"),
    (["kernel", "--repeats=0"], "--repeats=0: expected a positive integer"),
    (["host", "--repeats=-2"], "--repeats=-2: expected a positive integer"),
    (["train", "--rounds=0"], "--rounds=0: expected a positive integer"),
    (["kernel", "--device=tpu"], "expected cpu, cuda or cuda:N"),  # configurator.check_device's
    (["kernel", "--device=cuda"] if not torch.cuda.is_available() else ["kernel", "--device=xla"], "cuda"),
    (["kernel", "--threads=-1"], "--threads=-1"),
    (["kernel", "--model=gpt2-124m"], "unknown config key 'model'"),
    (["train", "--methods=bf16,gaussws[qkv,nope]"], "no layer 'nope'"),
    (["train", "--methods=ste[all]@q9"], "target format 'q9'"),
    (["train", "--methods=ste[all]"], "target format ''"),
    (["train", "--methods=ste[all]@q4_k:4"], "'q4_k' takes no :BITS"),
    (["train", "--methods=ste[all]@auto-gguf:4"], "ranks tensors by their learned b_t"),
    (["train", "--methods=ste[all]@error-gguf:9"], "bits_per_weight=9: expected 2.625"),
    (["train", "--methods=ste[all]@error-gguf:x"], "could not convert"),
    (["train", "--n_embd=96", "--n_head=2", "--methods=ste[all]@q4_k"], "has input width 96"),
    (["train", "--model=gpt5"], "expected one of gpt2-124m"),
    (["train", "--grad_accum=1,0"], "positive integers"),
    (["train", "--block_size=4096"], "exceeds the model's block_size"),
    (["train", "--n_head=5"], "multiple of n_head"),
    (["train", "--n_layer=abc"], "--n_layer=abc"),
    (["train", "--vocab_size=0"], "--vocab_size=0: expected a positive integer"),
    (["train", "--compile=maybe"], "expected a bool"),
    (["train", "--recompute_w_hat=1"], "recompute_w_hat"),
    (["train", "--json=/no/such/dir/x.json"], "/no/such/dir does not exist"),
    (["kernel", "--json=/no/such/dir/x.json"], "/no/such/dir does not exist"),
    (["host", "--json=/no/such/dir/x.json"], "/no/such/dir does not exist"),  # before the run, not after it
    (["gpu-check", "--json=/no/such/dir/x.json"], "/no/such/dir does not exist"),  # on any machine
    (["train", "--bogus=1"], "unknown config key 'bogus'"),
    (["train", "rounds=2"], "not found"),
    (["host", "--layers=2,0"], "positive integers"),
    (["host", "--width=0"], "--width=0"),
    (["bench"], "expected 'kernel', 'train' or 'host'"),
    ([], "expected 'kernel', 'train' or 'host'"),
])
def test_bad_arguments_fail_in_one_line(argv, words, capsys):
    assert util.cli(bench.main, argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error:") and words in err


def test_bad_arguments_from_the_shell_give_no_traceback(tmp_path):
    json_path = tmp_path / "out.json"
    json_path.write_text('{"keep": true}')  # an earlier summary, which a run may write again
    proc = subprocess.run([sys.executable, "bench.py", "train", "--methods=gausws[all]", f"--json={json_path}"],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr and "gausws" in proc.stderr
    assert json_path.read_text() == '{"keep": true}'  # nothing overwritten


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_the_usage_of_every_command_and_exits_0(flag):
    proc = subprocess.run([sys.executable, "bench.py", flag], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == ""
    usage = [line.strip() for line in proc.stdout.splitlines() if line.strip().startswith("python bench.py")]
    assert list(dict.fromkeys(u.split()[2] for u in usage)) == ["kernel", "train", "gpu-check", "host"]
    for option in ("--shapes=", "--repeats=", "--device=", "--threads=", "--json=PATH", "--model=", "--methods=",
                   "--grad_accum=", "--rounds=", "--train=", "--layers=", "--width="):
        assert option in proc.stdout, option


def test_gpu_check_reads_its_options_before_it_looks_for_a_gpu(capsys):
    """A typo is named on any machine (and --help is the configurator's), not hidden behind "no GPU"."""
    assert util.cli(bench.main, ["gpu-check", "--repeatz=3"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown config key 'repeatz'" in err
