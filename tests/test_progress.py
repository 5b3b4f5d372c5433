"""What a run says while it trains (progress.py): where it starts, its dtype, one line per logged
step with step k/N, throughput, MFU where the GPU's peak is known and the ETA, the same fields in
metrics.jsonl, and a summary at the end."""
import json
import os
import re
import subprocess
import sys

import pytest

import progress
import train
from conftest import ROOT, TINY_RUN

# step 4/6 (66.7%) | loss 4.6994 | lr 2.50e-03 | 49 ms | 5,277 tok/s [| MFU 1.2%] [| b_t 6.00 [5.98, 6.01]] [| eta 1s]
LINE = re.compile(r"^step (\d+)/(\d+) \((\d+\.\d)%\) \| loss (\d+\.\d{4}) \| lr (\d\.\d\de[-+]\d\d) \| (\d+) ms \| "
                  r"([\d,]+) tok/s(?: \| MFU (\d+\.\d)%)?(?: \| b_t (\d+\.\d\d) \[(\d+\.\d\d), (\d+\.\d\d)\])?"
                  r"(?: \| eta (\d+s|\d+m\d\ds|\d+h\d\dm))?$")


def run_train(args):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.splitlines()


def flags(data_dir, out_dir, **kw):
    return [f"--{k}={v}" for k, v in {**TINY_RUN, "dataset": data_dir, "out_dir": str(out_dir), **kw}.items()]


@pytest.fixture(scope="module")
def tiny_run(tiny_corpus, tmp_path_factory):
    """A 6-step run logging every 2 steps: its printed lines and its metrics.jsonl records."""
    out = tmp_path_factory.mktemp("run")
    lines = run_train(flags(tiny_corpus, out, max_iters=6, eval_interval=3, log_interval=2, dtype="float32"))
    with open(out / "metrics.jsonl") as f:
        return out, lines, [json.loads(line) for line in f]


def test_every_logged_step_is_one_line_of_the_step_of_max_iters(tiny_run):
    _, lines, records = tiny_run
    logged = [LINE.match(line) for line in lines if line.startswith("step ") and "/" in line.split()[1]]
    assert all(logged), [line for line in lines if line.startswith("step ")]
    steps = {r["iter"]: r for r in records if "loss" in r}
    assert [int(m[1]) for m in logged] == sorted(steps) == [2, 4, 6]
    tokens_per_step = TINY_RUN["batch_size"] * TINY_RUN["block_size"]  # one micro-step
    for m in logged:
        k, n, pct, loss, lr, ms, tok_s, mfu, b_mean, b_min, b_max, eta = m.groups()
        r = steps[int(k)]
        assert int(n) == 6 and float(pct) == round(100 * int(k) / 6, 1)
        assert loss == f"{r['loss']:.4f}" and lr == f"{r['lr']:.2e}" and int(ms) == round(r["ms_per_iter"])
        assert int(tok_s.replace(",", "")) == pytest.approx(tokens_per_step / (r["ms_per_iter"] / 1000), abs=1)
        assert mfu is None and "mfu_pct" not in r  # a CPU has no peak to measure against
        b_t = tuple(round(r[f"b_t/{s}"], 2) for s in ("mean", "min", "max"))
        assert (float(b_mean), float(b_min), float(b_max)) == b_t
        assert eta is not None and "eta_s" in r  # step 2 is one after the first (test_eta_... below)
    assert steps[6]["eta_s"] == 0 and logged[-1][12] == "0s"


def test_the_run_says_where_it_starts_and_in_which_dtype(tiny_run, tiny_corpus, tmp_path):
    out, lines, _ = tiny_run
    assert "from scratch (seed 1337)" in lines
    assert ("dtype: float32, no autocast, set by the config "
            "(weights and optimizer state float32, w_hat bfloat16)") in lines
    resumed = run_train(flags(tiny_corpus, out, max_iters=8, eval_interval=4, log_interval=2, dtype="float32",
                              init_from="resume"))
    assert f"resumed from step 6 of {out / 'ckpt.pt'}" in resumed
    started = run_train(flags(tiny_corpus, tmp_path, max_iters=1, eval_interval=1, init_from=str(out)))
    assert f"initialised from {out} (its weights; a new run from step 0)" in started
    assert not any(line.startswith("compiling") for line in lines + resumed + started)  # only with --compile


