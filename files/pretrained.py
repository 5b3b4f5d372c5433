"""Hugging Face models in and out: pretrained GPT-2 / Llama weights into our model, ours out to transformers.

    load_pretrained("gpt2")             # GPT-2 from the hub (also gpt2-medium, gpt2-large, gpt2-xl)
    load_pretrained("path/to/dir")      # a local GPT2LMHeadModel or LlamaForCausalLM (config.json + safetensors)
    fit_pretrained(args, sd, requested) # with the user's shape keys applied (train.py's init_from)
    save_pretrained(args, sd, out_dir)  # a training checkpoint's model as a transformers directory (hf.py)

The two layouts differ in two places. GPT-2's checkpoints store Linear weights as Conv1D,
(in, out): transposed here. Hugging Face's Llama orders each head's query and key rows as
[x_0..x_{d/2-1} | y_0..y_{d/2-1}] for its rotate_half, while our model.apply_rope rotates
adjacent pairs (x_i, y_i) as Meta's Llama 2: the rows are permuted (_to_pairs/_to_halves),
which is exactly the inverse of transformers' own convert_llama_weights_to_hf.
transformers is not needed here; safetensors is.
"""
import glob
import json
import math
import os

import torch

import checkpoint
from quant import budget
from util import UserError, atomic_dir, reason, unusable_dir

