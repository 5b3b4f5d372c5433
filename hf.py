"""Export a train.py checkpoint as a Hugging Face transformers directory: config.json, model.safetensors
and the data's tokenizer for AutoTokenizer (byte tokens, SentencePiece or a tokenizer.json; not
tiktoken's, whose hub files are GPT-2's). The library is files/pretrained.py (save_pretrained).

    python hf.py --ckpt=out/ckpt.pt --out=hf_out     # a training checkpoint -> a transformers directory
    python hf.py --ckpt=out/model-mxfp4.safetensors --out=hf_out   # export.py's file: its dequantized weights
"""
import os
import sys

import checkpoint
from configurator import configure
from data import tokenizer
from data import loader
from data.common import DataError, load_meta
from files import pretrained
from util import cli

DEFAULTS = dict(
    # the training checkpoint (ckpt.pt, ckpt.dcp, or a run directory holding one), or a low-precision
    # file of export.py (.safetensors: its dequantized weights)
    ckpt="out/ckpt.pt",
    out="",  # the directory to write (must not exist, or be empty); required
    data_dir="",  # where the data's meta.json and tokenizer files are; "": data/<the checkpoint's dataset>
)
USAGE = "usage: python hf.py --out=DIR [--ckpt=out/ckpt.pt] [--data_dir=DIR]"


def read_exported(path):
    """A file of export.py as a checkpoint dict: its model's dequantized weights, architecture and config."""
    from files import lowbit
    try:
        model, info = lowbit.load(path)
    except lowbit.ExportError as e:
        raise pretrained.HFError(str(e)) from None
    return {"model": model.state_dict(), "model_args": info["model_args"], "config": info.get("config") or {}}


def data_tokenizer(ckpt, data_dir=""):
    """(tokenizer.Tokenizer or None, why none) of the data the checkpoint was trained on: the one its
    meta.json names (data.common.load_meta; the .bin files need not be there)."""
    data_dir = data_dir or loader.data_dir(str((ckpt.get("config") or {}).get("dataset", "default")))
    try:
        meta = load_meta(data_dir, bins=False)
    except DataError as e:
        return None, str(e)
    spec = str(meta.get("tokenizer"))
    if spec != "bytes" and not spec.startswith(("sentencepiece:", "tokenizers:")):
        hint = "; GPT-2's own is openai-community/gpt2's" if spec == "tiktoken:gpt2" else ""
        return None, f"the data's tokenizer {spec!r} has no transformers files{hint}"
    try:  # a missing tokenizer file is an error: the data is incomplete
        return tokenizer.from_meta(meta, os.path.abspath(data_dir)), None
    except tokenizer.TokenizerError as e:
        raise pretrained.HFError(str(e)) from None


def main(argv):
    c = dict(DEFAULTS)
    configure(c, argv, usage=USAGE)
    if not c["out"]:
        raise pretrained.HFError(f"--out is required: the directory to write ({USAGE.removeprefix('usage: ')})")
    pretrained.check_out(c["out"])  # before reading the checkpoint
    if c["data_dir"] and not os.path.isfile(os.path.join(c["data_dir"], "meta.json")):
        # named by the user: a wrong path is an error, where the checkpoint's own dataset may be absent
        raise pretrained.HFError(f"--data_dir={c['data_dir']!r} holds no meta.json: give the folder of the data the "
                                 f"run trained on (its prepare.py wrote meta.json there), or leave --data_dir out")
    ckpt = read_exported(c["ckpt"]) if c["ckpt"].endswith(".safetensors") else checkpoint.read(c["ckpt"])
    tok, why = data_tokenizer(ckpt, c["data_dir"])
    written, no_tokenizer = pretrained.save_pretrained(ckpt["model_args"], ckpt["model"], c["out"], tok)
    why = why or no_tokenizer
    print(f"wrote {c['out']}: {', '.join(written)}" + (f" (no tokenizer files: {why})" if why else ""))


if __name__ == "__main__":
    sys.exit(cli(main))
