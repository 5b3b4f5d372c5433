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
"""
import dataclasses
import json
import math
import os
import re
import statistics
import sys
import time
import types

import torch

import gaussws
import model as model_lib
import ste
from configurator import check_device, configure
from kernels import BL
from step import sync, train_step
from util import UserError, cli, git_commit, keep_freed_cpu_memory, write_atomic

# --- small helpers ---------------------------------------------------------------------------------


class BenchError(UserError):
    """Bad input; the message is one line."""


def say(*args):
    print(*args, flush=True)  # progress must show while a long run goes on


def write_json(path, records):
    """Write atomically, so an interrupted run never leaves half a file where a good one was."""
    write_atomic(path, json.dumps(records, indent=1) + "\n")


def markdown_table(header, rows):
    """A table that reads well in a terminal and pastes into the README as it is."""
    cells = [list(map(str, header))] + [list(map(str, r)) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    line = lambda row: "| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |"
    return "\n".join([line(cells[0]), "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"]
                     + [line(r) for r in cells[1:]])


def load_avg():
    """The machine's 1-minute load average (None where the OS has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def machine_load():
    """Threads we use and the load on the machine: other processes on these cores skew every figure."""
    load = f", load average {load_avg():.2f} on {os.cpu_count()} CPUs" if load_avg() is not None else ""
    return f"{torch.get_num_threads()} torch threads{load}"


def time_per_call(fns, device, repeats, min_block_s=0.05):
    """{name: median seconds per call} of no-argument callables, timed interleaved after warm-up.

    The first call compiles (torch.compile, Triton), so two untimed calls come first. A block holds
    enough calls to last min_block_s, so the timer and, on GPU, launch and synchronize costs do not
    dominate small shapes. Repeat r times every callable once before repeat r + 1, so a change in
    the machine's load (other processes on these cores) hits all of them alike.
    """
    calls = {}
    for name, fn in fns.items():
        fn()
        fn()
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        calls[name] = max(1, min(10_000, math.ceil(min_block_s / max(time.perf_counter() - t, 1e-9))))
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync(device)
            t = time.perf_counter()
            for _ in range(calls[name]):
                fn()
            sync(device)
            times[name].append((time.perf_counter() - t) / calls[name])
    return {name: statistics.median(t) for name, t in times.items()}


# --- kernel: Figure 6 ------------------------------------------------------------------------------

CPU_SHAPES = [(512, 2048), (2048, 2048), (2048, 8192), (4096, 4096), (8192, 8192)]
# On GPU also the shapes the paper names: Llama 3.2 1B's (2k, 0.5k) and Llama 3.1 405B's (16k, 1k)-(16k, 16k).
CUDA_SHAPES = [(2048, 512)] + CPU_SHAPES + [(16384, 1024), (16384, 16384)]
KERNEL_IMPLS = ("copy", "torch", "bm", "ours", "diffq")


def torch_r(shape, generator):
    """The `torch` baseline's noise: R = round(N(0,1) / 2) from torch.randn (Box-Muller inside)."""
    return torch.round(torch.randn(shape, generator=generator, device=generator.device) / 2)


def torch_w_hat(w, b_t, generator):
    """Figure 6's `torch` baseline: Eq. 3 in plain eager PyTorch, one tensor pass per op."""
    m, n = w.shape
    r = torch_r(w.shape, generator)
    scale_bl = gaussws.block_absmax(w) * torch.exp2(1.0 - b_t)
    scale = scale_bl.repeat_interleave(BL, 0)[:m].repeat_interleave(BL, 1)[:, :n]
    return (w + r * scale).to(torch.bfloat16)


def kernel_impls(w, b_t, seed, device):
    """{impl: (callable w -> w_hat, or None, reason it cannot run here)}, the callables the benchmark times."""
    generator = torch.Generator(device=device).manual_seed(seed)
    impls = {
        "copy": (lambda: w.to(torch.bfloat16), None),
        "torch": (lambda: torch_w_hat(w, b_t, generator), None),
        "ours": (lambda: gaussws.pseudo_quantize(w, b_t, seed, "gaussws"), None),
        "diffq": (lambda: gaussws.pseudo_quantize(w, b_t, seed, "diffq"), None),
    }
    if torch.device(device).type != "cuda":
        impls["bm"] = (None, "Triton Box-Muller needs a GPU (the Triton interpreter on CPU is not a benchmark)")
    else:
        try:
            from kernels import triton_noise
        except ImportError as e:
            impls["bm"] = (None, f"Triton is not importable here ({e})")
        else:
            impls["bm"] = (lambda: triton_noise.bm(w, gaussws.block_absmax(w) * torch.exp2(1.0 - b_t), seed), None)
    return {name: impls[name] for name in KERNEL_IMPLS}


