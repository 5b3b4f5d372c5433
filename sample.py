"""Sample from a trained model.

    python sample.py --out_dir=out --start="def " --num_samples=3 --max_new_tokens=200
    python sample.py --init_from=out/model-auto.safetensors     # a low-precision model of export.py

Reads <out_dir>/ckpt.pt (written by train.py), or an exported file, and decodes with the tokenizer that the checkpoint's
dataset was prepared with (data/<dataset>/meta.json).
"""
import sys

import torch

import checkpoint
import gaussws
from configurator import check_device, configure
from data import loader
from data.common import DataError
from model import GPT, ROLES, ModelConfig
from util import UserError, cli, first_line, load_error

# -----------------------------------------------------------------------------
init_from = "resume"  # "resume": the checkpoint in out_dir; or a low-precision file of export.py (.safetensors)
out_dir = "out"  # the directory holding ckpt.pt (or ckpt.dcp)
start = "\n"  # the prompt; "FILE:prompt.txt" reads it from a file
num_samples = 3  # number of samples to draw
max_new_tokens = 200  # tokens generated per sample
temperature = 0.8  # 1.0 samples the model's distribution, lower is more predictable, 0 takes the argmax
top_k = 200  # sample only among the top_k most likely tokens; 0 keeps them all
seed = 1337
device = "cuda" if torch.cuda.is_available() else "cpu"  # "cpu", "cuda", "cuda:1", ...
# -----------------------------------------------------------------------------
CONFIG_KEYS = ("init_from", "out_dir", "start", "num_samples", "max_new_tokens", "temperature", "top_k", "seed",
               "device")


class UsageError(UserError):
    """Something the user can fix; reported as one line, no traceback."""


def load_tokenizer(meta):
    """(encode, decode) with the tokenizer that meta.json names (tokenizer.from_meta): bytes, tiktoken,
    or a SentencePiece / tokenizers file kept beside meta.json in meta["data_dir"]. The prompt may
    hold the end-of-sequence token's text (<|endoftext|>, </s>): it is read as that token."""
    from data import tokenizer
    try:
        tok = tokenizer.from_meta(meta, meta.get("data_dir"))
    except tokenizer.TokenizerError as e:
        raise UsageError(str(e)) from None
    return (lambda s: tok.encode(s, special=True)), tok.decode


def load_checkpoint(out_dir, device):
    """(model in eval mode, checkpoint dict) from <out_dir>/ckpt.pt, or from the sharded
    checkpoint <out_dir>/ckpt.dcp of an FSDP run; verified before it is loaded (checkpoint.read)."""
    ckpt = checkpoint.read(out_dir)
    path, pqt = ckpt["path"], ckpt["pqt"]
    try:
        model = GPT(ModelConfig(**ckpt["model_args"]))
        gaussws.convert(model, pqt["method"], ROLES[model.config.arch], b_init=pqt["b_init"], b_target=pqt["b_target"],
                        fmt=pqt["target_format"], ste_start=int(pqt["ste_start"]),
                        bits_per_weight=pqt["bits_per_weight"])
        model.load_state_dict(ckpt["model"])
    except (TypeError, ValueError, RuntimeError, KeyError) as e:
        raise UsageError(f"{path} is not a checkpoint of this project's model ({load_error(e)}): train it with "
                         f"train.py, or point --out_dir at the run that made it")
    model.eval()  # also turns the PQT noise off: eval-mode PQTLinear is a plain Linear
    return model.to(device), ckpt


def load_export(path, device):
    """(model in eval mode, info) from a file of export.py: the model holds the dequantized weights."""
    from files import lowbit
    if not path.endswith(".safetensors"):
        raise UsageError(f"--init_from={path!r}: expected 'resume' or a .safetensors file written by export.py")
    try:
        return lowbit.load(path, device)
    except lowbit.ExportError as e:
        raise UsageError(str(e)) from None


def load_meta(ckpt):
    """meta.json of the checkpoint's dataset (loader.read_meta; its .bin files need not be there),
    with "data_dir": where its tokenizer files lie."""
    directory = loader.data_dir(str((ckpt.get("config") or {}).get("dataset", "default")))
    try:
        return {**loader.read_meta(directory, bins=False), "data_dir": directory}
    except DataError as e:
        raise UsageError(f"the tokenizer of the checkpoint's dataset is unknown: {e}") from None


def main(argv):
    cfg = {k: globals()[k] for k in CONFIG_KEYS}
    configure(cfg, argv)
    check_device(cfg)
    dev = torch.device(cfg["device"])
    if cfg["temperature"] < 0:
        raise UsageError(f"--temperature must be >= 0, got {cfg['temperature']}")
    for key in ("num_samples", "max_new_tokens"):
        if cfg[key] < 1:
            raise UsageError(f"--{key}={cfg[key]}: expected an integer >= 1")
    if not 0 <= cfg["seed"] < 2**63:
        raise UsageError(f"--seed={cfg['seed']}: expected an integer in [0, 2^63)")

    if cfg["init_from"] == "resume":
        model, ckpt = load_checkpoint(cfg["out_dir"], dev)
    else:
        model, ckpt = load_export(cfg["init_from"], dev)
    broken = [k for k, v in model.state_dict().items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if broken:  # a diverged model: its logits are NaN, and the argmax of NaN is token 0
        source = cfg["out_dir"] if cfg["init_from"] == "resume" else cfg["init_from"]
        raise UsageError(f"the model of {source} holds non-finite values (NaN or Inf) in {len(broken)} tensor(s), "
                         f"e.g. {broken[0]}: it diverged and cannot be sampled; use an earlier checkpoint")
    meta = load_meta(ckpt)
    if meta.get("vocab_size", 0) > model.config.vocab_size:
        raise UsageError(f"the dataset's vocab ({meta.get('vocab_size')}) is larger than the model's "
                         f"({model.config.vocab_size}): the checkpoint was trained on other data")
    encode, decode = load_tokenizer(meta)

    prompt = cfg["start"]
    if prompt.startswith("FILE:"):
        try:
            with open(prompt[5:], encoding="utf-8") as f:
                prompt = f.read()
        except OSError as e:
            raise UsageError(f"cannot read the prompt file {prompt[5:]}: {first_line(e)}")
        except UnicodeDecodeError as e:
            raise UsageError(f"the prompt file {prompt[5:]} is not UTF-8 text (byte {e.start}); save it as UTF-8")
    ids = encode(prompt)
    if not ids:
        raise UsageError("the prompt is empty: pass --start=TEXT")
    x = torch.tensor(ids, dtype=torch.long, device=dev)[None, ...]

    torch.manual_seed(cfg["seed"])
    # BF16 autocast on GPUs that have it, as in training; the CPU samples in FP32.
    use_bf16 = dev.type == "cuda" and torch.cuda.is_bf16_supported()
    with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=use_bf16):
        for _ in range(cfg["num_samples"]):
            y = model.generate(x, cfg["max_new_tokens"], temperature=cfg["temperature"],
                               top_k=cfg["top_k"] if cfg["top_k"] > 0 else None, vocab_size=meta.get("vocab_size"))
            print(decode(y[0].tolist()))
            print("---------------")


if __name__ == "__main__":
    sys.exit(cli(main))
