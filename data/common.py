"""The data library: what the data/<name>/prepare.py scripts do, and the one reader of a prepared
dataset's meta.json (load_meta, which data/loader.py, train.py and hf.py use).

data/openwebtext and data/c4: load documents (from the Hugging Face hub or local files), tokenize
them (tokenizer.py: tiktoken, SentencePiece, Hugging Face tokenizers) in parallel processes, and
write train.bin/val.bin (the tokenizer's end-of-sequence token after every document), meta.json and
the tokenizer's files atomically; their command line (PREPARE_DEFAULTS, prepare_arguments). data/default: the offline
corpus of byte tokens (prepare_default), which loader.open_data makes where it is missing.
"""
import fcntl
import glob
import json
import math
import os
import sys
import sysconfig
from contextlib import contextmanager
from functools import partial

import numpy as np
from tqdm import tqdm

from data import tokenizer  # the prepare scripts put the repository root on sys.path
from util import UserError, cli, commit, read_json_or_none, reason, temp_path, unusable_dir

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
    named = f"{paths[0]!r}{' ...' if len(paths) > 1 else ''}"
    no_documents = f"{flag}: {named} holds no documents; give files with at least 2 documents"
    try:
        ds = load_dataset(kind, data_files=paths, split="train", streaming=streaming,
                          **({"sample_by": "document"} if kind == "text" else {}))
    except Exception as e:
        # datasets' JSON builder infers its fields from the first record: files without one (empty, or blank
        # lines) end in StopIteration, or in a split that "corresponds to no data"
        if isinstance(e, StopIteration) or "corresponds to no data" in str(e):
            raise DataError(no_documents) from None
        raise DataError(f"{flag}: could not read {named} ({reason(e)})") from e
    if ds.column_names == []:  # a stream of blank lines: no first record to take fields from
        raise DataError(no_documents)
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


def check_out_dir(out_dir, origin=None):
    """out_dir can take a dataset's files: it can be written, it is not a run directory of train.py, and,
    given the origin of the data to prepare ({"hub": name} or {"data_files": ...}), any dataset already
    prepared there came from the same origin (prepared again, as after an interrupted run); hours of
    another dataset's preparation are not replaced by a mistyped --out_dir."""
    why = unusable_dir(out_dir)
    if why:
        raise DataError(f"--out_dir={str(out_dir)!r} is unusable: {why}; choose a directory that can be written")
    if any(os.path.exists(os.path.join(out_dir, name)) for name in ("ckpt.pt", "ckpt.dcp", "metrics.jsonl")):
        raise DataError(f"--out_dir={str(out_dir)!r} is a run directory of train.py; choose another --out_dir")
    meta_path = os.path.join(out_dir, "meta.json")
    if origin is None or not os.path.exists(meta_path):
        return
    meta = read_json_or_none(meta_path)
    source = meta.get("source") if isinstance(meta, dict) else None
    theirs = {k: source.get(k) for k in origin} if isinstance(source, dict) else source
    if theirs != origin:
        raise DataError(f"--out_dir={str(out_dir)!r} already holds a dataset prepared from {theirs or 'elsewhere'}, "
                        f"not {origin}; choose another --out_dir, or remove its train.bin, val.bin and meta.json first")


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


def load_meta(data_dir, bins=True):
    """meta.json of a prepared dataset, the one reader of it: its fields checked, and with bins, checked
    against its .bin files before anything trains on them: sizes, and every token below vocab_size
    (numpy's max over the memory-mapped file: one read of the data, about a second for OpenWebText's
    17 GB from the page cache). bins=False for a reader of the tokenizer alone, where the .bin files
    may be absent. Raises DataError (one line: what is wrong, the value, what is accepted)."""
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
    for split in ("train", "val") if bins else ():
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


# ---------------------------------------------------------------------------------------------
# the command line of data/openwebtext/prepare.py and data/c4/prepare.py (configurator: --key=value,
# a bare --streaming, --help from these comments)

