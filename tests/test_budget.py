"""export.py's bit budget (--bits_per_weight): int2/int3/int4 per block at a mean number of element bits,
ranked by the learned b_t (auto-int) or by each block's own quantization error (error-int)."""
import itertools
import json
import os

import numpy as np
import pytest
import torch

import export as E
import util
from files import lowbit
from model import GPT, ModelConfig
from quant import budget, formats

ARGS = dict(arch="gpt2", n_layer=1, n_head=2, n_embd=64, vocab_size=256, block_size=32, bias=True)


def greedy_total(priority, bits):
    """The sum of the priorities of the upgrades a block assignment holds."""
    return sum(priority[j, :b - 2].sum().item() for j, b in enumerate(bits))


def test_budget_bits_takes_the_best_upgrades_that_fit():
    """Against every assignment of 2-4 bits to six equal blocks that spends as many bits: the greedy one
    holds the largest sum of priorities (decreasing per block: a separable concave objective), and it
    spends all the budget allows."""
    gen = torch.Generator().manual_seed(0)
    weights = torch.full((6,), 1024.0)
    for _ in range(20):
        b_t = 2 + 3 * torch.rand(6, generator=gen, dtype=torch.float64)
        priority = b_t[:, None] - torch.tensor([2.0, 3.0], dtype=torch.float64)
        for allowed in (2.0, 2.5, 3.0, 3.25, 4.0):
            bits = budget.budget_bits(priority, weights, allowed)
            assert (bits * weights).sum() <= allowed * weights.sum() and bits.min() >= 2 and bits.max() <= 4
            assert bits.sum() == min(24, 12 + int((allowed - 2) * 6))
            best = max(greedy_total(priority, c) for c in itertools.product((2, 3, 4), repeat=6)
                       if sum(c) == bits.sum())
            assert greedy_total(priority, bits.tolist()) == pytest.approx(best)
    by_hand = torch.tensor([[3.0, 2.0], [0.1, -0.9], [1.6, 0.6], [0.9, -0.1]], dtype=torch.float64)
    assert budget.budget_bits(by_hand, torch.full((4,), 1024.0), 3.0).tolist() == [4, 2, 3, 3]
    assert budget.budget_bits(by_hand, torch.full((4,), 1024.0), 2.5).tolist() == [4, 2, 2, 2]
    # edge blocks hold fewer weights: an upgrade that does not fit is passed over for smaller ones that do
    b_t = torch.tensor([2.5, 4.5, 3.2, 4.9, 2.1], dtype=torch.float64)
    sizes = torch.tensor([1024.0, 1024, 512, 1024, 256])  # budget (3 - 2) * 3840 = 3840 bits of upgrades:
    bits = budget.budget_bits(b_t[:, None] - torch.tensor([2.0, 3.0], dtype=torch.float64), sizes, 3.0)
    assert bits.tolist() == [2, 3, 3, 4, 3]  # 4.9 twice, 4.5, 3.2, 2.1: 2048 + 1024 + 512 + 256 = 3840


def test_error_int_minimises_the_total_squared_error_at_the_budget():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(1))
    w[:32] *= torch.linspace(0.1, 3.0, 96)  # blocks of unlike spread
    chosen = budget.budget_format_ids("error-int", {"w": w}, {}, 3.0)["w"]
    blocks = formats.to_blocks(w.double())

    def error(bits):  # the total squared error of int<b> per block, by brute force
        total = 0.0
        for block, b in zip(blocks, bits):
            fmt = lowbit.FORMATS[lowbit.BY_NAME[f"int{b}"]]
            back = formats.dequantize_blocks(*formats.quantize_blocks(block[None], fmt), fmt)
            total += (back - block).square().sum().item()
        return total
    got = [int(lowbit.FORMATS[i].name[3:]) for i in chosen.flatten().tolist()]
    best = min(error(c) for c in itertools.product((2, 3, 4), repeat=6) if sum(c) <= 3 * 6)
    assert sum(got) == 18 and error(got) == pytest.approx(best)


