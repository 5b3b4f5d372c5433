"""GPT2 and Llama2 in one file: the architectures; the method is applied to them from outside.

GPT2 follows nanoGPT (and so GPT-2 itself): learned positions, pre-LN, GELU, tied lm_head, and
GPT-2's own parameter names (transformer.wte, wpe, h.N.attn.c_attn, ...), so a GPT-2 checkpoint
maps key by key. Llama2 follows Meta's Llama 2: RMSNorm, rotary embeddings, SwiGLU, grouped-query
attention, untied head, no biases; it reuses the same container names (transformer.wte,
transformer.h.N.attn.q, ...) so that the two read alike.

Every Linear is a plain nn.Linear. Pseudo-quantization training enters afterwards:
gaussws.convert(model, "gaussws[od]", ROLES[arch], ...) swaps the Linears whose role the method
names for gaussws.PQTLinear, keeping their weights; embeddings, norms and lm_head always stay.
Besides ROLES (which Linear of a block is qkv, out, up or down: the architecture's side of the
method switch), all model.py knows of the method is the name of the bitwidth parameters such a
layer adds, b_i: get_num_params leaves them out of the model's size, get_num_bitwidth_params
counts them.
"""
import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F



@dataclass
class ModelConfig:
    arch: str = "gpt2"  # "gpt2" or "llama2"
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int = None  # llama2 grouped-query attention; None -> n_head (plain multi-head)
    n_embd: int = 768
    ffn_hidden: int = None  # hidden size of the MLP; None -> 4 * n_embd (gpt2) or Llama 2's rule (llama2)
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64 for speed, as nanoGPT
    block_size: int = 1024
    bias: bool = True  # gpt2: biases in Linears and LayerNorms, as GPT-2; llama2 has none
    dropout: float = 0.0
    rope_theta: float = 10000.0  # llama2 rotary base
    norm_eps: float = 1e-5  # llama2 RMSNorm epsilon (gpt2 LayerNorm keeps PyTorch's 1e-5)
    gelu: str = None  # gpt2 MLP: None, exact GELU as nanoGPT; "tanh", GPT-2's own approximation (HF gelu_new)

    def __post_init__(self):
        if self.arch not in ("gpt2", "llama2"):
            raise ValueError(f"unknown arch {self.arch!r}; expected 'gpt2' or 'llama2'")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")
        self.n_kv_head = self.n_kv_head or self.n_head
        if self.arch == "gpt2" and self.n_kv_head != self.n_head:
            raise ValueError(f"gpt2 has no grouped-query attention: n_kv_head={self.n_kv_head} must equal n_head")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head}")
        if self.gelu not in (None, "tanh"):
            raise ValueError(f"gelu={self.gelu!r}: expected None (exact GELU) or 'tanh' (GPT-2's approximation)")
        if self.arch == "llama2" and (self.n_embd // self.n_head) % 2:
            raise ValueError(f"rotary embeddings need an even head size, got {self.n_embd // self.n_head}")
        if self.ffn_hidden is None:
            # Llama 2: 2/3 of 4*dim (SwiGLU has three matrices), rounded up to a multiple of 256.
            self.ffn_hidden = (4 * self.n_embd if self.arch == "gpt2"
                               else 256 * math.ceil(8 * self.n_embd / 3 / 256))
        if self.arch == "llama2":
            self.bias = False


# Named model shapes; any ModelConfig field may still be overridden.
PRESETS = {
    # GPT-2 small as in nanoGPT: 124.5M parameters (tied head counted once).
    "gpt2-124m": dict(arch="gpt2", n_layer=12, n_head=12, n_embd=768, vocab_size=50304, block_size=1024,
                      bias=True),
    # The paper's Llama2-134M: 134.1M counting the untied embedding and head.
    "llama2-134m": dict(arch="llama2", n_layer=12, n_head=12, n_embd=768, ffn_hidden=2048, vocab_size=32000,
                        block_size=2048),
    # The paper does not print the larger shapes; these are well-known models of those sizes.
    # TinyLlama-1.1B: 1.10B.
    "llama2-1b": dict(arch="llama2", n_layer=22, n_head=32, n_kv_head=4, n_embd=2048, ffn_hidden=5632,
                      vocab_size=32000, block_size=2048),
    # OpenLLaMA-3B (v1/v2): 3.43B; its RMSNorm epsilon is 1e-6.
    "llama2-3b": dict(arch="llama2", n_layer=26, n_head=32, n_embd=3200, ffn_hidden=8640, vocab_size=32000,
                      block_size=2048, norm_eps=1e-6),
    # Llama-2-70B itself: 69.0B (the paper's throughput test keeps 4 of its 80 layers: n_layer=4).
    "llama2-70b": dict(arch="llama2", n_layer=80, n_head=64, n_kv_head=8, n_embd=8192, ffn_hidden=28672,
                       vocab_size=32000, block_size=4096),
}


def shape_args(config, explicit):
    """ModelConfig's arguments from a script's config (train.py's: a preset name under "model", and
    ModelConfig's fields): ModelConfig's defaults < the preset < the config's own values where no
    preset < the keys the user set (explicit). 0 means "derive it" for n_kv_head, ffn_hidden and
    block_size, as None does for ModelConfig."""
    model_args = dict(PRESETS[config["model"]]) if config["model"] else {}
    for k in (f.name for f in fields(ModelConfig)):
        if k in config and (k in explicit or not config["model"]):
            model_args[k] = config[k]
    for k in ("n_kv_head", "ffn_hidden"):
        if model_args.get(k) == 0:
            model_args[k] = None
    if model_args.get("block_size", 0) == 0:
        model_args.pop("block_size", None)
    return model_args


# The role each Linear of a block plays in the method switch (`--method=gaussws[qkv,up]`), keyed by
# its module path inside the block (transformer.h.<i>.<key>): what gaussws.convert needs to know.
ROLES = {"gpt2": {"attn.c_attn": "qkv", "attn.c_proj": "out", "mlp.c_fc": "up", "mlp.c_proj": "down"},
         "llama2": {"attn.q": "q", "attn.k": "k", "attn.v": "v", "attn.out": "out",
                    "mlp.gate": "gate", "mlp.up": "up", "mlp.down": "down"}}


# --- GPT2 ---------------------------------------------------------------------------------------

class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head, self.dropout = config.n_head, config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.ffn_hidden, bias=config.bias)
        self.gelu = nn.GELU(approximate=config.gelu or "none")
        self.c_proj = nn.Linear(config.ffn_hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, rope=None):  # rope: unused, GPT2 has learned positions
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


