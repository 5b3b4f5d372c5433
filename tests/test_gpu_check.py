"""bench.py gpu-check: where there is no GPU, one line; its parts run on CPU tensors too."""
import subprocess
import sys

import pytest
import torch

from benchmarks import gpu_check
from kernels import torch_noise
from conftest import ROOT


@pytest.mark.skipif(torch.cuda.is_available(), reason="this checks the message of a machine without CUDA")
def test_without_cuda_it_says_so_in_one_line():
    proc = subprocess.run([sys.executable, "bench.py", "gpu-check"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "CUDA" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == ""


def test_parity_rows_pass_on_the_interpreter():
    """The parity part, with Triton's interpreter on CPU tensors standing in for the GPU."""
    rows = gpu_check.gpu_parity("cpu", shapes=[(33, 65), (64, 256)], seeds=[5], bm_shape=(64, 1024))
    assert [(k, m) for k, m, _, _ in rows] == [("gen", "gaussws"), ("apply", "gaussws"), ("block_sums", "gaussws"),
                                               ("gen", "diffq"), ("apply", "diffq"), ("block_sums", "diffq"),
                                               ("bm", "box-muller")]
    assert [r for _, _, _, r in rows] == ["identical", "identical", "within"] * 2 + ["ok"], rows


@pytest.mark.parametrize("method", ["gaussws", "diffq"])
def test_bytes_per_element_are_the_tensors_the_kernels_touch(method):
    """KERNEL_BYTES against the sizes of the tensors themselves (the scale and sums, 1/1024 of an
    element's bytes, are left out there)."""
    m, n = 64, 256
    w = torch.zeros(m, n)
    r_store = torch_noise.gen(m * n, 1, method, "cpu")
    w_hat = torch.zeros(m, n, dtype=torch.bfloat16)
    per = lambda *ts: sum(t.numel() * t.element_size() for t in ts) / (m * n)
    assert gpu_check.KERNEL_BYTES[f"gen {method}"] == per(r_store)
    assert gpu_check.KERNEL_BYTES[f"apply {method}"] == per(w, r_store, w_hat)
    assert gpu_check.KERNEL_BYTES[f"block_sums {method}"] == per(w, r_store)  # g is FP32 like w
    assert gpu_check.KERNEL_BYTES["bm"] == per(w, w_hat)
    assert gpu_check.KERNEL_BYTES["copy"] == per(w, w)


def test_one_pass_and_batched_step_rows_pass_on_the_interpreter():
    """The one pass and the batched step against the per-layer kernels, as gpu-check runs them on a GPU, with
    Triton's interpreter on CPU tensors standing in."""
    rows = gpu_check.one_pass_parity("cpu", shapes=[(33, 65), (64, 256)], seeds=[5])
    assert [(k, m, r) for k, m, _, r in rows] == [("eq3 (one pass)", "gaussws", "identical"),
                                                  ("eq3 (one pass)", "diffq", "identical")]
    rows = gpu_check.batched_step_parity("cpu")
    assert rows[0][-1] == "identical", rows


def test_table1_models_are_read_from_the_option():
    assert gpu_check.table1_models("llama2-134m:24,llama2-1b:8") == [("llama2-134m", 24), ("llama2-1b", 8)]
    with pytest.raises(gpu_check.BenchError, match="MODEL:BATCH"):
        gpu_check.table1_models("llama2-1b")
