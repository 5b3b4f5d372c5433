"""Bit budgets: which format each 32x32 block, or which GGML type each tensor, takes at a mean number of bits
per weight, and the b_t level a PQT phase trains at before such a choice. One place for every allocation:

    ids = budget.budget_format_ids("auto-int", weights, b_t, 3.5)   # int2/int3/int4 per 32x32 block
    types = budget.gguf_types("auto-gguf", weights, 4.27, b_t=...)   # one GGML type per tensor
    b_t = budget.matched_b_t(E_R2, "q4_k")    # the level whose PQN has q4_k's rounding error (Eq. 3)
    b_t = budget.budget_level(E_R2, 3.5, "auto-int")   # a budget's level, between its formats' levels

The budgets' names are formats.py's (INT_BUDGETS, GGUF_BUDGETS). Both allocators upgrade items greedily
(greedy_upgrades) in the order of what an upgrade buys per bit it costs: auto-* by the learned b_t, error-*
by the weight's own (imatrix-weighted, for GGUF) rounding error. A run chooses at its switch (ste.py) and
saves the choice beside each weight; export.py writes what the run trained on (trained_formats,
trained_ggml_types) or, for a block budget without one, allocates afresh with the same function.
"""
import functools
import math

import numpy as np
import torch

from kernels import BL
from kernels.torch_noise import block_absmax
from quant.formats import (BUDGET_TARGETS, BY_NAME, FORMATS, GGML_FORMATS, GGUF_BUDGETS, INT_BUDGETS, block_weights,
                           dequantize_blocks, quantize_blocks, to_blocks)
from quant.grids import LATTICE_BLOCK, LATTICE_FORMATS, check_format, fake_quantize, ggml
from util import UserError

# What a GGUF budget mixes, in the order of their bits per weight (scales included: ggml_quants.bits_per_weight).
# iq4_xs has fewer bits than q4_k (super-blocks of 256 as q4_k's, 6-bit scales and no mins) and 6 % more rounding
# error on Gaussian weights (rounding_error); iq4_nl has q4_k's bits and q4_0's (which a budget does not mix), 4.8 %
# more error than q4_k and 22 % less than q4_0. Of two types of equal bits a ladder keeps the first (budget_ladder):
# a tensor q4_k fits takes q4_k, and iq4_nl is the 4.5-bit step of a width that is a multiple of 32, not of 256.
GGUF_BUDGET_TYPES = ("q2_k", "q3_k", "iq4_xs", "q4_k", "iq4_nl", "q5_k", "q6_k", "q8_0")
BUDGET_FORMATS = ("int2", "int3", "int4")  # what a block budget mixes, one bit apart
IMATRIX_STEPS = 16  # error-gguf: optimizer steps before the switch whose input activations weight the error
UNCHOSEN = 255  # format_ids and ggml_type before the budget chose them (no format or GGML type has this id)
# What a layer's formats add to its state dict (ste.BlockFormats): the choice a run saves, error-gguf's imatrix
FORMAT_STATE = (".format_ids", ".ggml_type", ".imatrix")


class BudgetError(UserError, ValueError):
    """A checkpoint's budget choice that cannot be exported as asked: the message is one line."""


# --- what a budget can be: its bits, a method that ranks, widths its types hold ---------------------

