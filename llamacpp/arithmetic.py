"""llama.cpp's CPU arithmetic reproduced in our code: how its matmuls round the activations against each
weight type (Q8_0 or Q8_K blocks, ACTIVATIONS), its FP16 GELU table and its FP16 attention, as a torch
function mode over our model of a GGUF file (files.gguf_file.model_from_gguf).

    with arithmetic.LlamaCppArithmetic(file_model, path):   # our model, computed as llama.cpp rounds
        logits = file_model(x, y)[0]

What remains between llama.cpp's logits and these is FP32 summation order; docs/GGUF.md derives the bound
runtime.check_llama_cpp holds llama.cpp to.
"""
import math

import torch
import torch.nn.functional as F

from files import gguf_file
from files.gguf_file import GGUFError

Q = gguf_file.Q
QK = gguf_file.QK
QK_K = 256  # values per Q8_K block: the activations against a K-quant weight


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
               Q.IQ4_NL: _q8_0, Q.IQ4_XS: _q8_k,
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
                            f"this check does not reproduce (llamacpp.arithmetic.ACTIVATIONS)")
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

