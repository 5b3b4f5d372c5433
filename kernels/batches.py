"""Eq. 3 and Eq. 4 for many PQT layers in one launch each: how gaussws.TrainStep serves its layers on the Triton
backend (docs/GPU.md). On a GPU a launch costs the host more than the arithmetic of a small weight, so the
per-step work must not grow with the number of layers.

- _Batch, step mode: the step-mode layers of one kind make w_hat in one launch at the step's begin and Eq. 4
  in one launch at its end, into their b_i.grad (w_hat is made once for all the micro-steps).
- _Block, per micro-step: the layers that make w_hat in every forward (recompute=True, or FSDP's sharded
  weights, whole only inside their block's forward) are served per transformer block and kind. The first
  forward of a block's layers in a micro-step makes every w_hat of the block in one launch (inside FSDP's
  unshard, which gathers the block's weights at once); the block's backward makes Eq. 4 in one launch,
  once the last of its layers has its dL/dw_hat, and hands it to autograd, so that DDP's and FSDP's hooks
  (FSDP's reduce-scatter runs after the block's backward) see b_i's gradient as any other.
- _Seeds: the step seeds of the layers on a device, in one copy to it a step.

The layers' own path (gaussws.PQTLinear one at a time) is the reference these give the bits of
(tests/test_gaussws.py, tests/test_batches.py); a launch counter holds the counts (tests/test_launch_count.py).
"""
import torch
import torch.nn as nn

from kernels.ops import autocast_linear, linear_grads, noise_e
from quant.ste import StraightThrough


def _triton():
    """kernels.triton_noise, imported where first used: Triton is imported only by runs that launch it (and after
    TRITON_INTERPRET, which the interpreter reads at Triton's import, is set)."""
    from kernels import triton_noise
    return triton_noise


def _wait(event):
    if event is not None:
        event.synchronize()


