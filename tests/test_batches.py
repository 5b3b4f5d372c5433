"""The per-micro-step path served per transformer block (kernels.batches._Block): layers that make w_hat in every
forward (recompute_w_hat; FSDP's sharded weights) make it for their whole block in one launch, and Eq. 4 in one.
The reference is the same layers one at a time (TrainStep(batched=False)): the same outputs, dL/dw and b_i.grad to
the bit, and a launch count that does not grow with the block's layers. Triton runs in its interpreter."""
import os
from collections import Counter

import pytest
import torch
import torch.nn as nn

import gaussws
from benchmarks.host import LaunchCounter
from conftest import end_spawned_rank

# (in, out, weight dtype, method): kinds that rows of R start a word of, or not; FP32 and BF16 weights
KINDS = [(64, 48, torch.float32, "gaussws"), (48, 64, torch.float32, "gaussws"), (64, 35, torch.float32, "diffq"),
         (35, 64, torch.bfloat16, "gaussws")]


class Block(nn.Module):
    """A residual chain of PQT layers of the given kinds."""

    def __init__(self, recompute, kinds):
        super().__init__()
        self.layers = nn.ModuleList(gaussws.PQTLinear(n_in, n_out, method=method, backend="triton", dtype=dtype,
                                                      recompute=recompute and dtype == torch.float32)
                                    for n_in, n_out, dtype, method in kinds)

    def forward(self, x):
        h = x
        for layer in self.layers:
            h = torch.nn.functional.gelu(layer(h.to(layer.weight.dtype)).float())
        return x + h


class Blocks(nn.Module):
    """Transformer-like: an nn.ModuleList of Blocks."""

    def __init__(self, n_blocks, recompute, kinds):
        super().__init__()
        self.blocks = nn.ModuleList(Block(recompute, kinds) for _ in range(n_blocks))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _net(n_blocks=2, recompute=True, kinds=KINDS):
    torch.manual_seed(0)
    net = Blocks(n_blocks, recompute, kinds)
    for layer in gaussws.pqt_layers(net):  # integer b_t: 2^(1 - b_t) exact on every path (see test_gaussws)
        layer.b_i.data = torch.randint(-2, 4, layer.b_i.shape).float() / 2
    return gaussws.set_noise_seed(net, 5)


def _train(net, batched, autocast, steps=(3, 4), micro=2, data_seed=0):
    xs = [torch.randn(6, 64, generator=torch.Generator().manual_seed(data_seed + k)) for k in range(micro)]
    outs = []
    for step in steps:
        with gaussws.TrainStep(net, step, batched=batched):
            for x in xs:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    y = net(x)
                outs.append(y.detach())
                (y.float().square().mean() + 0.1 * gaussws.bitwidth_loss(net)).backward()
    return outs


@pytest.mark.parametrize("recompute,autocast", [(True, True), (True, False), (False, False)])
def test_blocks_give_the_bits_of_one_layer_at_a_time(recompute, autocast):
    """Two steps of two micro-steps (the second step's gradients added to the first's): the same outputs, dL/dw
    and b_i.grad as each layer alone, with recompute_w_hat (w_hat made again in the backward) and without
    (here a layer is per micro-step because its block is: a BF16 layer that does not recompute rides along)."""
    nets = {batched: _net(recompute=recompute) for batched in (True, False)}
    if not recompute:  # the per-micro-step way without recompute is FSDP's; here forced for every layer
        for net in nets.values():
            for layer in gaussws.pqt_layers(net):
                layer.step_mode = lambda: False
    outs = {batched: _train(net, batched, autocast) for batched, net in nets.items()}
    for a, b in zip(outs[True], outs[False]):
        assert torch.equal(a, b)
    for (name, a), (_, b) in zip(nets[True].named_parameters(), nets[False].named_parameters()):
        assert a.grad is not None and torch.equal(a.grad, b.grad), name
    block = nets[True].blocks[0].layers[0].__dict__["_blocks"][1]
    assert len(block) == 2 * (2 if recompute else 3)  # per block its kinds; recompute: the BF16 layer's is a step's
    assert all(layer._micro is None for layer in gaussws.pqt_layers(nets[True]))


def test_a_block_skips_what_gets_no_gradient():
    """A layer whose output does not reach the loss, and a b_i that needs no gradient, get none; the others'
    are those of one layer at a time."""
    nets = {batched: _net(1) for batched in (True, False)}
    x = torch.randn(4, 64)
    for batched, net in nets.items():
        layers = gaussws.pqt_layers(net)
        layers[1].b_i.requires_grad_(False)
        with gaussws.TrainStep(net, 2, batched=batched):
            h = layers[1](layers[0](x))
            layers[2](x)  # computed, unused
            h.square().sum().backward()
    for (name, a), (_, b) in zip(nets[True].named_parameters(), nets[False].named_parameters()):
        assert (a.grad is None) == (b.grad is None) and (a.grad is None or torch.equal(a.grad, b.grad)), name
    layers = gaussws.pqt_layers(nets[True])
    assert layers[0].b_i.grad is not None and layers[1].b_i.grad is None and layers[2].weight.grad is None


