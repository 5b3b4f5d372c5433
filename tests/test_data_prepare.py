"""
data/openwebtext/prepare.py and data/c4/prepare.py on small generated local files, with tiktoken
encodings built here (the tests run offline: no gpt2 BPE files, no hub): the tokens in
train.bin + val.bin, cut at each end-of-text token, decode back to exactly the input documents.
"""
import collections
import gzip
import importlib.util
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tiktoken
from disk_faults import full_disk_open, no_space, read_only_dir, tiny_tmpfs

ROOT = Path(__file__).resolve().parents[1]
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def load_script(name):
    """The scripts are files, not a package: import each the way `python data/<name>/prepare.py` runs it."""
    spec = importlib.util.spec_from_file_location(f"prepare_{name}", ROOT / "data" / name / "prepare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


owt, c4 = load_script("openwebtext"), load_script("c4")
common = owt.common


def tiny_encoding_args(big=False):
    """Byte-level BPE with a few merges; big=True puts a merge and <|endoftext|> above 2**16."""
    ranks = {bytes([i]): i for i in range(256)}
    ranks.update({b" t": 256, b"he": 257, b" the": 258, b"in": 259, b"ing": 260})
    if big:
        ranks[b" a"] = 70000
    return dict(name="tiny_big" if big else "tiny", pat_str=GPT2_PAT, mergeable_ranks=ranks,
                special_tokens={"<|endoftext|>": 70001 if big else 261})


def tiny_encoding(big=False):
    return tiktoken.Encoding(**tiny_encoding_args(big))


def make_docs(n, seed=0):
    """Documents that test the edges: unicode, newlines, an empty one, and the eot text itself."""
    rng = random.Random(seed)
    words = ["the", "thing", "and", "a", "sing", "héllo", "数据", "🙂", "42", "don't", "\n", "\n\n", "  ", "x"]
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 40))) for _ in range(n)]
    docs[1] = ""
    docs[2] = "text that names <|endoftext|> is still text"
    return docs


def write_jsonl(path, docs, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"text": d, "url": f"https://example.com/{i}"}) + "\n")
    return str(path)


def read_bins(out_dir, enc):
    """meta.json and, per split, the documents between end-of-text tokens, decoded."""
    meta = json.loads((Path(out_dir) / "meta.json").read_text())
    docs, tokens = {}, {}
    for split in ("train", "val"):
        t = np.fromfile(Path(out_dir) / f"{split}.bin", dtype=meta["dtype"])
        assert t[-1] == enc.eot_token, "every document, the last included, ends with eot"
        ends = np.flatnonzero(t == enc.eot_token)
        starts = np.r_[0, ends[:-1] + 1]
        docs[split] = [enc.decode_bytes(t[s:e].tolist()).decode("utf-8") for s, e in zip(starts, ends)]
        tokens[split] = t
    return meta, docs, tokens


def n_tokens(enc, docs):
    return sum(len(enc.encode_ordinary(d)) + 1 for d in docs)


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    """datasets' cache in tmp_path, not in the user's ~/.cache."""
    import datasets
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def test_openwebtext_bins_decode_to_the_input_documents(tmp_path):
    enc, docs = tiny_encoding(), make_docs(60)
    data = write_jsonl(tmp_path / "owt.jsonl", docs)
    meta = owt.prepare(data_files=data, out_dir=tmp_path / "out", encoding=enc, num_proc=2)
    disk_meta, out, tokens = read_bins(tmp_path / "out", enc)
    assert meta == disk_meta
    assert collections.Counter(out["train"] + out["val"]) == collections.Counter(docs)
    assert len(out["val"]) == 1 and len(out["train"]) == 59  # ceil(0.0005 * 60) documents go to val
    assert tokens["train"].dtype == np.uint16
    assert {k: meta[k] for k in ("vocab_size", "dtype", "tokenizer", "eot_token")} == {
        "vocab_size": 262, "dtype": "uint16", "tokenizer": "tiktoken:tiny", "eot_token": 261}
    for split in ("train", "val"):
        assert meta[f"{split}_tokens"] == len(tokens[split]) == n_tokens(enc, out[split])
        assert meta[f"{split}_docs"] == len(out[split])
    assert meta["source"]["data_files"] == data
    # the same seed splits off the same val document again
    owt.prepare(data_files=data, out_dir=tmp_path / "again", encoding=enc, num_proc=1)
    assert read_bins(tmp_path / "again", enc)[1]["val"] == out["val"]


