"""Gaussian weight sampling (GaussWS): pseudo-quantization training (PQT) of Linear weights.

Each training step replaces a weight w by (Eq. 3, docs/METHOD.md section 1)

    w_hat = w + R * broadcast_bl(max_bl(|w|) * 2^(1 - b_t))

with 32x32 blocks, a learnable bitwidth b_t per block, and noise R that is redrawn every optimizer
step: round(N(0,1)/2) made from random bits (gaussws) or U(-1/2, 1/2) in BF16 (diffq, the
baseline). w_hat is BF16; the matmul that follows is the ordinary one. The noise kernels and Eq. 3/4 as
autograd ops live in kernels/ (pseudo_quantize: kernels/ops.py); this file holds the layer, the seeds, and
how a model trains with it:

    convert(model, "gaussws[od]", roles, seed=seed)    # once, after the model is built: Linear -> PQTLinear
    optimizers = build_optimizers(model, "adamw", roles, lr=..., ...)   # b_i in an AdamW group of their own
    for step in ...:
        with TrainStep(model, step):                   # this step's noise; Eq. 4 at its end
            ... forwards and backwards of the micro-steps ...
        clip, optimizer.step(), zero_grad

The other baseline, straight-through fake quantization (STE-QAT, "ste[...]"), is ste.py's converter;
convert hands it the Linears that `ste[...]` names, so one method string chooses every method, and
TrainStep runs its hook. Either method can start late (convert's `start`): the layers are plain
nn.Linear until that step, so a run is the bf16 run up to there, then a PQT or STE phase with the same
optimizer state. A PQT layer can end on a bit budget's per-block formats or per-tensor GGML types
(convert's `ste_start`, ste.BlockFormats): its learned b_t rank the blocks (or tensors), then STE
finishes them.

See README.md.
"""
import hashlib
import re

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import BL, batches
from kernels.ops import (RecomputedLinear, backend_name, check_seed, noise_e, noise_kernels,  # noqa: F401 (API)
                         pseudo_quantize, sample_r, scale_bl)
from kernels.torch_noise import block_absmax
from quant import budget, ste
from util import load_error

METHODS = ("bf16", "gaussws", "diffq", "ste")
GROUPS = {"all": None, "od": ("out", "down")}  # None: every role of the model


