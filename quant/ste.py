"""STE-QAT, the baseline PQT competes with: straight-through fake quantization of Linear weights onto
the grid of one export format (ours, 32x32 blocks; or one of llama.cpp's GGML block types), at a bit
budget onto int2/int3/int4 chosen per 32x32 block, or at a GGUF budget onto one GGML type per tensor.

A converter in torchtitan's shape: called once after the model is built, before it is wrapped, and a
hook at each optimizer step.

    convert(model, "int3", start=step)         # nn.Linear -> STELinear (all of them, or those `takes` names)
    convert(model, "q4_k")                     # llama.cpp's Q4_K grid, blocks along each row (input dimension)
    for step in ...:
        with gaussws.TrainStep(model, step):   # calls before_step: the budget's switch, each layer's state
            ... forwards and backwards ...

A training-mode forward multiplies by w_q = fake_quantize(w, fmt), the weight export writes for that
format (torchao's fake quantization for our int grids and MX element casts; ggml_quants.fake_quantize
for the GGML types), and the backward passes dL/dw = dL/dw_q (StraightThrough). The master weight does
not change within an optimizer step, so w_q is made once per step, in TrainStep's begin, for all its
micro-steps (per forward only for FSDP's sharded weights, whole inside the forward alone).

Budgets, chosen once at the step the STE starts (before_step) for all the budget layers together:
  - per 32x32 block (fmt "error-int" here; "auto-int" ranks the blocks of gaussws layers by their
    learned b_t): export.py's allocation, budget.budget_format_ids (BlockFormats' format_ids);
  - per tensor (fmt "error-gguf"; "auto-gguf" ranks gaussws layers by their learned b_t): one type of
    budget.GGUF_BUDGET_TYPES per block Linear at bits_per_weight (each type's real bits, scales included),
    budget.gguf_types; "error-gguf" weights each tensor's error by its input activations' mean square per
    column (llama.cpp's importance matrix), summed over the budget.IMATRIX_STEPS steps before the switch in
    each layer's `imatrix` buffer.
A layer on a GGML type records it in its uint8 buffer `ggml_type` (gguf's GGMLQuantizationType value;
UNCHOSEN until a budget's switch), which export reads from the checkpoint. A gaussws.PQTLinear can end
its training on a budget too (its `ste_start`). gaussws.py's convert takes `ste[...]` and hands it
here with its role filter, so one --method names every method.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import BL
from quant import budget
from quant.budget import IMATRIX_STEPS, UNCHOSEN
from quant.formats import BUDGET_TARGETS, GGML_FORMATS, GGUF_BUDGETS
from quant.grids import LATTICE_FORMATS, check_format, fake_quantize, fake_quantize_blocks, ggml, ggml_type

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


# --- the layer's quantized weight: a format, a budget's per-block formats, or a GGML type ------------

@torch.no_grad()
def _collect(layer, x):
    """Add the squares of a forward's inputs x (..., in) per input column to the layer's step sum."""
    s = x.detach().float().square().reshape(-1, x.shape[-1]).sum(0)
    layer._imatrix_step = s if layer._imatrix_step is None else layer._imatrix_step.add_(s)


class BlockFormats:
    """What an nn.Linear trains on by STE, as a mixin (STELinear; gaussws.PQTLinear after its ste_start):
      - a budget's per-block formats: the uint8 buffer format_ids, one id of formats.FORMATS per 32x32
        block as export.py's "format" tensor;
      - a GGML type: the uint8 scalar buffer ggml_type (gguf's GGMLQuantizationType value), fixed by
        the format, or chosen by a GGUF budget; error-gguf adds the float32 buffer imatrix, the sum of
        the squared input activations per input column over the steps from imatrix_from to the switch;
      - else the layer's format fmt.
    A budget's buffers hold UNCHOSEN until before_step chooses them at step `formats_from` (then they
    are saved with the model, so that a resumed run trains on the choice made at the switch, never on
    a new one). _begin_formats makes this step's w_q once for its micro-steps (step_weight)."""

    formats_from = None  # the first step on a budget's chosen formats; None: the layer has no budget
    has_ggml = False  # whether the layer trains on a GGML type (its ggml_type buffer)
    imatrix_from = None  # error-gguf: the first step whose input activations imatrix sums
    quantized = collecting = False  # whether this step trains on w_q, collects imatrix: _begin_formats sets them
    w_q = None  # step mode: this optimizer step's w_q, shared by its micro-steps
    _fake_quantize = _fake_quantize_blocks = _collect = None  # made by _eager_fake_quantizers
    _formats = _type = _imatrix_step = None

    @classmethod
    def _eager_fake_quantizers(cls):
        """fake_quantize and fake_quantize_blocks as torch.compile leaves them, eager inside a compiled
        model: fused, inductor keeps the BF16 scale in FP32 without rounding it (its
        emulate_precision_casts is off), and the grid would not be export's; and imatrix's collection,
        which updates the layer. Made by the first layer that fake-quantizes, not at import: importing
        torch._dynamo costs every process over a second."""
        if BlockFormats._fake_quantize is None:
            BlockFormats._fake_quantize = staticmethod(torch.compiler.disable(fake_quantize))
            BlockFormats._fake_quantize_blocks = staticmethod(torch.compiler.disable(fake_quantize_blocks))
            BlockFormats._collect = staticmethod(torch.compiler.disable(_collect))

    def _rows(self, w):
        """The weight as (out, in), rows along the input: a GGML type's blocks run along them."""
        return w

    def _init_formats(self, fmt, bits_per_weight, formats_from, device):
        """A budget: fmt one of BUDGET_TARGETS, chosen at step formats_from."""
        self._eager_fake_quantizers()
        self.fmt, self.bits_per_weight, self.formats_from = fmt, float(bits_per_weight), int(formats_from)
        if fmt in GGUF_BUDGETS:
            self._init_ggml(UNCHOSEN, device)
            if fmt == "error-gguf":
                self.imatrix_from = max(0, self.formats_from - IMATRIX_STEPS)
                width = self._rows(self.weight).shape[1]
                self.register_buffer("imatrix", torch.zeros(width, dtype=torch.float32, device=device))
            return
        shape = (-(-self.weight.shape[0] // BL), -(-self.weight.shape[1] // BL))
        self.register_buffer("format_ids", torch.full(shape, UNCHOSEN, dtype=torch.uint8, device=device))

    def _init_ggml(self, value, device):
        self.has_ggml, self._ggml_init = True, int(value)
        self.register_buffer("ggml_type", torch.tensor(self._ggml_init, dtype=torch.uint8, device=device))

    def _take_weight(self, weight, bias):
        """Hold another layer's weight and bias Parameters (a converter's swap); the buffers, made on the
        meta device with the layer, move to the weight's device as they were made."""
        self.weight, self.bias = weight, bias
        if self.formats_from is not None and not self.has_ggml:
            self.format_ids = torch.full_like(self.format_ids, UNCHOSEN, device=weight.device)
        if self.has_ggml:
            self.ggml_type = torch.full_like(self.ggml_type, self._ggml_init, device=weight.device)
        if self.imatrix_from is not None:
            self.imatrix = torch.zeros_like(self.imatrix, device=weight.device)

    def formats_used(self):
        """The format ids the layer's blocks hold (one read of the buffer after each load)."""
        if self._formats is None:
            self._formats = sorted(self.format_ids.unique().tolist())
        return self._formats

    def ggml(self):
        """The GGML type's value the layer holds (one read of the buffer after each load), or UNCHOSEN."""
        if self._type is None:
            self._type = int(self.ggml_type)
        return self._type

    def chosen(self):
        """Whether the layer holds its budget's choice."""
        return self.ggml() != UNCHOSEN if self.has_ggml else UNCHOSEN not in self.formats_used()

    def set_formats(self, ids):
        self.format_ids.copy_(ids)
        self._formats = sorted(ids.unique().tolist())

    def set_type(self, t):
        self.ggml_type.fill_(int(t))
        self._type = int(t)

    @torch.no_grad()
    def quantized_weight(self):
        """w_q (no gradient): the weight on its GGML type's grid, its blocks' formats', or its format's."""
        if self.has_ggml:  # the buffer's value as gguf's type (ggml_quants names types, not their values)
            G = ggml()
            return self._rows(G.fake_quantize(self._rows(self.weight), G.T(self.ggml()), check=False))
        if self.formats_from is not None:
            return self._fake_quantize_blocks(self.weight, self.format_ids, self.formats_used())
        if self.fmt in LATTICE_FORMATS:  # blocks along each row, as a GGML type's
            return self._rows(self._fake_quantize(self._rows(self.weight), self.fmt))
        return self._fake_quantize(self.weight, self.fmt)

    def _begin_formats(self, step, quantized):
        """The state of step `step`: whether it trains on w_q (quantized) and collects imatrix; w_q made
        once, with the straight-through gradient, unless the weight is an FSDP shard (whole only inside
        the forward: then step_weight makes it in each forward)."""
        self.quantized = quantized
        self.collecting = self.imatrix_from is not None and self.imatrix_from <= step < self.formats_from
        if quantized and not hasattr(self.weight, "full_tensor"):
            self._version = self.weight._version
            with torch.enable_grad():
                self.w_q = StraightThrough.apply(self.weight, self.quantized_weight())

    def step_weight(self):
        """w_q with the straight-through gradient dL/dw = dL/dw_q, for a training-mode forward."""
        if self.w_q is None:
            return StraightThrough.apply(self.weight, self.quantized_weight())
        if not torch.compiler.is_compiling() and self.weight._version != self._version:
            raise RuntimeError(f"{type(self).__name__}: stale w_q, the weight changed inside the step that made it "
                               f"(optimizer.step() belongs after the `with gaussws.TrainStep(...)` block)")
        return self.w_q

    def collect(self, x):
        """Add the squares of the forward's inputs x (..., in) per input column to this step's sum."""
        self._collect(self, x)

    @torch.no_grad()
    def _end_formats(self, keep=True):
        """Release the step's w_q; with keep, add the step's imatrix sums (over all processes) to imatrix."""
        self.w_q, step_sums, self._imatrix_step = None, self._imatrix_step, None
        if keep and step_sums is not None:
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.all_reduce(step_sums)
            self.imatrix.add_(step_sums)

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self._formats = self._type = None


class STELinear(BlockFormats, nn.Linear):
    """nn.Linear trained by straight-through fake quantization: a training-mode forward multiplies by
    w_q = fake_quantize(w, fmt), the weight export writes for that format, made once per optimizer step,
    and the backward passes dL/dw = dL/dw_q unchanged (the straight-through estimator, also where fp4
    saturates; the int scale never clips a weight). The master weight w stays FP32. In eval mode, and in
    the steps before `start` (an STE phase), the layer is exactly nn.Linear. With fmt "error-int" or
    "error-gguf" and bits_per_weight, each block (or the tensor) trains on the format (or GGML type) the
    budget chose at step `start` (BlockFormats). It has no learnable bitwidth; its training-mode
    forwards run inside a gaussws.TrainStep, as PQTLinear's.
    """

    def __init__(self, in_features, out_features, bias=True, *, fmt, start=0, bits_per_weight=0.0, device=None,
                 dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.fmt, self.start = fmt, int(start)
        self._eager_fake_quantizers()
        if fmt in BUDGET_TARGETS:
            budget.check_budget(fmt, bits_per_weight, "ste")
            self._init_formats(fmt, bits_per_weight, start, device)
        elif check_format(fmt) in GGML_FORMATS:
            self._init_ggml(ggml_type(fmt), device)
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
        if self.training and self.collecting:
            self.collect(x)
        if not self.training or not self.active:
            return F.linear(x, self.weight, self.bias)
        return F.linear(x, self.step_weight(), self.bias)

    def _begin(self, step):
        self.in_step, self.active = True, step >= self.start
        self._begin_formats(step, self.active)

    def _end(self, apply_eq4=True):
        self.in_step = False
        self._end_formats(apply_eq4)

    def extra_repr(self):
        return (f"{super().extra_repr()}, fmt={self.fmt}" + (f", start={self.start}" if self.start else "")
                + (f", bits_per_weight={self.bits_per_weight:g}" if self.formats_from is not None else ""))


# --- a budget's switch: the per-block formats or the per-tensor GGML types, chosen once --------------

def budget_layers(model):
    """[(module path, layer)] of the layers of `model` that train on a bit budget's formats, in its order."""
    return [(name, m) for name, m in model.named_modules() if getattr(m, "formats_from", None) is not None]


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _say(line):
    """Print on one process: rank 0 of a distributed run."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()) or \
            torch.distributed.get_rank() == 0:
        print(line, flush=True)


def _choose_gguf_types(layers, step):
    """The GGUF budget's switch: each layer's GGML type, gguf_types' choice from the weights they hold
    at step `step` (before it), with the tensors' learned b_t (auto-gguf: gaussws.PQTLinear's b_t, Eq.
    11 in float64) or the imatrix each layer summed (error-gguf); the mix printed once."""
    (fmt, allowed), = {(layer.fmt, layer.bits_per_weight) for _, layer in layers}
    weights = {name: layer._rows(_full(layer.weight)) for name, layer in layers}
    if fmt == "auto-gguf":
        b_t = {name: budget.tensor_b_t(layer.b_t_float64(), layer.weight.shape) for name, layer in layers}
        chosen = budget.gguf_types(fmt, weights, allowed, b_t=b_t)
    else:
        chosen = budget.gguf_types(fmt, weights, allowed, imatrix={name: layer.imatrix for name, layer in layers})
    for name, layer in layers:
        layer.set_type(ggml_type(chosen[name]))
    numel = {name: w.numel() for name, w in weights.items()}
    bits = sum(ggml().bits_per_weight(GGML_FORMATS[chosen[k]]) * n for k, n in numel.items()) / sum(numel.values())
    mix = ", ".join(f"{sum(v == t for v in chosen.values())} {GGML_FORMATS[t]}" for t in budget.GGUF_BUDGET_TYPES
                    if t in chosen.values())
    by = "the tensors' learned b_t" if fmt == "auto-gguf" else "their input-weighted rounding error"
    _say(f"note: step {step}: {fmt} chose one GGML type per block Linear, ranked by {by}: {mix} = {bits:.4f} bits "
         f"per weight of the {len(layers)} Linears (budget {allowed:g})")


@torch.no_grad()
def choose_formats(layers, step):
    """The switch to a bit budget's formats for every layer of `layers` ([(module path, layer)]: all the
    budget layers of a model, budget_layers), chosen together from the weights they hold at optimizer
    step `step` (before it): a GGUF budget's GGML types (_choose_gguf_types), or the per-block formats of
    budget.budget_format_ids, the function export.py's --bits_per_weight uses, with, for auto-int, the
    b_t of the layers that learn one (gaussws.PQTLinear: Eq. 11 in float64, as export.py reads them).
    Raises if some layer is not due at `step` or holds formats already."""
    if any(step < layer.formats_from or layer.chosen() for _, layer in layers):
        raise RuntimeError(f"ste.choose_formats: at step {step} every budget layer must be due and unchosen "
                           f"(one budget, one switch per model)")
    if layers[0][1].has_ggml:
        return _choose_gguf_types(layers, step)
    (fmt, allowed), = {(layer.fmt, layer.bits_per_weight) for _, layer in layers}
    weights = {name: _full(layer.weight) for name, layer in layers}
    b_t = {name: layer.b_t_float64() for name, layer in layers if hasattr(layer, "b_t_float64")}
    chosen = budget.budget_format_ids(fmt, weights, b_t, allowed)
    for name, layer in layers:
        layer.set_formats(chosen[name].to(layer.format_ids.device))


def before_step(layers, step):
    """The STE's hook before optimizer step `step` (gaussws.TrainStep calls it): at the first step a
    budget's formats are due, choose them for all the budget layers together (`layers`: budget_layers),
    unless they hold them already (a run resumed after that step). The switch is made here only."""
    if any(step >= layer.formats_from and not layer.chosen() for _, layer in layers):
        choose_formats(layers, step)


def convert(model, fmt, *, start=0, bits_per_weight=0.0, takes=None):
    """Swap nn.Linear modules of `model` for STELinear in place and return model: those for which
    takes(module path, module) is true, every one when takes is None (gaussws.convert passes its
    filter of the roles `ste[...]` names). Each trains on format fmt (grids.STE_FORMATS, GGML_FORMATS,
    LATTICE_FORMATS) from optimizer step `start`, or with fmt "error-int" / "error-gguf" and bits_per_weight on
    per-block int2/int3/int4 or per-tensor GGML types chosen at `start`. A width fmt cannot hold is refused
    (check_layers) before any layer is swapped. Call it after the model is built and before it is
    wrapped (DDP, FSDP, compile); the weights and biases stay the same Parameters, and nothing is
    drawn from torch's RNG."""
    if fmt not in BUDGET_TARGETS:
        check_format(fmt)
    taken = {name: m for name, m in model.named_modules()
             if type(m) is nn.Linear and (takes is None or takes(name, m))}
    budget.check_layers({name: tuple(m.weight.shape) for name, m in taken.items()}, fmt, bits_per_weight)
    for name, module in taken.items():
        model.set_submodule(name, STELinear.from_linear(module, fmt=fmt, start=start, bits_per_weight=bits_per_weight))
    return model
