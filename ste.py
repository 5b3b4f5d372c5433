"""STE-QAT, the baseline PQT competes with: straight-through fake quantization of Linear weights onto
the grid of one export format, or at a bit budget onto int2/int3/int4 chosen per 32x32 block.

A converter in torchtitan's shape: called once after the model is built, before it is wrapped, and a
hook at each optimizer step.

    convert(model, "int3", start=step)         # nn.Linear -> STELinear (all of them, or those `takes` names)
    for step in ...:
        with gaussws.TrainStep(model, step):   # calls before_step: the budget's switch, each layer's state
            ... forwards and backwards ...

A training-mode forward multiplies by fake_quantize(w, fmt), the weight export.py writes for that
format (torchao's fake quantization: its affine int grid and its MX element casts), and the backward
passes dL/dw = dL/dw_q (StraightThrough). At a bit budget (fmt "error-int" here; "auto-int" ranks the
blocks of gaussws layers by their learned b_t) each block trains on its own format, chosen once by
export.py's allocation (formats.budget_format_ids) at the step the STE starts (BlockFormats,
choose_formats); a gaussws.PQTLinear can end its training that way too (its `ste_start`). gaussws.py's
convert takes `ste[...]` and hands it here with its role filter, so one --method names every method.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from formats import BY_NAME, FORMATS, budget_format_ids, e8m0_exponents, int_scales, pow2
from kernels import BL
from kernels.torch_noise import block_absmax

STE_FORMATS = tuple(f"int{b}" for b in range(2, 9)) + ("mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3",
                                                        "mxfp8_e5m2")
BUDGET_TARGETS = ("auto-int", "error-int")  # int2/int3/int4 per block at bits_per_weight: ranked by b_t, by error


def check_format(name):
    """The name of a format the STE trains on (and a PQT phase is matched to), or a ValueError."""
    if name not in STE_FORMATS:
        raise ValueError(f"target format {name!r}: expected one of {', '.join(STE_FORMATS)} (export.py's formats "
                         f"with a per-block scale, up to 8 bits), or {' / '.join(BUDGET_TARGETS)} with a bit budget")
    return name


def check_budget(fmt, bits_per_weight, method):
    """A bit budget to train toward: fmt one of BUDGET_TARGETS, bits_per_weight in [2, 4], and for
    auto-int a method that learns b_t (not ste). Raises ValueError (one line) otherwise."""
    if fmt not in BUDGET_TARGETS:
        raise ValueError(f"target format {fmt!r} is not a bit budget: expected {' or '.join(BUDGET_TARGETS)}, which "
                         f"mix int2/int3/int4 per block at --bits_per_weight")
    if not 2 <= bits_per_weight <= 4:
        raise ValueError(f"bits_per_weight={bits_per_weight:g}: expected a mean of 2 to 4 element bits per weight "
                         f"(int2 to int4) for target_format={fmt!r}")
    if fmt == "auto-int" and method == "ste":
        raise ValueError(f"target_format='auto-int' ranks blocks by their learned b_t, and method {method} learns "
                         f"none: use error-int, which ranks them by their own quantization error")


# --- the grids: torchao's fake quantization with export.py's scales -------------------------------

def _mx_elements(v, fmt):
    """v (FP32, already divided by the block scale) rounded to fmt's elements, half to even, saturated at
    +-fmt.max: torchao's MX element casts for fp4 and fp6, torch's own for fp8 (clamped first, as torchao
    does: e5m2's cast overflows to inf; clamping to a value on the grid commutes with rounding)."""
    if fmt.name in ("mxfp4", "mxfp6_e2m3", "mxfp6_e3m2"):
        from torchao.prototype.mx_formats import kernels as mx
        to_codes, to_values = {"mxfp4": (mx.f32_to_f4_unpacked, mx.f4_unpacked_to_f32),
                               "mxfp6_e2m3": (mx.f32_to_f6_e2m3_unpacked, mx.f6_e2m3_unpacked_to_f32),
                               "mxfp6_e3m2": (mx.f32_to_f6_e3m2_unpacked, mx.f6_e3m2_unpacked_to_f32)}[fmt.name]
        return to_values(to_codes(v))
    dtype = {"mxfp8_e4m3": torch.float8_e4m3fn, "mxfp8_e5m2": torch.float8_e5m2}[fmt.name]
    return v.clamp(-fmt.max, fmt.max).to(dtype).float()


@torch.no_grad()
def fake_quantize(w, name):
    """w (m, n) on the grid export.py stores for format `name` (FP32 values, no gradient): every 32x32
    block, partial at the edges, with the scale export gives it from max_bl(|w|), a BF16 one rounded up
    for int-b (formats.int_scales) or an E8M0 power of two for the MX formats (formats.e8m0_exponents).
    The values come from torchao: its affine fake quantization with a (32, 32) block for int-b, which
    computes round(w * (1 / s)) in FP32 (export.py rounds the same way), and its MX element casts.
    """
    fmt = FORMATS[BY_NAME[check_format(name)]]
    m, n = w.shape
    nbm, nbn = -(-m // BL), -(-n // BL)
    amax = block_absmax(w)
    w = F.pad(w.detach().float(), (0, nbn * BL - n, 0, nbm * BL - m))  # zeros: on every grid, and no block's max
    if fmt.kind == "int":
        from torchao.quantization.quant_primitives import ZeroPointDomain, _fake_quantize_affine
        s = int_scales(amax, fmt).float()
        s = torch.where(s > 0, s, 1.0)  # an all-zero block: any scale gives its zeros (export stores 0)
        q = _fake_quantize_affine(w, (BL, BL), s, None, torch.int32, -fmt.levels, fmt.levels, ZeroPointDomain.NONE)
        q = q + 0.0  # -0.0 -> +0.0: export's integer codes have no negative zero
    else:
        x = pow2(e8m0_exponents(amax, fmt)).float().repeat_interleave(BL, 0).repeat_interleave(BL, 1)
        q = _mx_elements(w / x, fmt) * x  # both exact: x is a power of two
    return q[:m, :n]


@torch.no_grad()
def fake_quantize_blocks(w, format_ids, used=None):
    """w (m, n) with each 32x32 block on the grid export.py stores for that block's own format:
    format_ids holds one id of formats.FORMATS per block (export's "format" tensor), `used` the ids it
    holds (read from it when None). Each block is fake_quantize's for its format, whose scales are per
    block, so the whole is export.py's quantize_weight with these ids."""
    m, n = w.shape
    used = sorted(format_ids.unique().tolist()) if used is None else used
    ids = format_ids.repeat_interleave(BL, 0).repeat_interleave(BL, 1)[:m, :n]
    w_q = fake_quantize(w, FORMATS[used[0]].name)
    for fid in used[1:]:
        w_q = torch.where(ids == fid, fake_quantize(w, FORMATS[fid].name), w_q)
    return w_q


class StraightThrough(torch.autograd.Function):
    """A weight made outside autograd from w (the STE's w_q, or gaussws's w_hat of a whole step), with
    the straight-through gradient dL/dw = dL/dw_q and none to what made it. It saves no tensors, so
    every micro-step of an optimizer step can backpropagate through it."""

    @staticmethod
    def forward(ctx, w, w_q):
        ctx.w_dtype = w.dtype
        return w_q

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.w_dtype), None


# --- the per-block formats of a bit budget -----------------------------------------------------------

UNCHOSEN = 255  # format_ids before the budget chose them (no format has this id)


class BlockFormats:
    """The per-block formats a bit budget chose, for a layer that trains on them (STE): the uint8 buffer
    format_ids, one id of formats.FORMATS per 32x32 block as export.py's "format" tensor, UNCHOSEN until
    before_step chooses them at step `formats_from` (then saved with the model, so that a resumed run
    trains on the formats chosen at the switch, never on a new choice). A mixin of nn.Linear layers."""

    formats_from = None  # the first step on the chosen formats; None: the layer has no budget
    _fake_quantize = _fake_quantize_blocks = None  # made by _eager_fake_quantizers

    @classmethod
    def _eager_fake_quantizers(cls):
        """fake_quantize and fake_quantize_blocks as torch.compile leaves them, eager inside a compiled
        model: fused, inductor keeps the BF16 scale in FP32 without rounding it (its
        emulate_precision_casts is off), and the grid would not be export's. Made by the first layer
        that fake-quantizes, not at import: importing torch._dynamo costs every process over a second."""
        if BlockFormats._fake_quantize is None:
            BlockFormats._fake_quantize = staticmethod(torch.compiler.disable(fake_quantize))
            BlockFormats._fake_quantize_blocks = staticmethod(torch.compiler.disable(fake_quantize_blocks))

    def _init_formats(self, fmt, bits_per_weight, formats_from, device):
        self._eager_fake_quantizers()
        self.fmt, self.bits_per_weight, self.formats_from = fmt, float(bits_per_weight), int(formats_from)
        shape = (-(-self.weight.shape[0] // BL), -(-self.weight.shape[1] // BL))
        self.register_buffer("format_ids", torch.full(shape, UNCHOSEN, dtype=torch.uint8, device=device))
        self._formats = None  # the ids format_ids holds; read from it when None (after a load)

    def _take_weight(self, weight, bias):
        """Hold another layer's weight and bias Parameters (a converter's swap); format_ids, made on the
        meta device with the layer, moves to the weight's device, unchosen."""
        self.weight, self.bias = weight, bias
        if self.formats_from is not None:
            self.format_ids = torch.full_like(self.format_ids, UNCHOSEN, device=weight.device)

    def formats_used(self):
        """The format ids the layer's blocks hold (one read of the buffer after each load)."""
        if self._formats is None:
            self._formats = sorted(self.format_ids.unique().tolist())
        return self._formats

    def set_formats(self, ids):
        self.format_ids.copy_(ids)
        self._formats = sorted(ids.unique().tolist())

    def weight_on_formats(self):
        """w_q: the weight on its blocks' grids, with the straight-through gradient dL/dw = dL/dw_q."""
        w_q = self._fake_quantize_blocks(self.weight, self.format_ids, self.formats_used())
        return StraightThrough.apply(self.weight, w_q)

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self._formats = None


class STELinear(BlockFormats, nn.Linear):
    """nn.Linear trained by straight-through fake quantization: a training-mode forward multiplies by
    fake_quantize(w, fmt), the weight export.py writes for that format, and the backward passes
    dL/dw = dL/dw_q unchanged (the straight-through estimator, also where fp4 saturates; the int scale
    never clips a weight). The master weight w stays FP32. In eval mode, and in the steps before
    `start` (an STE phase), the layer is exactly nn.Linear. With fmt "error-int" and bits_per_weight,
    each block trains on its own format of int2/int3/int4, chosen by the budget at step `start` from
    the weights of that step (BlockFormats). It has no learnable bitwidth; its training-mode forwards
    run inside a gaussws.TrainStep, as PQTLinear's.
    """

    def __init__(self, in_features, out_features, bias=True, *, fmt, start=0, bits_per_weight=0.0, device=None,
                 dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.fmt, self.start = fmt, int(start)
        self._eager_fake_quantizers()
        if fmt in BUDGET_TARGETS:
            check_budget(fmt, bits_per_weight, "ste")
            self._init_formats(fmt, bits_per_weight, start, device)
        else:
            check_format(fmt)
        self.in_step, self.active = False, self.start == 0  # the step state, set by TrainStep only

    @classmethod
    def from_linear(cls, linear, **kwargs):
        """An STELinear holding `linear`'s own weight and bias Parameters; draws nothing from torch's RNG."""
        with torch.device("meta"):
            layer = cls(linear.in_features, linear.out_features, linear.bias is not None, **kwargs)
        layer._take_weight(linear.weight, linear.bias)
        return layer.train(linear.training)

    def forward(self, x):
        if self.training and not self.in_step:
            raise RuntimeError("STELinear: a training-mode forward outside a step; run the step's forwards inside "
                               "`with gaussws.TrainStep(model, step):`, or call model.eval() for the master weights")
        if not self.training or not self.active:
            return F.linear(x, self.weight, self.bias)
        if self.formats_from is not None:
            return F.linear(x, self.weight_on_formats(), self.bias)
        return F.linear(x, StraightThrough.apply(self.weight, self._fake_quantize(self.weight, self.fmt)), self.bias)

    def _begin(self, step):
        self.in_step, self.active = True, step >= self.start

    def _end(self, apply_eq4=True):
        self.in_step = False

    def extra_repr(self):
        return (f"{super().extra_repr()}, fmt={self.fmt}" + (f", start={self.start}" if self.start else "")
                + (f", bits_per_weight={self.bits_per_weight:g}" if self.formats_from is not None else ""))


def budget_layers(model):
    """[(module path, layer)] of the layers of `model` that train on a bit budget's formats, in its order."""
    return [(name, m) for name, m in model.named_modules() if getattr(m, "formats_from", None) is not None]


@torch.no_grad()
def choose_formats(layers, step):
    """The switch to a bit budget's per-block formats: the format_ids of every layer of `layers`
    ([(module path, layer)]: all the budget layers of a model, budget_layers), chosen together by
    formats.budget_format_ids, the function export.py's --bits_per_weight uses, from the weights they
    hold at optimizer step `step` (before it) and, for auto-int, the b_t of the layers that learn one
    (gaussws.PQTLinear: Eq. 11 in float64, as export.py reads them). Raises if some layer is not due at
    `step` or holds formats already."""
    if any(step < layer.formats_from or UNCHOSEN not in layer.formats_used() for _, layer in layers):
        raise RuntimeError(f"ste.choose_formats: at step {step} every budget layer must be due and unchosen "
                           f"(one budget, one switch per model)")
    (fmt, budget), = {(layer.fmt, layer.bits_per_weight) for _, layer in layers}
    weights = {name: layer.weight.full_tensor() if hasattr(layer.weight, "full_tensor") else layer.weight
               for name, layer in layers}
    b_t = {name: layer.b_t_float64() for name, layer in layers if hasattr(layer, "b_t_float64")}
    chosen = budget_format_ids(fmt, weights, b_t, budget)
    for name, layer in layers:
        layer.set_formats(chosen[name].to(layer.format_ids.device))


def before_step(layers, step):
    """The STE's hook before optimizer step `step` (gaussws.TrainStep calls it): at the first step a
    budget's formats are due, choose them for all the budget layers together (`layers`: budget_layers),
    unless they hold them already (a run resumed after that step). The switch is made here only."""
    due = [layer for _, layer in layers if step >= layer.formats_from]
    if any(UNCHOSEN in layer.formats_used() for layer in due):
        choose_formats(layers, step)


def convert(model, fmt, *, start=0, bits_per_weight=0.0, takes=None):
    """Swap nn.Linear modules of `model` for STELinear in place and return model: those for which
    takes(module path, module) is true, every one when takes is None (gaussws.convert passes its
    filter of the roles `ste[...]` names). Each trains on format fmt (STE_FORMATS) from optimizer step
    `start`, or with fmt "error-int" and bits_per_weight on per-block int2/int3/int4 chosen at `start`.
    Call it after the model is built and before it is wrapped (DDP, FSDP, compile); the weights and
    biases stay the same Parameters, and nothing is drawn from torch's RNG."""
    if fmt not in BUDGET_TARGETS:
        check_format(fmt)
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and (takes is None or takes(name, module)):
            model.set_submodule(name, STELinear.from_linear(module, fmt=fmt, start=start,
                                                             bits_per_weight=bits_per_weight))
    return model