def check_budget(fmt, bits_per_weight, method, switch=None):
    """A bit budget to train toward: fmt one of BUDGET_TARGETS, bits_per_weight in [2, 4] for the int
    budgets or from the cheapest to the dearest of GGUF_BUDGET_TYPES' bits per weight for the GGUF ones,
    for auto-* a method that learns b_t (not ste), and for error-gguf a switch (the step the budget is
    chosen at, when given) after step 0, so that input activations were seen. Raises ValueError (one line) otherwise."""
    if fmt not in BUDGET_TARGETS:
        raise ValueError(f"target format {fmt!r} is not a bit budget: expected {' or '.join(INT_BUDGETS)}, which "
                         f"mix int2/int3/int4 per block, or {' or '.join(GGUF_BUDGETS)}, one GGML type per tensor, "
                         f"at --bits_per_weight")
    if fmt in INT_BUDGETS and not 2 <= bits_per_weight <= 4:
        raise ValueError(f"bits_per_weight={bits_per_weight:g}: expected a mean of 2 to 4 element bits per weight "
                         f"(int2 to int4) for target_format={fmt!r}")
    if fmt in GGUF_BUDGETS:
        first, last = (GGML_FORMATS[t] for t in (GGUF_BUDGET_TYPES[0], GGUF_BUDGET_TYPES[-1]))
        lo, hi = ggml().bits_per_weight(first), ggml().bits_per_weight(last)
        if not lo <= bits_per_weight <= hi:
            raise ValueError(f"bits_per_weight={bits_per_weight:g}: expected {lo:g} (every tensor {first}) to {hi:g} "
                             f"(every tensor {last}) bits per weight, scales included, for target_format={fmt!r}")
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
    32 weights or 256 (the K-quants, iq4_xs); a GGUF budget needs 32 (iq4_nl and q8_0, the types it mixes
    whose blocks are 32), and enough bits for every tensor's cheapest type. shapes: {module path: (out, in)}."""
    if fmt not in GGML_FORMATS and fmt not in GGUF_BUDGETS and fmt not in LATTICE_FORMATS:
        return
    blocks = fmt in GGML_FORMATS or fmt in LATTICE_FORMATS  # a type whose blocks run along rows
    need = ggml().block_size(GGML_FORMATS[fmt]) if fmt in GGML_FORMATS else LATTICE_BLOCK if blocks else 32
    bad = [(name, shape[1]) for name, shape in shapes.items() if shape[1] % need]
    if bad:
        (name, width), more = bad[0], f" (and {len(bad) - 1} more Linears)" if len(bad) > 1 else ""
        if width % 32 == 0:
            works = f"use input widths that are multiples of {need}, or q4_0, q8_0 or mxfp4_row (blocks of 32)"
        else:  # neither does a 32-weight type: the advice is the type's own block, or another kind of format
            works = (f"use input widths (n_embd, ffn_hidden) that are multiples of {need}, or one of our 32x32-block "
                     f"formats (int4, mxfp4, ...), which take any width")
        what = f"{fmt}'s blocks are {need} weights of a row" if blocks else \
            f"{fmt} mixes GGML types whose blocks are 32 or 256 weights of a row"
        raise ValueError(f"{name} has input width {width}{more}, which target_format={fmt!r} cannot hold ({what}): "
                         f"{works}")
    if fmt in GGUF_BUDGETS and shapes:
        bits = {name: budget_ladder(shape[1])[0][1] for name, shape in shapes.items()}
        total = sum(out * width for out, width in shapes.values())
        least = sum(bits[name] * out * width for name, (out, width) in shapes.items()) / total
        if bits_per_weight < least:
            cheapest = [GGML_FORMATS[budget_ladder(width)[0][0]] for width in (256, 32)]
            raise ValueError(f"bits_per_weight={bits_per_weight:g} is below what these Linears can take at the "
                             f"least, {least:.4g} bits per weight ({cheapest[0]}, or {cheapest[1]} where the input "
                             f"width is not a multiple of 256): raise bits_per_weight, or use widths that are "
                             f"multiples of 256")


# --- the allocators: int2/int3/int4 per 32x32 block, one GGML type per tensor -----------------

def greedy_upgrades(priority, cost, allowance):
    """How many upgrades each item takes: item i's upgrade j (from its level j to j + 1) has priority
    priority[i, j] and costs cost[i, j] (-inf and inf where an item has fewer upgrades). Upgrades are
    made in descending priority (ties: item order, then upgrade order) while their cost fits what is
    left of `allowance`, skipping those that do not fit; an item's upgrade never ranks above one before
    it (its priority is the running minimum along the item's upgrades), nor is made without it.
    Returns the levels (a long tensor, one per item)."""
    k, u = priority.shape
    priority = priority.double().cummin(dim=1).values.flatten()
    order = torch.argsort(priority, descending=True, stable=True).tolist()
    cost, levels, left = cost.double().flatten().tolist(), [0] * k, float(allowance)
    for i in order:
        item = i // u
        if levels[item] == i % u and cost[i] <= left:
            levels[item] += 1
            left -= cost[i]
    return torch.tensor(levels)


def budget_bits(priority, weights, budget):
    """Element bits of each block for a mean of `budget` bits per weight (weights: how many each block
    holds). Every block starts at 2 bits; one-bit upgrades, priority[:, 0] for 2 -> 3 and [:, 1] for
    3 -> 4, are made by greedy_upgrades (descending priority, ties: block order) while the bits they
    add fit the budget, skipping those that do not fit (a whole block after an edge one). A block's
    second upgrade never ranks above its first, nor is made without it."""
    weights = weights.double()
    return 2 + greedy_upgrades(priority, weights[:, None].expand(-1, 2), (budget - 2) * weights.sum().item())


