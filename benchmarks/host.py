"""bench.py host: what a PQT step's begin and end cost the host, against the number of PQT Linears.

On a GPU the step's own work is small; what costs is the host's calls that launch it (docs/GPU.md): each
PyTorch op that runs a kernel, each Triton launch. Both are measured here without a GPU, on the Triton
backend's path (the one a GPU takes) with CPU tensors:
  - launches: LaunchCounter counts, for one TrainStep.begin() + end(), the PyTorch ops that would launch
    a GPU kernel (a TorchDispatchMode: every op but views, empty tensors and metadata) and the Triton
    launches (kernels.triton_noise._launch, the one door of every Triton kernel);
  - time: the host's microseconds of begin() + end() on tiny weights (64 x 64), with every Triton launch
    replaced by a recorder that runs nothing (Triton's interpreter is not a GPU), so what is timed is
    the Python and PyTorch calls the host makes, and the PyTorch ops' CPU work on tiny tensors.
Both for the batched step (one _Batch of every layer: a constant number of launches) and one layer at a
time (batched=False: the per-layer path, what every step did before the batches). The "H200 host"
column prices the launches as docs/GPU.md measured them on an H200's host: 13 us a PyTorch kernel, 34 us
a Triton launch.
"""
import contextlib
import statistics
import time
from collections import Counter

import numpy as np
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import gaussws
from benchmarks.common import markdown_table, say

US_PER_TORCH_LAUNCH, US_PER_TRITON_LAUNCH = 13.0, 34.0  # an H200 host's (docs/GPU.md)

# PyTorch ops that launch no GPU kernel: new uninitialised tensors, aliases and metadata.
NO_LAUNCH = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach", "alias",
             "lift_fresh", "is_same_size", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "set_"}


class LaunchCounter(TorchDispatchMode):
    """Within it: `torch` (Counter of the PyTorch ops that would launch a GPU kernel, by op name) and
    `triton` (Counter of the Triton launches, by kernel variant). With run=False a Triton launch only
    counts (no kernel runs): for timing the host alone."""

    def __init__(self, run=True):
        super().__init__()
        self.run, self.torch, self.triton = run, Counter(), Counter()
        self._patch = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not (func.is_view or name in NO_LAUNCH):
            self.torch[name] += 1
        return func(*args, **(kwargs or {}))

    def _launch(self, variant, grid, per_call=None, **args):
        self.triton[variant] += 1
        if self.run:
            with _disable_current_modes():  # the interpreter's own copies are not the step's
                self._real(variant, grid, per_call, **args)

    def __enter__(self):
        self._patch = triton_launches(self._launch)
        self._real = self._patch.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        self._patch.__exit__(*exc)
        return super().__exit__(*exc)

    def total(self):
        return sum(self.torch.values()) + sum(self.triton.values())


@contextlib.contextmanager
def triton_launches(launch):
    """Every Triton launch made by `launch(variant, grid, per_call, **args)` within; yields the real one."""
    from kernels import triton_noise
    real, triton_noise._launch = triton_noise._launch, launch
    try:
        yield real
    finally:
        triton_noise._launch = real


def host_model(n_layers, width=64):
    """n_layers PQTLinear(width, width) on the Triton backend, on the CPU: one kind, one _Batch."""
    torch.manual_seed(0)
    model = nn.Sequential(*(gaussws.PQTLinear(width, width, backend="triton") for _ in range(n_layers)))
    return gaussws.set_noise_seed(model, 1)


def _fake_grads(model):
    """A zero dL/dw on every weight (what the micro-steps' backwards would leave), no b_i gradient (what
    the optimizer's zero_grad leaves)."""
    for layer in gaussws.pqt_layers(model):
        layer.weight.grad = torch.zeros_like(layer.weight)
        layer.b_i.grad = None


def count_step(model, step, batched, run=True):
    """The LaunchCounter of one TrainStep.begin() + end() (dL/dw faked between them)."""
    counter = LaunchCounter(run)
    gaussws.TrainStep(model, step - 1, batched=batched).begin().end(apply_eq4=False)  # batches made, untimed
    train_step = gaussws.TrainStep(model, step, batched=batched)
    _fake_grads(model)
    with counter:
        train_step.begin()
        train_step.end()
    return counter


def time_step(model, batched, repeats):
    """Median microseconds of the host for one TrainStep.begin() + end(), Triton launches not run."""
    times = []
    with triton_launches(lambda *args, **kwargs: None):
        for step in range(repeats + 2):  # two untimed first: the batches are made, caches warm
            _fake_grads(model)
            t = time.perf_counter()
            train_step = gaussws.TrainStep(model, step, batched=batched)
            train_step.begin()
            train_step.end()
            times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times[2:])


def fit_line(xs, ys):
    """(a, b) of the least-squares line y = a + b x."""
    b, a = np.polyfit(np.asarray(xs, dtype=float), np.asarray(ys, dtype=float), 1)
    return float(a), float(b)


def run_host(args):
    """Rows of bench.py host, one per (number of Linears, batched), and the fitted lines."""
    say(f"bench.py host: TrainStep begin + end on the Triton backend's path, {args.width}x{args.width} "
        f"weights on the CPU, Triton launches not run; median of {args.repeats} steps")
    records = []
    for batched in (False, True):
        for n in args.layers:
            model = host_model(n, args.width)
            counts = count_step(model, 2, batched, run=False)
            us = time_step(model, batched, args.repeats)
            torch_launches, triton_launches = sum(counts.torch.values()), sum(counts.triton.values())
            records.append({"linears": n, "batched": batched, "host_us": us, "torch_launches": torch_launches,
                            "triton_launches": triton_launches, "torch_ops": dict(counts.torch),
                            "triton_kernels": dict(counts.triton),
                            "h200_host_us": (torch_launches * US_PER_TORCH_LAUNCH
                                             + triton_launches * US_PER_TRITON_LAUNCH),
                            "threads": torch.get_num_threads()})
            say(f"  {n} Linears, {'batched' if batched else 'one layer at a time'}: {us:.0f} us, "
                f"{torch_launches} PyTorch + {triton_launches} Triton launches")
    fits = {}
    for batched in (False, True):
        rows = [r for r in records if r["batched"] == batched]
        fits[batched] = {k: fit_line([r["linears"] for r in rows], [r[k] for r in rows])
                         for k in ("host_us", "torch_launches", "triton_launches", "h200_host_us")}
    say("")
    say(markdown_table(["Linears", "path", "host us/step", "PyTorch launches", "Triton launches", "H200 host us"],
                       [(r["linears"], "batched" if r["batched"] else "per layer", f"{r['host_us']:.0f}",
                         r["torch_launches"], r["triton_launches"], f"{r['h200_host_us']:.0f}") for r in records]))
    say("")
    say(markdown_table(["path", "host us = a + b x Linears", "launches per added Linear", "H200 host us per Linear"],
                       [("batched" if b else "per layer", f"{f['host_us'][0]:.0f} + {f['host_us'][1]:.1f} x",
                         f"{f['torch_launches'][1] + f['triton_launches'][1]:.2f}", f"{f['h200_host_us'][1]:.1f}")
                        for b, f in fits.items()]))
    slope = fits[False]["host_us"][1] / fits[True]["host_us"][1]
    say(f"host us per added Linear: {fits[False]['host_us'][1]:.1f} one layer at a time, "
        f"{fits[True]['host_us'][1]:.1f} batched ({slope:.1f}x less)")
    for r in records:
        r["fit"] = {k: list(v) for k, v in fits[r["batched"]].items()}
    return records

