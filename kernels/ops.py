"""Eq. 3 and Eq. 4 as differentiable PyTorch ops over either noise backend (triton_noise, torch_noise).

pseudo_quantize(w, b_t, seed) is Eq. 3 with Eq. 4 as its backward; sample_r(shape, seed) the noise it adds;
RecomputedLinear the Linear that makes w_hat again in its backward. The ops are torch.library custom ops,
so torch.compile neither traces the kernels nor specialises on the seed. gaussws.py builds its layer on
them and re-exports pseudo_quantize, sample_r, noise_e and scale_bl.
"""
import torch
import torch.nn.functional as F

from kernels import BL


def noise_e(b_t):
    """2^(1 - b_t) of each block, FP32: Eq. 3's scale without the block max. Differentiating the scale
    max_bl * noise_e(b_t) in b_t (max_bl a constant) turns sum_bl(dL/dw_hat * R) into Eq. 4's b_t gradient."""
    return torch.exp2(1.0 - b_t.float())


def scale_bl(max_bl, b_t):
    """max_bl(|w|) * 2^(1 - b_t): the scale of each block's noise in Eq. 3."""
    return max_bl * noise_e(b_t)


def backend_name(backend, device):
    """'triton' or 'torch': the backend 'auto' is on `device` (Triton on a GPU), else the one named."""
    if backend == "auto":
        return "triton" if torch.device(device).type == "cuda" else "torch"
    if backend not in ("triton", "torch"):
        raise ValueError(f"unknown backend {backend!r}; expected 'auto', 'triton' or 'torch'")
    return backend


def noise_kernels(backend, device):
    """The module that makes R: 'triton' (kernels/triton_noise.py) or 'torch' (kernels/torch_noise.py)."""
    if backend_name(backend, device) == "triton":
        from kernels import triton_noise
        return triton_noise
    from kernels import torch_noise
    return torch_noise


def check_seed(seed):
    seed = int(seed)
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an integer in [0, 2^63), got {seed}")
    return seed