def test_tokens_above_16_bits_are_stored_as_uint32(tmp_path):
    enc, docs = tiny_encoding(big=True), make_docs(30, seed=1)
    (tmp_path / "owt.json").write_text(json.dumps([{"text": d} for d in docs]))  # a JSON array, not lines
    meta = owt.prepare(data_files=str(tmp_path / "owt.json"), out_dir=tmp_path / "out", encoding=enc, num_proc=1)
    _, out, tokens = read_bins(tmp_path / "out", enc)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70002 and meta["eot_token"] == 70001
    both = np.concatenate([tokens["train"], tokens["val"]])
    assert both.dtype == np.uint32 and 70000 in both  # the merge " a" above 2**16 survives the write
    assert collections.Counter(out["train"] + out["val"]) == collections.Counter(docs)


def test_txt_files_are_one_document_each(tmp_path):
    enc, docs = tiny_encoding(), [d for d in make_docs(12, seed=2) if d]
    for i, d in enumerate(docs):
        (tmp_path / f"page{i:02d}.txt").write_text(d, encoding="utf-8")
    owt.prepare(data_files=str(tmp_path / "page*.txt"), out_dir=tmp_path / "out", encoding=enc, num_proc=1)
    _, out, _ = read_bins(tmp_path / "out", enc)
    assert collections.Counter(out["train"] + out["val"]) == collections.Counter(docs)


def test_c4_streaming_keeps_the_first_max_docs_of_each_split(tmp_path):
    enc, train, val = tiny_encoding(), make_docs(40, seed=3), make_docs(10, seed=4)
    write_jsonl(tmp_path / "c4-train.00000-of-00002.json.gz", train[:20], gzip.open)
    write_jsonl(tmp_path / "c4-train.00001-of-00002.json.gz", train[20:], gzip.open)
    write_jsonl(tmp_path / "c4-validation.00000-of-00001.json.gz", val, gzip.open)
    meta = c4.prepare(data_files=str(tmp_path / "c4-train.*.json.gz"),
                      val_data_files=str(tmp_path / "c4-validation.*.json.gz"),
                      out_dir=tmp_path / "out", encoding=enc, num_proc=2, streaming=True, max_docs=25)
    _, out, _ = read_bins(tmp_path / "out", enc)
    assert out["train"] == train[:25]  # in file order: C4 is not shuffled here
    assert out["val"] == val
    assert meta["train_docs"] == 25 and meta["val_docs"] == 10
    assert meta["source"]["streaming"] and meta["source"]["max_docs"] == 25
    assert sorted(os.listdir(tmp_path / "out")) == ["meta.json", "train.bin", "val.bin"]  # the stream's copy is gone


def test_c4_reads_whole_local_splits_without_streaming(tmp_path):
    enc, train, val = tiny_encoding(), make_docs(30, seed=5), make_docs(8, seed=6)
    meta = c4.prepare(data_files=write_jsonl(tmp_path / "train.jsonl", train),
                      val_data_files=write_jsonl(tmp_path / "val.jsonl", val),
                      out_dir=tmp_path / "out", encoding=enc, num_proc=2)
    _, out, _ = read_bins(tmp_path / "out", enc)
    assert out["train"] == train and out["val"] == val
    assert meta["train_tokens"] == n_tokens(enc, train) and meta["val_tokens"] == n_tokens(enc, val)


def full_disk_at_the_bins(monkeypatch):
    """The .bin files' space is reserved before they are memory-mapped: a full disk says so there."""
    def no_room(fd, offset, length):
        raise no_space()
    monkeypatch.setattr(os, "posix_fallocate", no_room)


def full_disk_at_meta_json(monkeypatch):
    monkeypatch.setattr(common, "open", full_disk_open(), raising=False)  # meta.json is written after both bins


@pytest.mark.parametrize("fault", [full_disk_at_the_bins, full_disk_at_meta_json])
def test_a_full_disk_is_one_line_and_leaves_the_earlier_files_as_they_were(tmp_path, monkeypatch, fault):
    enc, out_dir = tiny_encoding(), tmp_path / "out"
    owt.prepare(data_files=write_jsonl(tmp_path / "a.jsonl", make_docs(20)), out_dir=out_dir, encoding=enc)
    before = {p.name: p.read_bytes() for p in out_dir.iterdir()}
    fault(monkeypatch)
    with pytest.raises(common.DataError) as e:
        # the same files, grown: prepared again into their folder
        owt.prepare(data_files=write_jsonl(tmp_path / "a.jsonl", make_docs(30, seed=9)), out_dir=out_dir, encoding=enc)
    assert "No space left on device" in str(e.value) and "--out_dir" in str(e.value) and "\n" not in str(e.value)
    assert {p.name: p.read_bytes() for p in out_dir.iterdir()} == before  # no temporary left, nothing replaced


