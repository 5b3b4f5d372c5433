"""data/loader.py: a batch is a function of its key alone, and the loss estimate is the mean of the
evaluation batches' losses, computed here by hand."""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from data import loader
from data.common import DataError
from model import GPT, ModelConfig


def test_a_batch_is_windows_of_the_data_drawn_by_its_key_alone(tiny_corpus):
    meta = loader.read_meta(tiny_corpus)
    data = loader.open_split(tiny_corpus, "train", meta, 32)
    tokens = np.fromfile(f"{tiny_corpus}/train.bin", dtype=np.uint16).astype(np.int64)
    x, y = loader.get_batch(data, (1, "train", 5, 0), batch_size=6, block_size=32, device="cpu")
    assert x.shape == y.shape == (6, 32) and x.dtype == torch.int64
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        starts = [i for i in range(len(tokens) - 33) if tokens[i:i + 32].tolist() == row_x]
        assert any(tokens[i + 1:i + 33].tolist() == row_y for i in starts)  # y is x one token on, in the data
    again = loader.get_batch(data, (1, "train", 5, 0), batch_size=6, block_size=32, device="cpu")
    other = loader.get_batch(data, (1, "train", 5, 1), batch_size=6, block_size=32, device="cpu")
    assert torch.equal(again[0], x) and not torch.equal(other[0], x)


def test_estimate_loss_is_the_mean_of_the_evaluation_batches_losses(tiny_corpus):
    meta = loader.read_meta(tiny_corpus)
    data = {s: loader.open_split(tiny_corpus, s, meta, 16) for s in ("train", "val")}
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=256, block_size=16)).train()
    got = loader.estimate_loss(model, data, seed=3, eval_iters=4, batch_size=5, block_size=16, device="cpu")
    assert model.training  # the mode it came in
    for split in data:
        by_hand = []
        for k in range(4):
            x, y = loader.get_batch(data[split], (3, split, "eval", k), batch_size=5, block_size=16, device="cpu")
            with torch.no_grad():
                logits, _ = model.eval()(x, y)
            by_hand.append(F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)).item())
        assert got[split] == pytest.approx(sum(by_hand) / 4, rel=1e-6)
    assert got["train"] != got["val"]


def test_bad_splits_are_one_line_that_says_how_to_prepare_them(tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 256, "dtype": "uint16"}))
    (tmp_path / "train.bin").write_bytes(b"\x01")
    with pytest.raises(DataError, match="is corrupt .1 bytes, not a whole number of uint16 tokens"):
        loader.open_split(str(tmp_path), "train", {"dtype": "uint16"}, 8)
    (tmp_path / "train.bin").write_bytes(np.arange(10, dtype=np.uint16).tobytes())
    with pytest.raises(DataError, match="holds 10 tokens, too few for block_size=9: use --block_size below 9"):
        loader.open_split(str(tmp_path), "train", {"dtype": "uint16"}, 9)
    with pytest.raises(DataError, match="val.bin not found; prepare the data first: write train.bin"):
        loader.open_split(str(tmp_path), "val", {"dtype": "uint16"}, 8)


def test_autocast_is_bf16_or_none():
    with loader.autocast_for("bfloat16", "cpu"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with loader.autocast_for("float32", "cpu"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
