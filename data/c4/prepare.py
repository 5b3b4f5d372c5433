"""
Prepares C4 (English, allenai/c4 "en") for the Llama2 runs (Fig. 4): each document's tokens followed
by one end-of-text token, in train.bin and val.bin (val: C4's own validation split), plus meta.json.
C4 en is ~305 GB of json.gz; --streaming with --max_docs reads only the documents it keeps.

    python data/c4/prepare.py --streaming --max_docs=1000000              # a slice, from the hub
    python data/c4/prepare.py --data_files='c4/en/c4-train.*.json.gz' \\
        --val_data_files='c4/en/c4-validation.*.json.gz' --num_proc=8      # local files, offline
"""
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root
from configurator import configure  # noqa: E402
from data import common  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
HUB_DATASET, HUB_CONFIG = "allenai/c4", "en"


def prepare(data_files=None, val_data_files=None, out_dir=HERE, encoding="gpt2", num_proc=1, streaming=False,
            max_docs=None):
    """Write out_dir/{train,val}.bin and meta.json; encoding is a tiktoken.Encoding or its name;
    max_docs limits each split."""
    common.check_out_dir(out_dir, {"data_files": data_files, "val_data_files": val_data_files} if data_files
                         else {"hub": f"{HUB_DATASET}:{HUB_CONFIG}"})  # before any slow work
    if bool(data_files) != bool(val_data_files):
        raise common.DataError("C4 keeps its own validation split: give --data_files (train) and --val_data_files "
                               "together, e.g. --data_files='en/c4-train.*.json.gz' "
                               "--val_data_files='en/c4-validation.*.json.gz'")
    files = data_files and (common.find_files(data_files), common.find_files(val_data_files, "--val_data_files"))
    enc = common.get_encoding(encoding)  # before loading, so a missing tokenizer fails before a long download
    if data_files:
        splits = {"train": common.load_local(files[0], streaming),
                  "val": common.load_local(files[1], streaming, flag="--val_data_files")}
        source = {"data_files": data_files, "val_data_files": val_data_files}
    else:
        offline = "--data_files='en/c4-train.*.json.gz' --val_data_files='en/c4-validation.*.json.gz'"
        ds = common.load_hub(HUB_DATASET, HUB_CONFIG, streaming=streaming, num_proc=num_proc, offline=offline)
        splits = {"train": ds["train"], "val": ds["validation"]}
        source = {"hub": f"{HUB_DATASET}:{HUB_CONFIG}"}
    source.update(val="C4's validation split", streaming=streaming, max_docs=max_docs)
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".stream-") as cache_dir:  # holds a stream's documents
        splits = {split: common.materialize(ds, max_docs, cache_dir) for split, ds in splits.items()}
        for split, flag in (("train", "--data_files"), ("val", "--val_data_files")):
            common.check_texts(splits[split], flag if data_files else f"{HUB_DATASET} {split}")
        return common.write_bins(splits, enc, out_dir, num_proc, source)


# the command line: these keys of common.PREPARE_DEFAULTS (--help shows their comments)
KEYS = ("data_files", "val_data_files", "out_dir", "num_proc", "tokenizer", "streaming", "max_docs")


def main(argv):
    config = {k: common.PREPARE_DEFAULTS[k] for k in KEYS}
    usage = "usage: python data/c4/prepare.py [--key=value ...] [--streaming]"
    configure(config, argv, script=common.__file__, usage=usage)
    return prepare(**common.prepare_arguments(config, __file__))


if __name__ == "__main__":
    common.run(main)

# Expected sizes, from published counts, not measured by this repository (its tests run offline):
# C4 en has 364,868,892 train and 364,608 validation documents (the dataset card). Dodge et al. (2021)
# count ~156B tokens in its train split, with their own tokenizer, not GPT-2 BPE; RedPajama reports
# ~175B Llama-tokenizer tokens for its copy of C4. So expect on the order of 150-180B gpt2 tokens in
# train.bin (~300-360 GB as uint16) and ~1/1000 of that in val.bin (~0.17B tokens, ~340 MB).
