"""The offline default corpus: the Python standard library's own source and documentation.

Every machine that runs this project has this text, so the default run needs no download. The
documents are the top-level modules of the standard library (sysconfig's "stdlib" directory,
*.py directly in it, sorted by name; packages and tests are left out so the corpus stays a few MB)
and then the pydoc topics of the reference manual (pydoc_data.topics, sorted by topic), when that
module is installed. Docstrings come with the source.

Tokens are the UTF-8 bytes themselves (vocab 256, "tokenizer": "bytes" in meta.json; sample.py
decodes them). Split: document i (in the order above) goes to
val when i % 20 == 0, else to train: about 5%, and the same on every run of the same Python.
Writes train.bin and val.bin (uint16, like nanoGPT's other datasets, so train.py reads every
dataset the same way) and meta.json. meta.json is written last: its presence means the data is
complete. Files are written under unique temporary names and renamed after an fsync, all of them
only once all are written (a full disk leaves the earlier files as they were), and one
preparation of a folder runs at a time (data/common.py), so two first runs that both find the
corpus missing neither collide nor see half-written files.

    python data/default/prepare.py
"""
import json
import os
import sys
import sysconfig

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
from data import common  # noqa: E402
from util import cli  # noqa: E402

VAL_EVERY = 20  # document i goes to val when i % VAL_EVERY == 0
MAX_BYTES = 8 * 2**20  # stop adding documents past this, so preparing stays about a second on any Python
DTYPE = np.uint16


def documents():
    """(name, bytes) of every document, in a fixed order."""
    stdlib = sysconfig.get_paths()["stdlib"]
    docs = []
    for name in sorted(os.listdir(stdlib)):
        path = os.path.join(stdlib, name)
        if name.endswith(".py") and os.path.isfile(path):
            with open(path, "rb") as f:
                docs.append((name, f.read()))
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions ship Python without it
        topics = {}
    docs += [(f"pydoc:{key}", topics[key].encode("utf-8")) for key in sorted(topics)]
    kept, total = [], 0
    for name, text in docs:
        if total + len(text) > MAX_BYTES:
            break
        if not text.endswith(b"\n"):
            text += b"\n"
        kept.append((name, text))
        total += len(text)
    return kept


def unigram_entropy(tokens, vocab_size=256):
    """Entropy in nats of the token frequencies: the loss of a model that ignores all context."""
    p = np.bincount(tokens, minlength=vocab_size) / len(tokens)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def prepare(out_dir=os.path.dirname(os.path.abspath(__file__))):
    """Write train.bin, val.bin and meta.json into out_dir; return the meta dict. Raises common.DataError."""
    common.check_out_dir(out_dir)
    with common.prepare_lock(out_dir):
        return _prepare(out_dir)


def _prepare(out_dir):
    docs = documents()
    train = b"".join(text for i, (_, text) in enumerate(docs) if i % VAL_EVERY)
    val = b"".join(text for i, (_, text) in enumerate(docs) if i % VAL_EVERY == 0)
    train_ids = np.frombuffer(train, dtype=np.uint8).astype(DTYPE)
    val_ids = np.frombuffer(val, dtype=np.uint8).astype(DTYPE)
    meta = {
        "vocab_size": 256,
        "tokenizer": "bytes",
        "dtype": np.dtype(DTYPE).name,
        "train_tokens": len(train_ids),
        "val_tokens": len(val_ids),
        "max_token": int(max(train_ids.max(), val_ids.max())),
        "unigram_entropy_nats": unigram_entropy(train_ids),
        "documents": len(docs),
        "source": f"Python {sysconfig.get_python_version()} standard library and pydoc topics",
    }
    files = {"train.bin": train_ids.tobytes(), "val.bin": val_ids.tobytes(),
             "meta.json": (json.dumps(meta, indent=1) + "\n").encode()}
    with common.staged(out_dir, files) as temps:  # all written, then renamed: a full disk changes nothing
        for name, data in files.items():
            with open(temps[name], "wb") as f:
                f.write(data)
    return meta


def prepare_if_missing(out_dir=os.path.dirname(os.path.abspath(__file__))):
    """The meta dict of out_dir, preparing it first unless a complete copy is there. Under the
    preparation lock, so when two runs start at once the second waits for the first and uses its
    files (prepare() would write them again, removing meta.json while the first run reads it)."""
    common.check_out_dir(out_dir)
    with common.prepare_lock(out_dir):
        try:
            return common.load_meta(out_dir)
        except common.DataError:
            pass
        return _prepare(out_dir)


def main(argv):
    """The corpus in data/default (argv: none taken); a DataError is one line (util.cli)."""
    meta = prepare()
    print(f"{meta['documents']} documents ({meta['source']})")
    print(f"train has {meta['train_tokens']:,} tokens")
    print(f"val has {meta['val_tokens']:,} tokens")
    print(f"unigram entropy of train: {meta['unigram_entropy_nats']:.4f} nats/token")


if __name__ == "__main__":
    sys.exit(cli(main))

# On Python 3.11.7 (Linux, pyenv), in 0.4 s (other Python versions give other counts):
# 247 documents (Python 3.11 standard library and pydoc topics)
# train has 4,878,010 tokens
# val has 286,495 tokens
# unigram entropy of train: 3.1703 nats/token
