"""The one-pass kernels give the bits of the per-layer kernels they replace (Triton's interpreter, CPU).

eq3 reads w once and makes what block_absmax, gen and apply made in three passes (and the scale between
them): max_bl(|w|), R as gen stores it, and BF16 w_hat. Many's eq3 does that for many weights in one
launch, and its eq4 writes into each b_i.grad what autograd wrote through the per-layer scale: the block
sums of _block_sums_kernel, then Eq. 4's chain. Each is checked bit for bit against the per-layer kernels
(themselves checked against the PyTorch twin and the paper's equations, tests/test_kernels.py,
tests/test_gaussws.py), on aligned, unaligned and partial-block shapes, FP32 and BF16 weights, gaussws
and diffq.
"""
import pytest
import torch

from kernels import torch_noise, triton_noise

SEEDS = [0, 2**40 + 3, 2**63 - 1]


def _bits(t):
    return t.view({torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}.get(
        t.dtype, t.dtype))


def _weight(shape, dtype, gen):
    w = (torch.randn(shape, generator=gen) * 0.02).to(dtype)
    w[0, -1] = 0.25  # one block's maximum far above the rest
    return w


def _e(nbm, nbn, gen):
    return torch.exp2(1.0 - (2 + 8 * torch.rand(nbm, nbn, generator=gen)))