def checkpoint(out_dir, data_dir, b_t=True):
    """A one-block GPT2's checkpoint, every block Linear with b_i (b_t in [2, 5]) unless b_t=False."""
    torch.manual_seed(0)
    sd = GPT(ModelConfig(**ARGS)).state_dict()
    gen = torch.Generator().manual_seed(2)
    for key in [k for k in sd if k.startswith("transformer.h.") and k.endswith(".weight") and sd[k].dim() == 2]:
        if b_t:
            shape = (-(-sd[key].shape[0] // 32), -(-sd[key].shape[1] // 32))
            sd[key[:-7] + ".b_i"] = ((2 + 3 * torch.rand(shape, generator=gen) - 4.0) / 2.0)
    pqt = dict(method="gaussws[all]" if b_t else "bf16", b_init=6.0, b_target=4.0)
    os.makedirs(out_dir, exist_ok=True)
    torch.save(dict(model=sd, optimizer=[], model_args=dict(ARGS), iter_num=1, best_val_loss=9.0, pqt=pqt,
                    config=dict(dataset=data_dir, seed=1, batch_size=2, eval_iters=1, dtype="float32")),
               os.path.join(out_dir, "ckpt.pt"))
    return sd


@pytest.fixture
def data_dir(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    ids = np.random.default_rng(0).integers(0, 256, 4000).astype(np.uint16)
    ids[:3600].tofile(d / "train.bin")
    ids[3600:].tofile(d / "val.bin")
    (d / "meta.json").write_text(json.dumps({"vocab_size": 256, "tokenizer": "bytes", "dtype": "uint16"}))
    return str(d)


def test_auto_int_at_a_budget_gives_more_bits_to_blocks_of_higher_b_t(data_dir, tmp_path, capsys):
    sd = checkpoint(tmp_path, data_dir)
    rc = util.cli(E.main, [f"--out_dir={tmp_path}", "--format=auto-int,error-int", "--bits_per_weight=3.0",
                f"--json={tmp_path / 'export.json'}", "--plot=False"])
    assert rc == 0
    exports = {r["format"]: r for r in json.loads((tmp_path / "export.json").read_text())["exports"]}
    for name in ("auto-int", "error-int"):  # error-int: Gaussian blocks alike, so int3 for all is its optimum
        share = exports[name]["share"]
        assert set(share) <= {"int2", "int3", "int4"} and len(share) == (3 if name == "auto-int" else 1)
        assert sum(int(f[3:]) * s for f, s in share.items()) == pytest.approx(3.0)  # whole blocks: all of it
    from safetensors.torch import load_file
    tensors = load_file(str(tmp_path / "model-auto-int.safetensors"))
    b_t, bits = [], []
    for key in [k for k in sd if k.endswith(".b_i")]:
        b_t.append(4.0 + 2.0 * sd[key].double().flatten())
        ids = tensors[key[:-4] + ".weight.format"].flatten()
        bits.append(torch.tensor([int(lowbit.FORMATS[i].name[3:]) for i in ids]))
    b_t, bits = torch.cat(b_t), torch.cat(bits)
    order = b_t.argsort()
    assert (bits[order].diff() >= 0).all()  # over all layers together: the higher b_t, the more bits


@pytest.mark.parametrize("args, message", [
    (["--format=auto-int", "--bits_per_weight=5"], "expected a mean of 2 to 4 element bits"),
    (["--format=int3", "--bits_per_weight=3"], "is for --format=auto-int or error-int"),
    (["--format=error-int"], "pass --bits_per_weight"),
])
def test_a_bad_budget_is_one_line(data_dir, tmp_path, capsys, args, message):
    checkpoint(tmp_path, data_dir)
    assert util.cli(E.main, [f"--out_dir={tmp_path}", *args]) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_auto_int_at_a_budget_needs_learned_bitwidths(data_dir, tmp_path, capsys):
    checkpoint(tmp_path, data_dir, b_t=False)
    argv = [f"--out_dir={tmp_path}", "--format=auto-int", "--bits_per_weight=3", "--evaluate=False"]
    assert util.cli(E.main, argv) == 1
    assert "use --format=error-int" in capsys.readouterr().err
