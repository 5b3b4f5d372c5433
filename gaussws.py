"""Gaussian weight sampling (GaussWS): pseudo-quantization training (PQT) of Linear weights.

Each training step replaces a weight w by (Eq. 3, docs/METHOD.md section 1)

    w_hat = w + R * broadcast_bl(max_bl(|w|) * 2^(1 - b_t))

with 32x32 blocks, a learnable bitwidth b_t per block, and noise R that is redrawn every optimizer
step: round(N(0,1)/2) made from random bits (gaussws) or U(-1/2, 1/2) in BF16 (diffq, the
baseline). w_hat is BF16; the matmul that follows is the ordinary one. The noise kernels live in
kernels/; this file holds the math around them, the layer, and the seeds.

Use on any model: swap nn.Linear for PQTLinear, call set_noise_seed(model, seed) once and
set_step(model, step) before each optimizer step's forwards. See README.md.
"""
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import BL
from kernels.torch_noise import Compiled

METHODS = ("bf16", "gaussws", "diffq")
LAYERS = {
    "gpt2": ("qkv", "out", "up", "down"),
    "llama2": ("q", "k", "v", "out", "gate", "up", "down"),
}
GROUPS = {"all": None, "od": ("out", "down")}  # None: every layer of the arch


def parse_method(spec, arch="gpt2"):
    """'gaussws[od]' -> ('gaussws', frozenset({'out', 'down'})); 'bf16' -> ('bf16', frozenset())."""
    if arch not in LAYERS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(LAYERS)}")
    valid = LAYERS[arch]
    hint = (f"expected bf16, or gaussws[...] / diffq[...] with a comma-separated list of "
            f"{', '.join(valid)} or {', '.join(GROUPS)} inside the brackets, e.g. gaussws[od]")
    match = re.fullmatch(r"\s*(\w+)\s*(?:\[([^\]]*)\])?\s*", str(spec))
    if not match or match.group(1) not in METHODS:
        raise ValueError(f"bad method {spec!r}: {hint}")
    method, parts = match.group(1), match.group(2)
    if method == "bf16":
        if parts is not None:
            raise ValueError(f"bad method {spec!r}: bf16 takes no layer list; {hint}")
        return method, frozenset()
    if parts is None or not parts.strip():
        raise ValueError(f"bad method {spec!r}: say which layers get the method; {hint}")
    layers = set()
    for part in (p.strip() for p in parts.split(",")):
        if part in GROUPS:
            layers.update(GROUPS[part] or valid)
        elif part in valid:
            layers.add(part)
        else:
            raise ValueError(f"bad method {spec!r}: no layer {part!r} in {arch}; {hint}")
    return method, frozenset(layers)


