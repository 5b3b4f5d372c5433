"""data/default/prepare.py (data/common.py's prepare_default): the offline corpus is the standard
library's text, byte for byte."""
import json
import math
import os
import sysconfig
from collections import Counter

import numpy as np
import pytest

from data import common


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = tmp_path_factory.mktemp("default")
    meta = common.prepare_default(out_dir=str(out))
    return out, meta


def read(out, split):
    return np.fromfile(out / f"{split}.bin", dtype=np.uint16)


def stdlib_modules():
    stdlib = sysconfig.get_paths()["stdlib"]
    names = sorted(n for n in os.listdir(stdlib) if n.endswith(".py") and os.path.isfile(os.path.join(stdlib, n)))
    return [(n, open(os.path.join(stdlib, n), "rb").read()) for n in names]


def test_meta_json_counts_match_the_bins(prepared):
    out, meta = prepared
    on_disk = json.loads((out / "meta.json").read_text())
    assert on_disk == meta
    assert (meta["vocab_size"], meta["tokenizer"], meta["dtype"]) == (256, "bytes", "uint16")
    train, val = read(out, "train"), read(out, "val")
    assert meta["train_tokens"] == len(train) > 1_000_000
    assert meta["val_tokens"] == len(val) > 50_000
    assert 0.02 < len(val) / (len(train) + len(val)) < 0.10  # about 1 document in 20
    assert train.max() < 256 and val.max() < 256
    assert sorted(os.listdir(out)) == ["meta.json", "train.bin", "val.bin"]  # no temporary files left


def test_unigram_entropy_is_that_of_the_train_bytes(prepared):
    out, meta = prepared
    counts = Counter(read(out, "train").astype(np.uint8).tobytes())
    n = sum(counts.values())
    h = -sum(c / n * math.log(c / n) for c in counts.values())
    assert meta["unigram_entropy_nats"] == pytest.approx(h, rel=1e-9)
    assert 2.5 < h < math.log(256)  # text, not noise


def test_tokens_decode_to_the_stdlib_sources_split_one_file_in_twenty(prepared):
    out, _ = prepared
    train = read(out, "train").astype(np.uint8).tobytes()
    val = read(out, "val").astype(np.uint8).tobytes()
    train.decode("utf-8")  # whole files only: the bytes are valid UTF-8 text
    modules = stdlib_modules()
    assert val.startswith(modules[0][1]) and train.startswith(modules[1][1])
    for i, (name, source) in enumerate(modules):
        home, other = (val, train) if i % 20 == 0 else (train, val)
        assert source in home, f"{name} (document {i}) missing from its split"
        assert source not in other, f"{name} (document {i}) in both splits"


def test_pydoc_topics_are_in_the_corpus(prepared):
    topics = pytest.importorskip("pydoc_data.topics", reason="this Python ships without pydoc_data").topics
    out, _ = prepared
    corpus = read(out, "train").astype(np.uint8).tobytes() + read(out, "val").astype(np.uint8).tobytes()
    assert topics["assert"].encode() in corpus


def test_preparing_twice_gives_the_same_bytes(prepared, tmp_path):
    out, meta = prepared
    again = common.prepare_default(out_dir=str(tmp_path))
    assert again == meta
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (tmp_path / name).read_bytes() == (out / name).read_bytes()


def test_a_full_disk_is_one_line_and_the_earlier_corpus_stays(prepared, tmp_path, monkeypatch):
    from disk_faults import full_disk_open
    out, _ = prepared
    for name in ("train.bin", "val.bin", "meta.json"):
        (tmp_path / name).write_bytes((out / name).read_bytes())
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    monkeypatch.setattr(common, "open", full_disk_open(), raising=False)  # train.bin's write fills the disk
    with pytest.raises(common.DataError) as e:
        common.prepare_default(out_dir=str(tmp_path))
    assert "No space left on device" in str(e.value) and "\n" not in str(e.value)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # meta.json too: the data stays complete


def test_an_unusable_out_dir_is_one_line(tmp_path):
    (tmp_path / "a_file").write_text("keep")
    for out_dir in (tmp_path / "a_file", tmp_path / "a_file" / "sub"):
        with pytest.raises(common.DataError, match="is unusable: .*a_file is not a directory"):
            common.prepare_default(out_dir=str(out_dir))
        with pytest.raises(common.DataError, match="is unusable"):
            common.prepare_default_if_missing(out_dir=str(out_dir))
    assert (tmp_path / "a_file").read_text() == "keep"