def run_kernel(args):
    device = args.device
    shapes = args.shapes or (CUDA_SHAPES if torch.device(device).type == "cuda" else CPU_SHAPES)
    say(f"bench.py kernel: forward of Eq. 3 on FP32 w (M, N) -> BF16 w_hat, device={device}, "
        f"median of {args.repeats} repeats; {machine_load()}")
    records, skipped = [], {}
    for m, n in shapes:
        gen = torch.Generator(device=device).manual_seed(0)
        w = torch.randn(m, n, generator=gen, device=device) * 0.02
        b_t = torch.full((-(-m // BL), -(-n // BL)), 6.0, device=device)
        impls = kernel_impls(w, b_t, seed=1234, device=device)
        for impl, (fn, reason) in impls.items():
            if fn is None and impl not in skipped:
                skipped[impl] = reason
                say(f"  {impl}: skipped: {reason}")
        with torch.no_grad():
            seconds = time_per_call({i: fn for i, (fn, _) in impls.items() if fn is not None}, device, args.repeats)
        speed = {impl: m * n / s / 1e9 for impl, s in seconds.items()}
        say(f"  {m}x{n}: " + ", ".join(f"{impl} {v:.3f}" for impl, v in speed.items())
            + f" 1e9 elements/s; {machine_load()}")
        for impl, v in speed.items():
            records.append({"shape": [m, n], "impl": impl, "gelem_per_s": v,
                            "speedup_vs_torch": v / speed["torch"], "share_of_copy": v / speed["copy"],
                            "device": device, "threads": torch.get_num_threads(), "load_avg": load_avg()})
    say("")
    say(markdown_table(["shape (M, N)", "impl", "1e9 elements/s", "speed-up vs torch", "share of copy"],
                       [(f"{r['shape'][0]}x{r['shape'][1]}", r["impl"], f"{r['gelem_per_s']:.3f}",
                         f"{r['speedup_vs_torch']:.2f}x", f"{100 * r['share_of_copy']:.1f} %") for r in records]))
    return records


# --- train: Table 1 ---------------------------------------------------------------------------------

def split_methods(text):
    """'bf16,gaussws[qkv,up],diffq[all]' -> ['bf16', 'gaussws[qkv,up]', 'diffq[all]'] (commas in [] stay)."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    parts.append(cur.strip())
    return [p for p in parts if p]


def build_config(args):
    cfg = {**model_lib.PRESETS[args.model], **args.model_overrides}
    try:
        return model_lib.ModelConfig(**cfg)
    except (ValueError, TypeError) as e:
        raise BenchError(f"bad model settings for {args.model}: {e}") from None


def pqt_weight_numel(model):
    """Weight elements of the layers the method converted (PQT or STE)."""
    return sum(layer.weight.numel() for layer in gaussws.method_layers(model))


def parse_arm(spec, roles):
    """An arm of --methods: (method, target_format, bits_per_weight) of 'METHOD', 'METHOD@FORMAT' or
    'METHOD@BUDGET:BITS' (ste[all]@q4_k, ste[all]@error-gguf:4.5, gaussws[all]@auto-gguf:4.5); a
    BenchError (one line) for what train.py would refuse."""
    method, _, target = spec.partition("@")
    fmt, _, bits = target.partition(":")
    try:
        kind, _ = gaussws.parse_method(method, roles)
        budget = float(bits) if bits else 0.0
        if fmt in ste.BUDGET_TARGETS:
            ste.check_budget(fmt, budget, kind, switch=1)
        elif fmt or kind == "ste":
            ste.check_format(fmt)
        if bits and fmt not in ste.BUDGET_TARGETS or kind == "bf16" and fmt:
            raise ValueError(f"{fmt!r} takes no :BITS" if bits else "bf16 trains on no format")
    except ValueError as e:
        raise BenchError(f"--methods: arm {spec!r}: {e} (an arm is METHOD, METHOD@FORMAT or METHOD@BUDGET:BITS, "
                         f"e.g. ste[all]@q4_k, ste[all]@error-gguf:4.5)") from None
    return method, fmt, budget


def _tensors(value):
    """The tensors in an attribute's value, looking into tuples, lists and dicts (a layer's step state)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def held_bytes(model, x, y, device, step=0):
    """Bytes held for the backward of one micro-step: tensors autograd saves plus tensors PQT layers hold.

    Taken inside a gaussws.TrainStep as train.py takes a step, at the end of the forward, when all
    of it is held at once. Each storage counts once (a w_hat both saved and cached is one tensor);
    parameters and buffers are left out (they exist whether or not a backward follows).
    """
    with gaussws.TrainStep(model, step):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
                _, loss = model(x, y)
        state = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        held = [t for layer in gaussws.method_layers(model) for v in vars(layer).values() for t in _tensors(v)]
        storages = {}
        for t in saved + held:
            s = t.untyped_storage()
            if s.data_ptr() not in state:
                storages[s.data_ptr()] = s.nbytes()
        saved.clear(), held.clear()  # free them before the backward
        loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


# train.py's default optimizer settings and clipping, which the measured step uses (its cost does not
# depend on their values; tests/test_bench.py checks that they are train.py's). The method's own
# settings are gaussws.convert's defaults, train.py's too, and Eq. 12 is off, as train_step's default.
STEP_SETTINGS = dict(optimizer="adamw", learning_rate=2e-3, beta1=0.9, beta2=0.99, weight_decay=0.1,
                     bitwidth_weight_decay=0.1, grad_clip=1.0)


class Runner:
    """One method's model, optimizers and data; step() is one optimizer step as train.py takes it."""

    def __init__(self, args, arm):
        self.method, self.device = arm, args.device
        config = build_config(args)
        method, fmt, budget = parse_arm(arm, model_lib.ROLES[config.arch].values())
        # a budget chooses its formats at step 1 (error-gguf: from step 0's activations), before any timing
        kind, _ = gaussws.parse_method(method, model_lib.ROLES[config.arch].values())
        self.switch = 1 if fmt in ste.BUDGET_TARGETS else 0
        phase = dict(start=self.switch) if kind == "ste" else dict(ste_start=self.switch)
        torch.manual_seed(args.seed)  # the same initial weights for every method: convert draws nothing
        try:
            self.model = gaussws.convert(model_lib.GPT(config), method, model_lib.ROLES[config.arch], seed=args.seed,
                                         recompute=args.recompute_w_hat, fmt=fmt, bits_per_weight=budget, **phase)
        except ValueError as e:
            raise BenchError(f"--methods: arm {arm!r}: {e}") from None
        self.switch_seconds = None
        self.model.to(args.device).train()
        self.step_mode = not args.recompute_w_hat  # as gaussws.TrainStep chooses for unsharded weights
        self.forward = torch.compile(self.model) if args.compile else self.model
        d = STEP_SETTINGS  # train.py's optimizer, built by the same function
        self.optimizers = gaussws.build_optimizers(
            self.model, d["optimizer"], model_lib.ROLES[config.arch], lr=d["learning_rate"],
            betas=(d["beta1"], d["beta2"]), weight_decay=d["weight_decay"],
            bitwidth_weight_decay=d["bitwidth_weight_decay"], n_embd=config.n_embd, n_head=config.n_head,
            n_kv_head=config.n_kv_head)
        self.step_count = 0

    def step(self, batches):
        """train.py's step (step.train_step) over the micro-batches, under BF16 autocast. pqt_seconds:
        the time of TrainStep's begin and end, the method's own work in step mode (w_hat and R; Eq. 4);
        per micro-step it is inside the forwards and backwards instead."""
        timer = {}
        train_step(self.model, self.optimizers, self.step_count, batches[0], lambda _, m: batches[m % len(batches)],
                   len(batches), forward=self.forward, grad_clip=STEP_SETTINGS["grad_clip"], timer=timer,
                   autocast=torch.autocast(torch.device(self.device).type, dtype=torch.bfloat16))
        self.pqt_seconds = timer["pqt_s"]
        if self.switch and self.step_count == self.switch:  # TrainStep's begin chose the budget's formats
            self.switch_seconds = self.pqt_seconds
        self.step_count += 1

    def past_switch(self, batches):
        """Untimed steps up to and including a budget's switch, so that every timed step trains on the
        formats it chose (the choice itself is switch_seconds)."""
        while self.switch and self.step_count <= self.switch:
            self.step(batches)

    def timed_step(self, batches):
        """Wall seconds of one step, the process's CPU seconds (CPU only), and on CUDA the allocator's peak
        above what was held before it."""
        cuda = torch.device(self.device).type == "cuda"
        sync(self.device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
        t, c = time.perf_counter(), time.process_time()
        self.step(batches)
        sync(self.device)
        seconds, cpu_seconds = time.perf_counter() - t, time.process_time() - c
        peak = torch.cuda.max_memory_allocated(self.device) - before if cuda else None
        return seconds, (None if cuda else cpu_seconds), peak


def paired_overhead(base, method):
    """Median over rounds of 100 * (1 - tokens/s of the method / tokens/s of bf16 in the same round)."""
    return statistics.median(100 * (1 - b / m) for b, m in zip(base, method))


def run_train(args):
    device = args.device
    methods = split_methods(args.methods)
    arch = build_config(args).arch
    for spec in methods:
        parse_arm(spec, model_lib.ROLES[arch].values())
    if "bf16" not in methods:
        say("bench.py train: adding bf16, the baseline every overhead is measured against")
    methods = ["bf16"] + [m for m in dict.fromkeys(methods) if m != "bf16"]
    max_block = build_config(args).block_size
    if args.block_size > max_block:
        raise BenchError(f"--block_size={args.block_size} exceeds the model's block_size {max_block}; "
                         f"pass --block_size<={max_block}")

    runners = []
    for spec in methods:
        say(f"building {args.model} with {spec} on {device} ...")
        runners.append(Runner(args, spec))
    cfg = runners[0].model.config
    n_params = runners[0].model.get_num_params(non_embedding=False)
    say(f"{args.model}: {n_params / 1e6:.1f}M parameters; {args.batch_size} x {args.block_size} tokens per "
        f"micro-step; compile={args.compile}; {machine_load()}")

    gen = torch.Generator().manual_seed(args.seed)
    data = torch.randint(cfg.vocab_size, (max(args.grad_accum), args.batch_size, args.block_size + 1), generator=gen)
    data = data.to(device)
    micro = [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]

    for r in runners:
        r.past_switch(micro[:1])
    memory = {}
    if torch.device(device).type != "cuda":
        for r in runners:
            memory[r.method] = held_bytes(r.model, *micro[0], device, step=r.step_count)

    records = []
    for accum in args.grad_accum:
        tokens = accum * args.batch_size * args.block_size
        seconds, cpu_seconds, peaks, pqt_seconds = time_rounds(runners, micro[:accum], args, tokens)
        if torch.device(device).type == "cuda":
            memory = {m: max(p) for m, p in peaks.items()}
        for r in runners:
            n_pqt = pqt_weight_numel(r.model)
            extra = (memory[r.method] - memory["bf16"]) / n_pqt if n_pqt else 0.0
            records.append({
                "method": r.method, "grad_accum": accum,
                "tokens_per_s": statistics.median(tokens / s for s in seconds[r.method]),
                "overhead_pct": paired_overhead(seconds["bf16"], seconds[r.method]),
                # CPU time: what the step computed, whatever else ran on these cores (clean with --threads=1;
                # with more threads it also counts threads spinning while they wait for each other).
                "overhead_cpu_time_pct": (None if torch.device(device).type == "cuda"
                                          else paired_overhead(cpu_seconds["bf16"], cpu_seconds[r.method])),
                "extra_bytes_per_param": extra,
                # Step mode: TrainStep's begin + end against the bf16 step of the same round. Far less noisy
                # than the overhead; the two differ by bf16's own per-micro-step weight casts (autocast), which
                # PQT layers skip (w_hat is BF16 already).
                "pqt_share_pct": (statistics.median(100 * p / b for p, b in zip(pqt_seconds[r.method], seconds["bf16"]))
                                  if r.step_mode else None),
                "model": args.model, "device": device, "batch_size": args.batch_size, "block_size": args.block_size,
                "rounds": args.rounds, "compile": args.compile, "recompute_w_hat": args.recompute_w_hat,
                "threads": torch.get_num_threads(),
                "load_avg": load_avg(),
                "step_s": seconds[r.method], "step_cpu_s": cpu_seconds[r.method], "pqt_s": pqt_seconds[r.method],
                "memory_bytes": memory[r.method], "pqt_weight_params": n_pqt, "switch_s": r.switch_seconds,
                "memory_measure": ("cuda_max_memory_allocated" if torch.device(device).type == "cuda"
                                   else "cpu_saved_for_backward"),
            })
    print_train_table(records, args)
    return records


def time_rounds(runners, batches, args, tokens):
    """After `warmup` untimed steps of each runner, `rounds` rounds of one timed step per runner:
    {method: [per round]} of wall seconds, CPU seconds, CUDA peak bytes and TrainStep seconds."""
    accum = len(batches)
    for r in runners:
        for i in range(args.warmup):
            say(f"grad_accum={accum} warm-up {i + 1}/{args.warmup} {r.method} ...")
            r.step(batches)
    seconds, cpu_seconds, peaks, pqt_seconds = ({r.method: [] for r in runners} for _ in range(4))
    for round_ in range(args.rounds):
        for r in runners:
            s, c, peak = r.timed_step(batches)
            seconds[r.method].append(s)
            cpu_seconds[r.method].append(c)
            peaks[r.method].append(peak)
            pqt_seconds[r.method].append(r.pqt_seconds)
        say(f"grad_accum={accum} round {round_ + 1}/{args.rounds}: " + "  ".join(
            f"{m} {s[-1]:.2f} s ({tokens / s[-1]:.0f} tok/s)" for m, s in seconds.items())
            + f"; {machine_load()}")
    return seconds, cpu_seconds, peaks, pqt_seconds


def print_train_table(records, args):
    say("")
    say(f"{args.model}, {args.batch_size} x {args.block_size} tokens per micro-step, {args.device}, "
        f"recompute_w_hat={args.recompute_w_hat}, median of {args.rounds} rounds; extra memory per weight "
        f"element of the PQT layers vs bf16 ({records[0]['memory_measure']})")
    cpu = records[0]["overhead_cpu_time_pct"] is not None
    share = lambda r: "-" if r["pqt_share_pct"] is None else f"{r['pqt_share_pct']:.2f} %"
    say(markdown_table(["method", "grad_accum", "tokens/s", "overhead vs bf16"] + ["overhead (CPU time)"] * cpu
                       + ["begin+end_step / bf16 step", "extra bytes/param"],
                       [(r["method"], r["grad_accum"], f"{r['tokens_per_s']:.1f}", f"{r['overhead_pct']:+.2f} %")
                        + ((f"{r['overhead_cpu_time_pct']:+.2f} %",) if cpu else ())
                        + (share(r), f"{r['extra_bytes_per_param']:.3f}")
                        for r in records]))
    for r in records:
        if r["switch_s"] is not None and r["grad_accum"] == records[0]["grad_accum"]:
            say(f"{r['method']}: the budget's choice at its switch (step 1, untimed) took {r['switch_s']:.2f} s")


# --- gpu-check: the first GPU -----------------------------------------------------------------------
# One command for a machine with a GPU: do the Triton kernels give the PyTorch twin's bits there, how
# close to the memory's peak do they run, and the two benchmarks of the paper at its settings.

GPU_CHECK_CONFIG = dict(
    shapes="",  # MxN,... for Fig. 6; "": bench.py kernel's CUDA list
    bandwidth_shape="8192x8192",  # w of the bandwidth table
    repeats=5,  # timed blocks per kernel; the median is reported
    model="llama2-134m",  # Table 1's model (paper: local batch 24 x 2048 on an A100-40G)
    batch_size=24,
    block_size=2048,
    methods="bf16,diffq[all],gaussws[all]",
    rounds=3,  # timed optimizer steps per method
    train=True,  # False: skip the training benchmark (the longest part)
    json="",  # also write all records to this path as JSON
)
# as tests/test_kernels.py, and 2048x768
PARITY_SHAPES = [(1, 1), (33, 65), (4096, 11), (70, 40), (256, 512), (2048, 768)]
PARITY_SEEDS = [0, 1, 2**40 + 3, 2**63 - 1]

# Bytes each kernel must move per element of w (FP32 w, BF16 w_hat): w 4 B, R 1/2 B (gaussws, one
# int32 word per 8 elements) or 2 B (diffq, BF16), w_hat 2 B; block sums read g (FP32) and R; the
# scale and the sums (one FP32 per 1024 elements) are left out. copy: FP32 read, FP32 written.
KERNEL_BYTES = {"copy": 8, "gen gaussws": 0.5, "gen diffq": 2, "apply gaussws": 4 + 0.5 + 2, "apply diffq": 4 + 2 + 2,
                "block_sums gaussws": 4 + 0.5, "block_sums diffq": 4 + 2, "bm": 4 + 2}


def _bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32) if t.dtype == torch.float32 else t


def gpu_parity(device, shapes=PARITY_SHAPES, seeds=PARITY_SEEDS, bm_shape=(256, 4096)):
    """Rows (kernel, method, cases, result): Triton on `device` tensors against the PyTorch twin on CPU.

    gen and apply must agree bit for bit (kernels/__init__.py); block sums to within the bound of
    FP32 summation order, and bit for bit for integer-valued g (every order exact); bm, which has
    no twin, must draw round(N(0,1)/2): the share of zeros within 5 sigma of 0.682689.
    """
    from kernels import torch_noise, triton_noise

    rows = []
    for method in ("gaussws", "diffq"):
        bad = {"gen": [], "apply": [], "block_sums": []}
        worst = 0.0
        for m, n in shapes:
            gen = torch.Generator().manual_seed(m * 1000 + n)
            for seed in seeds:
                r_cpu = torch_noise.gen(m * n, seed, method, "cpu")
                r_dev = triton_noise.gen(m * n, seed, method, device)
                if not torch.equal(_bits(r_dev.cpu()), _bits(r_cpu)):
                    bad["gen"].append((m, n, seed))
                scale = 2 + 10 * torch.rand(-(-m // BL), -(-n // BL), generator=gen)
                for dtype in (torch.float32, torch.bfloat16):
                    w = (torch.randn(m, n, generator=gen) * 0.02).to(dtype)
                    got = triton_noise.apply(w.to(device), r_dev, scale.to(device), method).cpu()
                    if not torch.equal(_bits(got), _bits(torch_noise.apply(w, r_cpu, scale, method))):
                        bad["apply"].append((m, n, seed, str(dtype)))
                g_int = torch.randint(-8, 9, (m, n), generator=gen).float()  # gaussws: every partial sum exact
                exact = method != "gaussws" or torch.equal(
                    triton_noise.block_sums(g_int.to(device), r_dev, method).cpu(),
                    torch_noise.block_sums(g_int, r_cpu, method))
                if not exact:
                    bad["block_sums"].append((m, n, seed, "integer g"))
                g = torch.randn(m, n, generator=gen)
                a = triton_noise.block_sums(g.to(device), r_dev, method).cpu().double()
                b = torch_noise.block_sums(g, r_cpu, method).double()
                prod = g * torch_noise._unpack(r_cpu, m * n, method).view(m, n)
                total_abs = torch.nn.functional.pad(prod.abs().double(), (0, -n % BL, 0, -m % BL))
                total_abs = total_abs.view(-1, BL, total_abs.shape[1] // BL, BL).sum(dim=(1, 3))
                gamma = 1023 * 2.0**-24 / (1 - 1023 * 2.0**-24)
                ratio = ((a - b).abs() / (2 * gamma * total_abs).clamp_min(1e-300)).max().item()
                worst = max(worst, ratio)
                if ratio > 1:
                    bad["block_sums"].append((m, n, seed, "bound"))
        cases = len(shapes) * len(seeds)
        for kernel, failures in bad.items():
            integers = ", integer g bit for bit" if method == "gaussws" else ""
            what = {"gen": "R bits", "apply": "w_hat bits, FP32 and BF16 w",
                    "block_sums": f"bound (worst {worst:.3f} of it){integers}"}
            rows.append((kernel, method, f"{cases} x {what[kernel]}",
                         "identical" if not failures and kernel != "block_sums" else
                         "within" if not failures else f"FAILED {len(failures)}: {failures[:3]}"))
    w = torch.zeros(bm_shape, device=device)
    r = triton_noise.bm(w, torch.ones(-(-bm_shape[0] // BL), -(-bm_shape[1] // BL), device=device), seed=3).float()
    zeros = (r == 0).float().mean().item()
    sigma = math.sqrt(0.682689 * (1 - 0.682689) / r.numel())
    ok = abs(zeros - 0.682689) < 5 * sigma and set(r.unique().tolist()) <= {-3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0}
    rows.append(("bm", "box-muller", f"{r.numel()} draws: share of 0 = {zeros:.5f}", "ok" if ok else "FAILED"))
    return rows


def peak_bandwidth(device):
    """Theoretical DRAM bytes/s of the device: 2 (double data rate) x memory clock x bus width, or None."""
    props = torch.cuda.get_device_properties(device)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", None), getattr(props, "memory_bus_width", None)
    if not (clock_khz and bus_bits):
        try:  # Triton asks the driver for the same two numbers
            import triton
            info = triton.runtime.driver.active.utils.get_device_properties(torch.device(device).index or 0)
            clock_khz, bus_bits = info["mem_clock_rate"], info["mem_bus_width"]
        except Exception:  # noqa: BLE001 - the table then shows the measured copy only
            return None
    return 2 * clock_khz * 1e3 * bus_bits / 8


def kernel_bandwidth(device, shape, repeats):
    """Rows (kernel, bytes/element, GB/s, share of peak, share of copy) for each Triton kernel on w of `shape`."""
    from kernels import triton_noise

    m, n = shape
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(m, n, generator=gen, device=device) * 0.02
    scale = gaussws.block_absmax(w) * 2.0**-5
    stored = {method: triton_noise.gen(m * n, 1234, method, device) for method in ("gaussws", "diffq")}
    fns = {"copy": lambda: torch.empty_like(w).copy_(w),
           "gen gaussws": lambda: triton_noise.gen(m * n, 1234, "gaussws", device),
           "gen diffq": lambda: triton_noise.gen(m * n, 1234, "diffq", device),
           "apply gaussws": lambda: triton_noise.apply(w, stored["gaussws"], scale, "gaussws"),
           "apply diffq": lambda: triton_noise.apply(w, stored["diffq"], scale, "diffq"),
           "block_sums gaussws": lambda: triton_noise.block_sums(w, stored["gaussws"], "gaussws"),
           "block_sums diffq": lambda: triton_noise.block_sums(w, stored["diffq"], "diffq"),
           "bm": lambda: triton_noise.bm(w, scale, 1234)}
    with torch.no_grad():
        seconds = time_per_call(fns, device, repeats)
    peak = peak_bandwidth(device)
    copy = KERNEL_BYTES["copy"] * m * n / seconds["copy"]
    rows = []
    for name, s in seconds.items():
        bw = KERNEL_BYTES[name] * m * n / s
        rows.append((name, KERNEL_BYTES[name], bw / 1e9, None if peak is None else bw / peak, bw / copy))
    return rows, peak


def gpu_check(argv):
    """python bench.py gpu-check: parity, bandwidth, Fig. 6 and Table 1 on the first GPU, one table."""
    config = dict(GPU_CHECK_CONFIG)
    configure(config, argv)  # first: its options (and a typo in them) are read on any machine
    if not torch.cuda.is_available():
        raise BenchError("gpu-check needs a CUDA GPU and torch.cuda.is_available() is False here; "
                         "the CPU checks are `pytest tests/test_kernels.py tests/test_triton_compile.py`")
    device = "cuda"
    parse_ints("repeats", config["repeats"])
    bandwidth_shape = parse_shapes(config["bandwidth_shape"])[0]
    name = torch.cuda.get_device_name(device)
    import triton
    head = (f"bench.py gpu-check on {name}, torch {torch.__version__}, triton {triton.__version__}, "
            f"commit {git_commit()}")
    say(head)
    say("parity: Triton on CUDA tensors against the PyTorch twin ...")
    parity = gpu_parity(device)
    say(markdown_table(["kernel", "method", "cases", "result"], parity))
    say(f"bandwidth on w {bandwidth_shape[0]}x{bandwidth_shape[1]} ...")
    bandwidth, peak = kernel_bandwidth(device, bandwidth_shape, config["repeats"])
    peak_text = "unknown" if peak is None else f"{peak / 1e9:.0f} GB/s"
    say(markdown_table(["kernel", "bytes/element", "GB/s", f"share of peak ({peak_text})", "share of copy"],
                       [(k, b, f"{g:.0f}", "-" if p is None else f"{100 * p:.1f} %", f"{100 * c:.1f} %")
                        for k, b, g, p, c in bandwidth]))
    kernel_args = parse_args(["kernel", "--device=cuda", f"--repeats={config['repeats']}"]
                             + ([f"--shapes={config['shapes']}"] if config["shapes"] else []))[1]
    fig6 = run_kernel(kernel_args)
    table1 = []
    if config["train"]:
        train_args = parse_args(["train", "--device=cuda", f"--model={config['model']}",
                                 f"--batch_size={config['batch_size']}", f"--block_size={config['block_size']}",
                                 f"--methods={config['methods']}", f"--rounds={config['rounds']}"])[1]
        table1 = run_train(train_args)
    rows = [("parity", f"{k} {m}", f"{c}: {r}") for k, m, c, r in parity]
    rows += [("bandwidth", k, f"{g:.0f} GB/s" + ("" if p is None else f", {100 * p:.1f} % of peak")
              + f", {100 * c:.1f} % of copy") for k, b, g, p, c in bandwidth]
    rows += [("Fig. 6", f"{r['shape'][0]}x{r['shape'][1]} {r['impl']}",
              f"{r['gelem_per_s']:.2f} 1e9 elements/s ({r['speedup_vs_torch']:.2f}x torch)") for r in fig6]
    rows += [("Table 1", f"{config['model']} {r['method']}",
              f"{r['tokens_per_s']:.0f} tokens/s ({r['overhead_pct']:+.2f} %), "
              f"{r['extra_bytes_per_param']:+.2f} bytes/param") for r in table1]
    say("")
    say(head + f"; peak {peak_text}")
    say(markdown_table(["part", "case", "result"], rows))
    records = {"device": name, "peak_bytes_per_s": peak, "parity": parity, "bandwidth": bandwidth,
               "fig6": fig6, "table1": table1}
    if config["json"]:
        write_json(config["json"], records)
    return records


# --- command line -----------------------------------------------------------------------------------
# Defaults of each command; `--key=value` overrides them, type-checked by the configurator train.py
# uses. Lists are strings parsed here ("1,8", "512x2048,4096x4096").

def _common():
    return dict(
        device="cuda" if torch.cuda.is_available() else "cpu",  # "cpu" or "cuda"
        threads=0,  # CPU threads for torch; 0: torch's default (one per core). Fewer when others share the cores
        json="",  # also write the records to this path as JSON
    )


KERNEL_CONFIG = dict(
    shapes="",  # MxN,... of w; "": a default list for the device
    repeats=5,  # timed blocks per impl; the median is reported
    **_common(),
)
TRAIN_CONFIG = dict(
    model="gpt2-124m",  # a name of model.PRESETS
    methods="bf16,gaussws[all],diffq[all]",  # method strings; bf16 (the baseline) is always added
    batch_size=1,  # sequences per micro-step
    block_size=1024,  # tokens per sequence
    grad_accum="1",  # micro-steps per optimizer step; a list such as "1,8" measures each
    rounds=3,  # timed optimizer steps per method
    warmup=1,  # untimed steps per method first (the noise kernels compile at the first)
    compile=False,  # torch.compile the model
    recompute_w_hat=False,  # as train.py: keep no w_hat for the backward, make it again there (less memory)
    seed=1337,  # initial weights, tokens and noise
    **_common(),
)
# Any model.ModelConfig field overrides the preset, e.g. a tiny model: --n_layer=1 --n_embd=64.
MODEL_KEYS = [f.name for f in dataclasses.fields(model_lib.ModelConfig) if f.name != "block_size"]


def parse_shapes(text):
    shapes = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", part)
        if not match or 0 in (int(match.group(1)), int(match.group(2))):
            raise BenchError(f"--shapes={text}: bad shape {part!r}; expected MxN with positive M and N, e.g. 512x2048")
        shapes.append((int(match.group(1)), int(match.group(2))))
    return shapes


def parse_ints(key, text):
    try:
        values = [int(v) for v in str(text).split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise BenchError(f"--{key}={text}: expected positive integers separated by commas, e.g. 1,8")
    return values


def parse_args(argv):
    """(command, namespace of settings) from the command line; a UserError for bad input."""
    if not argv or argv[0] not in ("kernel", "train"):
        got = f"got {argv[0]!r}" if argv else "got nothing"
        raise BenchError(f"expected 'kernel' or 'train' as the first argument, or 'gpu-check' ({got}); "
                         "see python bench.py --help")
    command = argv[0]
    config = dict(KERNEL_CONFIG if command == "kernel" else TRAIN_CONFIG)
    defaults = dataclasses.asdict(model_lib.ModelConfig()) if command == "train" else {}
    config.update({k: defaults[k] for k in MODEL_KEYS if command == "train"})
    explicit = configure(config, argv[1:])
    args = types.SimpleNamespace(command=command, **{k: v for k, v in config.items() if k not in MODEL_KEYS})
    args.model_overrides = {k: config[k] for k in MODEL_KEYS if k in explicit}
    for key in ("vocab_size", "n_layer", "n_head", "n_embd"):
        if args.model_overrides.get(key, 1) < 1:
            raise BenchError(f"--{key}={args.model_overrides[key]}: expected a positive integer")
    positive = ["repeats"] if command == "kernel" else ["batch_size", "block_size", "rounds", "warmup"]
    for key in positive:
        parse_ints(key, getattr(args, key))
    if args.threads < 0:
        raise BenchError(f"--threads={args.threads}: expected 0 (torch's default) or a positive number")
    if command == "kernel":
        args.shapes = parse_shapes(args.shapes) if args.shapes else None
    else:
        args.grad_accum = parse_ints("grad_accum", args.grad_accum)
        if args.model not in model_lib.PRESETS:
            raise BenchError(f"--model={args.model}: unknown; expected one of {', '.join(model_lib.PRESETS)}")
    check_device(config)
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise BenchError(f"--json={args.json}: its folder does not exist")
    return command, args


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
    if torch.device(args.device).type == "cpu":
        keep_freed_cpu_memory()  # as train.py: no page faults on every step's fresh tensors
    records = run_kernel(args) if command == "kernel" else run_train(args)
    if args.json:
        write_json(args.json, records)
        say(f"wrote {len(records)} records to {args.json}")
    return records


if __name__ == "__main__":
    sys.exit(cli(main))