def test_a_really_full_disk_is_one_line_not_a_sigbus(tmp_path):
    """On a 64 KiB tmpfs the bins do not fit: the memory map of an unreserved file died of SIGBUS."""
    docs = [" ".join(["thing"] * 400) + f" {i}" for i in range(40)]  # ~100 KB of tokens
    mount = tmp_path / "small"
    r = run_cli("openwebtext", tmp_path, f"--data_files={write_jsonl(tmp_path / 'd.jsonl', docs)}",
                f"--out_dir={mount / 'out'}", "--tokenizer=tiny", "--num_proc=1", prefix=tiny_tmpfs(mount))
    last = r.stderr.strip().splitlines()[-1]  # after datasets' progress bars
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stderr.count("error:") == 1, r.stderr
    assert last.startswith("error: cannot write into") and "No space left on device" in last


@pytest.mark.parametrize("files, expect", [
    ("missing/*.jsonl", "no file matches"),
    ("notes.md", "is not one of"),
    ("notext.jsonl", "no field 'text'"),
    ("broken.jsonl", "could not read|reading the stream failed .*JSON parse error"),
    ("one.jsonl", "need at least 2 documents"),
    ("notes.md,one.jsonl", "is not one of"),
    ("empty.jsonl", "holds no documents; give files with at least 2"),
    ("blank.jsonl", "holds no documents; give files with at least 2"),
])
@pytest.mark.parametrize("streaming", [False, True], ids=["files", "stream"])
def test_bad_local_files_are_one_clear_error(tmp_path, files, expect, streaming):
    (tmp_path / "notes.md").write_text("# not data")
    (tmp_path / "notext.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "broken.jsonl").write_text('{"text": "fine"}\n{"text": "cut off\n')
    write_jsonl(tmp_path / "one.jsonl", ["only one"])
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    data_files = ",".join(str(tmp_path / f) for f in files.split(","))
    with pytest.raises(common.DataError, match=expect):
        owt.prepare(data_files=data_files, out_dir=tmp_path / "out", encoding=tiny_encoding(), streaming=streaming)
    assert not (tmp_path / "out" / "train.bin").exists()


@pytest.mark.parametrize("streaming", [False, True], ids=["files", "stream"])
@pytest.mark.parametrize("lines, expect", [
    ([b'{"text": 5}', b'{"text": 6}'], "not a string"),
    ([b'{"text": "a"}', b'{"text": 5}', b'{"text": "b"}'], "not a string"),  # a stream cast it to "5"
    ([b'{"text": "a"}', b'{"text": ["x"]}', b'{"text": "b"}'], "not a string"),
    ([b'{"text": "a"}', b'{"text": null}', b'{"text": "b"}'], "null|NoneType"),
    ([b'{"text": "a"}', b'{"text": "b\xff\xfec"}', b'{"text": "d"}'], "utf-8"),  # bytes that are not UTF-8
    ([b'{"text": "a"}', b'{"text": "b\\ud800c"}', b'{"text": "d"}'], "surrogate"),  # an escape UTF-8 has no code for
], ids=["numbers", "a-number", "a-list", "a-null", "invalid-utf8", "lone-surrogate"])
def test_a_document_whose_text_is_not_a_utf8_string_is_one_line(tmp_path, lines, expect, streaming):
    (tmp_path / "docs.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "train.bin").write_bytes(b"earlier run")
    with pytest.raises(common.DataError) as e:
        owt.prepare(data_files=str(tmp_path / "docs.jsonl"), out_dir=out_dir, encoding=tiny_encoding(),
                    streaming=streaming)
    assert re.search(expect, str(e.value), re.IGNORECASE) and "\n" not in str(e.value), str(e.value)
    assert os.listdir(out_dir) == ["train.bin"] and (out_dir / "train.bin").read_bytes() == b"earlier run"


def test_the_document_that_is_not_utf8_is_named(tmp_path):
    docs = [b'{"text": "fine"}'] * 5000 + [b'{"text": "caf\xe9"}']  # Latin-1, past the first batch
    (tmp_path / "docs.jsonl").write_bytes(b"\n".join(docs) + b"\n")
    with pytest.raises(common.DataError, match="document 5000 is not valid UTF-8 \\(byte 3\\)"):
        owt.prepare(data_files=str(tmp_path / "docs.jsonl"), out_dir=tmp_path / "out", encoding=tiny_encoding())


def unusable_out_dirs(tmp_path):
    (tmp_path / "a_file").write_text("not a directory")
    return {"a file": tmp_path / "a_file", "under a file": tmp_path / "a_file" / "out",
            "read-only": read_only_dir(tmp_path), "not creatable": "/proc/no/such/place"}


@pytest.mark.parametrize("case", ["a file", "under a file", "read-only", "not creatable"])
def test_an_unusable_out_dir_is_one_line_before_any_work(tmp_path, case):
    out_dir = unusable_out_dirs(tmp_path)[case]
    data = write_jsonl(tmp_path / "d.jsonl", make_docs(5))
    with pytest.raises(common.DataError, match="--out_dir=.* is unusable"):
        owt.prepare(data_files=data, out_dir=out_dir, encoding=tiny_encoding())
    with pytest.raises(common.DataError, match="--out_dir=.* is unusable"):
        c4.prepare(data_files=data, val_data_files=data, out_dir=out_dir, encoding=tiny_encoding())
    line = one_error_line(run_cli("openwebtext", tmp_path, f"--data_files={data}", f"--out_dir={out_dir}",
                                  "--tokenizer=tiny"))
    assert "is unusable" in line and "Hugging Face" not in line  # checked before the tokenizer or any download
    assert (tmp_path / "a_file").read_text() == "not a directory"


def test_another_datasets_folder_or_a_run_directory_is_kept_and_said_in_one_line(tmp_path):
    """A dataset prepared from other files (or the hub), or a train.py run directory, as --out_dir: refused
    before any work, its files as they were; the same files prepared again (an interrupted run) are not."""
    enc = tiny_encoding()
    data, other = write_jsonl(tmp_path / "a.jsonl", make_docs(20)), write_jsonl(tmp_path / "b.jsonl", make_docs(30))
    owt.prepare(data_files=data, out_dir=tmp_path / "out", encoding=enc)
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir() if p.is_file()}
    for prepare in (lambda: owt.prepare(data_files=other, out_dir=tmp_path / "out", encoding=enc),
                    lambda: owt.prepare(out_dir=tmp_path / "out", encoding=enc),  # the hub's
                    lambda: c4.prepare(data_files=data, val_data_files=data, out_dir=tmp_path / "out", encoding=enc)):
        with pytest.raises(common.DataError, match="already holds a dataset prepared from") as e:
            prepare()
        assert "\n" not in str(e.value) and "choose another --out_dir" in str(e.value)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir() if p.is_file()} == before
    owt.prepare(data_files=data, out_dir=tmp_path / "out", encoding=enc)  # the same files again
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "ckpt.pt").write_bytes(b"a checkpoint")
    with pytest.raises(common.DataError, match="is a run directory of train.py"):
        owt.prepare(data_files=data, out_dir=tmp_path / "run", encoding=enc)
    assert sorted(os.listdir(tmp_path / "run")) == ["ckpt.pt"]


