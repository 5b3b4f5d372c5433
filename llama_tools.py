"""llama.cpp running the GGUF files of export.py: llama-cpp-python's model of a file, llama.cpp's CPU
roundings reproduced in our code, and the check of llama.cpp's logits and val loss against ours.

    llm = llama_tools.llama_cpp_model("out/model-mxfp4.gguf", n_ctx=64)   # llama-cpp-python's Llama
    llama_tools.llama_quantize("out/model-fp32.gguf", "out/q4_k_m.gguf", "Q4_K_M", pure=False)   # llama.cpp's own
    with llama_tools.LlamaCppArithmetic(file_model, path):   # our model, computed as llama.cpp rounds
        logits = file_model(x, y)[0]
    r = llama_tools.check_llama_cpp("out/model-mxfp4.gguf")   # export_gguf.py's check

The file itself (its tensors, checksums, reader, the file's model) is gguf_file.py's. docs/GGUF.md
derives the bound check_llama_cpp holds llama.cpp's logits to. llama.cpp's command-line tools
(llama-quantize, llama-imatrix) are found in the directory $LLAMA_CPP_BIN names, else on PATH.
"""
import importlib.util
import math
import os
import shutil
import subprocess

import numpy as np
import torch
import torch.nn.functional as F

import gguf_file
from data import loader
from gguf_file import GGUFError

Q = gguf_file.Q
QK = gguf_file.QK
QK_K = 256  # values per Q8_K block: the activations against a K-quant weight


# --- llama.cpp's arithmetic, in our code -----------------------------------------------------------

def _divide(a, t):
    """The number a divided by each value of t, correctly rounded in FP32 as C's a / t (torch computes a / t
    as a times t's reciprocal, two roundings)."""
    return torch.full_like(t, a) / t


def _q8_0(x):
    """x as llama.cpp's CPU matmul reads it against a Q4_0, Q8_0 or MXFP4 weight: Q8_0 per 32 values of
    a row, d = amax / 127 stored in FP16 and q = x * (127 / amax) rounded half to even (quantize_row_q8_0)."""
    v = x.float().unflatten(-1, (-1, QK))
    amax = v.abs().amax(-1, keepdim=True)
    q = torch.round(v * torch.where(amax > 0, _divide(127, torch.where(amax > 0, amax, 1.0)), 0.0))
    return (q * (amax / 127).half().float()).flatten(-2).type_as(x)


def _q8_k(x):
    """x as llama.cpp's CPU matmul reads it against a K-quant weight (Q2_K ... Q6_K): Q8_K per 256 values
    of a row (quantize_row_q8_K_ref, which x86 uses too): iscale = -127 / the value of largest magnitude,
    q = x * iscale rounded half to even (nearest_int; the product rounded to FP32 first: ggml-base has no
    FMA), at most 127, and the FP32 scale d = 1 / iscale; an all-zero block stays 0. Which of +a and -a is
    the largest does not matter: both give the same values."""
    v = x.float().unflatten(-1, (-1, QK_K))
    top = v.gather(-1, v.abs().argmax(-1, keepdim=True))
    iscale = _divide(-127, torch.where(top != 0, top, 1.0))
    q = torch.round(v * iscale).clamp_(max=127).add_(0.0)  # -0 + 0 = +0: the integer code 0, as ggml's int8
    return torch.where(top != 0, q * _divide(1, iscale), 0.0).flatten(-2).type_as(x)


# How llama.cpp's CPU matmul rounds the activations against a weight of each type (its vec_dot_type,
# ggml-cpu.c's type_traits_cpu).
K_QUANTS = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
ACTIVATIONS = {Q.Q4_0: _q8_0, Q.Q8_0: _q8_0, Q.MXFP4: _q8_0, **dict.fromkeys(K_QUANTS, _q8_k),
               Q.BF16: lambda x: x.bfloat16().type_as(x), Q.F16: lambda x: x.half().type_as(x), Q.F32: lambda x: x}


def _fp16_gelu(x):
    """ggml's GELU: the tanh GELU of x rounded to FP16, read from a table of FP16 values; x past +-10 as is, 0."""
    h = x.half().float()
    y = (0.5 * h * (1 + torch.tanh(0.7978845608028654 * h * (1 + 0.044715 * h * h)))).half().type_as(x)
    return torch.where(x >= 10, x, torch.where(x <= -10, torch.zeros_like(x), y))


def _fp16_attention(q, k, v, is_causal=True, enable_gqa=False, **_):
    """Attention as llama.cpp's (without flash attention): K and V in its FP16 cache, Q rounded to FP16 for
    the K dot products, the softmax in FP32, its probabilities rounded to FP16 for the V dot products."""
    q, k, v = (t.half().float() for t in (q, k, v))
    if enable_gqa:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1).half().float() @ v