def test_the_summary_gives_val_losses_tokens_time_and_peak_memory(tiny_run):
    """... and, the run being gaussws's, whose val losses those are and export's command for its model."""
    out, lines, records = tiny_run
    vals = {r["iter"]: r["val/loss"] for r in records if "val/loss" in r}
    assert sorted(vals) == [0, 3, 6]
    assert lines[-4] == f"val loss: {vals[6]:.4f} at step 6, best {min(vals.values()):.4f}"
    tokens = 6 * TINY_RUN["batch_size"] * TINY_RUN["block_size"]
    assert re.fullmatch(rf"trained: steps 0-6, {tokens:,} tokens in \d+s", lines[-3]), lines[-3]
    m = re.fullmatch(r"peak memory: ([\d,]+) MiB \(the process's peak RSS\)", lines[-2])
    assert m and 100 < int(m[1].replace(",", "")) < 64 * 1024, lines[-2]  # python + torch, less than the machine
    assert lines[-1] == (f"val losses: of the master weights; the auto model export writes: "
                         f"python export.py --out_dir={out} --format=auto")


def test_eta_is_the_mean_pace_since_the_first_step_times_the_steps_left(monkeypatch):
    clock = iter([0.0, 60.0, 62.0])  # Progress made; step 1 done after a minute (compiling); asked at step 3
    monkeypatch.setattr(progress.time, "time", lambda: next(clock))
    p = progress.Progress(0, 10, tokens_per_iter=100, flops_per_token=1e6, peak=None)
    p.stepped(1)
    assert p.eta(1) is None  # no pace yet but the first step's
    for step in (2, 3):
        p.stepped(step)
    assert p.eta(3) == pytest.approx((62.0 - 60.0) / (3 - 1) * 7)  # 7 s: 1 s a step since step 1, not 62 / 3


def test_mfu_is_model_flops_over_the_peak_of_the_gpus():
    p = progress.Progress(0, 10, tokens_per_iter=1000, flops_per_token=1e6, peak=1e12)
    r = p.record(5, 2.5, 1e-3, 0.5, None)  # 2,000 tokens/s x 1e6 FLOPs = 2e9 FLOP/s of 1e12
    assert r["tokens_per_s"] == 2000 and r["mfu_pct"] == pytest.approx(0.2)
    assert p.line(r).endswith("| 2,000 tok/s | MFU 0.2%")


@pytest.mark.parametrize("name,peak", [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                                       ("NVIDIA H100 NVL", 835e12), ("NVIDIA H200", 989e12),
                                       ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA L40S", 362e12),
                                       ("NVIDIA L4", 121e12), ("NVIDIA GeForce GTX 1080", None)])
def test_the_peak_of_a_gpu_is_its_datasheets_dense_bf16(name, peak):
    assert progress.peak_flops(name) == peak


def test_mfu_only_for_bfloat16_on_a_gpu_the_table_knows(monkeypatch):
    monkeypatch.setattr(progress.torch.cuda, "get_device_name", lambda device: "NVIDIA H200")
    assert progress.device_peak("cuda:0", "bfloat16", 2) == 2 * 989e12
    assert progress.device_peak("cuda:0", "float32", 2) is None
    assert progress.device_peak("cpu", "bfloat16", 1) is None


def test_flops_per_token_is_nanogpts_estimate_for_gpt2_small():
    """GPT-2 small by hand: N = wte V d + L (12 d^2 + 13 d) + ln_f 2d (wpe left out, lm_head tied),
    6N + 12 L H Q T with V 50304, d 768, L 12, H 12, Q 64, T 1024."""
    import torch
    from model import GPT, PRESETS, ModelConfig
    with torch.device("meta"):
        m = GPT(ModelConfig(**PRESETS["gpt2-124m"]))
    V, d, L, H, T = 50304, 768, 12, 12, 1024
    N = V * d + L * (12 * d * d + 13 * d) + 2 * d
    assert progress.flops_per_token(m) == 6 * N + 12 * L * H * (d // H) * T == 855_383_040


def test_a_compiled_run_says_so_before_its_slow_first_steps(tiny_corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(train.torch, "compile", lambda model: model)  # what is said, not compiling itself
    train.main(flags(tiny_corpus, tmp_path, max_iters=1, eval_interval=1, compile=True))
    lines = capsys.readouterr().out.splitlines()
    note = lines.index("compiling the model (the first steps are slow)")
    assert note < min(i for i, line in enumerate(lines) if line.startswith("step 1/1"))


def test_duration_is_written_as_a_clock_reads():
    assert [progress.duration(s) for s in (0.4, 38, 98, 3599, 7500)] == ["0s", "38s", "1m38s", "59m59s", "2h05m"]