def parse_method(spec, roles):
    """'gaussws[od]' -> ('gaussws', frozenset({'out', 'down'})); 'bf16' -> ('bf16', frozenset()); ste[...] alike.

    roles: the role names a model has (e.g. model.ROLES["gpt2"].values()); [all] means all of them.
    """
    valid = tuple(dict.fromkeys(roles))
    hint = (f"expected bf16, or gaussws[...] / diffq[...] / ste[...] with a comma-separated list of "
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
            raise ValueError(f"bad method {spec!r}: no layer {part!r} in this model; {hint}")
    return method, frozenset(layers)


class PQTLinear(ste.BlockFormats, nn.Linear):
    """nn.Linear whose weight is pseudo-quantized (Eq. 3) in training mode.

    b_i is the internal bitwidth of each 32x32 block (Eq. 11), initialised to 1 so that
    b_t = b_target + b_i * (b_init - b_target) starts at b_init; weight decay on b_i pulls b_t
    toward b_target. In eval mode the layer is exactly nn.Linear (the BF16 baseline under autocast).

    A training-mode forward runs inside a TrainStep, which selects the step's noise and chooses
    one of two ways to make w_hat (see TrainStep); nothing else sets the layer's step state.
    Before optimizer step `start` (a PQT phase) the layer is dormant: exactly nn.Linear, and b_i
    gets no gradient, so AdamW leaves it as it is (it skips parameters without one).
    From optimizer step `ste_start` (0: never) the layer trains by STE on the per-block formats (or the
    GGML type) that the bit budget (fmt "auto-int"/"auto-gguf" ranks by b_t, "error-int"/"error-gguf" by
    error; bits_per_weight) chooses at that step (ste.BlockFormats); from then on b_i gets no gradient.
    Build one with convert(model, ...), or directly and then set_noise_seed(model, seed).
    """

    def __init__(self, in_features, out_features, bias=True, *, method="gaussws", b_init=6.0, b_target=4.0,
                 backend="auto", recompute=False, layer_seed=0, start=0, ste_start=0, fmt="", bits_per_weight=0.0,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if method not in ("gaussws", "diffq"):
            raise ValueError(f"PQTLinear method must be 'gaussws' or 'diffq', got {method!r}")
        if ste_start:
            if not int(ste_start) > int(start):
                raise ValueError(f"ste_start={ste_start} must come after the PQT phase's start {start}")
            budget.check_budget(fmt, bits_per_weight, method)
            self._init_formats(fmt, bits_per_weight, ste_start, device)
        self.method, self.b_init, self.b_target, self.backend = method, float(b_init), float(b_target), backend
        self.recompute = bool(recompute)  # keep no w_hat for the backward: make it again there
        self.b_i = nn.Parameter(torch.ones(-(-out_features // BL), -(-in_features // BL), device=device))
        self.layer_seed = check_seed(layer_seed)  # convert / set_noise_seed derive it from (seed, module name)
        # The step state, set by TrainStep only. The seed of this step's R is a CPU tensor, so a new
        # value neither syncs a GPU nor makes torch.compile recompile.
        self.noise_seed = torch.tensor(_step_seed(self.layer_seed, 0), dtype=torch.int64, device="cpu")
        self.in_step = False
        self.start = int(start)  # the first optimizer step with noise
        self.active = self.start == 0  # whether this (or the last) step has noise: TrainStep sets it
        self.w_hat = None  # step mode: this optimizer step's w_hat, shared by its micro-steps
        self._eq4 = None  # step mode: (scale_bl with its graph to b_i or None if batched, stored R, w's version)
        self._micro = None  # per micro-step: the kernels.batches._Block that makes this step's w_hat, if any

    @classmethod
    def from_linear(cls, linear, **kwargs):
        """A PQTLinear that holds `linear`'s own weight and bias Parameters (values, dtype, device kept);
        b_i = 1 on the weight's device. Draws nothing from torch's RNG (built on the meta device)."""
        with torch.device("meta"):
            layer = cls(linear.in_features, linear.out_features, linear.bias is not None, **kwargs)
        layer._take_weight(linear.weight, linear.bias)
        layer.b_i = nn.Parameter(torch.ones(layer.b_i.shape, device=linear.weight.device))
        return layer.train(linear.training)

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

    @torch.no_grad()
    def b_t_float64(self):
        """Eq. 11 in float64 on the CPU, as export.py reads b_t from a checkpoint (learned_bitwidths)."""
        b_i = self.b_i.full_tensor() if hasattr(self.b_i, "full_tensor") else self.b_i
        return eq11_float64(b_i, self.b_init, self.b_target)

    def forward(self, x):
        if not self.training:
            return self._matmul(x, self.weight)
        if not self.in_step:
            raise RuntimeError("PQTLinear: a training-mode forward outside a step; run the step's forwards inside "
                               "`with gaussws.TrainStep(model, step):`, or call model.eval() for noise-free use")
        if self.collecting:  # error-gguf: the input activations of the steps before ste_start
            self.collect(x)
        if self.quantized:  # from ste_start: STE on the chosen formats (ste.BlockFormats)
            return self._matmul(x, self.step_weight())
        if not self.active:  # before the phase: nn.Linear's forward
            return self._matmul(x, self.weight)
        if self._micro is not None and not torch.compiler.is_compiling():
            y = self._micro.forward(self, x)  # per micro-step: the block's w_hat in one launch, its Eq. 4 in one
            if y is not None:
                return y
        if self.w_hat is not None:  # step mode: w_hat made once for the whole optimizer step
            if not torch.compiler.is_compiling() and self.weight._version != self._eq4[2]:
                raise RuntimeError("PQTLinear: stale w_hat, the weight changed inside the step that made it "
                                   "(optimizer.step() belongs after the `with gaussws.TrainStep(...)` block)")
            w_hat = self.w_hat
        elif self.recompute:  # per micro-step, w_hat made again in the backward
            return RecomputedLinear.apply(x, self.weight, noise_e(self.b_t), self.bias,
                                           self.noise_seed, self.method, self.backend)
        else:  # per micro-step: Eq. 3 here, Eq. 4 in this backward
            w_hat = pseudo_quantize(self.weight, self.b_t, self.noise_seed, self.method, backend=self.backend)
        if not torch.is_autocast_enabled(x.device.type):
            w_hat = w_hat.to(x.dtype)  # exact: BF16 values are representable in FP32
        return self._matmul(x, w_hat)

    def _matmul(self, x, w):
        return F.linear(x, w, self.bias)

    def batched(self):
        """Whether TrainStep makes this layer's w_hat and Eq. 4 in a _Batch, with the other step-mode layers
        of its kind (the Triton backend's multi-layer kernels), rather than in _begin and _end."""
        w = self.weight
        return (backend_name(self.backend, w.device) == "triton" and self.b_i.dtype == torch.float32
                and w.is_contiguous() and w.data_ptr() % 16 == 0)

    def batched_micro(self):
        """Whether TrainStep serves this layer per micro-step in a kernels.batches._Block, with the other
        layers of its transformer block and kind (the Triton backend's multi-layer kernels)."""
        return backend_name(self.backend, self.weight.device) == "triton" and self.b_i.dtype == torch.float32

    def step_mode(self):
        """Whether this step's w_hat is made once, at its begin (else in every forward: per micro-step,
        where w_hat is recomputed to save its memory, or under FSDP, where the weight is whole only
        inside the forward)."""
        return self.active and not self.recompute and not hasattr(self.weight, "full_tensor")

    def _state(self, **values):
        """Set attributes of the step's state (none a parameter, buffer or module) without nn.Module's
        __setattr__, whose checks cost a batched layer's step more than the rest of its host work."""
        self.__dict__.update(values)

    def _begin(self, step):
        """The layer's state of optimizer step `step`. Returns "step" where w_hat is made once for the step
        (TrainStep makes it: in a _Batch, or by _begin_alone), "micro" where every forward makes it (TrainStep
        sets the step's seed, which its forwards and backwards read), else None (nn.Linear's forward)."""
        if self.formats_from is not None:  # a budget's STE phase (ste.BlockFormats)
            with torch.no_grad():
                self._begin_formats(step, step >= self.formats_from)
        self._state(in_step=True, active=step >= self.start and not self.quantized)
        return ("step" if self.step_mode() else "micro") if self.active else None

    @torch.no_grad()
    def _begin_alone(self, step):
        """Step mode, one layer: this step's w_hat and stored R; the scale with its graph to b_i for Eq. 4."""
        seed = _step_seed(self.layer_seed, step)
        self.noise_seed.fill_(seed)
        k = noise_kernels(self.backend, self.weight.device)
        with torch.enable_grad():  # the scale keeps its graph to b_i: Eq. 4 backpropagates through it at the end
            scale = scale_bl(block_absmax(self.weight), self.b_t)
        r_store = k.gen(self.weight.numel(), seed, self.method, self.weight.device)
        w_hat = k.apply(self.weight.detach(), r_store, scale.detach(), self.method)
        self._eq4 = (scale, r_store, self.weight._version)
        with torch.enable_grad():
            self.w_hat = ste.StraightThrough.apply(self.weight, w_hat)

    def _end(self, apply_eq4=True):
        """Release the step. With apply_eq4, a step-mode layer alone returns (scale_bl, sum_bl(dL/dw_hat * R)):
        backpropagating the sums through the scale is Eq. 4, then Eq. 11's chain rule, into b_i.grad,
        which TrainStep.end does for all such layers at once; else None (a batched layer's _Batch did it)."""
        if self.formats_from is not None:
            with torch.no_grad():
                self._end_formats(apply_eq4)
        state = self._eq4
        self._state(_eq4=None, w_hat=None, in_step=False, _micro=None)
        if state is None or state[0] is None or not apply_eq4:  # state[0] None: batched, its _Batch did Eq. 4
            return None
        scale, r_store, version = state
        if self.weight.grad is None:
            return None
        self._check_version(version)
        with torch.no_grad():
            noise = noise_kernels(self.backend, self.weight.device)
            return scale, noise.block_sums(self.weight.grad, r_store, self.method)

    def _check_version(self, version):
        if self.weight._version != version:
            raise RuntimeError("PQTLinear: the weight changed inside the step, so Eq. 4 would use a stale R; "
                               "optimizer.step() belongs after the `with gaussws.TrainStep(...)` block")

    def extra_repr(self):
        return (f"{super().extra_repr()}, method={self.method}, b_init={self.b_init}, b_target={self.b_target}"
                + (", recompute=True" if self.recompute else "") + (f", start={self.start}" if self.start else "")
                + (f", ste_start={self.formats_from}, fmt={self.fmt}, bits_per_weight={self.bits_per_weight:g}"
                   if self.formats_from is not None else ""))


class PQTConv1D(PQTLinear):
    """PQT of a Hugging Face GPT-2 `Conv1D` (a Linear that stores its weight as (in, out) and computes
    x @ w + b), keeping that layout and its state dict names. Eq. 3 runs on the stored weight: its
    32x32 blocks are those of the transpose, so the noise is the method's either way."""

    @classmethod
    def from_conv1d(cls, conv, **kwargs):
        if kwargs.get("recompute"):
            raise ValueError("recompute=True is for nn.Linear layers; a Conv1D makes w_hat once per step")
        n_in, n_out = conv.weight.shape
        with torch.device("meta"):  # the weight (n_in, n_out) as stored: nn.Linear's "out_features" is n_in
            layer = cls(n_out, n_in, conv.bias is not None, **kwargs)
        layer._take_weight(conv.weight, conv.bias)
        layer.b_i = nn.Parameter(torch.ones(layer.b_i.shape, device=conv.weight.device))
        return layer.train(conv.training)

    def _matmul(self, x, w):
        return F.linear(x, w.t(), self.bias)

    def _rows(self, w):
        return w.t()  # stored (in, out): the rows along the input, which a GGML type's blocks run along


def _is_conv1d(module):
    """transformers' Conv1D (GPT-2), recognised without importing transformers."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and module.weight.dim() == 2


class TrainStep:
    """One optimizer step of PQT: the noise of `step` for every PQT layer of `model`, and Eq. 4.

        with gaussws.TrainStep(model, step):
            for x, y in micro_batches:
                loss(model(x), y).backward()     # DDP's all-reduce happens in the last backward
        clip the gradients; optimizer.step(); optimizer.zero_grad()

    (or step = TrainStep(model, step); step.begin(); ...; step.end()). Each layer takes one of two
    ways, chosen here and nowhere else:
      - step mode (default): w and b_t do not change within an optimizer step, so neither does w_hat.
        begin() makes it once (and keeps R, 0.5 byte per weight) for all micro-steps, whose
        backwards pass dL/dw_hat to w alone; end() applies Eq. 4 once to the accumulated (and
        all-reduced) w.grad. Exact, because Eq. 4 is linear in dL/dw_hat and w.grad is the sum of the
        micro-steps' dL/dw_hat. On the Triton backend the step-mode layers of one kind (_Batch) go
        through one launch at begin and one at end, whatever their number (batched=False: one layer
        at a time, the reference the batches give the bits of).
      - per micro-step, for layers converted with recompute=True (no w_hat kept for the backward) and
        for sharded (FSDP) weights: every forward makes w_hat, every backward applies Eq. 4. On the
        Triton backend the layers of one transformer block and kind (kernels.batches._Block) make
        them in one launch each, inside FSDP's unshard of the block and before its reduce-scatter.
    Layers whose phase starts after `step` are plain nn.Linear in it. STE layers (ste.py) make their
    w_q in begin(), once for the step, and begin() runs the STE's hook, ste.before_step: the first step
    on a bit budget's formats (per block or a GGML type per tensor; a layer's formats_from: ste_start,
    or an STE layer's start) chooses them for all the model's budget layers together, unless they hold
    them already (a run resumed after it); end() adds error-gguf's imatrix sums of the step.
    Leaving the block by an exception releases the step without touching any gradient. Opening a
    step while one is open, or a training-mode forward outside a step, raises.
    """

    def __init__(self, model, step, batched=True):
        # method_layers and ste.budget_layers in one walk of the modules: it runs at every step
        named = [(name, m) for name, m in model.named_modules() if isinstance(m, (PQTLinear, ste.STELinear))]
        self.model, self.layers, self.step, self.batched = model, [m for _, m in named], int(step), batched
        self.budget = [(name, m) for name, m in named if m.formats_from is not None]
        self.batches, self.blocks = [], []

    def begin(self):
        if any(layer.in_step for layer in self.layers):
            raise RuntimeError("gaussws.TrainStep: a step is already open on this model; end it first")
        ste.before_step(self.budget, self.step)
        ways = [(layer, layer._begin(self.step)) for layer in self.layers]
        step_mode = [layer for layer, way in ways if way == "step"]
        self.batches, alone = batches.batches(step_mode, _step_seeds) if self.batched else ([], step_mode)
        self.blocks, seeds = batches.blocks(self.model, [layer for layer, way in ways if way == "micro"],
                                            _step_seeds, grouped=self.batched)
        for device_seeds in seeds:
            device_seeds.set_step(self.step)
        for block in self.blocks:
            for layer in block.layers:
                layer._state(_micro=block)
        for layer in alone:
            layer._begin_alone(self.step)
        for batch in self.batches:
            batch.begin(self.step)
        return self

    def end(self, apply_eq4=True):
        """Release the step; with apply_eq4, first add Eq. 4's b_t gradient to the b_i.grad of step-mode
        layers."""
        try:
            for batch in self.batches:
                batch.end(apply_eq4)
        finally:
            for block in self.blocks:
                block.release()
            eq4 = [pair for pair in (layer._end(apply_eq4) for layer in self.layers) if pair is not None]
        if eq4:  # one autograd call for every layer: on a GPU each call costs the host far more than its arithmetic
            scales, sums = zip(*eq4)
            torch.autograd.backward(scales, sums)

    def __enter__(self):
        return self.begin()

    def __exit__(self, exc_type, exc, tb):
        self.end(apply_eq4=exc_type is None)


def method_linears(model, method, roles):
    """{module path: module} of the modules of `model` that `method` (parse_method) converts: those
    playing a role it names. roles: {module-path suffix: role}, e.g. model.ROLES["gpt2"] =
    {"attn.c_attn": "qkv", ...}; a module plays the role of the longest suffix its path ends with
    (".attn.c_attn" or the whole path). The one role filter of both converters (convert, ste.convert).
    ValueError for a chosen module that is not an nn.Linear (nor, but for ste, a transformers Conv1D),
    or for a chosen role no module plays."""
    kind, chosen = parse_method(method, roles.values())
    taken, found = {}, set()
    for name, module in model.named_modules():
        keys = [k for k in roles if name == k or name.endswith("." + k)]
        role = roles[max(keys, key=len)] if keys else None
        if role not in chosen:
            continue
        if type(module) is not nn.Linear and (kind == "ste" or not _is_conv1d(module)):
            raise ValueError(f"{name} plays role {role!r} but is a {type(module).__name__}, not an nn.Linear"
                             + ("" if kind == "ste" else " (or a transformers Conv1D)"))
        taken[name] = module
        found.add(role)
    if chosen - found:
        raise ValueError(f"method {method!r}: no nn.Linear of the model plays role(s) "
                         f"{', '.join(sorted(chosen - found))} (roles: {dict(roles)})")
    return taken


def convert(model, method, roles, *, b_init=6.0, b_target=4.0, seed=0, backend="auto", recompute=False, start=0,
            fmt="", ste_start=0, bits_per_weight=0.0):
    """Swap the nn.Linear modules of `model` that `method` chooses (method_linears, by their roles) for
    PQTLinear (a Hugging Face GPT-2's Conv1D for PQTConv1D), in place; return model. For ste[...],
    ste.convert swaps them for STELinear.

    method: "bf16" (nothing changes), or "gaussws[...]" / "diffq[...]" / "ste[...]" naming roles (parse_method).
    start: the first optimizer step with the method; the layers are plain nn.Linear before it. fmt: the format
    STELinear trains on (grids.STE_FORMATS, formats.GGML_FORMATS, grids.LATTICE_FORMATS), or for ste "error-int" /
    "error-gguf" with bits_per_weight: per block int2/int3/int4, or a GGML type per tensor, chosen at `start`; a
    width fmt cannot hold is refused (budget.check_layers). PQT layers take their b_t from b_init, b_target.
    ste_start (PQT only; 0: never): the first step of STE on the formats chosen then by the budget (fmt one of
    formats.BUDGET_TARGETS, bits_per_weight), after PQT. Call it after the model is built and initialised and before
    it is wrapped (DDP, FSDP, compile). The weights and biases are the same Parameters, so values, dtype and device
    are kept exactly, also on the meta device; b_i starts at 1 (b_t = b_init); nothing is drawn from torch's RNG, so
    the same seed gives the same initial weights and data order with any method. Each layer's noise seed is a
    function of (seed, module path).
    """
    kind, _ = parse_method(method, roles.values())
    if kind == "bf16":
        return model
    if method_layers(model):
        raise ValueError("the model has PQT layers already (PQTLinear or STELinear); convert one of plain nn.Linear")
    if kind == "ste" and ste_start:
        raise ValueError("ste_start is the switch of a gaussws/diffq run to STE; an ste[...] run trains by STE from "
                         "its start on")
    taken = method_linears(model, method, roles)
    if kind == "ste":
        return ste.convert(model, fmt, start=start, bits_per_weight=bits_per_weight,
                           takes=lambda name, _: name in taken)
    budget.check_layers({name: tuple(m.weight.shape[::-1] if _is_conv1d(m) else m.weight.shape)
                         for name, m in taken.items()}, fmt, bits_per_weight)  # a width fmt cannot hold: refused
    for name, module in taken.items():
        make = PQTConv1D.from_conv1d if _is_conv1d(module) else PQTLinear.from_linear
        model.set_submodule(name, make(module, method=kind, b_init=b_init, b_target=b_target, backend=backend,
                                       recompute=recompute, start=start, ste_start=ste_start, fmt=fmt,
                                       bits_per_weight=bits_per_weight))
    return set_noise_seed(model, seed)


# E[R^2] of the noise: gaussws from Eq. 10's probabilities, Pr(+-2) and Pr(+-1) per sign; diffq's U(-1/2, 1/2)
# (the level b_t matched to a format's rounding error, quant.budget.matched_b_t, divides by it).
_P2 = 0.75 * 2.0 ** -9
_P1 = 0.75 ** 2 * 2.0 ** -2 * (1 - 2 * _P2)
R_SECOND_MOMENT = {"gaussws": 2 * (_P1 + 4 * _P2), "diffq": 1 / 12}


# --- optimizers ------------------------------------------------------------------------------

def build_optimizers(model, optimizer="adamw", roles=None, *, lr, betas, weight_decay, bitwidth_weight_decay,
                     n_embd=None, n_head=None, n_kv_head=None):
    """The optimizers of a (converted) model: a list, each stepped after clipping.

    b_i always sit in an AdamW group of their own with weight decay `bitwidth_weight_decay`: decay
    pulls b_t toward b_target (Eq. 11), a choice of the method, never the weights' decay.
    adamw: one AdamW, decay on matrices, none on vectors (biases, norms), plus the b_i group.
    adam_mini: Adam-mini (n_embd, n_head, n_kv_head needed) for everything but b_i, taught from
    `roles` which parameters hold attention heads (one lr per head for q, k and a fused qkv; per
    neuron for v and the output projection), plus an AdamW for b_i.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    b_i = [p for n, p in named if n.endswith("b_i")]
    named = [(n, p) for n, p in named if not n.endswith("b_i")]
    params = [p for _, p in named] + b_i
    if any(p.device.type == "cuda" for p in params):
        extra = dict(fused=True)
    else:  # foreach kernels do not take FSDP's DTensors on CPU
        extra = dict(foreach=not any(hasattr(p, "full_tensor") for p in params))
    bitwidth_group = [dict(params=b_i, weight_decay=bitwidth_weight_decay)] if b_i else []
    if optimizer == "adamw":
        groups = [dict(params=[p for _, p in named if p.dim() >= 2], weight_decay=weight_decay),
                  dict(params=[p for _, p in named if p.dim() < 2], weight_decay=0.0)]
        return [torch.optim.AdamW(groups + bitwidth_group, lr=lr, betas=betas, **extra)]
    if optimizer != "adam_mini":
        raise ValueError(f"unknown optimizer {optimizer!r}; expected 'adamw' or 'adam_mini'")
    from adam_mini import Adam_mini
    mini = Adam_mini(named, lr=lr, betas=betas, weight_decay=weight_decay, dim=n_embd, n_heads=n_head,
                     n_kv_heads=n_kv_head, verbose=False)
    # Adam-mini finds its blocks by substrings of parameter names: teach it ours.
    for key, role in (roles or {}).items():
        if role in ("q", "k", "qkv"):
            mini.wqk_names.add(key + ".")
        elif role == "v":
            mini.wv_names.add(key + ".")
        elif role == "out":
            mini.attn_proj_names.add(key + ".")
    return [mini] + ([torch.optim.AdamW(bitwidth_group, lr=lr, betas=betas, **extra)] if b_i else [])


def load_weights(model, state_dict):
    """Load a state dict into a converted model: b_i the source lacks keep their fresh init (b_t =
    b_init); b_i of layers the new method leaves plain are dropped; the STE's formats state (a budget's
    choice, a GGML type, imatrix: budget.FORMAT_STATE) is never taken (the new run makes its own). Anything
    else must match, else ValueError names what is missing and unexpected, or the shape that differs."""
    own = model.state_dict()
    state_dict = {k: v for k, v in state_dict.items() if (k in own or not k.endswith(".b_i"))
                  and not k.endswith(budget.FORMAT_STATE)}
    try:
        result = model.load_state_dict(state_dict, strict=False)
    except RuntimeError as e:  # a shape that differs is an error even when not strict
        if isinstance(e, torch.OutOfMemoryError):
            raise
        raise ValueError(load_error(e)) from None
    missing = [k for k in result.missing_keys if not k.endswith((".b_i",) + budget.FORMAT_STATE)]
    if missing or result.unexpected_keys:
        raise ValueError(f"missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}")


def ddp_ignored_parameters(model):
    """Names of the parameters DDP must leave alone: the b_i of step-mode layers. Their gradient
    comes from end() after DDP's all-reduce, from the averaged w.grad, so it is the same on every
    rank already and DDP must not wait for it in the backward."""
    return [f"{name}.b_i" for name, layer in model.named_modules()
            if isinstance(layer, PQTLinear) and not layer.recompute]


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


def _layer_seed(seed, name):
    """A layer's seed from the user's seed and its module path: the same layer draws the same noise
    whichever other layers are PQT (gaussws[od] and gaussws[all] agree on out and down)."""
    key = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    return _mix(_mix(seed) + 0x9E3779B97F4A7C15 * (key + 1)) >> 1


def _step_seed(layer_seed, step):
    return _mix(layer_seed + 0x9E3779B97F4A7C15 * (step + 1)) >> 1  # >> 1: Philox seed in [0, 2^63)


def _step_seeds(layer_seeds, step):
    """_step_seed of every layer seed at once, as int64: NumPy's uint64 arithmetic wraps as _mix's masks do."""
    x = np.array(layer_seeds, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15 * (step + 1) % 2**64)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return ((x ^ (x >> np.uint64(31))) >> np.uint64(1)).astype(np.int64)


def pqt_layers(model):
    return [m for m in model.modules() if isinstance(m, PQTLinear)]


def method_layers(model):
    """The layers convert made: PQTLinear and STELinear."""
    return [m for m in model.modules() if isinstance(m, (PQTLinear, ste.STELinear))]


def set_noise_seed(model, seed):
    """Give every PQTLinear of `model` its own layer seed, from `seed` and its module path; returns model."""
    seed = check_seed(seed)
    for name, layer in model.named_modules():
        if isinstance(layer, PQTLinear):
            layer.layer_seed = _layer_seed(seed, name)
    return model


# --- the bitwidths -----------------------------------------------------------------------------

def eq11_float64(b_i, b_init, b_target):
    """Eq. 11, b_t = b_target + b_i (b_init - b_target), in float64 on the CPU: the b_t a bit budget
    ranks, in training (ste.choose_formats) and in export.py (from a checkpoint's b_i), alike to the bit."""
    return b_target + b_i.detach().double().cpu() * (b_init - b_target)


def bitwidth_loss(model):
    """Eq. 12 without lambda: sum over PQT layers of the mean |b_t - b_target| of their blocks (the
    layers of this step: none before a PQT phase, whose b_i get no gradient until it starts)."""
    terms = [(layer.full_b_t() - layer.b_target).abs().mean() for layer in pqt_layers(model) if layer.active]
    return torch.stack(terms).sum() if terms else torch.zeros(())


@torch.no_grad()
def bitwidth_stats(model):
    """Mean, min and max of b_t over all PQT blocks of the model, or None without PQT layers."""
    b_t = [layer.full_b_t().flatten() for layer in pqt_layers(model)]
    if not b_t:
        return None
    b_t = torch.cat(b_t).float()
    return {"mean": b_t.mean().item(), "min": b_t.min().item(), "max": b_t.max().item()}


@torch.no_grad()
def bitwidth_histograms(model):
    """{module path: numpy array of the b_t of its blocks} for every PQT layer (collective under FSDP)."""
    return {name: layer.full_b_t().float().cpu().flatten().numpy()
            for name, layer in model.named_modules() if isinstance(layer, PQTLinear)}