def budget_format_ids(fmt_name, weights, b_t, budget):
    """{layer: format ids} of int2/int3/int4 at a mean of `budget` element bits per weight over all the
    layers' blocks together (weights: {layer: weight}), the blocks ranked
      - auto-int: by their learned b_t, each upgrade by b_t - bits, the bits it lacks by its own b_t;
      - error-int: by their own quantization error (a PTQ heuristic for any run), each upgrade by the
        drop in the block's squared error it buys, per bit it costs."""
    layers = list(weights)
    counts = torch.cat([block_weights(*weights[k].shape).flatten() for k in layers])
    if fmt_name == "auto-int":
        if any(k not in b_t for k in layers):
            raise ValueError("auto-int at a bit budget ranks blocks by their learned b_t, and these layers have "
                             "none (no PQT): use error-int, which ranks them by their own error")
        learned = torch.cat([b_t[k].flatten() for k in layers])[:, None]
        priority = learned - torch.tensor([2.0, 3.0], dtype=torch.float64)
    else:
        errors = []
        for k in layers:
            blocks = to_blocks(weights[k].detach().float().cpu().double())
            fmts = [FORMATS[BY_NAME[f]] for f in BUDGET_FORMATS]
            errors.append(torch.stack([(dequantize_blocks(*quantize_blocks(blocks, f), f) - blocks).square().sum(1)
                                       for f in fmts], dim=1))
        error = torch.cat(errors)
        priority = (error[:, :-1] - error[:, 1:]) / counts[:, None]
    candidates = torch.tensor([BY_NAME[f] for f in BUDGET_FORMATS], dtype=torch.uint8)
    ids = candidates[budget_bits(priority, counts, budget) - 2]
    sizes = [block_weights(*weights[k].shape).shape for k in layers]
    return {k: part.view(size) for k, part, size in zip(layers, ids.split([a * b for a, b in sizes]), sizes)}


def budget_ladder(width):
    """[(type name, bits per weight)] of GGUF_BUDGET_TYPES a row of `width` weights can be, in bits order, each
    step more bits than the one below (of two types of equal bits, the first)."""
    G = ggml()
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
    greedy_upgrades, the upgrades ranked by the drop in the layer's proxy error they buy per
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


# --- the b_t level a PQT phase trains at: matched to a format's rounding error ------------------

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
    if check_format(name) in GGML_FORMATS or name in LATTICE_FORMATS:
        n, shape = TILE * TILE, (TILE, TILE)
        i = _fixed_order(n).double()
    else:
        n, shape = BL * BL, (BL, BL)
        i = torch.arange(n, dtype=torch.float64)
    w = torch.special.ndtri((i + 0.5) / n).float().view(shape)
    scale = block_absmax(w).double().repeat_interleave(BL, 0).repeat_interleave(BL, 1)
    return ((fake_quantize(w, name).double() - w.double()).square() / scale.square()).mean().item()


@functools.lru_cache(maxsize=None)
def matched_b_t(second_moment, name):
    """The b_t at which Eq. 3's PQN, of noise R with E[R^2] = second_moment (gaussws.R_SECOND_MOMENT of the
    method), has the variance of format `name`'s rounding error, both relative to max_bl(|w|)^2:
    E[R^2] * 4^(1 - b_t) = r,  so  b_t = 1 + log2(E[R^2] / r) / 2.

    r is rounding_error's, measured with the STE's own grid (grids.fake_quantize) on quantiles of
    N(0, 1) (weights as initialised; no draw, so the level is a constant, rounded to 0.01): a 32x32
    block of them for our formats, a 256x256 tile in a fixed pseudo-random order for llama.cpp's
    (GGML) types, whose blocks run along rows. For int-b the rounding error is close to uniform on one
    step max_bl / L (L = 2^(b-1) - 1) whatever the weights, r = 1 / (12 L^2), which gives b_t = log2(L)
    + log2(48 E[R^2]) / 2: for gaussws int3 3.49, int4 4.71 (diffq 2.58, 3.81); int2, whose step is the
    whole block max, is where the two part most. For the MX formats r depends on how the weights fill
    each binade, and for the GGML types on their 32- or 16-weight sub-block scales, hence the
    measurement. gaussws (diffq): q2_k 3.73 (2.83), q3_k 4.63 (3.73), q4_0 5.42 (4.52), q4_k 5.63
    (4.73), q5_k 6.64 (5.73), q6_k 7.66 (6.75), q8_0 9.43 (8.52), mxfp4_row 5.00 (4.10), iq4_xs 5.59
    (4.68), iq4_nl 5.60 (4.69): a row block's scale follows its own 32 (or 16) weights, so the error
    relative to the 32x32 block max falls below that of int-b at the same code bits (int4 4.71).
    """
    return round(1 + 0.5 * math.log2(second_moment / rounding_error(name)), 2)


