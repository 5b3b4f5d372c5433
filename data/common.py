"""
What data/openwebtext/prepare.py and data/c4/prepare.py share: load documents (from the Hugging
Face hub or local files), tokenize them (tokenizer.py: tiktoken, SentencePiece, Hugging Face
tokenizers) in parallel processes, and write train.bin/val.bin (the tokenizer's end-of-sequence
token after every document), meta.json and the tokenizer's files atomically.
"""
import argparse
import fcntl
import glob
import json
import math
import os
import sys
import tempfile
from contextlib import contextmanager
from functools import partial

import numpy as np
from tqdm import tqdm

import tokenizer  # the repo root's; the prepare scripts put the root on sys.path
from util import UserError, cli, commit, reason, temp_path

# datasets' builder for each local file type; a .txt file is one document, as in OpenWebText's
# own archives (one .txt per web page)
BUILDERS = {".json": "json", ".jsonl": "json", ".txt": "text", ".parquet": "parquet"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
WRITE_BATCH = 4096  # documents per memmap write: big enough to be fast, small enough for RAM


class DataError(UserError):
    """Bad input or an unreachable source: the message is one line that says what to do."""


def get_encoding(encoding):
    """The tokenizer.Tokenizer that --tokenizer names (tokenizer.load: a tiktoken name, a SentencePiece
    tokenizer.model, a tokenizer.json or its directory, a hub name), or one given as an object."""
    try:
        return tokenizer.load(encoding)
    except tokenizer.TokenizerError as e:
        raise DataError(str(e)) from None


def load_hub(path, name=None, streaming=False, num_proc=None, offline="--data_files=path/to/*.jsonl"):
    """The dataset's splits from the Hugging Face hub (a DatasetDict, or IterableDatasetDict if streaming);
    offline: the flags that would read local files instead, for the error message."""
    from datasets import load_dataset
    print(f"loading {path}{f' ({name})' if name else ''} from the Hugging Face hub")
    try:
        return load_dataset(path, name, streaming=streaming, num_proc=None if streaming else num_proc)
    except Exception as e:
        raise DataError(f"could not load {path} from the Hugging Face hub ({reason(e)}); "
                        f"to run offline on local files: {offline}") from e


def find_files(data_files, flag="--data_files"):
    """(datasets builder, paths) of comma-separated local paths or globs, checked before any slow work."""
    paths = []
    for pattern in str(data_files).split(","):
        found = sorted(glob.glob(os.path.expanduser(pattern)))
        if not found:
            raise DataError(f"{flag}: no file matches {pattern!r}")
        paths += found
    kinds = set()
    for p in paths:
        if not os.path.isfile(p) or not os.access(p, os.R_OK):
            raise DataError(f"{flag}: {p!r} is not a readable file")
        stem, ext = os.path.splitext(p)
        if ext in COMPRESSIONS:
            ext = os.path.splitext(stem)[1]
        if ext.lower() not in BUILDERS:
            raise DataError(f"{flag}: {p!r} is not one of {', '.join(BUILDERS)} (optionally {'/'.join(COMPRESSIONS)})")
        kinds.add(BUILDERS[ext.lower()])
    if len(kinds) > 1:
        raise DataError(f"{flag}: mixes file types {sorted(kinds)}; give files of one type")
    return kinds.pop(), paths


def load_local(files, streaming=False, flag="--data_files"):
    """One split of documents from find_files' (builder, paths): field "text" of json/jsonl/parquet
    records, or one document per .txt file."""
    from datasets import load_dataset
    kind, paths = files
    try:
        ds = load_dataset(kind, data_files=paths, split="train", streaming=streaming,
                          **({"sample_by": "document"} if kind == "text" else {}))
    except Exception as e:
        raise DataError(f"{flag}: could not read {paths[0]!r}{' ...' if len(paths) > 1 else ''} ({reason(e)})") from e
    if ds.column_names is not None and "text" not in ds.column_names:
        raise DataError(f"{flag}: the files have no field 'text' (fields: {ds.column_names})")
    return ds


def _iterate(ds):
    """The stream's records; a text that is not a string stops it (datasets would cast 5 to "5")."""
    for i, record in enumerate(ds):
        if not isinstance(record["text"], str):
            raise DataError(f"document {i} of the stream has a 'text' of type {type(record['text']).__name__}, "
                            f"not a string; every document needs its text as a string")
        yield record


def materialize(ds, max_docs, cache_dir):
    """At most max_docs documents as a regular on-disk Dataset, so tokenizing can use num_proc.
    A stream is read here, into cache_dir; that is where its download or read errors surface."""
    from datasets import Dataset, Features, IterableDataset, Value
    if not isinstance(ds, IterableDataset):
        return ds.select(range(min(max_docs, len(ds)))) if max_docs else ds
    if max_docs:
        ds = ds.take(max_docs)
    try:
        return Dataset.from_generator(partial(_iterate, ds.select_columns(["text"])),
                                      features=Features({"text": Value("string")}), cache_dir=cache_dir)
    except Exception as e:
        cause = e
        while cause is not None and not isinstance(cause, DataError):  # datasets wraps the generator's errors
            cause = cause.__cause__ or cause.__context__
        raise cause or DataError(f"reading the stream failed ({reason(e)})") from None


def check_texts(ds, what):
    """Every document of ds (a Dataset; `what` names its source for the message) has a text that is a
    string of valid UTF-8, before any is tokenized: pyarrow's JSON reader keeps invalid bytes, and
    numbers or nulls in 'text', which would fail deep inside tokenizing."""
    import pyarrow as pa
    kind = ds.features["text"]
    if getattr(kind, "dtype", None) not in ("string", "large_string"):
        raise DataError(f"{what}: field 'text' is not a string in every document (it reads as {kind}); every "
                        f"document needs its text as a string")
    start = 0
    for batch in ds.with_format("arrow").iter(batch_size=WRITE_BATCH):
        texts = batch["text"]
        if texts.null_count:
            i = start + texts.is_null().to_pylist().index(True)
            raise DataError(f"{what}: document {i} has no text (null); every document needs its text as a string")
        for chunk in texts.chunks if isinstance(texts, pa.ChunkedArray) else [texts]:
            try:
                chunk.validate(full=True)
            except pa.ArrowInvalid as e:
                for j, raw in enumerate(chunk.cast(pa.large_binary()).to_pylist()):
                    try:
                        raw.decode("utf-8")
                    except UnicodeDecodeError as bad:
                        raise DataError(f"{what}: the text of document {start + j} is not valid UTF-8 (byte "
                                        f"{bad.start}); save the files as UTF-8") from None
                raise DataError(f"{what}: the documents do not read as text ({e})") from None
            start += len(chunk)


# ---------------------------------------------------------------------------------------------
# writing and reading a prepared dataset safely

DTYPES = ("uint16", "uint32")  # token ids on disk: uint16 while the vocabulary fits, else uint32


def reserve(path, nbytes):
    """Create path with nbytes allocated on disk. A memory map of a sparse file that meets a full disk
    dies of SIGBUS, with no message; reserved first, a full disk is an OSError (ENOSPC) here."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    finally:
        os.close(fd)


@contextmanager
def staged(out_dir, names):
    """{name: temporary path} for the files `names` of out_dir (meta.json last). Once the block has
    written them all, they replace out_dir's files: meta.json is removed first and renamed last, so
    between the renames the data counts as incomplete, never as a mix of two preparations. A failure
    before that (a full disk: one DataError line) leaves out_dir's files as they were, no temporary left."""
    temps = {name: temp_path(os.path.join(out_dir, name)) for name in names}
    try:
        yield temps
        meta = os.path.join(out_dir, "meta.json")
        if os.path.exists(meta):
            os.remove(meta)
        for name, tmp in temps.items():
            commit(tmp, os.path.join(out_dir, name))
    except OSError as e:
        raise DataError(f"cannot write into {out_dir} ({e.strerror or e}): free space there or choose another "
                        f"--out_dir") from None
    finally:
        for tmp in temps.values():
            if os.path.exists(tmp):
                os.remove(tmp)


def unusable_dir(path):
    """Why no file can be written in the directory path (made where missing), or None. Tried rather
    than read off the permission bits, which do not bind root: a temporary directory is made and
    removed in path's first existing ancestor."""
    probe = os.path.abspath(path)
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return f"{probe} is not a directory"
    try:
        os.rmdir(tempfile.mkdtemp(dir=probe, prefix=".probe-"))
    except OSError as e:
        return f"cannot write in {probe} ({e.strerror})"
    return None


def check_out_dir(out_dir):
    why = unusable_dir(out_dir)
    if why:
        raise DataError(f"--out_dir={str(out_dir)!r} is unusable: {why}; choose a directory that can be written")


@contextmanager
def prepare_lock(out_dir):
    """One preparation of out_dir at a time: an fcntl lock on the folder itself (no lock file to
    leave behind; the kernel drops it if the process dies). A second run waits for the first
    instead of interleaving its files with it."""
    os.makedirs(out_dir, exist_ok=True)
    fd = os.open(out_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def load_meta(data_dir):
    """meta.json of a prepared dataset, checked against its .bin files before anything trains on
    them: sizes, and every token below vocab_size (numpy's max over the memory-mapped file: one read
    of the data, about a second for OpenWebText's 17 GB from the page cache). Raises DataError (one
    line: what is wrong, the value, what is accepted)."""
    path = os.path.join(data_dir, "meta.json")
    again = f"prepare the data again (python {os.path.join(data_dir, 'prepare.py')})"
    try:
        with open(path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise DataError(f"{path} not found; prepare the data first") from None
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
        raise DataError(f"{path} is corrupt or unreadable ({reason(e)}); {again}") from None
    if not isinstance(meta, dict):
        raise DataError(f"{path} is corrupt: a JSON {type(meta).__name__}, expected an object; {again}")
    vocab = meta.get("vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab <= 0:
        raise DataError(f"{path}: vocab_size={vocab!r}; expected an integer > 0")
    dtype = meta.setdefault("dtype", "uint16")  # nanoGPT's other datasets: uint16, not recorded
    if dtype not in DTYPES:
        raise DataError(f"{path}: dtype={dtype!r}; expected one of {', '.join(DTYPES)}")
    itemsize = np.dtype(dtype).itemsize
    if vocab > np.iinfo(dtype).max + 1:
        raise DataError(f"{path}: vocab_size={vocab} does not fit dtype {dtype} (at most {np.iinfo(dtype).max + 1})")
    max_token = meta.get("max_token")
    if max_token is not None and not (isinstance(max_token, int) and 0 <= max_token < vocab):
        raise DataError(f"{path}: max_token={max_token!r} but vocab_size={vocab}: the data holds tokens the "
                        f"vocabulary does not; prepare it with the tokenizer of that vocabulary")
    for split in ("train", "val"):
        bin_path = os.path.join(data_dir, f"{split}.bin")
        try:
            size = os.path.getsize(bin_path)
        except OSError:
            raise DataError(f"{bin_path} not found; {again}") from None
        tokens = meta.get(f"{split}_tokens")
        if tokens is not None and size != tokens * itemsize:
            raise DataError(f"{bin_path} holds {size} bytes, but meta.json says {tokens} tokens of {dtype} "
                            f"({tokens * itemsize} bytes): the dtype or the file is wrong; {again}")
        if size % itemsize:
            raise DataError(f"{bin_path} holds {size} bytes, not a whole number of {dtype} tokens; {again}")
        top = int(np.memmap(bin_path, dtype=dtype, mode="r").max()) if size else -1
        if top >= vocab or max_token is not None and top > max_token:
            said = f"vocab_size={vocab}" if top >= vocab else f"max_token={max_token}"
            raise DataError(f"{bin_path} holds token id {top}, but meta.json says {said}: the .bin files are not the "
                            f"data meta.json describes; {again}")
    return meta


def write_bins(splits, encoding, out_dir, num_proc, source):
    """_write_bins under prepare_lock(out_dir): two runs preparing one folder take turns."""
    with prepare_lock(out_dir):
        return _write_bins(splits, encoding, out_dir, num_proc, source)


def _write_bins(splits, encoding, out_dir, num_proc, source):
    """Tokenize {"train": Dataset, "val": Dataset} (one eot after each document) and write
    <split>.bin, meta.json and the tokenizer's files into out_dir. Everything goes to uniquely named
    temporary files first (staged) and is renamed only when all is written, so an interrupted run
    leaves earlier good files as they were, and a second run on the same out_dir waits for the first."""
    from datasets import Features, Sequence, Value
    enc = get_encoding(encoding)  # a name, a tokenizer.Tokenizer or a tiktoken.Encoding
    eot = enc.eot
    dtype = np.uint16 if enc.vocab_size <= 2**16 else np.uint32
    for split, ds in splits.items():
        if len(ds) == 0:
            raise DataError(f"the {split} split has no documents ({source})")

    def process(batch):
        ids = [x + [eot] for x in enc.encode_batch(batch["text"])]  # an eot's text inside a text stays text
        return {"ids": ids, "len": [len(x) for x in ids]}

    features = Features({"ids": Sequence(Value(np.dtype(dtype).name)), "len": Value("int64")})
    meta = {"vocab_size": enc.vocab_size, "dtype": np.dtype(dtype).name, **enc.meta()}
    names = [f"{split}.bin" for split in splits] + sorted(enc.files) + ["meta.json"]  # meta.json last
    with staged(out_dir, names) as temps:
        for split, ds in splits.items():
            tokenized = ds.map(process, batched=True, remove_columns=ds.column_names, features=features,
                               num_proc=num_proc if num_proc > 1 else None, desc=f"tokenizing {split}")
            n = int(np.sum(tokenized.with_format("numpy")["len"], dtype=np.uint64))
            reserve(temps[f"{split}.bin"], n * np.dtype(dtype).itemsize)
            arr = np.memmap(temps[f"{split}.bin"], dtype=dtype, mode="r+", shape=(n,))
            idx, max_token = 0, 0
            for batch in tqdm(tokenized.with_format("arrow").iter(batch_size=WRITE_BATCH),
                              total=math.ceil(len(tokenized) / WRITE_BATCH), desc=f"writing {split}.bin"):
                ids = batch["ids"].combine_chunks().flatten().to_numpy()
                arr[idx: idx + len(ids)] = ids
                idx += len(ids)
                max_token = max(max_token, int(ids.max(initial=0)))
            arr.flush()
            del arr
            meta[f"{split}_tokens"], meta[f"{split}_docs"] = n, len(ds)
            meta["max_token"] = max(meta.get("max_token", 0), max_token)
        meta["source"] = source
        for name, blob in enc.files.items():  # the tokenizer's files, which meta.json names (SentencePiece, tokenizers)
            with open(temps[name], "wb") as f:
                f.write(blob)
        with open(temps["meta.json"], "w") as f:
            json.dump(meta, f, indent=2)
    print(f"wrote {', '.join(os.path.join(out_dir, n) for n in names)}: "
          + ", ".join(f"{s} {meta[f'{s}_tokens']:,} tokens" for s in splits))
    return meta


def argument_parser(doc, out_dir):
    """The command line both scripts share; doc is the script's docstring."""
    def positive(s):
        if not s.isdigit() or int(s) < 1:
            raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}")
        return int(s)

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data_files", help="local files instead of the hub: comma-separated paths or globs of "
                   ".json/.jsonl/.parquet (documents in field 'text', may be .gz) or .txt (one document each)")
    p.add_argument("--out_dir", default=out_dir, help="where train.bin, val.bin and meta.json go (default: %(default)s)")
    p.add_argument("--num_proc", type=positive, default=max(1, (os.cpu_count() or 2) // 2),
                   help="processes for loading and tokenizing (default: %(default)s)")
    p.add_argument("--tokenizer", dest="encoding", metavar="NAME", default="gpt2",
                   help="a tiktoken encoding name, a SentencePiece model (Llama 2's tokenizer.model), a tokenizer.json "
                   "or a directory holding one, or a Hugging Face hub name (default: %(default)s)")
    p.add_argument("--streaming", action="store_true",
                   help="read documents as they arrive instead of downloading the whole dataset first")
    p.add_argument("--max_docs", type=positive, help="use at most this many documents (per split where the "
                   "dataset has its own val split)")
    return p


def run(prepare, **kwargs):
    """Call prepare(**kwargs) for a command line: a DataError becomes one line on stderr and exit 1."""
    from huggingface_hub.utils import logging as hub_logging
    hub_logging.set_verbosity_error()  # one line on failure, not the hub client's retry log before it
    sys.exit(cli(lambda argv: prepare(**kwargs)))
