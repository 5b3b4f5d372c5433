"""What several test files share: the repository's root (ROOT), a tiny model (tiny_model), a small
byte corpus to train on (the tiny_corpus fixture), the train.py settings of a tiny GPT2 on it
(TINY_RUN), and a SentencePiece
model set up as Llama 2's (train_sentencepiece, on make_docs' documents). Test files import the
constants and helpers with `from conftest import ...`."""
import hashlib
import io
import json
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors. It must be chosen
# before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With PQT_REQUIRE_LLAMA_CPP=1 (.ci/run sets it, having built llama.cpp's tools), a test skipped for want of
    llama.cpp (its tools or llama-cpp-python: a reason that names llama) fails instead: CI runs every llama.cpp
    claim or says which it could not."""
    report = (yield).get_result()
    reason = report.longrepr[2] if report.skipped and isinstance(report.longrepr, tuple) else ""
    if os.environ.get("PQT_REQUIRE_LLAMA_CPP") == "1" and "llama" in reason.lower():
        report.outcome, report.longrepr = "failed", f"PQT_REQUIRE_LLAMA_CPP=1, and this test was skipped: {reason}"

def greedy_text(model, prompt, n):
    """The text of n tokens greedily decoded by hand after prompt (a byte-level model's ids are bytes)."""
    idx = torch.tensor([list(prompt.encode())])
    for _ in range(n):
        with torch.no_grad():
            logits, _ = model(idx)
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return bytes(idx[0].tolist()).decode("utf-8", errors="replace")


def end_spawned_rank():
    """The last call of a torch.multiprocessing.spawn worker that has written what it had to: as train.py ends
    a distributed run. fully_shard and DDP keep the gloo process group referenced from C++, so it outlives
    destroy_process_group and its threads abort in the interpreter's teardown now and then (SIGABRT,
    "terminate called without an active exception"): a passing worker would fail its test."""
    import torch.distributed as dist
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def tiny_model(arch, **kw):
    """A tiny ModelConfig of either architecture; odd widths so that b_i's edge blocks are partial."""
    from model import ModelConfig
    base = dict(arch=arch, n_layer=2, n_head=4, n_embd=48, vocab_size=97, block_size=16, ffn_hidden=80)
    if arch == "llama2":
        base["n_kv_head"] = 2
    base.update(kw)
    return ModelConfig(**base)


# train.py's settings of a tiny GPT2 that learns the corpus below in a few seconds on a CPU
TINY_RUN = dict(n_layer=2, n_head=2, n_embd=64, block_size=32, batch_size=8, max_iters=30, eval_interval=10,
                log_interval=1, eval_iters=2, warmup_iters=5, lr_decay_iters=30, learning_rate=3e-3, device="cpu")


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """A small corpus with structure to learn: 40,000 words of Python-like text drawn at random,
    byte tokens (vocab 256), the first 9/10 train.bin, the rest val.bin."""
    d = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    words = [b"def ", b"return ", b"self", b"(x)", b": ", b"\n", b"    ", b"import os", b" = ", b"1"]
    text = b"".join(words[i] for i in rng.integers(0, len(words), 40000))
    ids = np.frombuffer(text, dtype=np.uint8).astype(np.uint16)
    ids[: len(ids) * 9 // 10].tofile(d / "train.bin")
    ids[len(ids) * 9 // 10:].tofile(d / "val.bin")
    (d / "meta.json").write_text(json.dumps({"vocab_size": 256, "tokenizer": "bytes", "dtype": "uint16"}))
    return str(d)


WORDS = ["the", "river", "bank", "money", "sat", "on", "a", "mat", "héllo", "数据", "don't", "42", "1999", "\n"]


def make_docs(n, seed):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60))) for _ in range(n)]


def train_sentencepiece(path, docs, vocab_size=320):
    """A SentencePiece BPE model set up as Llama 2's (byte fallback, split digits, no normalization,
    unk/bos/eos = 0/1/2), on generated documents."""
    import sentencepiece as spm
    f = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(docs), model_writer=f, vocab_size=vocab_size,
                                   model_type="bpe", byte_fallback=True, split_digits=True, unk_id=0, bos_id=1,
                                   eos_id=2, pad_id=-1, character_coverage=1.0, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, minloglevel=2)
    path.write_bytes(f.getvalue())
    return spm.SentencePieceProcessor(model_file=str(path))


@pytest.fixture
def hub_offline(tmp_path, monkeypatch):
    """The Hugging Face hub offline, with an empty cache: a hub name must fail, and say what works."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


# --- what the tests of train.py share (tests/test_train.py, tests/test_train_record.py) -------------

def tiny(data_dir, out_dir, **kw):
    """train.py's flags of a tiny run (conftest.TINY_RUN) on data_dir, kw overriding them."""
    args = dict(dataset=data_dir, out_dir=str(out_dir), **TINY_RUN)
    args.update(kw)
    return [f"--{k}={v}" for k, v in args.items()]


def run_cli(args, **kw):
    """train.py run from the shell: subprocess.run's result."""
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, **kw)


def digest(path):
    """The SHA-256 of a file's bytes: whether a test's run left it as it was."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def untouched_state(path):
    """(inode, SHA-256) of a file: an atomic rewrite (a new file renamed over it) changes the first even
    with the same bytes, a write in place the second; a modification time can miss both."""
    return os.stat(path).st_ino, digest(path)


@pytest.fixture(scope="session")
def trained(tiny_corpus, tmp_path_factory):
    """A tiny run trained to step 10, once for the session; tests that change a run change a copy_run."""
    import train
    out = tmp_path_factory.mktemp("trained")
    train.main(tiny(tiny_corpus, out, max_iters=10))
    return out


def copy_run(trained, tmp_path):
    """A copy of the trained run in tmp_path/run, for a test to change."""
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    return out


def run_here(args, capsys):
    """train.py's command line run through its own cli() in this process, as subprocess.run's result
    (returncode, stdout, stderr)."""
    import train
    import util
    status = util.cli(train.main, args)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, status, out.out, out.err)


def divergence(out_dir):
    """diverged.json read by hand: its step, what went wrong and the step of the checkpoint kept."""
    with open(os.path.join(out_dir, "diverged.json")) as f:
        record = json.load(f)
    return {k: record[k] for k in ("step", "what", "checkpoint_step")}