def _copied(device):
    """On a GPU, an event after the copies queued so far: a pinned host buffer they read is free once it is."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


class _PinnedCopy:
    """An int64 tensor on the device set from the host once a step (or micro-step), through a pinned buffer that
    the previous copy has finished reading: one copy, no wait for the GPU."""

    def __init__(self, shape, device):
        self.host = torch.zeros(shape, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.device = torch.zeros(shape, dtype=torch.int64, device=device)
        self.copied = None

    def set(self, values):
        _wait(self.copied)
        self.host.numpy()[:] = values
        self.device.copy_(self.host, non_blocking=True)
        self.copied = _copied(self.device.device)
        return self.device


def _contiguous(g, keep):
    """g as the Eq. 4 kernel reads it (contiguous, 16-byte aligned): a copy where it is not (e.g. a view into
    DDP's gradient buckets), kept alive in `keep` until the kernel has read it."""
    if not g.is_contiguous() or g.data_ptr() % 16:
        keep.append(g := g.clone(memory_format=torch.contiguous_format))
    return g


def _e(b_i, b_init, b_target):
    """2^(1 - b_t) of every block of the layers, flat FP32, from their b_i by Eq. 11 (PQTLinear.b_t): a few ops
    whatever the number of layers; on a GPU each element's bits are those of its own layer's noise_e."""
    return noise_e(b_target + torch.cat([b.reshape(-1) for b in b_i]) * (b_init - b_target))


class _Seeds(_PinnedCopy):
    """The step seeds (gaussws._step_seed) of layers on one device, each layer's noise_seed a view of them there:
    all computed at once in NumPy and copied to the device in one copy a step, from a pinned buffer. A kernel
    reads its layer's seed on the device: no launch and no host read per layer, and under torch.compile no CPU
    tensor among a graph's inputs (one would keep inductor from CUDA graphs)."""

    def __init__(self, layers, device, step_seeds):
        super().__init__(len(layers), device)
        self.layers, self.step_seeds = layers, step_seeds
        for i, layer in enumerate(layers):
            layer.noise_seed = self.device[i]

    def set_step(self, step):
        self.set(self.step_seeds([layer.layer_seed for layer in self.layers], step))


class _Batch:
    """Step-mode PQT layers of one kind (the Triton kernels' many_key, b_init, b_target) that TrainStep
    serves together: at begin one launch of Eq. 3 for all (kernels.triton_noise.Many), after the few
    PyTorch ops that make every block's 2^(1 - b_t) from the concatenated b_i (Eq. 11); at end one launch
    of Eq. 4 into their b_i.grad. The per-layer Python left launches nothing: views, the StraightThrough
    node of each w_hat (one per layer, so that each weight's gradient is ready, for DDP's all-reduce, as
    soon as its backward is done), the checks. The seeds are a _Seeds: one copy to the device a step."""

    def __init__(self, layers, step_seeds):
        self.layers, first = layers, layers[0]
        self.weights = [layer._parameters["weight"] for layer in layers]
        self.b_i = [layer._parameters["b_i"] for layer in layers]
        self.many = _triton().Many(self.weights, first.method)
        self.b_init, self.b_target, device = first.b_init, first.b_target, self.many.device
        self.seeds = _Seeds(layers, device, step_seeds)
        self.table = _PinnedCopy((len(layers), 3), device)

    @staticmethod
    def key(layer):
        return _triton().many_key(layer.weight, layer.method), layer.b_init, layer.b_target

    @torch.no_grad()
    def begin(self, step):
        self.seeds.set_step(step)
        e = _e(self.b_i, self.b_init, self.b_target)
        w_hat, r_store = self.many.eq3(self.weights, self.seeds.device, e)
        with torch.enable_grad():
            for layer, w, w_h, r in zip(self.layers, self.weights, w_hat, r_store):
                layer._state(w_hat=StraightThrough.apply(w, w_h), _eq4=(None, r, w._version))

    @torch.no_grad()
    def end(self, apply_eq4):
        """Eq. 4 into the b_i.grad of the layers whose weight has a gradient, in one launch."""
        if not apply_eq4:
            return
        states = [layer._eq4 for layer in self.layers]
        for layer, w, state in zip(self.layers, self.weights, states):
            if state is not None and w.grad is not None:
                layer._check_version(state[2])
        t = _triton()
        skip, store, add = t.SKIP.value, t.STORE.value, t.ADD.value
        grad = torch.empty(self.many.blk0[-1], dtype=torch.float32, device=self.many.device)
        rows, keep = [], []
        for i, (w, b_i, state) in enumerate(zip(self.weights, self.b_i, states)):
            g = w.grad
            if state is None or g is None or not b_i.requires_grad:
                rows.append((0, 0, skip))
                continue
            g = _contiguous(g, keep)
            mode = store if b_i.grad is None else add  # b_i's own gradient (Eq. 12's) is FP32 and contiguous as b_i
            if mode == store:
                b_i.grad = grad[self.many.blk0[i]:self.many.blk0[i + 1]].view(b_i.shape)
            rows.append((g.data_ptr(), b_i.grad.data_ptr(), mode))
        self.many.eq4(self.table.set(rows), self.b_init - self.b_target)


def batches(layers, step_seeds):
    """(the _Batch of each kind among `layers`, TrainStep's step-mode layers, and the layers left alone), kept
    on the first layer from step to step: made again only when the layers or their weights change (a phase
    starts, a weight moves)."""
    if not layers:
        return [], []
    weights = [layer._parameters["weight"] for layer in layers]
    plan = layers[0].__dict__.get("_plan")
    if (plan is not None and plan[0] == tuple(layers) and all(a is b for a, b in zip(plan[1], weights))
            and plan[2] == [w.data_ptr() for w in weights]):
        return plan[3], plan[4]
    kinds, alone = {}, []
    for layer in layers:
        if layer.batched():
            kinds.setdefault(_Batch.key(layer), []).append(layer)
        else:
            alone.append(layer)
    made = [_Batch(group, step_seeds) for group in kinds.values()]
    layers[0].__dict__["_plan"] = (tuple(layers), weights, [w.data_ptr() for w in weights], made, alone)
    return made, alone


# --- per micro-step, per transformer block ---------------------------------------------------------------

class _BlockNoise(torch.autograd.Function):
    """The w_hat of every layer of a _Block, in one launch, with one `link` per layer: a tensor of no elements
    that the layer's own node (_Linked, _RecomputedLinear) takes, so that this node's backward runs once every
    layer of the block that took part has left its dL/dw_hat in `grads`; it makes Eq. 4 of all of them in one
    launch and returns each b_i's gradient to autograd. w_hat itself is made outside autograd."""

    @staticmethod
    def forward(ctx, block, grads, weights, *b_i):
        ctx.set_materialize_grads(False)
        ctx.block, ctx.grads = block, grads
        ctx.r_store, ctx.e = block.make(weights, b_i)  # None, None where the backward makes them again (recompute)
        return tuple(b.new_empty(0) for b in b_i)

    @staticmethod
    def backward(ctx, *_):
        return (None, None, None, *ctx.block.eq4(ctx.needs_input_grad[3:], ctx.grads, ctx.r_store, ctx.e))


class _Linked(torch.autograd.Function):
    """The w_hat a _Block made, as the layer's weight: dL/dw = dL/dw_hat (as StraightThrough), and dL/dw_hat
    left in `grads` for the block's Eq. 4."""

    @staticmethod
    def forward(ctx, w, link, w_hat, grads, i):
        ctx.set_materialize_grads(False)
        ctx.w_dtype, ctx.grads, ctx.i = w.dtype, grads, i
        return w_hat

    @staticmethod
    def backward(ctx, g):
        if g is None:
            return None, None, None, None, None
        if ctx.needs_input_grad[1]:
            ctx.grads[ctx.i] = g
        return (g.to(ctx.w_dtype) if ctx.needs_input_grad[0] else None,
                g.new_empty(0) if ctx.needs_input_grad[1] else None, None, None, None)


class _RecomputedLinear(torch.autograd.Function):
    """kernels.ops.RecomputedLinear for a layer of a _Block: F.linear(x, w_hat) keeping neither w_hat nor R for
    the backward, where the block makes them again, for all its layers in one launch; dL/dw_hat left in `grads`
    for the block's Eq. 4."""

    @staticmethod
    def forward(ctx, x, w, bias, link, w_hat, block, grads, i):
        y, x_c = autocast_linear(x, w_hat, bias)
        ctx.save_for_backward(x_c)
        ctx.block, ctx.grads, ctx.i = block, grads, i
        ctx.x_dtype, ctx.w_dtype, ctx.has_bias = x.dtype, w.dtype, bias is not None
        return y

    @staticmethod
    def backward(ctx, g):
        x_c, = ctx.saved_tensors
        grad_x, grad_w_hat, grad_bias = linear_grads(g, x_c, ctx.block.w_hat_again(ctx.i), ctx.x_dtype,
                                                     ctx.needs_input_grad[0], ctx.has_bias)
        if ctx.needs_input_grad[3]:
            ctx.grads[ctx.i] = grad_w_hat
        return (grad_x, grad_w_hat.to(ctx.w_dtype), grad_bias, g.new_empty(0) if ctx.needs_input_grad[3] else None,
                None, None, None, None)


class _Block:
    """The per-micro-step layers of one transformer block and kind (_Batch.key, and whether they recompute
    w_hat), served by the Triton kernels' Many: w_hat of all of them in one launch at the first of their forwards
    in a micro-step, Eq. 4 in one launch when the last of their backwards is done. The tables are built for the
    whole weights' shapes; where a forward finds the weights otherwise (sharded, or moved to an unaligned or
    non-contiguous place), its layers make their own w_hat in it (forward returns None)."""

    def __init__(self, layers, seeds):
        first = layers[0]
        self.layers, self.seeds, self.recompute = layers, seeds, first.recompute
        self.index = {id(layer): i for i, layer in enumerate(layers)}
        self.b_init, self.b_target = first.b_init, first.b_target
        self.many = _triton().Many([layer.weight for layer in layers], first.method)
        self.table = _PinnedCopy((len(layers), 3), self.many.device)
        self.release()

    def release(self):
        """Forget the micro-step's state (TrainStep.end: a forward that raised may leave some)."""
        self.pending, self.made, self.again = {}, None, None

    def _weights(self):
        weights = [layer._parameters["weight"] for layer in self.layers]
        fits = all(not hasattr(w, "full_tensor") and tuple(w.shape) == shape and w.is_contiguous()
                   and w.data_ptr() % 16 == 0 for w, shape in zip(weights, self.many.shapes))
        return weights if fits else None

    def forward(self, layer, x):
        """The layer's output in this micro-step, its w_hat from the block's launch; None where the block's
        weights do not fit the launch (the layer then makes its own)."""
        i = self.index[id(layer)]
        entry = self.pending.pop(i, None)
        if entry is None:  # the block's first layer in this forward (or one that runs twice in it)
            weights = self._weights()
            if weights is None:
                return None
            grads = {}
            links = _BlockNoise.apply(self, grads, weights, *(m._parameters["b_i"] for m in self.layers))
            self.pending = {j: (link, w_hat, grads) for j, (link, w_hat) in enumerate(zip(links, self.made))}
            self.made = None
            entry = self.pending.pop(i)
        link, w_hat, grads = entry
        if self.recompute:
            return _RecomputedLinear.apply(x, layer.weight, layer.bias, link, w_hat, self, grads, i)
        w_hat = _Linked.apply(layer.weight, link, w_hat, grads, i)
        if not torch.is_autocast_enabled(x.device.type):
            w_hat = w_hat.to(x.dtype)  # exact: BF16 values are representable in FP32
        return layer._matmul(x, w_hat)

    def _eq3(self, weights, b_i):
        """Every w_hat of the block in one launch: ([w_hat], flat R, e); the tables keep neither R nor e."""
        e = _e(b_i, self.b_init, self.b_target)
        w_hat, _ = self.many.eq3(weights, self.seeds, e)
        r_store, self.many.r_store, self.many.e = self.many.r_store, None, None
        return w_hat, r_store, e

    @torch.no_grad()
    def make(self, weights, b_i):
        """_BlockNoise's forward: every w_hat of the block (self.made); (R, e) for Eq. 4 unless the backward
        makes them again."""
        self.made, r_store, e = self._eq3(weights, b_i)
        return (None, None) if self.recompute else (r_store, e)

    @torch.no_grad()
    def w_hat_again(self, i):
        """Recompute: layer i's w_hat in the backward, every layer's made again in one launch at the first."""
        if self.again is None:
            self.again = self._again()
        return self.again[0][i]

    def _again(self):
        weights = self._weights()
        if weights is None:
            raise RuntimeError("PQTLinear: a block's weights changed place or shape between its forward and its "
                               "backward; w_hat cannot be made again for recompute_w_hat")
        return self._eq3(weights, [m._parameters["b_i"] for m in self.layers])

    @torch.no_grad()
    def eq4(self, needs, grads, r_store, e):
        """_BlockNoise's backward: Eq. 4 of the layers that left dL/dw_hat in `grads`, in one launch; the
        gradient of each b_i (None for the others)."""
        if not grads:  # none of the block's layers had a backward
            return [None] * len(self.layers)
        if self.recompute:  # R of the backward's launch (made again if another node of the block took it)
            (_, r_store, e), self.again = self.again or self._again(), None
        t = _triton()
        skip, store = t.SKIP.value, t.STORE.value
        dtypes = {g.dtype for g in grads.values()}
        g_dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32  # mixed: FP32 holds each exactly
        out = torch.empty(self.many.blk0[-1], dtype=torch.float32, device=self.many.device)
        rows, keep, b_grads = [], [], []
        for i, layer in enumerate(self.layers):
            g = grads.pop(i, None)
            if g is None or not needs[i]:
                rows.append((0, 0, skip))
                b_grads.append(None)
                continue
            keep.append(g := _contiguous(g.to(g_dtype), keep))  # alive until the kernel has read it
            b_grads.append(out[self.many.blk0[i]:self.many.blk0[i + 1]].view(layer._parameters["b_i"].shape))
            rows.append((g.data_ptr(), b_grads[-1].data_ptr(), store))
        if any(b is not None for b in b_grads):  # else every gradient was unneeded
            self.many.eq4(self.table.set(rows), self.b_init - self.b_target, r_store, e, g_dtype)
        return b_grads


def blocks(model, layers, step_seeds, grouped=True):
    """(the _Block of each transformer block and kind among `layers`, TrainStep's per-micro-step layers, and
    the _Seeds of every layer on each device, in which each _Block's seeds are a slice), kept on the first
    layer from step to step and made again when the layers or their devices change (grouped=False: no
    _Block, the seeds alone). A layer's block is the nearest module above it that is the outermost item of an
    nn.ModuleList (a transformer block, what fully_shard is applied to) or that FSDP shards as one (fully_shard),
    else the model. Layers on another backend, or whose b_i is not FP32, are in no _Block: they
    make their own w_hat."""
    if not layers:
        return [], []
    key = (tuple(layers), tuple(layer.weight.device for layer in layers), grouped)
    plan = layers[0].__dict__.get("_blocks")
    if plan is not None and plan[0] == key:
        return plan[1], plan[2]
    unit = _units(model) if grouped else {}
    groups = {}
    for layer in layers:
        served = grouped and layer.batched_micro()
        groups.setdefault((unit[id(layer)], _Batch.key(layer), layer.recompute) if served else id(layer),
                          []).append(layer)
    by_device = {}
    for group in groups.values():
        by_device.setdefault(group[0].weight.device, []).append(group)
    made, seeds = [], []
    for device, device_groups in by_device.items():
        ordered = [layer for group in device_groups for layer in group]
        seeds.append(_Seeds(ordered, device, step_seeds))
        start = 0
        for group in device_groups:
            if grouped and group[0].batched_micro():
                made.append(_Block(group, seeds[-1].device[start:start + len(group)]))
            start += len(group)
    layers[0].__dict__["_blocks"] = (key, made, seeds)
    return made, seeds


def _units(model):
    """{id(module): id of its block} for every module of `model` (see blocks)."""
    from torch.distributed.fsdp import FSDPModule
    unit = {id(model): id(model)}

    def walk(module, current, in_item):
        for child in module.children():
            outermost_item = isinstance(module, nn.ModuleList) and not in_item  # a transformer block
            here = id(child) if outermost_item or isinstance(child, FSDPModule) else current  # FSDP gathers at once
            unit[id(child)] = here
            walk(child, here, in_item or outermost_item)

    walk(model, id(model), False)
    return unit