PREPARE_DEFAULTS = dict(
    # local files instead of the hub: comma-separated paths or globs of .json/.jsonl/.parquet (documents
    # in field 'text', may be .gz) or .txt (one document each)
    data_files="",
    val_data_files="",  # with data_files: the local files of the validation split (c4, which keeps its own)
    out_dir="",  # where train.bin, val.bin and meta.json go; "": the script's own folder
    num_proc=max(1, (os.cpu_count() or 2) // 2),  # processes for loading and tokenizing
    # a tiktoken encoding name, a SentencePiece model (Llama 2's tokenizer.model), a tokenizer.json or a
    # directory holding one, or a Hugging Face hub name
    tokenizer="gpt2",
    streaming=False,  # read documents as they arrive instead of downloading the whole dataset first
    max_docs=0,  # use at most this many documents (per split where the dataset has its own val split); 0: all
)


def prepare_arguments(config, script):
    """prepare(...)'s keyword arguments from a prepare script's command line: config holds the keys of
    PREPARE_DEFAULTS it takes, as configure set them (its help's comments are those above: configure
    with script=data/common.py); script is its __file__, whose folder is the default out_dir. A bad
    value is one line (DataError)."""
    config = dict(config)
    for key, low in (("num_proc", 1), ("max_docs", 0)):
        if key in config and config[key] < low:
            raise DataError(f"--{key}={config[key]}: expected an integer >= {low}")
    encoding = config.pop("tokenizer")  # prepare's name: a tokenizer.Tokenizer, or what names one
    unset = {k: v or None for k, v in config.items() if k.endswith("data_files") or k == "max_docs"}
    return {**config, **unset, "encoding": encoding,
            "out_dir": config["out_dir"] or os.path.dirname(os.path.abspath(script))}


def run(main):
    """main(argv) as a prepare script's command: bad input or a DataError is one line on stderr and
    exit status 1 (util.cli)."""
    from huggingface_hub.utils import logging as hub_logging
    hub_logging.set_verbosity_error()  # one line on failure, not the hub client's retry log before it
    sys.exit(cli(main))


# ---------------------------------------------------------------------------------------------
# the offline default corpus: the Python standard library's own source and documentation
#
# Every machine that runs this project has this text, so the default run needs no download. The
# documents are the top-level modules of the standard library (sysconfig's "stdlib" directory, *.py
# directly in it, sorted by name; packages and tests are left out so the corpus stays a few MB) and
# then the pydoc topics of the reference manual (pydoc_data.topics, sorted by topic), when that module
# is installed. Docstrings come with the source. Tokens are the UTF-8 bytes themselves (vocab 256,
# "tokenizer": "bytes" in meta.json). Split: document i goes to val when i % VAL_EVERY == 0, else to
# train: about 5%, and the same on every run of the same Python. train.bin and val.bin are uint16,
# like the other datasets, so train.py reads every dataset the same way. The files are staged (all
# written, then renamed, meta.json last) under prepare_lock, so two first runs that both find the
# corpus missing neither collide nor see half-written files.

DEFAULT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default")
VAL_EVERY = 20  # document i goes to val when i % VAL_EVERY == 0
MAX_BYTES = 8 * 2**20  # stop adding documents past this, so preparing stays about a second on any Python


def stdlib_documents():
    """(name, bytes) of every document of the default corpus, in a fixed order."""
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


def prepare_default(out_dir=DEFAULT_DIR):
    """Write the default corpus' train.bin, val.bin and meta.json into out_dir; return the meta dict.
    Raises DataError."""
    check_out_dir(out_dir)
    with prepare_lock(out_dir):
        return _prepare_default(out_dir)


def _prepare_default(out_dir):
    docs = stdlib_documents()
    train = b"".join(text for i, (_, text) in enumerate(docs) if i % VAL_EVERY)
    val = b"".join(text for i, (_, text) in enumerate(docs) if i % VAL_EVERY == 0)
    train_ids = np.frombuffer(train, dtype=np.uint8).astype(np.uint16)
    val_ids = np.frombuffer(val, dtype=np.uint8).astype(np.uint16)
    meta = {
        "vocab_size": 256,
        "tokenizer": "bytes",
        "dtype": "uint16",
        "train_tokens": len(train_ids),
        "val_tokens": len(val_ids),
        "max_token": int(max(train_ids.max(), val_ids.max())),
        "unigram_entropy_nats": unigram_entropy(train_ids),
        "documents": len(docs),
        "source": f"Python {sysconfig.get_python_version()} standard library and pydoc topics",
    }
    files = {"train.bin": train_ids.tobytes(), "val.bin": val_ids.tobytes(),
             "meta.json": (json.dumps(meta, indent=1) + "\n").encode()}
    with staged(out_dir, files) as temps:  # all written, then renamed: a full disk changes nothing
        for name, data in files.items():
            with open(temps[name], "wb") as f:
                f.write(data)
    return meta


def prepare_default_if_missing(out_dir=DEFAULT_DIR):
    """The meta dict of out_dir, preparing the default corpus first unless a complete copy is there.
    Under the preparation lock, so when two runs start at once the second waits for the first and
    uses its files (prepare_default would write them again, removing meta.json while the first reads it)."""
    check_out_dir(out_dir)
    with prepare_lock(out_dir):
        try:
            return load_meta(out_dir)
        except DataError:
            pass
        return _prepare_default(out_dir)
