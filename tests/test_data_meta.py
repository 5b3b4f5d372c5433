"""Prepared data that can be trusted: concurrent preparation, and meta.json checked against the
.bin files (data/common.py's load_meta) before anything trains on them."""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import util
from data import common
from data.common import DataError
from conftest import ROOT


RACE = """
import os, sys, time
sys.path.insert(0, {root!r})
from data import common
while not os.path.exists(sys.argv[2]):  # both start together
    time.sleep(0.005)
print(common.{fn}(sys.argv[1])["train_tokens"])
"""


# RACE whose process says "waiting" on stderr as it asks for the preparation lock (fcntl.flock)
WAITING = RACE.replace("from data import common\n", """from data import common
import fcntl
_flock = fcntl.flock
def flock(fd, op):
    if op == fcntl.LOCK_EX:
        print("waiting", file=sys.stderr, flush=True)
    return _flock(fd, op)
fcntl.flock = flock
""")


@pytest.mark.parametrize("fn", ["prepare_default", "prepare_default_if_missing"])
def test_two_runs_preparing_the_default_corpus_at_once(tmp_path, fn):
    out, go = tmp_path / "default", tmp_path / "go"
    code = RACE.format(root=ROOT, fn=fn)
    runs = [subprocess.Popen([sys.executable, "-c", code, str(out), str(go)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(2)]
    time.sleep(0.5)
    go.touch()
    results = [r.communicate(timeout=120) + (r.returncode,) for r in runs]
    assert all(rc == 0 for _, _, rc in results), [err for _, err, _ in results]
    assert sorted(os.listdir(out)) == ["meta.json", "train.bin", "val.bin"]  # no temporary file left
    meta = common.load_meta(str(out))
    assert [int(stdout) for stdout, _, _ in results] == [meta["train_tokens"]] * 2
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    val = np.fromfile(out / "val.bin", dtype=np.uint16)
    assert meta["max_token"] == max(train.max(), val.max()) and len(train) == meta["train_tokens"]


def test_a_second_preparation_waits_for_the_first(tmp_path, monkeypatch):
    """Deterministic: the first is held between renaming train.bin and the rest; the second (another
    process) must not write into the folder meanwhile, and both end with whole, matching files."""
    import threading
    out, go = tmp_path / "default", tmp_path / "go"
    held, release, real = threading.Event(), threading.Event(), common.commit

    def commit_then_hold(tmp, path):
        real(tmp, path)
        if path.endswith("train.bin"):
            held.set()
            release.wait(60)
    monkeypatch.setattr(common, "commit", commit_then_hold)
    first = threading.Thread(target=common.prepare_default, args=(str(out),))
    first.start()
    assert held.wait(60)
    go.touch()
    code = WAITING.format(root=ROOT, fn="prepare_default")
    second = subprocess.Popen([sys.executable, "-c", code, str(out), str(go)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    assert second.stderr.readline() == "waiting\n"  # it asked for the lock (a run without one never does)
    time.sleep(3)  # from there, ample time for it to prepare the corpus (0.5 s), were it not waiting
    during = os.listdir(out)
    assert second.poll() is None and [n for n in during if not n.startswith(".")] == ["train.bin"]
    assert not [n for n in during if f".{second.pid}." in n]  # the first's temporaries only
    release.set()
    first.join(60)
    _, err = second.communicate(timeout=60)
    assert second.returncode == 0, err
    assert sorted(os.listdir(out)) == ["meta.json", "train.bin", "val.bin"]
    common.load_meta(str(out))


def dataset(tmp_path, meta, train=b"\x01\x00" * 100, val=b"\x02\x00" * 10):
    d = tmp_path / "data"
    d.mkdir(exist_ok=True)
    (d / "train.bin").write_bytes(train)
    (d / "val.bin").write_bytes(val)
    (d / "meta.json").write_text(meta if isinstance(meta, str) else json.dumps(meta))
    return str(d)


GOOD = {"vocab_size": 256, "dtype": "uint16", "train_tokens": 100, "val_tokens": 10, "max_token": 2}


def test_a_good_meta_json_loads(tmp_path):
    assert common.load_meta(dataset(tmp_path, GOOD)) == GOOD
    old = {"vocab_size": 256}  # hand-made or older: no dtype (uint16, as nanoGPT's), no counts
    assert common.load_meta(dataset(tmp_path, old))["dtype"] == "uint16"


@pytest.mark.parametrize("meta,message", [
    ({**GOOD, "dtype": "float32"}, "dtype='float32'; expected one of uint16, uint32"),
    ({**GOOD, "dtype": "uint32"}, "meta.json says 100 tokens of uint32"),  # the bins are uint16
    ({**GOOD, "vocab_size": 0}, "vocab_size=0; expected an integer > 0"),
    ({**GOOD, "vocab_size": -5}, "vocab_size=-5"),
    ({**GOOD, "vocab_size": "256"}, "vocab_size='256'"),
    ({**GOOD, "vocab_size": 70000}, "does not fit dtype uint16"),
    ({**GOOD, "train_tokens": 99}, "train.bin holds 200 bytes, but meta.json says 99 tokens"),
    ({**GOOD, "max_token": 256}, "max_token=256 but vocab_size=256"),
    ("{not json", "is corrupt or unreadable"),
    ("[1, 2]", "a JSON list, expected an object"),
])
def test_a_bad_meta_json_is_one_line(tmp_path, meta, message):
    with pytest.raises(DataError) as e:
        common.load_meta(dataset(tmp_path, meta))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("meta,train,val,message", [
    ({"vocab_size": 256}, np.array([1, 300, 2]), np.array([3]), "train.bin holds token id 300, but meta.json says "
                                                               "vocab_size=256"),  # no max_token to trust
    ({**GOOD, "train_tokens": 3, "val_tokens": 2}, np.array([1, 2, 2]), np.array([7, 1]),
     "val.bin holds token id 7, but meta.json says max_token=2"),
    ({"vocab_size": 256, "max_token": 255}, np.array([256, 0]), np.array([1]), "train.bin holds token id 256"),
])
def test_tokens_the_vocabulary_does_not_have_are_found_at_load(tmp_path, meta, train, val, message):
    """Checked against the tokens themselves: an embedding lookup past vocab_size fails deep in the model."""
    d = dataset(tmp_path, meta, train=train.astype(np.uint16).tobytes(), val=val.astype(np.uint16).tobytes())
    with pytest.raises(DataError) as e:
        common.load_meta(d)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_train_py_refuses_tokens_beyond_the_vocabulary_in_one_line(tmp_path):
    import train
    ids = np.arange(2000) % 300  # tokens up to 299, meta.json says 256 and has no max_token
    d = dataset(tmp_path, {"vocab_size": 256}, train=ids.astype(np.uint16).tobytes(),
                val=ids[:500].astype(np.uint16).tobytes())
    with pytest.raises(DataError) as e:
        train.main([f"--dataset={d}", f"--out_dir={tmp_path / 'out'}", "--n_layer=1", "--n_head=2", "--n_embd=32",
                    "--block_size=16", "--batch_size=2", "--max_iters=1", "--device=cpu", "--compile=False"])
    assert "holds token id 299, but meta.json says vocab_size=256" in str(e.value) and "\n" not in str(e.value)


def test_missing_files_and_odd_sizes(tmp_path):
    with pytest.raises(DataError, match="meta.json not found"):
        common.load_meta(str(tmp_path))
    d = dataset(tmp_path, {"vocab_size": 256}, train=b"\x01\x00\x02")  # 1.5 uint16 tokens
    with pytest.raises(DataError, match="not a whole number of uint16 tokens"):
        common.load_meta(d)
    d = dataset(tmp_path, GOOD)
    os.remove(os.path.join(d, "val.bin"))
    with pytest.raises(DataError, match="val.bin not found"):
        common.load_meta(d)


def test_write_atomic_leaves_the_old_file_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "train.bin"
    path.write_bytes(b"old")
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OSError):
        util.write_atomic(str(path), b"new data")
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["train.bin"]


def test_write_bins_records_the_largest_token_and_the_counts(tmp_path):
    import tiktoken
    from datasets import Dataset
    ranks = {bytes([i]): i for i in range(256)}
    ranks[b"zz"] = 300  # a merge with the largest id but the end-of-text token's
    enc = tiktoken.Encoding(name="tiny", pat_str=r"\w+|\s+|[^\w\s]+", mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": 301})
    splits = {"train": Dataset.from_dict({"text": ["abc zz", "hello"]}), "val": Dataset.from_dict({"text": ["q"]})}
    common.write_bins(splits, enc, str(tmp_path), 1, "test")
    meta = common.load_meta(str(tmp_path))
    tokens = {s: np.fromfile(tmp_path / f"{s}.bin", dtype=meta["dtype"]) for s in ("train", "val")}
    assert meta["max_token"] == max(t.max() for t in tokens.values()) == 301  # eot ends every document
    counts = [sum(len(enc.encode_ordinary(t)) + 1 for t in splits[s]["text"]) for s in ("train", "val")]
    assert [meta["train_tokens"], meta["val_tokens"]] == [len(tokens["train"]), len(tokens["val"])] == counts
    assert 300 in tokens["train"]  # the merge was used
    assert sorted(os.listdir(tmp_path)) == ["meta.json", "train.bin", "val.bin"]