# --- Llama2 -------------------------------------------------------------------------------------

def rope_cos_sin(T, head_dim, theta, device):
    """cos and sin of the rotary angles t * theta^(-2i/head_dim), shape (T, head_dim/2), FP32.

    Computed in every forward rather than stored: it costs one tiny outer product, and a buffer
    would be lost by meta-device construction or rounded by model.to(bfloat16).
    """
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(T, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate the pairs (x[2i], x[2i+1]) of x (B, H, T, head_dim) by angle t*freq_i, as Meta's Llama 2."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).type_as(x)


class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_kv_head, self.dropout = config.n_head, config.n_kv_head, config.dropout
        self.head_dim = config.n_embd // config.n_head
        self.q = nn.Linear(config.n_embd, config.n_head * self.head_dim, bias=False)
        self.k = nn.Linear(config.n_embd, config.n_kv_head * self.head_dim, bias=False)
        self.v = nn.Linear(config.n_embd, config.n_kv_head * self.head_dim, bias=False)
        self.out = nn.Linear(config.n_head * self.head_dim, config.n_embd, bias=False)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, rope):
        B, T, C = x.size()
        q = self.q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True, enable_gqa=self.n_kv_head != self.n_head)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.out(y))


class SwiGLU(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate = nn.Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.up = nn.Linear(config.n_embd, config.ffn_hidden, bias=False)
        self.down = nn.Linear(config.ffn_hidden, config.n_embd, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.down(F.silu(self.gate(x)) * self.up(x)))


class LlamaBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.attn = LlamaAttention(config)
        self.ln_2 = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x, rope):
        x = x + self.attn(self.ln_1(x), rope)
        return x + self.mlp(self.ln_2(x))