def _block_absmax(w):
    m, n = w.shape
    nbm, nbn = -(-m // BL), -(-n // BL)
    a = F.pad(w.abs(), (0, nbn * BL - n, 0, nbm * BL - m))  # partial edge blocks: zeros never win a max of |w|
    return a.view(nbm, BL, nbn, BL).amax(dim=(1, 3)).float()


_block_absmax_compiled = Compiled(_block_absmax)  # one fused pass over w for large weights


def block_absmax(w):
    """max_bl(|w|): FP32 max of |w| over each 32x32 block, shape (ceil(m/32), ceil(n/32))."""
    return _block_absmax_compiled(w.detach())


def scale_bl(max_bl, b_t):
    """max_bl(|w|) * 2^(1 - b_t): the scale of each block's noise in Eq. 3. Differentiating it in b_t
    (with max_bl a constant) is what turns sum_bl(dL/dw_hat * R) into Eq. 4's b_t gradient."""
    return max_bl * torch.exp2(1.0 - b_t.float())


def _kernels(backend, device):
    """The module that makes R: 'triton' (kernels/triton_noise.py) or 'torch' (kernels/torch_noise.py)."""
    if backend == "auto":
        backend = "triton" if torch.device(device).type == "cuda" else "torch"
    if backend == "triton":
        from kernels import triton_noise
        return triton_noise
    if backend == "torch":
        from kernels import torch_noise
        return torch_noise
    raise ValueError(f"unknown backend {backend!r}; expected 'auto', 'triton' or 'torch'")


def _check_seed(seed):
    seed = int(seed)
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an integer in [0, 2^63), got {seed}")
    return seed


def sample_r(shape, seed, method="gaussws", *, device="cpu", backend="auto"):
    """The noise R (FP32) that pseudo_quantize(w, b_t, seed, method) adds for a w of this shape."""
    m, n = shape
    k = _kernels(backend, device)
    r_store = k.gen(m * n, _check_seed(seed), method, device)
    ones = torch.ones(-(-m // BL), -(-n // BL), device=device)
    return k.apply(torch.zeros(m, n, device=device), r_store, ones, method).float()  # 0 + R * 1, exact


# Eq. 3 as an opaque op, so torch.compile neither traces the kernels nor specialises on the seed
# (a CPU int64 tensor): its value changes every step and must not trigger a recompile.
@torch.library.custom_op("pqt::w_hat", mutates_args=())
def _w_hat_op(w: torch.Tensor, scale_bl: torch.Tensor, seed: torch.Tensor, method: str, backend: str) -> torch.Tensor:
    k = _kernels(backend, w.device)
    r_store = k.gen(w.numel(), int(seed), method, w.device)
    return k.apply(w.contiguous(), r_store, scale_bl.contiguous(), method)


@_w_hat_op.register_fake
def _(w, scale_bl, seed, method, backend):
    return torch.empty(w.shape, dtype=torch.bfloat16, device=w.device)


@torch.library.custom_op("pqt::block_sums", mutates_args=())
def _block_sums_op(g: torch.Tensor, seed: torch.Tensor, method: str, backend: str) -> torch.Tensor:
    """sum_bl(g * R) with R regenerated from the seed: never stored between forward and backward."""
    k = _kernels(backend, g.device)
    r_store = k.gen(g.numel(), int(seed), method, g.device)
    return k.block_sums(g.contiguous(), r_store, method)


@_block_sums_op.register_fake
def _(g, seed, method, backend):
    return g.new_empty((-(-g.shape[0] // BL), -(-g.shape[1] // BL)), dtype=torch.float32)


def _w_hat_setup(ctx, inputs, output):
    w, scale_bl, seed, method, backend = inputs
    ctx.w_dtype = w.dtype
    ctx.save_for_backward(seed)
    ctx.method, ctx.backend = method, backend


def _w_hat_backward(ctx, g):
    # dL/dw = dL/dw_hat; dL/dscale_bl = sum_bl(dL/dw_hat * R). Autograd then carries the scale's
    # gradient through scale_bl = max_bl(|w|) * 2^(1 - b_t), which gives Eq. 4 for b_t.
    (seed,) = ctx.saved_tensors
    grad_w = g.to(ctx.w_dtype) if ctx.needs_input_grad[0] else None
    grad_scale = _block_sums_op(g, seed, ctx.method, ctx.backend) if ctx.needs_input_grad[1] else None
    return grad_w, grad_scale, None, None, None


_w_hat_op.register_autograd(_w_hat_backward, setup_context=_w_hat_setup)


def pseudo_quantize(w, b_t, seed, method="gaussws", *, backend="auto"):
    """Eq. 3: BF16 w_hat = w + R * broadcast(max_bl(|w|) * 2^(1 - b_t)); backward is Eq. 4.

    Differentiable in w (dL/dw = dL/dw_hat) and b_t; max_bl(|w|) is a constant in the backward.
    `seed` is an int in [0, 2^63) or a 0-dim int64 CPU tensor holding one.
    """
    if method not in ("gaussws", "diffq"):
        raise ValueError(f"unknown noise method {method!r}; expected 'gaussws' or 'diffq'")
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D, got shape {tuple(w.shape)}")
    expected = (-(-w.shape[0] // BL), -(-w.shape[1] // BL))
    if tuple(b_t.shape) != expected:
        raise ValueError(f"b_t must have shape {expected} for w of shape {tuple(w.shape)}, got {tuple(b_t.shape)}")
    if not isinstance(seed, torch.Tensor):
        seed = torch.tensor(_check_seed(seed), dtype=torch.int64)
    return _w_hat_op(w, scale_bl(block_absmax(w), b_t), seed, method, backend)


class _ToWeight(torch.autograd.Function):
    """w_hat made outside autograd, with the gradient path dL/dw = dL/dw_hat (Eq. 4) and none to b_t.

    It saves no tensors, so every micro-step of an optimizer step can backpropagate through it.
    """

    @staticmethod
    def forward(ctx, w, w_hat):
        ctx.w_dtype = w.dtype
        return w_hat

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.w_dtype), None


class _RecomputedLinear(torch.autograd.Function):
    """F.linear(x, w_hat) that keeps neither w_hat nor R for the backward: both are made again there
    from (w, seed). Saves w_hat's 2 bytes per parameter for one more Eq. 3 per micro-step."""

    @staticmethod
    def forward(ctx, x, w, scale, bias, seed, method, backend):
        # Under autocast the matmul runs in its dtype, as F.linear's would; autocast is off inside
        # custom Functions' backward, so the dtype is kept here for it.
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        x_c = x.to(dtype)
        w_hat = _w_hat_op(w.detach(), scale.detach(), seed, method, backend).to(dtype)
        ctx.save_for_backward(x_c, w, scale, seed)
        ctx.method, ctx.backend, ctx.x_dtype, ctx.has_bias = method, backend, x.dtype, bias is not None
        return F.linear(x_c, w_hat, None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, g):
        x_c, w, scale, seed = ctx.saved_tensors
        w_hat = _w_hat_op(w.detach(), scale.detach(), seed, ctx.method, ctx.backend).to(x_c.dtype)
        g = g.to(x_c.dtype)
        grad_x = (g @ w_hat).to(ctx.x_dtype)
        g2, x2 = g.reshape(-1, g.shape[-1]), x_c.reshape(-1, x_c.shape[-1])
        grad_w_hat = g2.t() @ x2
        grad_scale = _block_sums_op(grad_w_hat, seed, ctx.method, ctx.backend)
        grad_bias = g2.sum(0).float() if ctx.has_bias else None
        return grad_x, grad_w_hat.to(w.dtype), grad_scale, grad_bias, None, None, None


class PQTLinear(nn.Linear):
    """nn.Linear whose weight is pseudo-quantized (Eq. 3) in training mode.

    b_i is the internal bitwidth of each 32x32 block (Eq. 11), initialised to 1 so that
    b_t = b_target + b_i * (b_init - b_target) starts at b_init; weight decay on b_i pulls b_t
    toward b_target. In eval mode the layer is exactly nn.Linear (the BF16 baseline under autocast).
    """

    def __init__(self, in_features, out_features, bias=True, *, method="gaussws", b_init=6.0, b_target=4.0,
                 backend="auto", recompute=False, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if method not in ("gaussws", "diffq"):
            raise ValueError(f"PQTLinear method must be 'gaussws' or 'diffq', got {method!r}")
        self.method, self.b_init, self.b_target, self.backend = method, float(b_init), float(b_target), backend
        self.recompute = recompute  # keep no w_hat for the backward: make it again there
        self.b_i = nn.Parameter(torch.ones(-(-out_features // BL), -(-in_features // BL), device=device))
        # Until set_noise_seed assigns one, a layer seed from torch's RNG keeps layers independent.
        self.layer_seed = int(torch.randint(0, 2**62, (), device="cpu").item())  # cpu: also under a meta device
        self.step = 0
        # The seed of this step's R: a CPU tensor, so changing it neither syncs a GPU nor recompiles.
        self.noise_seed = torch.tensor(_step_seed(self.layer_seed, 0), dtype=torch.int64, device="cpu")
        self.w_hat = None  # step mode (begin_step): this optimizer step's w_hat, shared by its micro-steps
        self._step_state = None  # step mode: (max_bl, stored R) until end_step applies Eq. 4

    def reset_parameters(self):
        super().reset_parameters()
        if hasattr(self, "b_i"):
            nn.init.ones_(self.b_i)

    @property
    def b_t(self):
        """Eq. 11: the bitwidth of each block."""
        return self.b_target + self.b_i * (self.b_init - self.b_target)

    def full_b_t(self):
        """b_t of all blocks, also outside the forward of a sharded (FSDP) model where b_i is a DTensor."""
        b_t = self.b_t
        return b_t.full_tensor() if hasattr(b_t, "full_tensor") else b_t

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        if self.recompute:
            out = _RecomputedLinear.apply(x, self.weight, scale_bl(block_absmax(self.weight), self.b_t), self.bias,
                                          self.noise_seed, self.method, self.backend)
            return out
        if self.w_hat is not None:
            w_hat = self.w_hat
        else:
            w_hat = pseudo_quantize(self.weight, self.b_t, self.noise_seed, self.method, backend=self.backend)
        if not torch.is_autocast_enabled(x.device.type):
            w_hat = w_hat.to(x.dtype)  # exact: BF16 values are representable in FP32
        return F.linear(x, w_hat, self.bias)

    @torch.no_grad()
    def begin_step(self):
        """Step mode: Eq. 3 once for all micro-steps of this optimizer step (see begin_step below)."""
        k = _kernels(self.backend, self.weight.device)
        max_bl = block_absmax(self.weight)
        r_store = k.gen(self.weight.numel(), int(self.noise_seed), self.method, self.weight.device)
        w_hat = k.apply(self.weight.detach(), r_store, scale_bl(max_bl, self.b_t), self.method)
        self._step_state = (max_bl, r_store)
        with torch.enable_grad():
            self.w_hat = _ToWeight.apply(self.weight, w_hat)

    @torch.no_grad()
    def end_step(self):
        """Step mode: Eq. 4 once, on the gradient accumulated over the step's micro-steps."""
        if self._step_state is None:
            return
        (max_bl, r_store), self._step_state, self.w_hat = self._step_state, None, None
        if self.weight.grad is None:
            return
        sums = _kernels(self.backend, self.weight.device).block_sums(self.weight.grad, r_store, self.method)
        with torch.enable_grad():  # Eq. 4, then Eq. 11's chain rule, into b_i.grad
            scale_bl(max_bl, self.b_t).backward(sums)

    def extra_repr(self):
        return f"{super().extra_repr()}, method={self.method}, b_init={self.b_init}, b_target={self.b_target}"


# --- seeds (docs/METHOD.md section 4) --------------------------------------------------------
# user seed -> one seed per layer -> one seed per (layer, optimizer step) for the device Philox.
# Counter-based rather than stateful: the seed of any step is a pure function of (user seed,
# layer, step), so forward and backward agree, every data-parallel rank draws the same R, and a
# resumed run continues the identical sequence without saving any generator state.

def _mix(x):
    """splitmix64's finaliser: a bijection on 64-bit integers that scatters nearby inputs."""
    x &= 2**64 - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return x ^ (x >> 31)


def _layer_seed(seed, layer):
    return _mix(_mix(seed) + 0x9E3779B97F4A7C15 * (layer + 1)) >> 1


def _step_seed(layer_seed, step):
    return _mix(layer_seed + 0x9E3779B97F4A7C15 * (step + 1)) >> 1  # >> 1: Philox seed in [0, 2^63)


def pqt_layers(model):
    return [m for m in model.modules() if isinstance(m, PQTLinear)]


def set_noise_seed(model, seed):
    """Give every PQTLinear of `model` its own layer seed, derived from `seed` and its position."""
    seed = _check_seed(seed)
    for i, layer in enumerate(pqt_layers(model)):
        layer.layer_seed = _layer_seed(seed, i)
        layer.noise_seed.fill_(_step_seed(layer.layer_seed, layer.step))


def set_step(model, step):
    """Select the noise of optimizer step `step`: call once per step, before its micro-steps."""
    for layer in pqt_layers(model):
        layer.step = int(step)
        layer.noise_seed.fill_(_step_seed(layer.layer_seed, layer.step))


def begin_step(model, step):
    """Step mode: select the noise of `step` and compute every PQT layer's w_hat once for it.

    w and b_t do not change within an optimizer step, so neither does w_hat: instead of Eq. 3 in
    every micro-step's forward and Eq. 4 in every backward, compute w_hat (and the stored R) here
    and let all micro-steps share it; their backwards pass dL/dw_hat to w alone, and end_step then
    applies Eq. 4 once to the accumulated weight gradient. That is exact because Eq. 4 is linear in
    dL/dw_hat and w.grad is the sum of the micro-steps' dL/dw_hat. It costs R's 0.5 byte per
    parameter held until end_step, and needs whole weights (not FSDP's shards).
    """
    set_step(model, step)
    for layer in pqt_layers(model):
        layer.begin_step()


def end_step(model):
    """Step mode: add Eq. 4's b_t gradient to every b_i.grad; call after the last backward (and any
    data-parallel gradient all-reduce), before gradient clipping and the optimizer step."""
    for layer in pqt_layers(model):
        layer.end_step()


def bitwidth_loss(model):
    """Eq. 12 without lambda: sum over PQT layers of the mean |b_t - b_target| of their blocks."""
    terms = [(layer.full_b_t() - layer.b_target).abs().mean() for layer in pqt_layers(model)]
    return torch.stack(terms).sum() if terms else torch.zeros(())


@torch.no_grad()
def bitwidth_stats(model):
    """Mean, min and max of b_t over all PQT blocks of the model, or None without PQT layers."""
    b_t = [layer.full_b_t().flatten() for layer in pqt_layers(model)]
    if not b_t:
        return None
    b_t = torch.cat(b_t).float()
    return {"mean": b_t.mean().item(), "min": b_t.min().item(), "max": b_t.max().item()}
