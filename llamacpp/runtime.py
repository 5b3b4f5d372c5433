"""llama.cpp running a GGUF file of export.py, through llama-cpp-python (optional: pip install
llama-cpp-python): its model of a file, its logits and val loss on train.py's evaluation batches, and the
check of them against ours.

    llm = runtime.llama_cpp_model("out/model-mxfp4.gguf", n_ctx=64)   # llama-cpp-python's Llama
    r = runtime.check_llama_cpp("out/model-mxfp4.gguf")                # export_gguf.py's check

check_llama_cpp compares llama.cpp's logits with three models of ours: the .safetensors export's, the
file's (files.gguf_file.model_from_gguf) and the file's computed with llama.cpp's roundings
(arithmetic.LlamaCppArithmetic); docs/GGUF.md derives the bound it holds them to.
"""
import importlib.util
import math

import numpy as np
import torch
import torch.nn.functional as F

from data import loader
from files import gguf_file
from files.gguf_file import GGUFError
from llamacpp.arithmetic import LlamaCppArithmetic


def llama_cpp_model(path, n_ctx, plain_cpu=False, threads=0):
    """llama-cpp-python's Llama of a GGUF file, logits at every position; plain_cpu: without llama.cpp's
    extra buffer types (the AMX tile kernels for Q4_0/Q8_0 die at ldtilecfg in some virtual machines),
    which llama-cpp-python's Llama does not pass on, so its default model parameters are wrapped.
    threads: llama.cpp's threads (0: llama-cpp-python's default, as many as cores for a batch); on a
    machine busy with other work, fewer threads than cores avoid ggml's threads waiting for each other
    (one thread was ten times as fast as two on 2 busy cores)."""
    import llama_cpp
    import llama_cpp.llama_cpp as api
    defaults = api.llama_model_default_params

    def plain():
        params = defaults()
        params.use_extra_bufts = False
        return params
    api.llama_model_default_params = plain if plain_cpu else defaults
    try:
        counts = dict(n_threads=threads, n_threads_batch=threads) if threads else {}
        return llama_cpp.Llama(str(path), n_ctx=n_ctx, logits_all=True, verbose=False, **counts)
    finally:
        api.llama_model_default_params = defaults


def require_llama_cpp_python():
    if importlib.util.find_spec("llama_cpp") is None:
        raise GGUFError("llama-cpp-python is not installed: pip install llama-cpp-python (it builds llama.cpp "
                        "from source, minutes)")


def _llama_cpp_logits(llm, tokens, n):
    """llama.cpp's logits (FP32, n rows) at the first n positions of one sequence of tokens."""
    llm.reset()
    llm.eval(tokens.tolist())
    return torch.tensor(np.array(llm.scores[:n]), dtype=torch.float32)


@torch.no_grad()
def check_llama_cpp(path, eval_iters=0, plain_cpu=False):
    """llama.cpp's logits for train.py's evaluation batches against three models of ours: lowbit.load's of
    the file's .safetensors (FP32, "ours"), model_from_gguf's (the file's weights and llama.cpp's GELU,
    "file") and the latter with llama.cpp's roundings (LlamaCppArithmetic, "arithmetic"). Returns their
    val losses, the largest logit differences, the effect of llama.cpp's roundings (max |arithmetic -
    file|), within_bound: llama.cpp's logits within twice that effect of the file's model's (docs/GGUF.md
    derives it), and the RMS of llama.cpp's logits less the file's model's and less its arithmetic's (how
    much of the difference the reproduced roundings account for). The file is verified, and shown to be
    of that export, first."""
    model, info = gguf_file.open_export(path)
    require_llama_cpp_python()
    batches = loader.eval_batches(info["config"], model.config.block_size, eval_iters)
    file_model = gguf_file.model_from_gguf(path, info["model_args"])
    arithmetic = LlamaCppArithmetic(file_model, path)
    llm = llama_cpp_model(path, model.config.block_size, plain_cpu)
    nll = dict(ours=0.0, file=0.0, arithmetic=0.0, llama_cpp=0.0)
    worst = dict(ours=0.0, file=0.0, arithmetic=0.0, rounding=0.0)
    squares = dict(file=0.0, arithmetic=0.0)
    top = same = n = 0
    for x, y in batches:
        with arithmetic:
            rounded = file_model(x, y)[0]
        for b, (ours, exact, target) in enumerate(zip(model(x, y)[0], file_model(x, y)[0], y)):
            theirs = _llama_cpp_logits(llm, x[b], len(target))
            for name, logits in (("ours", ours), ("file", exact), ("arithmetic", rounded[b]), ("llama_cpp", theirs)):
                nll[name] += F.cross_entropy(logits, target, reduction="sum").item()
                if name in worst:
                    worst[name] = max(worst[name], (theirs - logits).abs().max().item())
                if name in squares:
                    squares[name] += (theirs - logits).square().sum().item()
            worst["rounding"] = max(worst["rounding"], (rounded[b] - exact).abs().max().item())
            top, n = max(top, ours.abs().max().item()), n + len(target)
            same += (theirs.argmax(-1) == ours.argmax(-1)).sum().item()
    rms = {name: math.sqrt(total / (n * model.config.vocab_size)) for name, total in squares.items()}
    return dict(batches=len(batches), tokens=n, val_loss=nll["ours"] / n, val_loss_llama_cpp=nll["llama_cpp"] / n,
                val_loss_file=nll["file"] / n, val_loss_arithmetic=nll["arithmetic"] / n,
                max_logit_difference=worst["ours"], max_logit_difference_file=worst["file"],
                max_logit_difference_arithmetic=worst["arithmetic"], rounding_effect=worst["rounding"],
                within_bound=worst["file"] <= 2 * worst["rounding"], max_logit=top, same_next_token=same / n,
                rms_logit_difference_file=rms["file"], rms_logit_difference_arithmetic=rms["arithmetic"])


@torch.no_grad()
def model_val_loss(model, batches):
    """Our model's val loss on batches: the mean cross-entropy over every token, as check_llama_cpp's."""
    total = n = 0
    for x, y in batches:
        total += F.cross_entropy(model(x, y)[0].flatten(0, 1), y.flatten(), reduction="sum").item()
        n += y.numel()
    return total / n


@torch.no_grad()
def file_val_losses(path, reader, model_args, batches, plain_cpu=False, threads=0):
    """(llama.cpp's val loss of the GGUF file at path on batches, that of our model of the file:
    model_from_gguf, gguf's dequantizer (which has every type of QUANTIZE_TYPES' files) and llama.cpp's GELU)."""
    llm = llama_cpp_model(path, batches[0][0].shape[1], plain_cpu, threads)
    ours = gguf_file.model_from_gguf(path, model_args, reader)
    total = dict(llama_cpp=0.0, file=0.0)
    n = 0
    for x, y in batches:
        logits = ours(x, y)[0]
        for b, target in enumerate(y):
            theirs = _llama_cpp_logits(llm, x[b], len(target))
            total["llama_cpp"] += F.cross_entropy(theirs, target, reduction="sum").item()
            total["file"] += F.cross_entropy(logits[b], target, reduction="sum").item()
            n += len(target)
    del llm
    return total["llama_cpp"] / n, total["file"] / n

