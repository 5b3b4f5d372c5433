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
    learned b_t): export.py's allocation, formats.budget_format_ids (BlockFormats' format_ids);
  - per tensor (fmt "error-gguf"; "auto-gguf" ranks gaussws layers by their learned b_t): one type of
    GGUF_BUDGET_TYPES per block Linear at bits_per_weight (each type's real bits, scales included),
    gguf_types; "error-gguf" weights each tensor's error by its input activations' mean square per
    column (llama.cpp's importance matrix), summed over the IMATRIX_STEPS steps before the switch in
    each layer's `imatrix` buffer.
A layer on a GGML type records it in its uint8 buffer `ggml_type` (gguf's GGMLQuantizationType value;
UNCHOSEN until a budget's switch), which export reads from the checkpoint. A gaussws.PQTLinear can end
its training on a budget too (its `ste_start`). gaussws.py's convert takes `ste[...]` and hands it
here with its role filter, so one --method names every method.
"""
import functools

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import BL
from kernels.torch_noise import block_absmax
from quant.formats import (BY_NAME, FORMATS, GGML_FORMATS, block_weights, budget_format_ids, e8m0_exponents,
                           greedy_upgrades, int_scales, pow2)

STE_FORMATS = tuple(f"int{b}" for b in range(2, 9)) + ("mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3",
                                                        "mxfp8_e5m2")  # and llama.cpp's types, GGML_FORMATS
INT_BUDGETS = ("auto-int", "error-int")  # int2/int3/int4 per block at bits_per_weight: ranked by b_t, by error
GGUF_BUDGETS = ("auto-gguf", "error-gguf")  # one GGML type per tensor at bits_per_weight: by b_t, by weighted error
BUDGET_TARGETS = INT_BUDGETS + GGUF_BUDGETS
# What a GGUF budget mixes, in the order of their bits per weight (scales included): Q2_K 2.625, Q3_K 3.4375,
# IQ4_XS 4.25, Q4_K 4.5, IQ4_NL 4.5, Q5_K 5.5, Q6_K 6.5625, Q8_0 8.5. IQ4_XS is below Q4_K in bits (super-blocks of
# 256 as Q4_K's, 6-bit scales and no mins) and 6 % above it in rounding error on Gaussian weights (rounding_error).
# IQ4_NL has the bits of Q4_K and of Q4_0 (which a budget does not mix): 4.8 % more error than Q4_K, 22 % less than
# Q4_0. Of two types of equal bits a ladder keeps the first (budget_ladder): a tensor Q4_K fits takes Q4_K, and
# IQ4_NL is the 4.5-bit step of a width that is a multiple of 32 and not of 256.
GGUF_BUDGET_TYPES = ("q2_k", "q3_k", "iq4_xs", "q4_k", "iq4_nl", "q5_k", "q6_k", "q8_0")
IMATRIX_STEPS = 16  # error-gguf: optimizer steps before the switch whose input activations weight the error
FORMAT_STATE = (".format_ids", ".ggml_type", ".imatrix")  # what BlockFormats adds to a layer's state dict
UNCHOSEN = 255  # format_ids and ggml_type before the budget chose them (no format or GGML type has this id)


def _ggml():
    """ggml_quants, imported where used: it imports torch._dynamo (over a second)."""
    from quant import ggml_quants
    return ggml_quants


def ggml_type(name):
    """gguf's GGMLQuantizationType of a GGML target format name ("q4_k", "mxfp4_row")."""
    return _ggml().ggml_type(GGML_FORMATS[name])


def check_format(name):
    """The name of a format the STE trains on (and a PQT phase is matched to), or a ValueError."""
    if name not in STE_FORMATS and name not in GGML_FORMATS:
        raise ValueError(f"target format {name!r}: expected one of {', '.join(STE_FORMATS)} (export.py's formats "
                         f"with a per-block scale, up to 8 bits), llama.cpp's {', '.join(GGML_FORMATS)}, or "
                         f"{' / '.join(BUDGET_TARGETS)} with a bit budget")
    return name


def check_budget(fmt, bits_per_weight, method, switch=None):
    """A bit budget to train toward: fmt one of BUDGET_TARGETS, bits_per_weight in [2, 4] for the int
    budgets or from Q2_K's to Q8_0's bits per weight for the GGUF ones, for auto-* a method that learns
    b_t (not ste), and for error-gguf a switch (the step the budget is chosen at, when given) after
    step 0, so that input activations were seen. Raises ValueError (one line) otherwise."""
    if fmt not in BUDGET_TARGETS:
        raise ValueError(f"target format {fmt!r} is not a bit budget: expected {' or '.join(INT_BUDGETS)}, which "
                         f"mix int2/int3/int4 per block, or {' or '.join(GGUF_BUDGETS)}, one GGML type per tensor, "
                         f"at --bits_per_weight")
    if fmt in INT_BUDGETS and not 2 <= bits_per_weight <= 4:
        raise ValueError(f"bits_per_weight={bits_per_weight:g}: expected a mean of 2 to 4 element bits per weight "
                         f"(int2 to int4) for target_format={fmt!r}")
    if fmt in GGUF_BUDGETS:
        lo, hi = (_ggml().bits_per_weight(GGML_FORMATS[t]) for t in (GGUF_BUDGET_TYPES[0], GGUF_BUDGET_TYPES[-1]))
        if not lo <= bits_per_weight <= hi:
            raise ValueError(f"bits_per_weight={bits_per_weight:g}: expected {lo:g} (every tensor Q2_K) to {hi:g} "
                             f"(every tensor Q8_0) bits per weight, scales included, for target_format={fmt!r}")
    if fmt.startswith("auto-") and method == "ste":
        raise ValueError(f"target_format={fmt!r} ranks {'tensors' if fmt in GGUF_BUDGETS else 'blocks'} by their "
                         f"learned b_t, and method {method} learns none: use error-{fmt[5:]}, which ranks them by "
                         f"their own quantization error")
    if fmt == "error-gguf" and switch == 0:
        raise ValueError("target_format='error-gguf' weights each tensor's error by its input activations of the "
                         f"{IMATRIX_STEPS} steps before the switch, and this one is at step 0: start the STE at a "
                         "later step (--pqt_start for ste[...], a fraction of max_iters or a step)")


def check_layers(shapes, fmt, bits_per_weight=0.0):
    """Refuse (ValueError, one line naming the first such layer, its width and what would work) Linears
    whose input width fmt cannot hold: a GGML type's blocks run along each row (the input dimension),
    32 weights or 256 (the K-quants); a GGUF budget needs 32 (Q8_0, the one type it mixes that is not a
    K-quant), and enough bits for every tensor's cheapest type. shapes: {module path: (out, in)}."""
    if fmt not in GGML_FORMATS and fmt not in GGUF_BUDGETS:
        return
    need = _ggml().block_size(GGML_FORMATS[fmt]) if fmt in GGML_FORMATS else 32
    bad = [(name, shape[1]) for name, shape in shapes.items() if shape[1] % need]
    if bad:
        (name, width), more = bad[0], f" (and {len(bad) - 1} more Linears)" if len(bad) > 1 else ""
        if width % 32 == 0:
            works = f"use input widths that are multiples of {need}, or q4_0, q8_0 or mxfp4_row (blocks of 32)"
        else:  # neither does a 32-weight type: the advice is the type's own block, or another kind of format
            works = (f"use input widths (n_embd, ffn_hidden) that are multiples of {need}, or one of our 32x32-block "
                     f"formats (int4, mxfp4, ...), which take any width")
        what = f"{fmt}'s blocks are {need} weights of a row" if fmt in GGML_FORMATS else \
            f"{fmt} mixes GGML types whose blocks are 32 or 256 weights of a row"
        raise ValueError(f"{name} has input width {width}{more}, which target_format={fmt!r} cannot hold ({what}): "
                         f"{works}")
    if fmt in GGUF_BUDGETS and shapes:
        bits = {name: budget_ladder(shape[1])[0][1] for name, shape in shapes.items()}
        total = sum(out * width for out, width in shapes.values())
        least = sum(bits[name] * out * width for name, (out, width) in shapes.items()) / total
        if bits_per_weight < least:
            raise ValueError(f"bits_per_weight={bits_per_weight:g} is below what these Linears can take at the "
                             f"least, {least:.4g} bits per weight (Q2_K, or IQ4_NL where the input width is not a "
                             f"multiple of 256): raise bits_per_weight, or use widths that are multiples of 256")


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
    A GGML format (GGML_FORMATS) is ggml_quants.fake_quantize's grid: blocks along each row, with the
    type's scales; it refuses non-finite weights and a row width the type cannot hold.
    """
    if check_format(name) in GGML_FORMATS:
        return _ggml().fake_quantize(w.detach(), GGML_FORMATS[name])
    fmt = FORMATS[BY_NAME[name]]
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


# --- the rounding error a PQT level is matched to ------------------------------------------------

TILE = 256  # the GGML types' measuring tile: TILE x TILE weights, a whole K super-block per row


def _fixed_order(n):
    """A fixed pseudo-random permutation of 0..n-1 (no draw): the indices sorted by splitmix64's finaliser
    of each, the scrambler gaussws's seeds use."""
    x = np.arange(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return torch.from_numpy(np.argsort(x, kind="stable"))


@functools.lru_cache(maxsize=None)
def rounding_error(name):
    """r: format `name`'s mean squared rounding error on weights as initialised, each relative to the
    squared max_bl(|w|) of its 32x32 block (the scale of Eq. 3's noise); a constant (no draw), made
    from quantiles of N(0, 1). Our 32x32 formats: one block holding the 1,024 quantiles in order (its
    one scale sees them all). The GGML types, whose blocks run along rows: in order, a row's 32 or 256
    weights would be neighbouring quantiles, almost equal, quantized almost exactly; so the 65,536
    quantiles fill a TILE x TILE tile in a fixed pseudo-random order (_fixed_order), and each weight's
    error is taken relative to the max of its 32x32 block of the tile."""
    if check_format(name) in GGML_FORMATS:
        n, shape = TILE * TILE, (TILE, TILE)
        i = _fixed_order(n).double()
    else:
        n, shape = BL * BL, (BL, BL)
        i = torch.arange(n, dtype=torch.float64)
    w = torch.special.ndtri((i + 0.5) / n).float().view(shape)
    scale = block_absmax(w).double().repeat_interleave(BL, 0).repeat_interleave(BL, 1)
    return ((fake_quantize(w, name).double() - w.double()).square() / scale.square()).mean().item()


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
            G = _ggml()
            return self._rows(G.fake_quantize(self._rows(self.weight), G.T(self.ggml()), check=False))
        if self.formats_from is not None:
            return self._fake_quantize_blocks(self.weight, self.format_ids, self.formats_used())
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
            check_budget(fmt, bits_per_weight, "ste")
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


def budget_ladder(width):
    """[(type name, bits per weight)] of GGUF_BUDGET_TYPES a row of `width` weights can be, in bits order, each
    step more bits than the one below (of two types of equal bits, the first)."""
    G = _ggml()
    ladder = []
    for t in GGUF_BUDGET_TYPES:
        bits = G.bits_per_weight(GGML_FORMATS[t])
        if width % G.block_size(GGML_FORMATS[t]) == 0 and (not ladder or bits > ladder[-1][1]):
            ladder.append((t, bits))
    return ladder


def tensor_b_t(b_t, shape):
    """A tensor's b_t from its blocks' learned b_t (auto-gguf's ranking): log4 of the mean of 4^b_t over
    its weights (blocks weighted by the weights they hold; shape: the weight's, whose 32x32 blocks b_t
    has). Why this mean: a block's b_t is the level of noise it learned to bear, 4^(1-b_t) max_bl^2
    (Eq. 3); a type whose rounding error matches level b (rounding_error) gives it 4^(b_t - b) times
    that, so the tensor's excess over what its blocks bear is the mean of 4^b_t times 4^-b: the blocks
    that need precision dominate it, where a plain mean of b_t would let many tolerant blocks hide them."""
    n = block_weights(*shape)
    top = b_t.double().max()
    return (top + 0.5 * torch.log2((n * torch.exp2(2 * (b_t.double() - top))).sum() / n.sum())).item()


def imatrix_error(w, name, columns):
    """error-gguf's proxy of a weight w (out, in) on format `name`: its squared rounding error per weight,
    each input column weighted by `columns`, the summed squares of that column's inputs (llama.cpp's
    importance matrix); the squared error of the layer's outputs over those inputs, were the input
    columns uncorrelated."""
    w = w.detach().float()
    errors = (fake_quantize(w, name).double() - w.double()).square().sum(0)
    return (errors * columns.double().to(w.device)).sum().item() / w.numel()


def gguf_types(fmt, weights, budget, *, b_t=None, imatrix=None):
    """{layer: GGML type name of GGUF_BUDGET_TYPES} for a mean of `budget` bits per weight (each type's
    bits, scales included) over the layers' weights together (weights: {layer: weight (out, in)}); each
    layer starts at the cheapest type its input width allows and goes up its allowed types by
    formats.greedy_upgrades, the upgrades ranked by the drop in the layer's proxy error they buy per
    bit they cost:
      - auto-gguf (b_t: {layer: tensor_b_t}): 4^b_t * rounding_error(type), the type's excess noise
        over what the tensor's blocks learned to bear;
      - error-gguf (imatrix: {layer: the input columns' summed squared activations}): imatrix_error,
        llama.cpp's importance-matrix error of the weight at each type."""
    layers = list(weights)
    allowed = [budget_ladder(weights[k].shape[1]) for k in layers]
    numel = [weights[k].numel() for k in layers]
    proxy = []
    for k, types in zip(layers, allowed):
        if fmt == "auto-gguf":
            proxy.append([4.0 ** b_t[k] * rounding_error(t) for t, _ in types])
        else:
            proxy.append([imatrix_error(weights[k], t, imatrix[k]) for t, _ in types])
    u = max(len(types) for types in allowed) - 1
    priority = torch.full((len(layers), max(u, 1)), -torch.inf, dtype=torch.float64)
    cost = torch.full(priority.shape, torch.inf, dtype=torch.float64)
    for i, (types, p) in enumerate(zip(allowed, proxy)):
        for j in range(len(types) - 1):
            extra = types[j + 1][1] - types[j][1]
            priority[i, j], cost[i, j] = (p[j] - p[j + 1]) / extra, numel[i] * extra
    least = sum(n * types[0][1] for n, types in zip(numel, allowed))
    levels = greedy_upgrades(priority, cost, budget * sum(numel) - least)
    return {k: types[level][0] for k, types, level in zip(layers, allowed, levels.tolist())}


def _say(line):
    """Print on one process: rank 0 of a distributed run."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()) or \
            torch.distributed.get_rank() == 0:
        print(line, flush=True)


def _choose_gguf_types(layers, step):
    """The GGUF budget's switch: each layer's GGML type, gguf_types' choice from the weights they hold
    at step `step` (before it), with the tensors' learned b_t (auto-gguf: gaussws.PQTLinear's b_t, Eq.
    11 in float64) or the imatrix each layer summed (error-gguf); the mix printed once."""
    (fmt, budget), = {(layer.fmt, layer.bits_per_weight) for _, layer in layers}
    weights = {name: layer._rows(_full(layer.weight)) for name, layer in layers}
    if fmt == "auto-gguf":
        b_t = {name: tensor_b_t(layer.b_t_float64(), layer.weight.shape) for name, layer in layers}
        chosen = gguf_types(fmt, weights, budget, b_t=b_t)
    else:
        chosen = gguf_types(fmt, weights, budget, imatrix={name: layer.imatrix for name, layer in layers})
    for name, layer in layers:
        layer.set_type(ggml_type(chosen[name]))
    numel = {name: w.numel() for name, w in weights.items()}
    bits = sum(_ggml().bits_per_weight(GGML_FORMATS[chosen[k]]) * n for k, n in numel.items()) / sum(numel.values())
    mix = ", ".join(f"{sum(v == t for v in chosen.values())} {GGML_FORMATS[t]}" for t in GGUF_BUDGET_TYPES
                    if t in chosen.values())
    by = "the tensors' learned b_t" if fmt == "auto-gguf" else "their input-weighted rounding error"
    _say(f"note: step {step}: {fmt} chose one GGML type per block Linear, ranked by {by}: {mix} = {bits:.4f} bits "
         f"per weight of the {len(layers)} Linears (budget {budget:g})")


@torch.no_grad()
def choose_formats(layers, step):
    """The switch to a bit budget's formats for every layer of `layers` ([(module path, layer)]: all the
    budget layers of a model, budget_layers), chosen together from the weights they hold at optimizer
    step `step` (before it): a GGUF budget's GGML types (_choose_gguf_types), or the per-block formats of
    formats.budget_format_ids, the function export.py's --bits_per_weight uses, with, for auto-int, the
    b_t of the layers that learn one (gaussws.PQTLinear: Eq. 11 in float64, as export.py reads them).
    Raises if some layer is not due at `step` or holds formats already."""
    if any(step < layer.formats_from or layer.chosen() for _, layer in layers):
        raise RuntimeError(f"ste.choose_formats: at step {step} every budget layer must be due and unchosen "
                           f"(one budget, one switch per model)")
    if layers[0][1].has_ggml:
        return _choose_gguf_types(layers, step)
    (fmt, budget), = {(layer.fmt, layer.bits_per_weight) for _, layer in layers}
    weights = {name: _full(layer.weight) for name, layer in layers}
    b_t = {name: layer.b_t_float64() for name, layer in layers if hasattr(layer, "b_t_float64")}
    chosen = budget_format_ids(fmt, weights, b_t, budget)
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
    filter of the roles `ste[...]` names). Each trains on format fmt (STE_FORMATS, GGML_FORMATS) from
    optimizer step `start`, or with fmt "error-int" / "error-gguf" and bits_per_weight on per-block
    int2/int3/int4 or per-tensor GGML types chosen at `start`. A width fmt cannot hold is refused
    (check_layers) before any layer is swapped. Call it after the model is built and before it is
    wrapped (DDP, FSDP, compile); the weights and biases stay the same Parameters, and nothing is
    drawn from torch's RNG."""
    if fmt not in BUDGET_TARGETS:
        check_format(fmt)
    taken = {name: m for name, m in model.named_modules()
             if type(m) is nn.Linear and (takes is None or takes(name, m))}
    check_layers({name: tuple(m.weight.shape) for name, m in taken.items()}, fmt, bits_per_weight)
    for name, module in taken.items():
        model.set_submodule(name, STELinear.from_linear(module, fmt=fmt, start=start, bits_per_weight=bits_per_weight))
    return model
