"""What a training run says about itself, after nanochat's log: where it starts and the dtype it
computes in, one line per logged step, and a summary at its end; and where its records go
(metrics.jsonl, wandb).

 step 280/400 (70.0%) | loss 2.4100 | lr 1.90e-03 | 812 ms | 5,040 tok/s | MFU 38.1% | b_t 5.93 [5.81, 6.05] | eta 1m38s

A step's record in metrics.jsonl holds the same: iter, loss, lr, ms_per_iter, tokens_per_s, mfu_pct,
b_t/mean, b_t/min, b_t/max, eta_s. MFU (model FLOPs utilisation) is nanoGPT's estimate of the
model's FLOPs (flops_per_token) per second over the GPUs' dense BF16 peak (PEAK_BF16_FLOPS): only
for bfloat16 runs on a GPU of that table, never on a CPU. The ETA is the mean wall time per step
since the first step of this process (the first includes torch.compile's work; the evaluations
and checkpoints after it count), times the steps left.
"""
import sys
import time

import torch

# Dense (no 2:4 sparsity) BF16 tensor-core FLOP/s of one GPU, from NVIDIA's datasheets, by a part of
# torch.cuda.get_device_name; the first that matches wins (so "H100 NVL" before "H100", "L40S"
# before "L40" before "L4"). A GPU not listed gets no MFU.
PEAK_BF16_FLOPS = (("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12),
                   ("B200", 2250e12), ("A100", 312e12), ("L40S", 362e12), ("L40", 181e12), ("L4", 121e12))


def peak_flops(device_name):
    """The dense BF16 FLOP/s of the GPU named device_name (PEAK_BF16_FLOPS), or None."""
    return next((flops for part, flops in PEAK_BF16_FLOPS if part in device_name), None)


def device_peak(device, dtype, world_size):
    """The dense BF16 FLOP/s of world_size GPUs like device, MFU's denominator: None on a CPU, for
    a float32 run, or on a GPU that PEAK_BF16_FLOPS does not list."""
    if torch.device(device).type != "cuda" or dtype != "bfloat16":
        return None
    peak = peak_flops(torch.cuda.get_device_name(device))
    return peak and peak * world_size


def flops_per_token(model):
    """nanoGPT's estimate_mfu (PaLM, appendix B): 6N for the matmuls of the forward and backward,
    N the parameters but the embedding tables, plus 12 L H Q T for attention's scores and mix (L
    layers, H heads of width Q, context T)."""
    cfg = model.config
    return 6 * model.get_num_params() + 12 * cfg.n_layer * cfg.n_head * (cfg.n_embd // cfg.n_head) * cfg.block_size


def duration(seconds):
    """38s, 1m38s, 2h05m."""
    s = round(seconds)
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s % 3600 // 60:02d}m"


def dtype_line(dtype, explicit, device_type):
    """The dtype the run computes in, and why: the config's, or the hardware's default (train.py)."""
    how = "bfloat16 autocast of the matmuls" if dtype == "bfloat16" else "float32, no autocast"
    if explicit:
        why = "set by the config"
    elif device_type == "cuda":
        why = "the default on a CUDA GPU"
    else:
        has = torch.ops.mkldnn._is_mkldnn_bf16_supported()
        why = f"the default here: this CPU has {'' if has else 'no '}BF16 matmuls, AVX512-BF16 or AMX"
    return f"dtype: {how}, {why} (weights and optimizer state float32, w_hat bfloat16)"


def start_line(init_from, seed, saved_step, checkpoint_path, forked):
    """Where the run starts: resumed, forked from another run's checkpoint, initialised from other
    weights, or from scratch."""
    if init_from == "resume":
        return f"resumed from step {saved_step} of {checkpoint_path}"
    if forked:
        return f"forked from step {saved_step} of {forked}"
    if init_from != "scratch":
        return f"initialised from {init_from} (its weights; a new run from step 0)"
    return f"from scratch (seed {seed})"


def peak_memory(device):
    """(bytes, what they measure) of this process's peak memory: CUDA's allocator on a GPU, else the
    process's peak resident set (None where the OS does not say, as on Windows)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device), "CUDA max_memory_allocated"
    try:
        import resource
    except ImportError:
        return None, "unknown"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak * (1 if sys.platform == "darwin" else 1024), "the process's peak RSS"


class Progress:
    """A run's progress from step `start` to max_iters, tokens_per_iter tokens a step (all processes
    together): each logged step's record and line, and the summary at the end. peak: the FLOP/s of
    all processes' devices together, for MFU (None: no MFU)."""

    def __init__(self, start, max_iters, tokens_per_iter, flops_per_token, peak):
        self.start, self.max_iters, self.tokens_per_iter = start, max_iters, tokens_per_iter
        self.flops_per_token, self.peak = flops_per_token, peak
        self.began, self.warm = time.time(), None  # warm: (time, step) once the first step is done
        self.val = {}  # step: val loss of this process's evaluations

    def stepped(self, iter_num):
        if self.warm is None:
            self.warm = (time.time(), iter_num)

    def eta(self, iter_num):
        """Seconds left at the mean pace since the first step; None before a second one."""
        if self.warm is None or iter_num <= self.warm[1]:
            return None
        return (time.time() - self.warm[0]) / (iter_num - self.warm[1]) * (self.max_iters - iter_num)

    def record(self, iter_num, loss, lr, dt, b_t):
        """metrics.jsonl's record of step iter_num: loss, lr, dt (mean seconds per step since the last
        log), b_t (gaussws.bitwidth_stats, or None)."""
        r = {"iter": iter_num, "loss": loss, "lr": lr, "ms_per_iter": 1000 * dt,
             "tokens_per_s": self.tokens_per_iter / dt}
        if self.peak:
            r["mfu_pct"] = 100 * self.flops_per_token * r["tokens_per_s"] / self.peak
        r.update({f"b_t/{k}": v for k, v in (b_t or {}).items()})
        eta = self.eta(iter_num)
        if eta is not None:
            r["eta_s"] = eta
        return r

    def line(self, r):
        """The log line of a record."""
        fields = [f"step {r['iter']}/{self.max_iters} ({100 * r['iter'] / self.max_iters:.1f}%)",
                  f"loss {r['loss']:.4f}", f"lr {r['lr']:.2e}", f"{r['ms_per_iter']:.0f} ms",
                  f"{r['tokens_per_s']:,.0f} tok/s"]
        if "mfu_pct" in r:
            fields.append(f"MFU {r['mfu_pct']:.1f}%")
        if "b_t/mean" in r:
            fields.append(f"b_t {r['b_t/mean']:.2f} [{r['b_t/min']:.2f}, {r['b_t/max']:.2f}]")
        if "eta_s" in r:
            fields.append(f"eta {duration(r['eta_s'])}")
        return " | ".join(fields)

    def summary(self, iter_num, best_val_loss, device):
        """The lines at the end of a run that reached step iter_num: its last and best val loss (best
        of the checkpoint's best_val_loss and this process's evaluations), the tokens and time this
        process trained, its peak memory."""
        lines = []
        if self.val:
            last = max(self.val)
            best = min(best_val_loss, *self.val.values())
            lines.append(f"val loss: {self.val[last]:.4f} at step {last}, best {best:.4f}")
        tokens = (iter_num - self.start) * self.tokens_per_iter
        took = duration(time.time() - self.began)
        lines.append(f"trained: steps {self.start}-{iter_num}, {tokens:,} tokens in {took}"
                     + (f" ({iter_num * self.tokens_per_iter:,} tokens since step 0)" if self.start else ""))
        peak, what = peak_memory(device)
        if peak is not None:
            lines.append(f"peak memory: {peak / 2**20:,.0f} MiB ({what})")
        return lines


class Metrics:
    """Where the run's records go: its directory's metrics.jsonl (run: checkpoint.Run, which rank 0
    started) and, with wandb_log, Weights & Biases (imported only then)."""

    def __init__(self, c, proc, run, run_info):
        self.run, self.wandb = run, None
        if c["wandb_log"] and proc.master:
            import wandb
            wandb.init(project=c["wandb_project"], name=c["wandb_run_name"], mode=c["wandb_mode"], dir=c["out_dir"],
                       config=run_info)
            self.wandb = wandb

    def log(self, record):
        self.run.log(record)
        if self.wandb and self.run.metrics:
            self.wandb.log(record, step=record["iter"])

    def close(self):
        if self.wandb:
            self.wandb.finish()
        self.run.close()