def budget_level(second_moment, bits, fmt="auto-int"):
    """The b_t level of a bit budget of `bits` bits per weight, linear in bits between the matched_b_t
    of the two formats it mixes around it (our choice): for the int budgets int<b> at b element bits;
    for the GGUF ones (fmt auto-gguf, error-gguf) the types of a K-quant row's ladder (budget_ladder(256):
    every type of GGUF_BUDGET_TYPES but iq4_nl, which has q4_k's bits) at their bits per weight, scales
    included (q2_k's level at 2.625, q3_k's at 3.4375, iq4_xs's at 4.25, ...). second_moment: as matched_b_t's."""
    if fmt in GGUF_BUDGETS:
        points = [(b, t) for t, b in budget_ladder(256)]
    else:
        points = [(b, f"int{b}") for b in (2, 3, 4)]
    i = max(1, min(len(points) - 1, next((i for i, (b, _) in enumerate(points) if b > bits), len(points))))
    (low, a), (high, b) = points[i - 1], points[i]
    a, b = matched_b_t(second_moment, a), matched_b_t(second_moment, b)
    return round(a + (bits - low) / (high - low) * (b - a), 2)


# --- what a run chose at its switch, saved beside each weight: what export.py writes -----------

def trained_formats(state_dict, pqt, quantized, fmt_name, budget):
    """{layer: format ids} a run trained on (STE at a bit budget: the format_ids saved beside each
    weight, chosen at its switch), when they are what --format at --bits_per_weight asks for: the run's
    own target_format and bits_per_weight, every quantized layer holding its chosen ids. Else None: the
    budget is allocated afresh (budget_format_ids) from the checkpoint's weights and b_t."""
    ids = {k[:-len(".format_ids")]: v for k, v in state_dict.items() if k.endswith(".format_ids")}
    if (fmt_name, budget) != (pqt.get("target_format"), pqt.get("bits_per_weight")) or set(ids) != set(quantized):
        return None
    if any((v == UNCHOSEN).any() for v in ids.values()):
        return None  # saved before the switch: the run has not chosen them yet
    return {k: ids[k].to(torch.uint8) for k in quantized}


def trained_ggml_types(state_dict, pqt, quantized, fmt_name, budget):
    """{layer: GGML type name} a run trained on at a bit budget of one type per weight (auto-gguf,
    error-gguf): the type saved beside each weight (<layer>.ggml_type, gguf's GGMLQuantizationType value,
    UNCHOSEN before its switch), when the run trained --format at --bits_per_weight. Else BudgetError:
    what to train (the types are chosen in training, from what export has no more: b_t's history, the
    activations)."""
    asked = f"--format={fmt_name} --bits_per_weight={budget:g} writes the GGML type each weight trained on"
    found = {}
    for k, v in state_dict.items():
        if k.endswith(".ggml_type"):
            if v.dtype != torch.uint8 or v.numel() != 1:  # int(10.5) would be Q2_K's 10
                raise BudgetError(f"{asked}, and {k} is {v.tolist()} ({v.dtype}), not the one uint8 GGML type id "
                                  f"train.py saves: the checkpoint is damaged or foreign")
            found[k[:-len(".ggml_type")]] = int(v)
    target, trained_budget = pqt.get("target_format"), pqt.get("bits_per_weight")
    if target in GGUF_BUDGETS and (target, trained_budget) != (fmt_name, budget):
        raise BudgetError(f"{asked}, and this run trained {target} at {trained_budget:g} bits per weight: export it "
                          f"with --format={target} --bits_per_weight={trained_budget!r}")
    missing = [k for k in quantized if k not in found]
    if target != fmt_name or missing:
        raise BudgetError(f"{asked}, and {'this run' if target != fmt_name else missing[0]} trained none (method "
                          f"{pqt.get('method')!r}, target_format {target or 'none'!r}): train a run with "
                          f"--target_format={fmt_name} --bits_per_weight={budget:g}, or export one type for every "
                          f"weight (--format={', '.join(GGML_FORMATS)})")
    unchosen = [k for k in quantized if found[k] == UNCHOSEN]
    if unchosen:
        raise BudgetError(f"{asked}, and this checkpoint was saved before the run chose them (step "
                          f"{pqt.get('ste_start') or pqt.get('pqt_start'):.0f}; {unchosen[0]}.ggml_type unchosen): "
                          f"export a later checkpoint of the run")
    known = {int(ggml().ggml_type(t)): t for t in GGML_FORMATS.values()}
    odd = [k for k in quantized if found[k] not in known]
    if odd:
        raise BudgetError(f"{odd[0]}.ggml_type is {found[odd[0]]}, none of llama.cpp's types export writes "
                          f"({', '.join(f'{t} {v}' for v, t in known.items())}): the checkpoint is damaged or foreign")
    numel = {k: state_dict[k + ".weight"].numel() for k in quantized}
    bits = sum(ggml().bits_per_weight(known[found[k]]) * n for k, n in numel.items()) / sum(numel.values())
    if bits > budget + 1e-9:  # the choice spends at most the budget (gguf_types)
        raise BudgetError(f"{asked}, and the types this checkpoint records hold {bits:.4f} bits per weight, more than "
                          f"the budget: its ggml_type buffers were changed after training; export a checkpoint of "
                          f"the run as train.py saved it")
    return {k: known[found[k]] for k in quantized}