def sample_r(shape, seed, method="gaussws", *, device="cpu", backend="auto"):
    """The noise R (FP32) that pseudo_quantize(w, b_t, seed, method) adds for a w of this shape."""
    m, n = shape
    k = noise_kernels(backend, device)
    r_store = k.gen(m * n, check_seed(seed), method, device)
    ones = torch.ones(-(-m // BL), -(-n // BL), device=device)
    return k.apply(torch.zeros(m, n, device=device), r_store, ones, method).float()  # 0 + R * 1, exact


# Eq. 3 as an opaque op, so torch.compile neither traces the kernels nor specialises on the seed (an int64
# tensor, on the weight's device for a layer's step seed): its value changes every step and must not trigger a
# recompile. On the Triton backend the kernels read the seed, the host never does (no GPU waits for it). Not a
# torch.library.triton_op, which would let inductor compile the kernels with its own options (FMA contraction
# on) and so move the bits of w + R * scale away from the eager ones.
@torch.library.custom_op("pqt::w_hat", mutates_args=())
def _w_hat_op(w: torch.Tensor, e: torch.Tensor, seed: torch.Tensor, method: str,
              backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(BF16 w_hat, max_bl(|w|)) of Eq. 3 with e = 2^(1 - b_t): one pass over w on the Triton backend."""
    w_hat, _, max_bl = noise_kernels(backend, w.device).eq3(w.contiguous(), e.contiguous(), seed, method)
    return w_hat, max_bl


@_w_hat_op.register_fake
def _(w, e, seed, method, backend):
    return torch.empty(w.shape, dtype=torch.bfloat16, device=w.device), torch.empty_like(e)


@torch.library.custom_op("pqt::block_sums", mutates_args=())
def _block_sums_op(g: torch.Tensor, seed: torch.Tensor, method: str, backend: str) -> torch.Tensor:
    """sum_bl(g * R) with R regenerated from the seed: never stored between forward and backward."""
    k = noise_kernels(backend, g.device)
    r_store = k.gen(g.numel(), seed, method, g.device)
    return k.block_sums(g.contiguous(), r_store, method)


@_block_sums_op.register_fake
def _(g, seed, method, backend):
    return g.new_empty((-(-g.shape[0] // BL), -(-g.shape[1] // BL)), dtype=torch.float32)


def _w_hat_setup(ctx, inputs, output):
    w, e, seed, method, backend = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.w_dtype = w.dtype
    ctx.save_for_backward(seed, output[1])
    ctx.method, ctx.backend = method, backend


def _w_hat_backward(ctx, g, _):
    # dL/dw = dL/dw_hat; dL/de = sum_bl(dL/dw_hat * R) * max_bl, the backward of scale = max_bl * e. Autograd
    # then carries it through e = 2^(1 - b_t) and Eq. 11, which gives Eq. 4 for b_t and b_i.
    seed, max_bl = ctx.saved_tensors
    grad_w = g.to(ctx.w_dtype) if ctx.needs_input_grad[0] else None
    grad_e = _block_sums_op(g, seed, ctx.method, ctx.backend) * max_bl if ctx.needs_input_grad[1] else None
    return grad_w, grad_e, None, None, None


_w_hat_op.register_autograd(_w_hat_backward, setup_context=_w_hat_setup)


def pseudo_quantize(w, b_t, seed, method="gaussws", *, backend="auto"):
    """Eq. 3: BF16 w_hat = w + R * broadcast(max_bl(|w|) * 2^(1 - b_t)); backward is Eq. 4.

    Differentiable in w (dL/dw = dL/dw_hat) and b_t; max_bl(|w|) is a constant in the backward.
    `seed` is an int in [0, 2^63) or an int64 tensor of one element holding one (a layer's step seed, on
    its device: the kernels read it, the host does not). On the Triton backend one kernel reads w once
    (kernels.triton_noise.eq3); where nothing needs a gradient or compiles, it is called directly (Figure
    6's `ours`: the launch without the op's dispatch).
    """
    if method not in ("gaussws", "diffq"):
        raise ValueError(f"unknown noise method {method!r}; expected 'gaussws' or 'diffq'")
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D, got shape {tuple(w.shape)}")
    expected = (-(-w.shape[0] // BL), -(-w.shape[1] // BL))
    if tuple(b_t.shape) != expected:
        raise ValueError(f"b_t must have shape {expected} for w of shape {tuple(w.shape)}, got {tuple(b_t.shape)}")
    e = noise_e(b_t)
    if not isinstance(seed, torch.Tensor):
        seed = check_seed(seed)  # an int: the Triton backend keeps its device tensor (triton_noise.seed_arg)
    if not (torch.is_grad_enabled() and (w.requires_grad or e.requires_grad)) and not torch.compiler.is_compiling():
        return noise_kernels(backend, w.device).eq3(w.detach().contiguous(), e.detach().contiguous(), seed, method)[0]
    if not isinstance(seed, torch.Tensor):
        seed = torch.tensor(seed, dtype=torch.int64)
    return _w_hat_op(w, e, seed, method, backend)[0]


def autocast_linear(x, w_hat, bias):
    """(F.linear(x, w_hat, bias) in the dtype autocast would run it in, x in that dtype): the forward of a Linear
    that keeps x, not w_hat, for its backward (autocast is off in a custom Function's backward, so the dtype is
    kept in x's copy)."""
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    x_c = x.to(dtype)
    return F.linear(x_c, w_hat.to(dtype), None if bias is None else bias.to(dtype)), x_c


def linear_grads(g, x_c, w_hat, x_dtype, need_x, has_bias):
    """(dL/dx, dL/dw_hat, dL/dbias) of autocast_linear, with w_hat made again: dL/dw_hat in x_c's dtype, unrounded."""
    w_hat, g = w_hat.to(x_c.dtype), g.to(x_c.dtype)
    g2, x2 = g.reshape(-1, g.shape[-1]), x_c.reshape(-1, x_c.shape[-1])
    return ((g @ w_hat).to(x_dtype) if need_x else None, g2.t() @ x2, g2.sum(0).float() if has_bias else None)


class RecomputedLinear(torch.autograd.Function):
    """F.linear(x, w_hat) that keeps neither w_hat nor R for the backward: both are made again there
    from (w, seed). Saves w_hat's 2 bytes per parameter for one more Eq. 3 per micro-step."""

    @staticmethod
    def forward(ctx, x, w, e, bias, seed, method, backend):
        w_hat, max_bl = _w_hat_op(w.detach(), e.detach(), seed, method, backend)
        y, x_c = autocast_linear(x, w_hat, bias)
        ctx.save_for_backward(x_c, w, e, max_bl, seed)
        ctx.method, ctx.backend, ctx.x_dtype, ctx.has_bias = method, backend, x.dtype, bias is not None
        return y

    @staticmethod
    def backward(ctx, g):
        x_c, w, e, max_bl, seed = ctx.saved_tensors
        w_hat = _w_hat_op(w.detach(), e.detach(), seed, ctx.method, ctx.backend)[0]
        grad_x, grad_w_hat, grad_bias = linear_grads(g, x_c, w_hat, ctx.x_dtype, ctx.needs_input_grad[0],
                                                     ctx.has_bias)
        grad_e = _block_sums_op(grad_w_hat, seed, ctx.method, ctx.backend) * max_bl  # as _w_hat_backward
        return grad_x, grad_w_hat.to(w.dtype), grad_e, grad_bias, None, None, None