@pytest.mark.parametrize("method", ["gaussws", "diffq"])
@pytest.mark.parametrize("shape", [(1, 1), (33, 65), (70, 40), (40, 48), (35, 131), (32, 6), (3, 4100)])
def test_one_pass_gives_the_bits_of_block_maxima_gen_and_apply(method, shape):
    m, n = shape
    gen = torch.Generator().manual_seed(m * 1000 + n)
    for seed, dtype in zip(SEEDS, (torch.float32, torch.bfloat16, torch.float16)):
        w = _weight(shape, dtype, gen)
        e = _e(-(-m // 32), -(-n // 32), gen)
        w_hat, r_store, max_bl = triton_noise.eq3(w, e, seed, method)
        want_max = torch_noise.block_absmax(w)
        want_r = triton_noise.gen(m * n, seed, method, "cpu")
        want = triton_noise.apply(w, want_r, want_max * e, method)
        assert torch.equal(_bits(max_bl), _bits(want_max)), (seed, dtype)
        assert torch.equal(_bits(r_store), _bits(want_r)), (seed, dtype)
        assert torch.equal(_bits(w_hat), _bits(want)), (seed, dtype)


# inf * 0 is the NaN this test wants; Triton's interpreter computes it in numpy, which warns of it
@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")
def test_one_pass_propagates_nan_and_inf_as_torch_does():
    """A NaN weight makes its block's max_bl NaN (torch.amax propagates it) and so its w_hat; an inf max
    makes inf * 0 = NaN where R = 0: the bits of block_absmax and apply, whatever their order in the tile."""
    w = torch.randn(64, 128) * 0.02
    w[3, 5], w[40, 100], w[33, 2] = float("nan"), float("inf"), -float("inf")
    e = torch.full((2, 4), 2.0**-5)
    w_hat, r_store, max_bl = triton_noise.eq3(w, e, 9, "gaussws")
    want_max = torch_noise.block_absmax(w)
    assert torch.equal(_bits(max_bl), _bits(want_max)) and max_bl[0, 0].isnan() and max_bl[1, 3].isinf()
    assert torch.equal(_bits(w_hat), _bits(triton_noise.apply(w, r_store, want_max * e, "gaussws")))


# Layers of one launch share a many_key: the weights' dtype, the method, how R is drawn and the hints.
KINDS = {
    "gaussws FP32, 8 | n": ("gaussws", torch.float32, [(64, 48), (32, 80), (48, 112), (96, 48)]),
    "gaussws BF16, words straddle rows": ("gaussws", torch.bfloat16, [(33, 65), (70, 37), (5, 11), (40, 13)]),
    "diffq FP32, 4 | n": ("diffq", torch.float32, [(33, 36), (70, 100), (5, 44)]),
    "diffq BF16, 4 does not divide n": ("diffq", torch.bfloat16, [(33, 65), (70, 37), (1, 9)]),
}


def _eq4_reference(g, r_store, max_bl, b_i, c, b_target, method, old=None):
    """b_i.grad as the per-layer step made it: _block_sums_kernel's sums backpropagated by autograd through
    scale_bl = max_bl * exp2(1 - (b_target + b_i * c)), into a gradient `old` where there is one."""
    b_i = b_i.detach().clone().requires_grad_()
    if old is not None:
        b_i.grad = old.clone()
    scale = max_bl * torch.exp2(1.0 - (b_target + b_i * c).float())
    torch.autograd.backward([scale], [triton_noise.block_sums(g, r_store, method)])
    return b_i.grad


@pytest.mark.parametrize("kind", list(KINDS))
def test_many_weights_in_one_launch_get_each_layers_bits(kind):
    method, dtype, shapes = KINDS[kind]
    gen = torch.Generator().manual_seed(len(kind))
    weights = [_weight(s, dtype, gen) for s in shapes]
    many = triton_noise.Many(weights, method)
    b_init, b_target = 6.0, 4.0
    b_i = [torch.rand(-(-m // 32), -(-n // 32), generator=gen) * 2 - 0.5 for m, n in shapes]
    # e of each layer as the per-layer step computed it; flat, as the batch hands it over
    e = [torch.exp2(1.0 - (b_target + b * (b_init - b_target)).float()) for b in b_i]
    seeds = torch.tensor([1, 2**62 + 5, 77, 2**63 - 1][:len(shapes)], dtype=torch.int64)
    w_hat, r_store = many.eq3(weights, seeds, torch.cat([x.view(-1) for x in e]))
    maxima = many.max_bl.split([b.numel() for b in b_i])
    for i, w in enumerate(weights):
        m, n = shapes[i]
        want_w_hat, want_r, want_max = triton_noise.eq3(w, e[i], int(seeds[i]), method)
        assert torch.equal(_bits(w_hat[i]), _bits(want_w_hat)) and torch.equal(_bits(r_store[i]), _bits(want_r))
        assert torch.equal(maxima[i].view(want_max.shape), want_max)
    # Eq. 4: the first layer gets no gradient (SKIP), the second adds to one already there (ADD)
    grads = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    targets = [torch.full(b.shape, float("nan")) for b in b_i]
    targets[1] = torch.randn(b_i[1].shape, generator=gen)
    before = targets[1].clone()
    modes = [triton_noise.SKIP.value, triton_noise.ADD.value] + [triton_noise.STORE.value] * (len(shapes) - 2)
    step = torch.tensor([(g.data_ptr(), t.data_ptr(), mode) for g, t, mode in zip(grads, targets, modes)])
    many.eq4(step, b_init - b_target)
    assert targets[0].isnan().all()  # untouched
    for i in range(1, len(shapes)):
        _, want_r, want_max = triton_noise.eq3(weights[i], e[i], int(seeds[i]), method)
        want = _eq4_reference(grads[i], want_r, want_max, b_i[i], b_init - b_target, b_target, method,
                              old=before if i == 1 else None)
        assert torch.equal(_bits(targets[i]), _bits(want)), i


def test_many_refuses_weights_of_different_kinds_and_a_changed_weight():
    with pytest.raises(ValueError, match="many_key"):
        triton_noise.Many([torch.zeros(64, 48), torch.zeros(64, 48, dtype=torch.bfloat16)], "gaussws")
    w = torch.zeros(64, 48)
    many = triton_noise.Many([w], "gaussws")
    with pytest.raises(ValueError, match="changed"):
        many.eq3([torch.zeros(64, 48).t().contiguous().t()], torch.zeros(1, dtype=torch.int64), torch.ones(4))