class LlamaCppArithmetic(torch.overrides.TorchFunctionMode):
    """Our model computed with llama.cpp's CPU roundings (with model_from_gguf's model: its weights and
    GELU): each Linear's input rounded as llama.cpp rounds it against the weight's GGUF type (ACTIVATIONS),
    the FP16 GELU table, FP16 attention. What remains between llama.cpp's logits and these is FP32
    summation order, which can put a rounded value on the other side of a rounding boundary."""

    def __init__(self, model, path):
        super().__init__()
        types = {t.name: t.tensor_type for t in gguf_file.read(path).tensors}
        names = gguf_file.gguf_names(model.config)  # GPT2's head is its embedding: one parameter, token_embd's type
        unknown = sorted({t.name for t in types.values()} - {t.name for t in ACTIVATIONS})
        if unknown:
            raise GGUFError(f"{path} holds {', '.join(unknown)} tensors, whose activations llama.cpp rounds in a way "
                            f"this check does not reproduce (llama_tools.ACTIVATIONS)")
        self.rounding = {id(p): ACTIVATIONS[types[names[k]]] for k, p in model.named_parameters()
                         if p.dim() == 2 and names.get(k) in types}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            return func(self.rounding[id(w)](x), w, *args[2:], **kwargs)
        if func is F.gelu:
            return _fp16_gelu(args[0])
        if func is F.scaled_dot_product_attention:
            return _fp16_attention(*args, **kwargs)
        return func(*args, **kwargs)


# --- llama.cpp itself (optional: llama-cpp-python) ----------------------------------------------------

def llama_cpp_model(path, n_ctx, plain_cpu=False):
    """llama-cpp-python's Llama of a GGUF file, logits at every position; plain_cpu: without llama.cpp's
    extra buffer types (the AMX tile kernels for Q4_0/Q8_0 die at ldtilecfg in some virtual machines),
    which llama-cpp-python's Llama does not pass on, so its default model parameters are wrapped."""
    import llama_cpp
    import llama_cpp.llama_cpp as api
    defaults = api.llama_model_default_params

    def plain():
        params = defaults()
        params.use_extra_bufts = False
        return params
    api.llama_model_default_params = plain if plain_cpu else defaults
    try:
        return llama_cpp.Llama(str(path), n_ctx=n_ctx, logits_all=True, verbose=False)
    finally:
        api.llama_model_default_params = defaults


def _eval_batches(model, info, eval_iters):
    """train.py's evaluation batches (x, y) of the export's run (its dataset, seed, batch size)."""
    config = info["config"]
    directory = loader.data_dir(config["dataset"])
    data = loader.open_split(directory, "val", loader.read_meta(directory), model.config.block_size)
    return [loader.eval_batch(data, "val", k, seed=config["seed"], batch_size=config["batch_size"],
                              block_size=model.config.block_size, device="cpu")
            for k in range(eval_iters or config["eval_iters"])]


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
    if importlib.util.find_spec("llama_cpp") is None:
        raise GGUFError("llama-cpp-python is not installed: pip install llama-cpp-python (it builds llama.cpp "
                        "from source, minutes)")
    batches = _eval_batches(model, info, eval_iters)
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
            llm.reset()
            llm.eval(x[b].tolist())
            theirs = torch.tensor(np.array(llm.scores[:len(target)]), dtype=torch.float32)
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


# --- llama.cpp's command-line tools ------------------------------------------------------------------

def llama_cpp_tool(name):
    """The path of llama.cpp's command-line tool `name` (llama-quantize, llama-imatrix, llama-perplexity):
    in the directory $LLAMA_CPP_BIN names, else on PATH; None where it is in neither."""
    folder = os.environ.get("LLAMA_CPP_BIN")
    if folder:
        path = os.path.join(folder, name)
        return path if os.path.isfile(path) and os.access(path, os.X_OK) else None
    return shutil.which(name)


def llama_quantize(src, dst, qtype, pure=True, keep="bf16", imatrix=None):
    """llama-quantize of the GGUF file src into dst in qtype (its name for a type or a mix: Q4_0, Q4_K_M,
    ...): every other 2-D weight in that type where pure (--pure: no K-quant mixture), the token embeddings
    and the head in `keep` (as export.py keeps them, so that files compare by their block Linears), with
    the importance matrix at imatrix where given. GGUFError (one line) where the tool is absent or fails."""
    tool = llama_cpp_tool("llama-quantize")
    if tool is None:
        raise GGUFError("llama-quantize not found: build llama.cpp's tools (cmake -B build && cmake --build build "
                        "--target llama-quantize) and set LLAMA_CPP_BIN to build/bin, or put them on PATH")
    args = [tool, *(["--pure"] if pure else []), "--token-embedding-type", keep, "--output-tensor-type", keep,
            *(["--imatrix", str(imatrix)] if imatrix else []), str(src), str(dst), qtype]
    run = subprocess.run(args, capture_output=True, text=True)
    if run.returncode != 0:
        last = (run.stderr.strip().splitlines() or ["no message"])[-1]
        raise GGUFError(f"llama-quantize {qtype} of {src} failed (exit status {run.returncode}): {last}")
    return dst
