"""What the benchmarks share: the one-line error, printing, tables, JSON records, the machine's load and
the interleaved timing of callables."""
import json
import math
import os
import statistics
import time

import torch

from step import sync
from util import UserError, write_atomic


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
