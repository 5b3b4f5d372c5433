"""A PQT step launches a constant number of kernels, whatever the number of PQT Linears.

On a GPU the cost of the method's per-step work is the host's calls that launch it (docs/GPU.md). This is
counted without one, on the Triton backend's path (the one a GPU takes), with CPU tensors and Triton's
interpreter: benchmarks.host.LaunchCounter counts the PyTorch ops that would launch a GPU kernel (every op
but views, empty tensors and metadata) and the Triton launches (kernels.triton_noise._launch, which every
Triton kernel goes through). Nets of 2 and 24 PQT Linears of the same two kinds (FP32 gaussws with 8 | n,
BF16 diffq with words of R across rows) must make the same launches in TrainStep's begin and end.
"""
from collections import Counter

import torch
import torch.nn as nn

import gaussws
from benchmarks.host import LaunchCounter, count_step

# (out, in, weight dtype, method) of the two kinds: each a _Batch of its own
KINDS = [(64, 48, torch.float32, "gaussws"), (33, 65, torch.bfloat16, "diffq")]
LAUNCHES_PER_KIND = 9  # begin: seeds to the device, cat, mul, add, rsub, exp2, eq3; end: the table, eq4


def _net(copies):
    torch.manual_seed(0)
    layers = []
    for _ in range(copies):
        for out, inp, dtype, method in KINDS:
            layers.append(gaussws.PQTLinear(inp, out, method=method, backend="triton", dtype=dtype))
    return gaussws.set_noise_seed(nn.Sequential(*layers), 1)


def test_begin_and_end_make_the_same_launches_for_2_and_24_linears():
    small, large = count_step(_net(1), 5, batched=True), count_step(_net(12), 5, batched=True)
    assert small.torch == large.torch and small.triton == large.triton, (small.torch, large.torch)
    assert dict(small.triton) == {"eq3_many_gaussws": 1, "eq3_many_diffq_unaligned": 1,
                                  "eq4_many_gaussws": 1, "eq4_many_diffq": 1}
    assert small.total() == LAUNCHES_PER_KIND * len(KINDS), (small.torch, small.triton)


def test_one_layer_at_a_time_launches_grow_with_the_layers():
    """The counter sees every launch of the per-layer path, which the batches replace: the same for every
    copy of a layer (35 for the two kinds here, 17.5 a Linear)."""
    small, large = count_step(_net(1), 5, batched=False), count_step(_net(12), 5, batched=False)
    assert large.torch == Counter({op: 12 * k for op, k in small.torch.items()})
    assert large.triton == Counter({v: 12 * k for v, k in small.triton.items()}) and small.total() == 35


def test_the_forward_and_backward_launch_less_than_bf16s():
    """Under BF16 autocast a plain Linear casts its FP32 weight to BF16 in every forward; a PQT Linear's w_hat
    is BF16 already: one launch fewer per Linear and micro-step, the rest the same (the backward's cast of
    dL/dw_hat to FP32 is bf16's cast back through autocast)."""
    def count(net, pqt):
        x = torch.randn(4, 48)
        step = gaussws.TrainStep(net, 0).begin() if pqt else None
        with LaunchCounter() as counter, torch.autocast("cpu", dtype=torch.bfloat16):
            net(x).float().sum().backward()
        if step is not None:
            step.end()
        return counter.total()

    for copies in (1, 12):
        dims = [48] + [64, 48] * copies
        plain = nn.Sequential(*(nn.Linear(a, b) for a, b in zip(dims, dims[1:])))
        pqt = nn.Sequential(*(gaussws.PQTLinear(a, b, backend="triton") for a, b in zip(dims, dims[1:])))
        assert count(pqt, True) == count(plain, False) - 2 * copies


def test_the_seeds_of_per_micro_step_layers_take_one_copy_a_step():
    """Layers that make w_hat in every forward (recompute_w_hat, FSDP) read their step seed from their weight's
    device: TrainStep's begin sets every one with one copy from the host, whatever their number, and each
    layer's noise_seed is then its _step_seed, a view on that device (the kernels read it; the host does not)."""
    for copies in (1, 12):
        torch.manual_seed(0)
        net = gaussws.set_noise_seed(nn.Sequential(*(gaussws.PQTLinear(48, 48, backend="triton", recompute=True)
                                                     for _ in range(2 * copies))), 1)
        gaussws.TrainStep(net, 4).begin().end()  # the seeds' buffers made, untimed
        step = gaussws.TrainStep(net, 5)
        with LaunchCounter() as counter:
            step.begin()
            step.end()
        assert counter.torch == Counter({"copy_": 1}) and not counter.triton
        for layer in gaussws.pqt_layers(net):
            assert layer.noise_seed.device == layer.weight.device and layer.noise_seed.dim() == 0
            assert int(layer.noise_seed) == gaussws._step_seed(layer.layer_seed, 5)