def test_c4_local_files_need_their_validation_files_too(tmp_path):
    with pytest.raises(common.DataError, match="--val_data_files"):
        c4.prepare(data_files=write_jsonl(tmp_path / "t.jsonl", ["a", "b"]), out_dir=tmp_path, encoding=tiny_encoding())


def test_an_encoding_without_end_of_text_is_refused():
    args = tiny_encoding_args()
    args["special_tokens"] = {}
    with pytest.raises(common.DataError, match="<|endoftext|>"):
        common.get_encoding(tiktoken.Encoding(**args))


# --- the command line, in a subprocess with no way out: hub offline, tiktoken's downloads refused ---

PLUGIN = """# a tiktoken plugin (tiktoken_ext namespace), so the real CLI can use --tokenizer=tiny offline
ENCODING_CONSTRUCTORS = {{"tiny": lambda: {args!r}}}
"""


def run_cli(script, tmp_path, *args, prefix=()):
    plugins = tmp_path / "plugins" / "tiktoken_ext"
    plugins.mkdir(parents=True, exist_ok=True)
    (plugins / "tiny_test_plugin.py").write_text(PLUGIN.format(args=tiny_encoding_args()))
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "plugins"), HF_HOME=str(tmp_path / "hf"),
               HF_DATASETS_CACHE=str(tmp_path / "hf" / "datasets"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TIKTOKEN_CACHE_DIR=str(tmp_path / "empty_tiktoken_cache"),
               HTTPS_PROXY="http://127.0.0.1:9", HTTP_PROXY="http://127.0.0.1:9")  # port 9: refused at once
    env.pop("NO_PROXY", None), env.pop("no_proxy", None)
    return subprocess.run([*prefix, sys.executable, str(ROOT / "data" / script / "prepare.py"), *args], env=env,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)