GPT2_HUB = {name: f"openai-community/{name}" for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")}
SUPPORTED = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama2"}
MODEL_TYPES = {"gpt2": "gpt2", "llama": "llama2"}  # config.json without "architectures"
GPT2_GELU = {"gelu": None, "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}  # HF activation -> ModelConfig.gelu
WEIGHT_FILES = ["config.json", "*.safetensors", "*.safetensors.index.json"]


class HFError(UserError, ValueError):
    """A model that cannot be read or written: the message is one line for the user."""


# --- the rotary layouts ----------------------------------------------------------------------------

def _to_pairs(w, n_heads):
    """Rows of a q/k projection from Hugging Face's rotate_half order to adjacent pairs (ours, Meta's)."""
    out, d_in = w.shape
    return w.view(n_heads, 2, out // n_heads // 2, d_in).transpose(1, 2).reshape(out, d_in)


def _to_halves(w, n_heads):
    """The inverse of _to_pairs: our adjacent pairs to Hugging Face's rotate_half order."""
    out, d_in = w.shape
    return w.view(n_heads, out // n_heads // 2, 2, d_in).transpose(1, 2).reshape(out, d_in)


# --- reading ---------------------------------------------------------------------------------------

def _model_dir(name_or_dir):
    """A local directory, or the hub repository's config and safetensors downloaded to the cache."""
    path = os.path.expanduser(str(name_or_dir))
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise HFError(f"{name_or_dir!r} is a file; give a Hugging Face model directory (config.json + "
                      f"*.safetensors) or one of {', '.join(GPT2_HUB)}")
    repo = GPT2_HUB.get(str(name_or_dir), str(name_or_dir))
    if path.startswith((os.sep, ".", "~")) or repo.count("/") > 1:
        raise HFError(f"{name_or_dir!r}: no such directory; give a Hugging Face model directory (config.json + "
                      f"*.safetensors) or one of {', '.join(GPT2_HUB)}")
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(repo, allow_patterns=WEIGHT_FILES)
    except Exception as e:
        raise HFError(f"could not get {repo!r} from the Hugging Face hub ({reason(e)}); offline, point at a local "
                      f"directory holding its config.json and *.safetensors (huggingface-cli download {repo} "
                      f"on a machine with network)") from None


def _read_config(d):
    path = os.path.join(d, "config.json")
    if not os.path.isfile(path):
        raise HFError(f"{d} is not a Hugging Face model directory: it has no config.json")
    try:
        with open(path) as f:
            config = json.load(f)
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise HFError(f"cannot read {path} ({reason(e)})") from None
    archs = config.get("architectures") or []
    arch = next((SUPPORTED[a] for a in archs if a in SUPPORTED), None)
    if arch is None and not archs:
        arch = MODEL_TYPES.get(config.get("model_type"))
    if arch is None:
        raise HFError(f"{path}: unsupported architecture {', '.join(archs) or config.get('model_type')!s}; "
                      f"supported: {', '.join(SUPPORTED)}")
    return arch, config


def _refuse(path, what, value, accepted):
    raise HFError(f"{path}: {what}={value!r} is not supported (accepted: {accepted})")


def _positive(c, path, key, kind=int, default=KeyError):
    """c[key] as a positive int (kind int) or a positive finite number (kind float); absent or null:
    default (KeyError: the key is required, and load_pretrained says the config lacks it)."""
    value = c.get(key)
    if value is None:
        if default is KeyError:
            raise KeyError(key)
        return default
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and (isinstance(value, int) if kind is int else math.isfinite(value)) and value > 0):
        raise HFError(f"{path}: {key}={value!r}; expected a positive {'integer' if kind is int else 'number'}")
    return kind(value)


def _gpt2_args(c, path):
    if c.get("activation_function", "gelu_new") not in GPT2_GELU:
        _refuse(path, "activation_function", c.get("activation_function"), ", ".join(GPT2_GELU))
    for key, want in (("layer_norm_epsilon", 1e-5), ("scale_attn_weights", True),
                      ("scale_attn_by_inverse_layer_idx", False), ("tie_word_embeddings", True),
                      ("add_cross_attention", False)):
        if c.get(key, want) != want:  # our GPT2 is nanoGPT's: these are fixed there
            _refuse(path, key, c[key], repr(want))
    n_embd = _positive(c, path, "n_embd")
    return dict(arch="gpt2", n_layer=_positive(c, path, "n_layer"), n_head=_positive(c, path, "n_head"), n_embd=n_embd,
                ffn_hidden=_positive(c, path, "n_inner", default=4 * n_embd),
                vocab_size=_positive(c, path, "vocab_size"), block_size=_positive(c, path, "n_positions"), bias=True,
                gelu=GPT2_GELU[c.get("activation_function", "gelu_new")])


def _llama_args(c, path):
    n_embd, n_head = _positive(c, path, "hidden_size"), _positive(c, path, "num_attention_heads")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}  # transformers 5 / earlier
    if not isinstance(rope, dict):
        _refuse(path, "rope_parameters", rope, "a JSON object")
    for key, value, want in (("hidden_act", c.get("hidden_act", "silu"), "silu"),
                             ("attention_bias", c.get("attention_bias", False), False),
                             ("mlp_bias", c.get("mlp_bias", False), False),
                             ("head_dim", c.get("head_dim") or n_embd // n_head, n_embd // n_head),
                             ("rope_type", rope.get("rope_type", rope.get("type", "default")), "default")):
        if value != want:
            _refuse(path, key, value, repr(want))
    theta = _positive(rope, path, "rope_theta", float, default=_positive(c, path, "rope_theta", float, default=10000.0))
    return dict(arch="llama2", n_layer=_positive(c, path, "num_hidden_layers"), n_head=n_head,
                n_kv_head=_positive(c, path, "num_key_value_heads", default=n_head), n_embd=n_embd,
                ffn_hidden=_positive(c, path, "intermediate_size"), vocab_size=_positive(c, path, "vocab_size"),
                block_size=_positive(c, path, "max_position_embeddings"), bias=False, rope_theta=theta,
                norm_eps=_positive(c, path, "rms_norm_eps", float, default=1e-6))


def _read_weights(d):
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                names = set(json.load(f)["weight_map"].values())
            if not all(isinstance(n, str) and n and os.path.basename(n) == n for n in names):
                raise ValueError("its weight_map's values are not file names")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise HFError(f"cannot read {index} ({reason(e)}); download the model again") from None
        files = sorted(os.path.join(d, name) for name in names)
        for f in files:
            if not os.path.isfile(f):
                raise HFError(f"{index} names {os.path.basename(f)}, which {d} does not hold; download the model again")
    else:
        files = sorted(glob.glob(os.path.join(d, "*.safetensors")))
    if not files:
        raise HFError(f"{d} holds no *.safetensors weights (pytorch_model.bin is not read: pickle can run "
                      f"code; save the model with safe_serialization=True)")
    from safetensors.torch import load_file
    sd = {}
    for f in files:
        try:
            sd.update(load_file(f))
        except Exception as e:
            raise HFError(f"cannot read {f} ({reason(e)})") from None
    return {k: v.float() for k, v in sd.items()}  # our weights train in FP32 (a BF16 checkpoint widens exactly)


def _taker(sd, path):
    def take(key):
        if key not in sd:
            raise HFError(f"{path}: weight {key!r} is missing")
        return sd.pop(key)
    return take


def _from_gpt2(sd, a, path):
    sd = {k.removeprefix("transformer."): v for k, v in sd.items()}  # GPT2Model checkpoints have no prefix
    take, out = _taker(sd, path), {}
    for name in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"):
        out[f"transformer.{name}"] = take(name)
    for i in range(a["n_layer"]):
        for name in ("ln_1", "ln_2", "attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            w = take(f"h.{i}.{name}.weight")
            out[f"transformer.h.{i}.{name}.weight"] = w if name.startswith("ln") else w.t().contiguous()  # Conv1D
            out[f"transformer.h.{i}.{name}.bias"] = take(f"h.{i}.{name}.bias")
        for buffer in ("attn.bias", "attn.masked_bias"):  # the causal mask, stored by older transformers
            sd.pop(f"h.{i}.{buffer}", None)
    head = sd.pop("lm_head.weight", None)
    if head is not None and not torch.equal(head, out["transformer.wte.weight"]):
        raise HFError(f"{path}: lm_head.weight differs from wte.weight; our GPT2 ties them")
    out["lm_head.weight"] = out["transformer.wte.weight"]
    _nothing_left(sd, path)
    return out


def _from_llama(sd, a, path):
    take, out = _taker(sd, path), {}
    out["transformer.wte.weight"] = take("model.embed_tokens.weight")
    for i in range(a["n_layer"]):
        p, q = f"model.layers.{i}.", f"transformer.h.{i}."
        out[q + "ln_1.weight"] = take(p + "input_layernorm.weight")
        # the rotary order of q and k: _to_pairs, once the shapes are checked
        out[q + "attn.q.weight"] = take(p + "self_attn.q_proj.weight")
        out[q + "attn.k.weight"] = take(p + "self_attn.k_proj.weight")
        out[q + "attn.v.weight"] = take(p + "self_attn.v_proj.weight")
        out[q + "attn.out.weight"] = take(p + "self_attn.o_proj.weight")
        out[q + "ln_2.weight"] = take(p + "post_attention_layernorm.weight")
        for name in ("gate", "up", "down"):
            out[q + f"mlp.{name}.weight"] = take(p + f"mlp.{name}_proj.weight")
        sd.pop(p + "self_attn.rotary_emb.inv_freq", None)  # a buffer older transformers stored
    out["transformer.ln_f.weight"] = take("model.norm.weight")
    head = sd.pop("lm_head.weight", None)
    # a tied checkpoint gives our untied head a copy of the embedding, which then trains on its own
    out["lm_head.weight"] = head if head is not None else out["transformer.wte.weight"].clone()
    _nothing_left(sd, path)
    return out


def _nothing_left(sd, path):
    if sd:
        raise HFError(f"{path}: {len(sd)} weights the architecture does not have, e.g. {sorted(sd)[0]!r}")


def _check_shapes(model_args, sd, where):
    """sd has exactly our model's parameter names and shapes (built on the meta device: no memory)."""
    from model import GPT, ModelConfig
    try:
        with torch.device("meta"):
            want = {k: v.shape for k, v in GPT(ModelConfig(**model_args)).state_dict().items()
                    if not k.endswith(".b_i")}
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise HFError(f"{where}: {reason(e)}") from None
    missing, extra = sorted(set(want) - set(sd)), sorted(set(sd) - set(want))
    if missing or extra:
        raise HFError(f"{where}: weights do not fit the model: missing {missing[:3]}, unexpected {extra[:3]}")
    for k, shape in want.items():
        if sd[k].shape != shape:
            raise HFError(f"{where}: {k} has shape {tuple(sd[k].shape)}, the config says {tuple(shape)}")


def load_pretrained(name_or_dir):
    """(model_args, state_dict) of a Hugging Face GPT2LMHeadModel or LlamaForCausalLM: a local directory
    (config.json + *.safetensors) or a hub name ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", or
    any repository id). model_args are ModelConfig's architecture fields; the state dict has our
    parameter names, in FP32, and loads with GPT(ModelConfig(**model_args)).load_state_dict(sd).
    Raises HFError with a one-line message for anything it cannot read."""
    d = _model_dir(name_or_dir)
    arch, config = _read_config(d)
    path = os.path.join(d, "config.json")
    try:
        args = _gpt2_args(config, path) if arch == "gpt2" else _llama_args(config, path)
    except KeyError as e:
        raise HFError(f"{path} lacks {e.args[0]!r}, which a {arch} config has") from None
    sd = _read_weights(d)
    out = _from_gpt2(sd, args, d) if arch == "gpt2" else _from_llama(sd, args, d)
    _check_shapes(args, out, d)
    if arch == "llama2":
        for i in range(args["n_layer"]):
            for name, heads in (("q", args["n_head"]), ("k", args["n_kv_head"])):
                key = f"transformer.h.{i}.attn.{name}.weight"
                out[key] = _to_pairs(out[key], heads).contiguous()
    return args, out


def fit_pretrained(model_args, state_dict, requested, source="the pretrained model"):
    """(model_args, state_dict) of load_pretrained with the user's explicit ModelConfig keys applied.

    A pretrained model fixes its shape: a requested key that differs is refused in one line, except
    block_size, which may shrink (GPT2's position table is cut, as nanoGPT's crop_block_size; Llama's
    rotary positions need no table), and dropout, which is no weight. PQT keys are ignored."""
    args, sd = dict(model_args), dict(state_dict)
    for key, value in requested.items():
        if key == "dropout":
            args[key] = value
        elif key in checkpoint.PQT_KEYS or value is None or value == args.get(key, value):  # None: not set
            continue
        elif key == "block_size" and 0 < value < args["block_size"]:
            args[key] = value
            if "transformer.wpe.weight" in sd:
                sd["transformer.wpe.weight"] = sd["transformer.wpe.weight"][:value].clone()
        else:
            raise HFError(f"{source} has {key}={args.get(key)!r}; --{key}={value!r} conflicts with it: drop it "
                          f"(only block_size may be smaller, and dropout set)")
    return args, sd


# --- writing ---------------------------------------------------------------------------------------

def _to_gpt2(sd, config):
    out = {k: sd[k] for k in ("transformer.wte.weight", "transformer.wpe.weight")}
    zeros = lambda n: torch.zeros(n, dtype=sd["transformer.wte.weight"].dtype)  # noqa: E731 (bias=False: zero biases)
    for i in range(config.n_layer):
        for name in ("ln_1", "ln_2", "attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            w = sd[f"transformer.h.{i}.{name}.weight"]
            out[f"transformer.h.{i}.{name}.weight"] = w if name.startswith("ln") else w.t()  # Conv1D is (in, out)
            bias = sd.get(f"transformer.h.{i}.{name}.bias")
            out[f"transformer.h.{i}.{name}.bias"] = bias if bias is not None else zeros(w.shape[0])
    out["transformer.ln_f.weight"] = sd["transformer.ln_f.weight"]
    out["transformer.ln_f.bias"] = sd.get("transformer.ln_f.bias", zeros(config.n_embd))
    # lm_head is tied to wte: transformers ties it again on loading, as in GPT-2's own files
    hf = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": config.n_layer,
          "n_head": config.n_head, "n_embd": config.n_embd, "n_inner": config.ffn_hidden,
          "n_positions": config.block_size, "n_ctx": config.block_size, "vocab_size": config.vocab_size,
          "activation_function": "gelu_new" if config.gelu == "tanh" else "gelu", "layer_norm_epsilon": 1e-5,
          "resid_pdrop": config.dropout, "embd_pdrop": config.dropout, "attn_pdrop": config.dropout,
          "scale_attn_weights": True, "tie_word_embeddings": True}
    return out, hf


def _to_llama(sd, config):
    out = {"model.embed_tokens.weight": sd["transformer.wte.weight"],
           "model.norm.weight": sd["transformer.ln_f.weight"], "lm_head.weight": sd["lm_head.weight"]}
    for i in range(config.n_layer):
        p, q = f"model.layers.{i}.", f"transformer.h.{i}."
        out[p + "input_layernorm.weight"] = sd[q + "ln_1.weight"]
        out[p + "self_attn.q_proj.weight"] = _to_halves(sd[q + "attn.q.weight"], config.n_head)
        out[p + "self_attn.k_proj.weight"] = _to_halves(sd[q + "attn.k.weight"], config.n_kv_head)
        out[p + "self_attn.v_proj.weight"] = sd[q + "attn.v.weight"]
        out[p + "self_attn.o_proj.weight"] = sd[q + "attn.out.weight"]
        out[p + "post_attention_layernorm.weight"] = sd[q + "ln_2.weight"]
        for name in ("gate", "up", "down"):
            out[p + f"mlp.{name}_proj.weight"] = sd[q + f"mlp.{name}.weight"]
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": config.n_embd,
          "intermediate_size": config.ffn_hidden, "num_hidden_layers": config.n_layer,
          "num_attention_heads": config.n_head, "num_key_value_heads": config.n_kv_head,
          "head_dim": config.n_embd // config.n_head, "max_position_embeddings": config.block_size,
          "vocab_size": config.vocab_size, "rms_norm_eps": config.norm_eps, "hidden_act": "silu",
          "rope_theta": config.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
          "attention_bias": False, "mlp_bias": False, "attention_dropout": config.dropout,
          "tie_word_embeddings": False}
    return out, hf


def check_out(out_dir):
    """out_dir can be written whole: it does not exist, or is an empty directory, and its parent can be
    made and written (util.unusable_dir tries it)."""
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise HFError(f"{out_dir} exists and is not an empty directory; choose a new --out")
    parent = os.path.dirname(out_dir)
    why = unusable_dir(parent)
    if why:
        raise HFError(f"--out={out_dir} cannot be written: {why}; choose another --out")


def save_pretrained(model_args, state_dict, out_dir, tokenizer=None):
    """Write out_dir as a transformers directory (config.json, model.safetensors, and the tokenizer's
    files when tokenizer, a tokenizer.Tokenizer, has them) that AutoModelForCausalLM.from_pretrained
    loads: GPT2LMHeadModel or LlamaForCausalLM, logits equal to ours.

    model_args and state_dict as in a training checkpoint: model_args' PQT keys (older checkpoints)
    are ignored, b_i and the STE's formats state (budget.FORMAT_STATE) dropped, PQT layers' weights w written
    as they are (eval mode uses w itself).
    out_dir must not exist or be empty; it is written whole or not at all. Returns (the names of the
    files written, None or why no tokenizer files were written)."""
    from model import ModelConfig
    args = {k: v for k, v in model_args.items() if k not in checkpoint.PQT_KEYS}
    sd = {k.removeprefix("_orig_mod."): v.detach().cpu() for k, v in state_dict.items()
          if not k.endswith((".b_i",) + budget.FORMAT_STATE)}
    _check_shapes(args, sd, "the checkpoint")
    bad = [k for k, v in sd.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise HFError(f"the checkpoint has non-finite weights ({bad[0]}{' ...' if len(bad) > 1 else ''}); not exported")
    config = ModelConfig(**args)
    out, hf = (_to_gpt2 if config.arch == "gpt2" else _to_llama)(sd, config)
    hf["torch_dtype"] = str(sd["transformer.wte.weight"].dtype).removeprefix("torch.")
    files, why = tokenizer.hf_files() if tokenizer is not None else ({}, "no tokenizer given")
    # our data puts the end-of-sequence token between documents: it both ends one and begins the next
    eot = tokenizer.eot if tokenizer is not None else None
    hf.update(bos_token_id=eot, eos_token_id=eot)
    out_dir = os.path.abspath(out_dir)
    check_out(out_dir)
    from safetensors.torch import save_file
    try:
        os.makedirs(os.path.dirname(out_dir), exist_ok=True)
        with atomic_dir(out_dir) as tmp:  # an empty out_dir, checked above, is replaced
            save_file({k: v.contiguous().clone() for k, v in out.items()}, os.path.join(tmp, "model.safetensors"),
                      metadata={"format": "pt"})  # clone: safetensors refuses tensors that share memory
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(hf, f, indent=2)
            for name, blob in files.items():
                with open(os.path.join(tmp, name), "wb") as f:
                    f.write(blob)
    except OSError as e:
        raise HFError(f"cannot write {out_dir} ({e.strerror or e}): free space or choose another --out; nothing "
                      f"was written") from None
    return sorted(["config.json", "model.safetensors", *files]), why