@pytest.mark.parametrize("recompute", [True, False])
def test_layers_that_run_twice_in_a_forward_give_the_bits_of_one_layer_at_a_time(recompute):
    """Weights used twice in one forward (the block's second launch serves the second use): each use's Eq. 4 is
    there, as one layer at a time has it."""
    nets = {batched: _net(1, recompute=recompute) for batched in (True, False)}
    x = torch.randn(4, 64)
    for batched, net in nets.items():
        first, second = gaussws.pqt_layers(net)[:2]
        if not recompute:
            for layer in (first, second):
                layer.step_mode = lambda: False
        with gaussws.TrainStep(net, 2, batched=batched):
            second(first(second(first(x)).tanh())).square().sum().backward()
    for (name, a), (_, b) in zip(nets[True].named_parameters(), nets[False].named_parameters()):
        assert (a.grad is None) == (b.grad is None) and (a.grad is None or torch.equal(a.grad, b.grad)), name
    assert gaussws.pqt_layers(nets[True])[0].b_i.grad is not None


def _micro_step_launches(copies, pqt):
    """Launches of one forward and backward of a block of `copies` x KINDS layers (recompute), by the counter of
    tests/test_launch_count.py; pqt=False: the same net of nn.Linear (bf16's launches)."""
    kinds = [(64, 48, torch.float32, "gaussws"), (48, 64, torch.float32, "diffq")] * copies
    torch.manual_seed(0)
    net = Blocks(1, True, kinds)
    if not pqt:
        for block in net.blocks:
            for i, layer in enumerate(block.layers):
                block.layers[i] = nn.Linear(layer.in_features, layer.out_features)
    net = gaussws.set_noise_seed(net, 1)
    x = torch.randn(4, 64)
    counters = []
    for step in range(2):  # the first makes the blocks and their tables
        net.zero_grad(set_to_none=True)  # as after an optimizer step: no gradient to add to
        with gaussws.TrainStep(net, step), LaunchCounter() as counter, torch.autocast("cpu", dtype=torch.bfloat16):
            net(x).float().sum().backward()
        counters.append(counter)
    return counters[1]


def test_a_blocks_micro_step_launches_a_constant_over_bf16():
    """A block's forward and backward (recompute_w_hat) launch a constant number of kernels more than the same
    block of nn.Linear under BF16 autocast, whatever the number of its layers: per kind, Eq. 11 and 2^(1 - b_t)
    (cat, mul, add, rsub, exp2) and the one pass, in the forward and again in the backward, the table of Eq. 4
    and Eq. 4: 14. Per layer the same launches as bf16's (where a gradient is there already, autograd adds each
    b_i's to it, as each weight's)."""
    for copies in (1, 8):
        pqt, plain = _micro_step_launches(copies, True), _micro_step_launches(copies, False)
        assert pqt.torch - plain.torch == Counter({"cat": 4, "mul": 4, "add": 4, "rsub": 4, "exp2": 4, "copy_": 2})
        assert not plain.torch - pqt.torch, plain.torch - pqt.torch
        assert pqt.triton == Counter({"eq3_many_gaussws": 2, "eq3_many_diffq": 2, "eq4_many_gaussws": 1,
                                      "eq4_many_diffq": 1})
        assert pqt.total() - plain.total() == 2 * 14  # two kinds, 14 each


# --- FSDP2 on two processes (gloo, CPU): the block's launch inside the unshard, Eq. 4 before the reduce-scatter


def fsdp_worker(rank, world_size, init_file, out):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        grads = {}
        for batched in (True, False):
            net = _net(recompute=False, kinds=KINDS[:3] + [(35, 64, torch.float32, "gaussws")])  # one dtype a block
            for block in net.blocks:
                fully_shard(block)
            fully_shard(net)
            assert all(layer.weight.__class__.__name__ == "DTensor" for layer in gaussws.pqt_layers(net))
            _train(net, batched, autocast=True, data_seed=10 * rank)  # each rank its own micro-batches
            grads[batched] = {name: p.grad.full_tensor() for name, p in net.named_parameters()}
            if batched:
                plan = gaussws.pqt_layers(net)[0].__dict__["_blocks"][1]
                assert len(plan) == 2 * 3, [(len(b.layers), b.many.shapes) for b in plan]  # gaussws, diffq, unaligned
        if rank == 0:
            torch.save(grads, out)
    except BaseException:
        dist.destroy_process_group()
        raise
    end_spawned_rank()


def test_fsdp_blocks_give_the_bits_of_one_layer_at_a_time(tmp_path):
    """Under FSDP2 (fully_shard per block and the root) the per-micro-step layers' gradients, reduce-scattered
    and gathered, equal those of the layers one at a time: w_hat was made while the block's weights were whole,
    and Eq. 4 reached b_i.grad before FSDP reduced it."""
    import torch.multiprocessing as mp
    assert os.environ.get("TRITON_INTERPRET") == "1"  # conftest sets it; the workers inherit it
    mp.spawn(fsdp_worker, args=(2, str(tmp_path / "init"), str(tmp_path / "grads.pt")), nprocs=2, join=True)
    grads = torch.load(tmp_path / "grads.pt", weights_only=True)
    assert grads[True].keys() == grads[False].keys() and any(k.endswith("b_i") for k in grads[True])
    for name in grads[True]:
        assert torch.equal(grads[True][name], grads[False][name]), name