def test_cli_prepares_local_files_with_a_tiktoken_plugin_tokenizer(tmp_path):
    docs = make_docs(30, seed=7)
    r = run_cli("openwebtext", tmp_path, f"--data_files={write_jsonl(tmp_path / 'd.jsonl', docs)}",
                f"--out_dir={tmp_path / 'out'}", "--tokenizer=tiny", "--num_proc=2")
    assert r.returncode == 0, r.stderr
    meta, out, _ = read_bins(tmp_path / "out", tiny_encoding())
    assert meta["tokenizer"] == "tiktoken:tiny"
    assert collections.Counter(out["train"] + out["val"]) == collections.Counter(docs)


def test_cli_takes_a_bare_streaming_flag_and_its_keys_as_key_value(tmp_path):
    """The command line is configurator's: --key=value, a bare --streaming for the bool, max_docs a number."""
    train, val = make_docs(12, seed=8), make_docs(4, seed=9)
    r = run_cli("c4", tmp_path, f"--data_files={write_jsonl(tmp_path / 't.jsonl', train)}",
                f"--val_data_files={write_jsonl(tmp_path / 'v.jsonl', val)}", f"--out_dir={tmp_path / 'out'}",
                "--tokenizer=tiny", "--num_proc=1", "--streaming", "--max_docs=5")
    assert r.returncode == 0, r.stderr
    meta, out, _ = read_bins(tmp_path / "out", tiny_encoding())
    assert meta["source"]["streaming"] is True and meta["source"]["max_docs"] == 5
    assert out["train"] == train[:5] and out["val"] == val[:4]


@pytest.mark.parametrize("args, words", [(["--num_proc=0"], "--num_proc=0: expected an integer >= 1"),
                                         (["--max_docs=-1"], "--max_docs=-1: expected an integer >= 0"),
                                         (["--streaming=maybe"], "expected a bool"),
                                         (["--stream"], "unknown config key 'stream'; did you mean --streaming")])
def test_cli_bad_keys_are_one_line(tmp_path, args, words):
    line = one_error_line(run_cli("openwebtext", tmp_path, f"--out_dir={tmp_path / 'out'}", *args))
    assert words in line and not (tmp_path / "out").exists()


def one_error_line(r):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def test_cli_says_in_one_line_when_gpt2_bpe_cannot_be_downloaded(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "train.bin").write_bytes(b"earlier run")
    r = run_cli("openwebtext", tmp_path, f"--data_files={write_jsonl(tmp_path / 'd.jsonl', make_docs(5))}",
                f"--out_dir={tmp_path / 'out'}")
    line = one_error_line(r)
    assert "tiktoken's 'gpt2'" in line and str(tmp_path / "empty_tiktoken_cache") in line  # where to copy it
    assert (tmp_path / "out" / "train.bin").read_bytes() == b"earlier run"


@pytest.mark.parametrize("script", ["openwebtext", "c4"])
def test_cli_says_in_one_line_when_the_hub_cannot_be_reached(tmp_path, script):
    r = run_cli(script, tmp_path, f"--out_dir={tmp_path / 'out'}", "--tokenizer=tiny")
    line = one_error_line(r)
    assert "Hugging Face hub" in line and "--data_files=" in line
    assert "Traceback" not in r.stdout + r.stderr


def test_cli_says_in_one_line_when_data_files_are_missing(tmp_path):
    line = one_error_line(run_cli("c4", tmp_path, "--data_files=nowhere/*.json.gz", "--val_data_files=v.jsonl"))
    assert "no file matches 'nowhere/*.json.gz'" in line
