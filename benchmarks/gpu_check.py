"""bench.py gpu-check: one command for a machine with a GPU. Do the Triton kernels give the PyTorch twin's
bits there (and the one-pass and multi-layer kernels the per-layer kernels' bits), how close to the memory's
peak do they run, and the two benchmarks of the paper at its settings."""
import math

import torch

import gaussws
from benchmarks.common import BenchError, markdown_table, say, time_per_call, write_json
from util import check_json_path
from benchmarks.fig6 import run_kernel
from benchmarks.options import check_positive, parse_args, parse_shapes
from benchmarks.table1 import run_train
from configurator import configure
from kernels import BL
from util import git_commit

GPU_CHECK_CONFIG = dict(
    shapes="",  # MxN,... for Fig. 6; "": bench.py kernel's CUDA list
    bandwidth_shape="8192x8192",  # w of the bandwidth table
    repeats=5,  # timed blocks per kernel; the median is reported
    # Table 1's models and local batches (the paper's, on an A100-40G: 24 and 8 sequences of 2048 tokens)
    models="llama2-134m:24,llama2-1b:8",
    block_size=2048,
    methods="bf16,diffq[all],gaussws[all]",
    compile="False,True",  # Table 1 eager, then with torch.compile
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
# The one pass (eq3) reads w and writes w_hat and R (the block maxima, 1/1024 of an element, left out).
KERNEL_BYTES = {"copy": 8, "gen gaussws": 0.5, "gen diffq": 2, "apply gaussws": 4 + 0.5 + 2, "apply diffq": 4 + 2 + 2,
                "block_sums gaussws": 4 + 0.5, "block_sums diffq": 4 + 2, "bm": 4 + 2,
                "eq3 gaussws": 4 + 2 + 0.5, "eq3 diffq": 4 + 2 + 2}


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


def one_pass_parity(device, shapes=PARITY_SHAPES, seeds=PARITY_SEEDS):
    """Rows (kernel, method, cases, result): the one pass (eq3) against block_absmax, gen and apply on
    `device`, bit for bit (R, w_hat, max_bl; FP32 and BF16 w)."""
    from kernels import triton_noise

    rows = []
    for method in ("gaussws", "diffq"):
        bad = []
        for m, n in shapes:
            gen = torch.Generator().manual_seed(m * 1000 + n)
            for seed in seeds:
                for dtype in (torch.float32, torch.bfloat16):
                    w = (torch.randn(m, n, generator=gen) * 0.02).to(dtype).to(device)
                    e = torch.exp2(1.0 - (2 + 10 * torch.rand(-(-m // BL), -(-n // BL), generator=gen))).to(device)
                    w_hat, r_store, max_bl = triton_noise.eq3(w, e, seed, method)
                    want_r = triton_noise.gen(m * n, seed, method, device)
                    want_max = gaussws.block_absmax(w)
                    want = triton_noise.apply(w, want_r, want_max * e, method)
                    if not all(torch.equal(_bits(a), _bits(b)) for a, b in
                               ((r_store, want_r), (max_bl, want_max), (w_hat, want))):
                        bad.append((m, n, seed, str(dtype)))
        rows.append(("eq3 (one pass)", method, f"{len(shapes) * len(seeds) * 2} x R, w_hat, max_bl bits",
                     "identical" if not bad else f"FAILED {len(bad)}: {bad[:3]}"))
    return rows


def mixed_net(device, seed=3, exact_exp2=False):
    """Linears of four kinds (FP32 / BF16 weights, gaussws / diffq, rows that start a word of R or not) and
    random b_t: what TrainStep groups into several batches. exact_exp2: b_t integers, 2^(1 - b_t) exact."""
    torch.manual_seed(seed)
    kinds = [(100, 70, "gaussws", torch.float32), (70, 64, "diffq", torch.float32),
             (64, 768, "gaussws", torch.bfloat16), (768, 64, "gaussws", torch.float32),
             (64, 35, "diffq", torch.bfloat16), (35, 40, "gaussws", torch.float32)]
    layers = []
    for n_in, n_out, method, dtype in kinds:
        layers += [gaussws.PQTLinear(n_in, n_out, method=method, backend="triton", dtype=dtype), torch.nn.GELU()]
    net = torch.nn.Sequential(*layers[:-1]).to(device)
    for layer in gaussws.pqt_layers(net):
        b_i = torch.randint(-2, 4, layer.b_i.shape) / 2 if exact_exp2 else torch.rand(layer.b_i.shape) * 2 - 0.5
        layer.b_i.data = b_i.float().to(device)
    return gaussws.set_noise_seed(net, seed)


def batched_step_parity(device, steps=(7, 8)):
    """Row: TrainStep's batches against one layer at a time (the per-layer kernels, Eq. 4 through autograd),
    on `device`: every gradient bit for bit, Eq. 12's added to, two steps accumulating. On a GPU each
    element of 2^(1 - b_t) is the same whether exp2 runs on a layer's b_t or on all layers' at once; on a
    CPU ATen rounds a tensor's last elements otherwise, so there b_t are integers (2^(1 - b_t) exact)."""
    nets = {batched: mixed_net(device, exact_exp2=torch.device(device).type == "cpu") for batched in (True, False)}
    xs = [torch.randn(5, 100, device=device) for _ in range(2)]
    autocast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    for step in steps:
        for batched, net in nets.items():
            with gaussws.TrainStep(net, step, batched=batched):
                for x in xs:
                    with autocast:
                        loss = net(x).float().square().mean() + 0.1 * gaussws.bitwidth_loss(net)
                    (loss / len(xs)).backward()
    bad = [name for (name, a), (_, b) in zip(nets[True].named_parameters(), nets[False].named_parameters())
           if not torch.equal(a.grad, b.grad)]
    cases = f"{len(list(nets[True].parameters()))} gradients x {len(steps)} steps (w, b_i; 4 kinds of layer)"
    return [("TrainStep batched", "gaussws, diffq", cases, "identical" if not bad else f"FAILED: {bad[:3]}")]


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
    e = torch.full((-(-m // BL), -(-n // BL)), 2.0**-5, device=device)
    scale = gaussws.block_absmax(w) * e
    stored = {method: triton_noise.gen(m * n, 1234, method, device) for method in ("gaussws", "diffq")}
    fns = {"copy": lambda: torch.empty_like(w).copy_(w),
           "gen gaussws": lambda: triton_noise.gen(m * n, 1234, "gaussws", device),
           "gen diffq": lambda: triton_noise.gen(m * n, 1234, "diffq", device),
           "apply gaussws": lambda: triton_noise.apply(w, stored["gaussws"], scale, "gaussws"),
           "apply diffq": lambda: triton_noise.apply(w, stored["diffq"], scale, "diffq"),
           "block_sums gaussws": lambda: triton_noise.block_sums(w, stored["gaussws"], "gaussws"),
           "block_sums diffq": lambda: triton_noise.block_sums(w, stored["diffq"], "diffq"),
           "bm": lambda: triton_noise.bm(w, scale, 1234),
           "eq3 gaussws": lambda: triton_noise.eq3(w, e, 1234, "gaussws"),
           "eq3 diffq": lambda: triton_noise.eq3(w, e, 1234, "diffq")}
    with torch.no_grad():
        seconds = time_per_call(fns, device, repeats)
    peak = peak_bandwidth(device)
    copy = KERNEL_BYTES["copy"] * m * n / seconds["copy"]
    rows = []
    for name, s in seconds.items():
        bw = KERNEL_BYTES[name] * m * n / s
        rows.append((name, KERNEL_BYTES[name], bw / 1e9, None if peak is None else bw / peak, bw / copy))
    return rows, peak


def table1_models(text):
    """[(model, local batch)] of --models: 'llama2-134m:24,llama2-1b:8'."""
    out = []
    for part in text.split(","):
        model, _, batch = part.strip().partition(":")
        if not batch.isdigit() or int(batch) < 1:
            raise BenchError(f"--models={text}: bad {part!r}; expected MODEL:BATCH, e.g. llama2-134m:24")
        out.append((model, int(batch)))
    return out


def gpu_check(argv):
    """python bench.py gpu-check: parity, bandwidth, Fig. 6 and Table 1 on the first GPU, one table."""
    config = dict(GPU_CHECK_CONFIG)
    configure(config, argv)  # first: its options (and a typo in them) are read on any machine
    table1_models(config["models"])
    check_json_path(config["json"], "gpu_check.json")
    if not torch.cuda.is_available():
        raise BenchError("gpu-check needs a CUDA GPU and torch.cuda.is_available() is False here; "
                         "the CPU checks are `pytest tests/test_kernels.py tests/test_triton_compile.py`")
    device = "cuda"
    check_positive("repeats", config["repeats"])
    bandwidth_shape = parse_shapes(config["bandwidth_shape"])[0]
    name = torch.cuda.get_device_name(device)
    import triton
    head = (f"bench.py gpu-check on {name}, torch {torch.__version__}, triton {triton.__version__}, "
            f"commit {git_commit()}")
    say(head)
    say("parity: Triton on CUDA tensors against the PyTorch twin, the one pass and the batched step against "
        "the per-layer kernels ...")
    parity = gpu_parity(device) + one_pass_parity(device) + batched_step_parity(device)
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
    for model, batch_size in (table1_models(config["models"]) if config["train"] else []):
        for compiled in [c.strip() for c in config["compile"].split(",")]:
            train_args = parse_args(["train", "--device=cuda", f"--model={model}", f"--batch_size={batch_size}",
                                     f"--block_size={config['block_size']}", f"--methods={config['methods']}",
                                     f"--rounds={config['rounds']}", f"--compile={compiled}"])[1]
            table1 += run_train(train_args)
    rows = [("parity", f"{k} {m}", f"{c}: {r}") for k, m, c, r in parity]
    rows += [("bandwidth", k, f"{g:.0f} GB/s" + ("" if p is None else f", {100 * p:.1f} % of peak")
              + f", {100 * c:.1f} % of copy") for k, b, g, p, c in bandwidth]
    rows += [("Fig. 6", f"{r['shape'][0]}x{r['shape'][1]} {r['impl']}",
              f"{r['gelem_per_s']:.2f} 1e9 elements/s ({r['speedup_vs_torch']:.2f}x torch)") for r in fig6]
    rows += [("Table 1", f"{r['model']}, {r['batch_size']} x {r['block_size']}"
                         f"{', compiled' * r['compile']} {r['method']}",
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
