"""bench.py kernel: Figure 6, the throughput of the forward of Eq. 3 (w -> BF16 w_hat) per implementation."""
import torch

import gaussws
from benchmarks.common import machine_load, markdown_table, load_avg, say, time_per_call
from kernels import BL

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
