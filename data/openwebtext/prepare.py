"""
Prepares OpenWebText for the GPT2-124M runs (Fig. 1b, 3) as nanoGPT does: each document's GPT-2 BPE
tokens followed by one end-of-text token, in train.bin and val.bin (val: 0.05% of the documents,
split off with nanoGPT's seed), plus meta.json.

    python data/openwebtext/prepare.py                                   # from the Hugging Face hub, ~54 GB
    python data/openwebtext/prepare.py --data_files='owt/*.jsonl' --num_proc=8   # local files, offline
"""
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
from configurator import configure  # noqa: E402
from data import common  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
# the hub's "openwebtext" lives here now; if its copy still holds only a loading script, datasets >= 4
# refuses it: download the data files and pass them with --data_files
HUB_DATASET = "Skylion007/openwebtext"
VAL_FRACTION, SPLIT_SEED = 0.0005, 2357  # nanoGPT's split: ~4k of ~8M documents go to val


def prepare(data_files=None, out_dir=HERE, encoding="gpt2", num_proc=1, streaming=False, max_docs=None):
    """Write out_dir/{train,val}.bin and meta.json; encoding is a tiktoken.Encoding or its name."""
    origin = {"data_files": data_files} if data_files else {"hub": HUB_DATASET}
    common.check_out_dir(out_dir, origin)  # before any slow work
    files = data_files and common.find_files(data_files)
    enc = common.get_encoding(encoding)  # before loading, so a missing tokenizer fails before a 54 GB download
    if data_files:
        ds = common.load_local(files, streaming)
        source = {"data_files": data_files}
    else:
        ds = common.load_hub(HUB_DATASET, streaming=streaming, num_proc=num_proc)["train"]
        source = {"hub": HUB_DATASET}
    source.update(val=f"train_test_split(test_size={VAL_FRACTION}, seed={SPLIT_SEED})", streaming=streaming,
                  max_docs=max_docs)
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".stream-") as cache_dir:  # holds a stream's documents
        ds = common.materialize(ds, max_docs, cache_dir)
        common.check_texts(ds, "--data_files" if data_files else HUB_DATASET)  # in the files' order, before the split
        if len(ds) < 2:
            raise common.DataError(f"need at least 2 documents to split off a val set, got {len(ds)} from {source}")
        split = ds.train_test_split(test_size=VAL_FRACTION, seed=SPLIT_SEED, shuffle=True)
        return common.write_bins({"train": split["train"], "val": split["test"]}, enc, out_dir, num_proc, source)


# the command line: these keys of common.PREPARE_DEFAULTS (--help shows their comments)
KEYS = ("data_files", "out_dir", "num_proc", "tokenizer", "streaming", "max_docs")


def main(argv):
    config = {k: common.PREPARE_DEFAULTS[k] for k in KEYS}
    usage = "usage: python data/openwebtext/prepare.py [--key=value ...] [--streaming]"
    configure(config, argv, script=common.__file__, usage=usage)
    return prepare(**common.prepare_arguments(config, __file__))


if __name__ == "__main__":
    common.run(main)

# Expected with the gpt2 tokenizer, as nanoGPT measured on the same data with the same split (not
# measured by this repository: its tests run offline):
# 8,013,769 documents -> train 8,009,762 docs, ~9B tokens (9,035,582,198), train.bin ~17 GB;
# val 4,007 docs, ~4M tokens (4,434,897), val.bin ~8.5 MB. uint16, since gpt2's vocab is 50257.