# --- the model ------------------------------------------------------------------------------------

# Linears that write into the residual stream: GPT-2's scaled init, std 0.02/sqrt(2*n_layer).
RESIDUAL_PROJECTIONS = ("attn.c_proj.weight", "mlp.c_proj.weight", "attn.out.weight", "mlp.down.weight")


class GPT(nn.Module):
    """A decoder-only transformer: GPT2 or Llama2 by config.arch."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        gpt2 = config.arch == "gpt2"
        block = Block if gpt2 else LlamaBlock
        modules = dict(wte=nn.Embedding(config.vocab_size, config.n_embd))
        if gpt2:
            modules["wpe"] = nn.Embedding(config.block_size, config.n_embd)  # Llama2's positions are rotary
        modules.update(
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([block(config) for _ in range(config.n_layer)]),
            ln_f=(nn.LayerNorm(config.n_embd, bias=config.bias) if gpt2
                  else nn.RMSNorm(config.n_embd, eps=config.norm_eps)),
        )
        self.transformer = nn.ModuleDict(modules)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if gpt2:
            # Weight tying as GPT-2 (https://paperswithcode.com/method/weight-tying); Llama 2 unties.
            self.transformer.wte.weight = self.lm_head.weight

        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith(RESIDUAL_PROJECTIONS):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def get_num_params(self, non_embedding=True):
        """Parameters of the model, b_i excluded (see get_num_bitwidth_params); a tied weight counts once.

        non_embedding=True leaves out the lookup tables that do no arithmetic, as nanoGPT: wpe, and
        wte when it is untied (Llama2). The preset names (124M, 134M) count everything:
        non_embedding=False.
        """
        n = sum(p.numel() for pn, p in self.named_parameters() if not pn.endswith("b_i"))
        if non_embedding:
            if "wpe" in self.transformer:
                n -= self.transformer.wpe.weight.numel()
            if self.transformer.wte.weight is not self.lm_head.weight:
                n -= self.transformer.wte.weight.numel()
        return n

    def get_num_bitwidth_params(self):
        """The b_i of all PQT layers: one per 32x32 block of weight."""
        return sum(p.numel() for pn, p in self.named_parameters() if pn.endswith("b_i"))

    def forward(self, idx, targets=None):
        b, t = idx.size()
        assert t <= self.config.block_size, f"sequence of length {t} exceeds block_size {self.config.block_size}"
        x = self.transformer.wte(idx)
        rope = None
        if "wpe" in self.transformer:
            x = x + self.transformer.wpe(torch.arange(t, dtype=torch.long, device=idx.device))
        else:
            rope = rope_cos_sin(t, self.config.n_embd // self.config.n_head, self.config.rope_theta, idx.device)
        x = self.transformer.drop(x)
        for block in self.transformer.h:
            x = block(x, rope)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])  # inference: only the last position is needed
            loss = None
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, vocab_size=None):
        """Continue idx (b, t) by max_new_tokens sampled tokens; temperature 0 takes the argmax.
        vocab_size: the tokenizer's, to never pick the ids a padded vocab adds (50257 of 50304).

        Put the model in eval mode first (model.eval()): PQT layers draw noise in training mode.
        """
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :vocab_size].float()
            if temperature == 0:
                idx_next = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                    logits[logits < v[:, [-1]]] = -float("inf")
                idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx
