"""bench.py train: Table 1, tokens/s and memory of train.py's optimizer step per method, against bf16."""
import statistics
import time

import torch

import gaussws
import model as model_lib
from benchmarks.common import BenchError, load_avg, machine_load, markdown_table, say
from quant.budget import check_budget
from quant.formats import BUDGET_TARGETS
from quant.grids import check_format
from step import sync, train_step

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
        if fmt in BUDGET_TARGETS:
            check_budget(fmt, budget, kind, switch=1)
        elif fmt or kind == "ste":
            check_format(fmt)
        if bits and fmt not in BUDGET_TARGETS or kind == "bf16" and fmt:
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
        self.switch = 1 if fmt in BUDGET_TARGETS else 0
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
