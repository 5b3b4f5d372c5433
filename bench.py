"""The paper's overhead measurements where it runs: the noise kernel (Figure 6) and training (Table 1).

    python bench.py kernel [--shapes=512x2048,4096x4096] [--repeats=5] [--device=cpu|cuda] [--threads=N]
        [--json=PATH]

Figure 6: throughput of the forward of Eq. 3 (w -> BF16 w_hat) on an FP32 w of shape (M, N), in 10^9
elements/s, for `torch` (plain eager PyTorch: randn, round(x/2), block max scale, add, BF16 cast),
`bm` (Triton Box-Muller, GPU only), `ours` (gaussws.pseudo_quantize, backend auto: compiled PyTorch on
CPU, Triton on GPU) and `diffq` (the same with U(-1/2, 1/2) noise). `copy` is a plain FP32 -> BF16
copy of the same w: it reads and writes what Eq. 3 must, so it is the machine's limit for this op.
The impls are timed interleaved (median of `repeats` blocks each) after warm-up calls that compile.

    python bench.py train [--model=gpt2-124m] [--methods=bf16,gaussws[all],diffq[all]] [--batch_size=1]
        [--block_size=1024] [--grad_accum=1,8] [--rounds=3] [--warmup=1] [--compile=False]
        [--recompute_w_hat=False] [--seed=1337]
        [--device=cpu|cuda] [--threads=N] [--json=PATH] [--n_layer=12 ... any model.ModelConfig field]

Table 1: tokens/s of one optimizer step for each method, taken as train.py takes it, with the same
code: the model built plain from one seed (so every method starts from the same weights) and
converted by gaussws.convert, the optimizers of gaussws.build_optimizers with train.py's default
settings, then per step train.py's own step (step.train_step): a gaussws.TrainStep around
grad_accum micro-steps of batch_size x block_size random tokens (forward and backward under BF16
autocast), the gradient clipping, the check that loss and gradient norm are finite, the optimizer
step and zero_grad. --recompute_w_hat=True converts as train.py does with it (w_hat made
in every micro-step's forward and again in its backward). An arm of --methods is a method string, or
METHOD@FORMAT for the format it trains on (STE: ste[all]@q4_k, any of train.py's --target_format), or
METHOD@BUDGET:BITS for a bit budget (ste[all]@error-gguf:4.5, gaussws[all]@auto-gguf:4.5): a budget's
switch is at step 1 (an STE phase from there; error-gguf weights by step 0's activations), and the
untimed steps up to it come first; the seconds of its choice are reported beside the table. All
methods run interleaved in one process: after `warmup` steps each, `rounds` rounds of one step per
method. Reported: median
tokens/s; overhead_pct = median over rounds of 100 * (1 - tokens/s of the method / tokens/s of bf16
in the same round), pairing the rounds so that drift in the machine's load cancels; pqt_share_pct
(step mode) = median over rounds of 100 * (seconds in TrainStep's begin and end / the bf16 step of
the round): the method's own work (for the STE, the fake quantization of the step's w_q),
timed apart from the matmuls and so far steadier than the overhead on a noisy machine.
Memory, extra_bytes_per_param = (memory of the method - memory of bf16) / (number of weight elements
in the method's PQT (or STE) layers):
  - CUDA: the allocator's peak during one optimizer step (torch.cuda.max_memory_allocated) above what
    was allocated before it;
  - CPU (no allocator statistics): the bytes held at the end of a micro-step's forward for its
    backward: tensors autograd saves plus tensors PQT and STE layers hold (w_hat, stored R, w_q), each storage
    counted once, parameters excluded. Under autocast bf16 also saves a BF16 copy of every weight
    for the backward, so a saved w_hat takes the place of that copy rather than adding to it.

Options are `--key=value`, checked as train.py checks its own (configurator.py). Lists are written
with commas. The full CPU measurement (GPT2-124M, 1 x 1024 tokens per micro-step):
    python bench.py train --model=gpt2-124m --grad_accum=1 --rounds=5     # about 5 minutes on 2 idle cores
    python bench.py train --model=gpt2-124m --grad_accum=8 --rounds=3     # about 20 minutes
Where other processes share the cores, add --threads=1: a thread that waits at every op for a
descheduled sibling makes multi-threaded step times swing 2-3x, while one thread's CPU time (the
"overhead (CPU time)" column) stays what the step computed.
On CPU both commands first make glibc keep freed memory, as train.py does (keep_freed_cpu_memory):
otherwise every large tensor is a fresh mmap whose page faults are a large part of a step and of its
jitter, and fall on bf16 and the methods alike.
Nothing here needs the network: the tokens are random (throughput does not depend on them).

    python bench.py gpu-check [--train=True] [--repeats=5] [--json=PATH] ...   (needs a CUDA GPU)

Everything a first GPU should show, in one table: the Triton kernels against the PyTorch twin on
CUDA tensors (gpu_parity), each kernel's bandwidth as a share of the device's peak and of a copy,
Figure 6 (bench.py kernel) and Table 1 (bench.py train, Llama2-134M, 24 x 2048 tokens, bf16 /
diffq[all] / gaussws[all]). Without CUDA it says so in one line and exits 1.

    python bench.py host [--layers=2,24,84,154] [--width=64] [--repeats=50] [--threads=N] [--json=PATH]

What a PQT step's TrainStep.begin() + end() costs the host against the number of PQT Linears, batched
and one layer at a time: the launches a GPU would get (PyTorch ops that run a kernel, Triton launches),
counted, and the host's microseconds with tiny weights and every Triton launch recorded but not run.
It runs the Triton backend's path on CPU tensors, in Triton's interpreter (set here: no GPU needed).
"""
import os
import sys

# bench.py host takes the Triton backend's path on CPU tensors: Triton's interpreter, which must be chosen
# before triton is first imported (kernels/ is, through the benchmarks below)
if sys.argv[1:2] == ["host"]:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from benchmarks.common import say, write_json  # noqa: E402
from benchmarks.fig6 import run_kernel  # noqa: E402
from benchmarks.gpu_check import gpu_check  # noqa: E402
from benchmarks.host import run_host  # noqa: E402
from benchmarks.options import parse_args  # noqa: E402
from benchmarks.table1 import run_train  # noqa: E402
from util import cli, keep_freed_cpu_memory  # noqa: E402


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return []
    if argv[:1] == ["gpu-check"]:
        return gpu_check(argv[1:])
    command, args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if getattr(args, "device", "cpu") == "cpu" or torch.device(args.device).type == "cpu":
        keep_freed_cpu_memory()  # as train.py: no page faults on every step's fresh tensors
    records = {"kernel": run_kernel, "train": run_train, "host": run_host}[command](args)
    if args.json:
        write_json(args.json, records)
        say(f"wrote {len(records)} records to {args.json}")
    return records


if __name__ == "__main__":
    sys.exit(cli(main))
