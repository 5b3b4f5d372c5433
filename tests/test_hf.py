"""Hugging Face interop against transformers' own models, and Llama 2-style tokenization end to end.

Truth here is transformers' forward of GPT2LMHeadModel / LlamaForCausalLM and SentencePiece's own
encoder; all offline: models are initialised at random and the SentencePiece model is trained here.

Tolerance of "our logits equal theirs": FP32, |ours - theirs| <= 1e-5 * (1 + max|logit|). The two
forwards do the same arithmetic in another order (rotate_half vs adjacent pairs, RMSNorm's
rsqrt then weight vs torch.nn.RMSNorm, attention kernels), so each result carries a few FP32
roundings (2^-24 ~ 6e-8 relative) summed over at most 64-term dot products and 2 layers: about
1e-6 relative; 1e-5 leaves a margin yet is four orders below the error of a wrong layout, which
the tests show (a missing rotary permutation or transpose moves logits by > 1e-1 relative).
"""
import gzip
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

import hf
from checkpoint import PQT_KEYS, CheckpointError
from conftest import ROOT, make_docs, train_sentencepiece
from files import pretrained
from model import GPT, ModelConfig

VOCAB, T = 96, 16


def assert_logits_equal(ours, theirs):
    scale = 1 + theirs.abs().max().item()
    assert (ours - theirs).abs().max().item() <= 1e-5 * scale


def hf_gpt2(activation="gelu_new"):
    torch.manual_seed(0)
    # initializer_range 0.2, not 0.02: attention that is far from uniform, so a layout error shows
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_inner=48, vocab_size=VOCAB, n_positions=T,
                                     activation_function=activation, initializer_range=0.2,
                                     bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # nonzero biases and norms, which random init leaves at 0 and 1
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def hf_llama(tied=False):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T,
                                      rope_theta=500.0, rms_norm_eps=1e-5, initializer_range=0.2,
                                      tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def hf_logits(model, x):
    with torch.no_grad():
        return model(x).logits


def our_logits(model, x):
    with torch.no_grad():
        return model(x, torch.zeros_like(x))[0]  # with targets: the logits of every position


def ours_from(model_args, sd):
    model = GPT(ModelConfig(**model_args))
    model.load_state_dict(sd)
    return model.eval()


def tokens():
    return torch.randint(0, VOCAB, (3, T), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("make", [hf_gpt2, lambda: hf_gpt2("gelu"), hf_llama, lambda: hf_llama(tied=True)],
                         ids=["gpt2", "gpt2-exact-gelu", "llama-gqa", "llama-tied"])
def test_a_transformers_model_gives_our_model_its_logits(tmp_path, make):
    theirs = make()
    theirs.save_pretrained(tmp_path)
    model_args, sd = pretrained.load_pretrained(str(tmp_path))
    ours = ours_from(model_args, sd)
    assert_logits_equal(our_logits(ours, tokens()), hf_logits(theirs, tokens()))
    if model_args["arch"] == "llama2":
        assert model_args["n_kv_head"] == 2 < model_args["n_head"] and model_args["rope_theta"] == 500.0


@pytest.mark.parametrize("make", [hf_gpt2, hf_llama], ids=["gpt2", "llama-gqa"])
def test_train_init_from_a_transformers_directory_starts_from_its_weights(tmp_path, make):
    import checkpoint
    import train
    theirs = make()
    theirs.save_pretrained(tmp_path / "hf")
    data = tmp_path / "data"  # tokens below the pretrained vocabulary
    data.mkdir()
    ids = np.random.default_rng(0).integers(0, VOCAB, 4000).astype(np.uint16)
    ids[:3600].tofile(data / "train.bin")
    ids[3600:].tofile(data / "val.bin")
    (data / "meta.json").write_text(json.dumps({"vocab_size": VOCAB, "tokenizer": "bytes", "dtype": "uint16"}))
    # one step at learning rate 0: the checkpoint holds the weights the run started from
    train.main([f"--init_from={tmp_path / 'hf'}", f"--dataset={data}", f"--out_dir={tmp_path / 'out'}",
                "--method=gaussws[all]", "--max_iters=1", "--eval_interval=1", "--eval_iters=1", "--batch_size=2",
                "--learning_rate=0.0", "--decay_lr=False", "--warmup_iters=0", "--dtype=float32", "--device=cpu"])
    saved = checkpoint.load(tmp_path / "out" / "ckpt.pt")
    ours = GPT(ModelConfig(**saved["model_args"]))
    ours.load_state_dict({k: v for k, v in saved["model"].items() if not k.endswith(".b_i")})
    assert any(k.endswith(".b_i") for k in saved["model"]) and saved["pqt"]["method"] == "gaussws[all]"
    assert_logits_equal(our_logits(ours.eval(), tokens()), hf_logits(theirs, tokens()))
    with pytest.raises(pretrained.HFError, match="conflicts with it"):  # the shape is the pretrained one
        train.main([f"--init_from={tmp_path / 'hf'}", f"--dataset={data}", f"--out_dir={tmp_path / 'o2'}",
                    "--n_layer=3", "--device=cpu"])


def test_gpt2s_own_hub_file_layout_loads_the_same(tmp_path):
    """openai-community/gpt2's model.safetensors: GPT2Model's names (no "transformer."), no lm_head,
    and each layer's causal-mask buffer "h.N.attn.bias"."""
    from safetensors.torch import load_file, save_file
    theirs = hf_gpt2()
    theirs.save_pretrained(tmp_path)
    sd = {k.removeprefix("transformer."): v for k, v in load_file(tmp_path / "model.safetensors").items()}
    sd.update({f"h.{i}.attn.bias": torch.tril(torch.ones(1, 1, T, T)) for i in range(2)})
    save_file(sd, tmp_path / "model.safetensors")
    ours = ours_from(*pretrained.load_pretrained(str(tmp_path)))
    assert_logits_equal(our_logits(ours, tokens()), hf_logits(theirs, tokens()))


def test_the_layouts_matter_so_the_equality_above_can_fail(tmp_path):
    """Without the rotary permutation (Llama) or the Conv1D transpose (GPT2) the logits are far off."""
    theirs = hf_llama()
    theirs.save_pretrained(tmp_path / "llama")
    model_args, sd = pretrained.load_pretrained(str(tmp_path / "llama"))
    for k in [k for k in sd if k.endswith(("attn.q.weight", "attn.k.weight"))]:
        heads = model_args["n_head"] if ".q." in k else model_args["n_kv_head"]
        sd[k] = pretrained._to_halves(sd[k], heads)  # back to Hugging Face's order
    wrong, right = our_logits(ours_from(model_args, sd), tokens()), hf_logits(theirs, tokens())
    assert (wrong - right).abs().max() > 0.1 * right.abs().max()

    theirs = hf_gpt2()
    theirs.save_pretrained(tmp_path / "gpt2")
    model_args, sd = pretrained.load_pretrained(str(tmp_path / "gpt2"))
    sd = {k: v.t() if k.endswith("attn.c_proj.weight") else v for k, v in sd.items()}  # square: loads untransposed
    wrong, right = our_logits(ours_from(model_args, sd), tokens()), hf_logits(theirs, tokens())
    assert (wrong - right).abs().max() > 0.1 * right.abs().max()


def test_a_pretrained_shape_is_kept_except_a_shorter_block_size(tmp_path):
    theirs = hf_gpt2()
    theirs.save_pretrained(tmp_path)
    model_args, sd = pretrained.load_pretrained(str(tmp_path))
    args, short = pretrained.fit_pretrained(model_args, sd, {"block_size": 8, "dropout": 0.1, "n_layer": 2,
                                                             "method": "bf16", "ffn_hidden": None})
    assert args["block_size"] == 8 and args["dropout"] == 0.1 and short["transformer.wpe.weight"].shape[0] == 8
    x = tokens()[:, :8]  # causal: the first 8 positions do not depend on the rest
    assert_logits_equal(our_logits(ours_from({**args, "dropout": 0.0}, short), x), hf_logits(theirs, x))
    for key, value in (("n_layer", 4), ("block_size", 32), ("vocab_size", 128)):
        with pytest.raises(pretrained.HFError) as e:
            pretrained.fit_pretrained(model_args, sd, {key: value}, source="gpt2")
        assert f"--{key}={value}" in one_line(e.value) and f"gpt2 has {key}={model_args[key]}" in str(e.value)


def our_model(arch):
    torch.manual_seed(2)
    args = (dict(arch="gpt2", n_layer=2, n_head=4, n_embd=32, ffn_hidden=48, vocab_size=VOCAB, block_size=T)
            if arch == "gpt2" else
            dict(arch="llama2", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64, vocab_size=VOCAB,
                 block_size=T, rope_theta=500.0))
    model = GPT(ModelConfig(**args)).eval()
    with torch.no_grad():  # weights of 0.2, not 0.02, for sharp attention; norms and biases not at 1 and 0
        for name, p in model.named_parameters():
            p.copy_(0.2 * torch.randn_like(p) if p.dim() == 2 else 1 + 0.1 * torch.randn_like(p)
                    if name.endswith("weight") else 0.1 * torch.randn_like(p))
    return args, model


def checkpoint_state(model):
    """A training checkpoint's model state: PQT layers add b_i (one per 32x32 block), which export drops."""
    sd = dict(model.state_dict())
    for k in [k for k in sd if k.endswith((".q.weight", ".c_attn.weight"))]:
        sd[k[:-len("weight")] + "b_i"] = torch.ones(-(-sd[k].shape[0] // 32), -(-sd[k].shape[1] // 32))
    return sd


@pytest.mark.parametrize("arch", ["gpt2", "llama2"])
def test_an_export_loads_in_transformers_with_our_logits_and_comes_back_bit_exact(tmp_path, arch):
    args, model = our_model(arch)
    old_layout = {**args, "method": "gaussws[all]", "b_init": 6.0, "b_target": 4.0}  # older checkpoints' model_args
    files, why = pretrained.save_pretrained(old_layout, checkpoint_state(model), tmp_path / "export")
    assert files == ["config.json", "model.safetensors"] and why == "no tokenizer given"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert type(theirs).__name__ == {"gpt2": "GPT2LMHeadModel", "llama2": "LlamaForCausalLM"}[arch]
    assert_logits_equal(our_logits(model, tokens()), hf_logits(theirs, tokens()))

    back_args, back = pretrained.load_pretrained(str(tmp_path / "export"))
    assert ModelConfig(**back_args) == model.config
    assert back.keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        assert torch.equal(back[k], v), k


def test_export_refuses_a_non_finite_model_and_an_occupied_directory(tmp_path):
    args, model = our_model("llama2")
    sd = model.state_dict()
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(pretrained.HFError, match="not an empty directory"):
        pretrained.save_pretrained(args, sd, tmp_path / "taken")
    assert os.listdir(tmp_path / "taken") == ["keep.txt"]
    sd["transformer.h.1.mlp.up.weight"][0, 0] = float("nan")
    with pytest.raises(pretrained.HFError, match="non-finite weights"):
        pretrained.save_pretrained(args, sd, tmp_path / "nan")
    assert not (tmp_path / "nan").exists() and sorted(os.listdir(tmp_path)) == ["taken"]  # no temporary left


# --- bad input: one line each ---------------------------------------------------------------------

def one_line(e):
    assert "\n" not in str(e) and str(e)
    return str(e)


def test_a_directory_that_is_not_a_model_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(pretrained.HFError) as e:
        pretrained.load_pretrained(str(tmp_path))
    assert "no config.json" in one_line(e.value)
    with pytest.raises(pretrained.HFError, match="no such directory"):
        pretrained.load_pretrained(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 8,
                                                      "num_attention_heads": 2, "num_hidden_layers": 1,
                                                      "intermediate_size": 16, "vocab_size": 10,
                                                      "max_position_embeddings": 8}))
    with pytest.raises(pretrained.HFError) as e:
        pretrained.load_pretrained(str(tmp_path))
    assert "no *.safetensors" in one_line(e.value)


@pytest.mark.parametrize("config, expect", [
    ({"architectures": ["BertForMaskedLM"], "model_type": "bert"}, "unsupported architecture BertForMaskedLM"),
    ({"model_type": "mistral"}, "unsupported architecture mistral"),
    ({"architectures": ["LlamaForCausalLM"], "hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
     "rope_type='linear' is not supported"),
    ({"architectures": ["GPT2LMHeadModel"], "activation_function": "relu"}, "activation_function='relu'"),
])
def test_an_unsupported_architecture_is_refused(tmp_path, config, expect):
    base = {"LlamaForCausalLM": dict(hidden_size=8, num_attention_heads=2, num_hidden_layers=1, intermediate_size=16,
                                     vocab_size=10, max_position_embeddings=8),
            "GPT2LMHeadModel": dict(n_embd=8, n_head=2, n_layer=1, vocab_size=10, n_positions=8)}
    (tmp_path / "config.json").write_text(json.dumps({**base.get((config.get("architectures") or [""])[0], {}),
                                                      **config}))
    with pytest.raises(pretrained.HFError) as e:
        pretrained.load_pretrained(str(tmp_path))
    assert expect in one_line(e.value)


def test_weights_of_another_shape_are_refused(tmp_path):
    theirs = hf_llama()
    theirs.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 4}))
    with pytest.raises(pretrained.HFError) as e:
        pretrained.load_pretrained(str(tmp_path))
    assert "self_attn.k_proj" in one_line(e.value) or "attn.k.weight" in one_line(e.value)


GPT2_BASE = dict(architectures=["GPT2LMHeadModel"], n_embd=8, n_head=2, n_layer=1, vocab_size=10, n_positions=8)
LLAMA_BASE = dict(architectures=["LlamaForCausalLM"], hidden_size=8, num_attention_heads=2, num_hidden_layers=1,
                  intermediate_size=16, vocab_size=10, max_position_embeddings=8)


@pytest.mark.parametrize("config, expect", [
    ({**GPT2_BASE, "n_layer": "2"}, "n_layer='2'; expected a positive integer"),
    ({**GPT2_BASE, "n_head": 0}, "n_head=0; expected a positive integer"),
    ({**GPT2_BASE, "n_embd": 8.0}, "n_embd=8.0; expected a positive integer"),
    ({**GPT2_BASE, "vocab_size": -1}, "vocab_size=-1"),
    ({**GPT2_BASE, "n_positions": True}, "n_positions=True"),
    ({**GPT2_BASE, "n_inner": [32]}, "n_inner=[32]"),
    ({**LLAMA_BASE, "hidden_size": 0}, "hidden_size=0"),
    ({**LLAMA_BASE, "num_key_value_heads": 0}, "num_key_value_heads=0"),
    ({**LLAMA_BASE, "rms_norm_eps": "1e-6"}, "rms_norm_eps='1e-6'; expected a positive number"),
    ({**LLAMA_BASE, "rope_theta": 0}, "rope_theta=0; expected a positive number"),
    ({**LLAMA_BASE, "rope_parameters": {"rope_type": "default", "rope_theta": float("nan")}}, "rope_theta=nan"),
    ({**LLAMA_BASE, "rope_parameters": "default"}, "rope_parameters='default' is not supported"),
])
def test_a_config_of_wrong_types_or_zeros_is_refused_in_one_line(tmp_path, config, expect):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(pretrained.HFError) as e:
        pretrained.load_pretrained(str(tmp_path))
    assert expect in one_line(e.value) and "config.json" in str(e.value)


def sharded(tmp_path):
    """A GPT2 saved in shards with model.safetensors.index.json, as large hub models are."""
    theirs = hf_gpt2()
    theirs.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    return theirs, index


@pytest.mark.parametrize("break_index, expect", [
    (lambda index: "{not json", "cannot read"),
    (lambda index: json.dumps({"metadata": {}}), "KeyError: 'weight_map'"),
    (lambda index: json.dumps({"weight_map": ["model-00001.safetensors"]}), "cannot read"),
    (lambda index: json.dumps({"weight_map": {**index["weight_map"], "wte.weight": 7}}), "not file names"),
    (lambda index: json.dumps({"weight_map": {**index["weight_map"], "wte.weight": "../elsewhere.safetensors"}}),
     "not file names"),
    (lambda index: json.dumps({"weight_map": {**index["weight_map"], "wte.weight": "model-09999.safetensors"}}),
     "names model-09999.safetensors, which"),
], ids=["not-json", "no-weight-map", "a-list", "a-number", "outside", "a-missing-shard"])
def test_a_broken_safetensors_index_is_refused_in_one_line(tmp_path, break_index, expect):
    theirs, index = sharded(tmp_path)
    ours = ours_from(*pretrained.load_pretrained(str(tmp_path)))
    assert_logits_equal(our_logits(ours, tokens()), hf_logits(theirs, tokens()))
    (tmp_path / "model.safetensors.index.json").write_text(break_index(index))
    with pytest.raises(pretrained.HFError) as e:
        pretrained.load_pretrained(str(tmp_path))
    assert expect in one_line(e.value) and "index.json" in str(e.value), str(e.value)


@pytest.mark.parametrize("case", ["under a file", "read-only", "not creatable"])
def test_an_out_in_an_unwritable_place_is_one_line_before_the_checkpoint_is_read(tmp_path, case):
    from disk_faults import read_only_dir
    (tmp_path / "a_file").write_text("keep")
    out = {"under a file": tmp_path / "a_file" / "hf", "read-only": os.path.join(read_only_dir(tmp_path), "hf"),
           "not creatable": "/proc/no/such/hf"}[case]
    with pytest.raises(pretrained.HFError) as e:  # the checkpoint does not exist: --out is checked first
        hf.main([f"--ckpt={tmp_path / 'missing.pt'}", f"--out={out}"])
    assert f"--out={out} cannot be written" in one_line(e.value)
    line = error_line(run(tmp_path, "hf.py", f"--ckpt={tmp_path / 'missing.pt'}", f"--out={out}"))
    assert "cannot be written" in line
    args, model = our_model("gpt2")
    with pytest.raises(pretrained.HFError, match="cannot be written"):
        pretrained.save_pretrained(args, model.state_dict(), out)
    assert (tmp_path / "a_file").read_text() == "keep"


def fill_the_disk_in_save_file(monkeypatch):
    import safetensors.torch
    from disk_faults import no_space

    def save_file(tensors, path, metadata=None):  # half the file lands, then the disk is full
        data = safetensors.torch.save(tensors, metadata=metadata)
        with open(path, "wb") as f:
            f.write(data[:len(data) // 2])
        raise no_space()
    monkeypatch.setattr(safetensors.torch, "save_file", save_file)


def fill_the_disk_in_config_json(monkeypatch):
    from disk_faults import full_disk_open
    monkeypatch.setattr(pretrained, "open", full_disk_open(), raising=False)


@pytest.mark.parametrize("fault", [fill_the_disk_in_save_file, fill_the_disk_in_config_json])
def test_a_full_disk_is_one_line_and_leaves_no_partial_output(tmp_path, monkeypatch, fault):
    args, model = our_model("llama2")
    (tmp_path / "empty").mkdir()  # an empty --out is allowed, and must stay as it was
    fault(monkeypatch)
    for out in (tmp_path / "new", tmp_path / "empty"):
        with pytest.raises(pretrained.HFError) as e:
            pretrained.save_pretrained(args, model.state_dict(), out)
        assert "No space left on device" in one_line(e.value) and "nothing was written" in str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["empty"] and os.listdir(tmp_path / "empty") == []  # no temporary left


def offline_env(tmp_path):
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               OMP_NUM_THREADS="1", HTTPS_PROXY="http://127.0.0.1:9", HTTP_PROXY="http://127.0.0.1:9")
    env.pop("NO_PROXY", None), env.pop("no_proxy", None)
    return env


def run(tmp_path, script, *args):
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *args], capture_output=True, text=True,
                          env=offline_env(tmp_path), cwd=tmp_path, timeout=120)


def error_line(r):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    return lines[0]


def test_hub_names_offline_fail_in_one_line_that_says_how_to_use_local_files(hub_offline):
    with pytest.raises(pretrained.HFError) as e:
        pretrained.load_pretrained("gpt2")
    assert "openai-community/gpt2" in one_line(e.value) and "local directory" in str(e.value)


def test_export_of_a_missing_or_foreign_checkpoint_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        hf.main([f"--ckpt={tmp_path / 'missing.pt'}", f"--out={tmp_path / 'x'}"])
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError) as e:
        hf.main([f"--ckpt={tmp_path / 'other.pt'}", f"--out={tmp_path / 'x'}"])
    assert "not a checkpoint of train.py" in one_line(e.value) and not (tmp_path / "x").exists()


def test_prepare_cli_bad_tokenizer_is_one_line(tmp_path):
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text('{"text": "a document"}\n{"text": "another"}\n')
    line = error_line(run(tmp_path, "data/c4/prepare.py", "--data_files=a.jsonl", "--val_data_files=b.jsonl",
                          f"--tokenizer={tmp_path / 'nowhere' / 'tokenizer.model'}"))
    assert "no such file or directory" in line and "nowhere" in line
    line = error_line(run(tmp_path, "data/openwebtext/prepare.py", "--data_files=a.jsonl",
                          "--tokenizer=no-such-org/no-such-tokenizer"))
    assert "Hugging Face hub" in line and "--tokenizer=path/to/tokenizer.model" in line


# --- the default corpus' byte tokens -------------------------------------------------------------

# Text whose UTF-8 holds every byte that UTF-8 can hold: ASCII, the 2-byte range (leads C2-DF, every
# continuation byte 80-BF), a 3-byte character per lead E0-EF and a 4-byte one per lead F0-F4.
EVERY_UTF8_BYTE = ("".join(map(chr, range(0x800))) + "".join(chr(0x1000 * k + 0x841) for k in range(16) if k != 0xD)
                   + "\ud7ff" + "".join(chr(0x10000 + 0x40000 * k) for k in range(4)) + chr(0x100000))
BYTE_TEXTS = ["def f(x):\n    return x", " leading space", "two  spaces", "tabs\tand\r\nnewlines\n\n", "\x00nul",
              "héllo 数据 🙂", "<|endoftext|></s> stay text", "", EVERY_UTF8_BYTE]


@pytest.fixture
def byte_export(tmp_path):
    """hf.py's export of a checkpoint trained on byte tokens (meta.json "tokenizer": "bytes", as
    data/default/prepare.py writes it): (our model, the export's directory, hf.py's line)."""
    import checkpoint
    torch.manual_seed(3)
    args = dict(arch="gpt2", n_layer=2, n_head=4, n_embd=32, ffn_hidden=48, vocab_size=256, block_size=64)
    model = GPT(ModelConfig(**args)).eval()
    # matrices of std about 0.2, not 0.02: logits far from uniform, no near-ties in greedy decoding
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(10.0 if p.dim() == 2 else 1.0)
    (tmp_path / "data").mkdir()
    meta = {"vocab_size": 256, "tokenizer": "bytes", "dtype": "uint16"}
    (tmp_path / "data" / "meta.json").write_text(json.dumps(meta))
    checkpoint.save({"model": checkpoint_state(model), "model_args": args, "config": {"dataset": "default"}},
                    str(tmp_path / "ckpt.pt"))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "hf.py"), f"--ckpt={tmp_path / 'ckpt.pt'}",
                        f"--out={tmp_path / 'hf'}", f"--data_dir={tmp_path / 'data'}"], capture_output=True, text=True,
                       env=offline_env(tmp_path), cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    return model, tmp_path / "hf", r.stdout.strip()


def test_a_byte_level_export_has_a_tokenizer_that_encodes_and_decodes_as_the_data(byte_export):
    """The data's tokens are the text's UTF-8 bytes (data/default/prepare.py: np.frombuffer of the
    bytes); transformers' AutoTokenizer of the export gives the same ids and the text back, and decodes
    any id sequence as bytes.decode("utf-8", errors="replace"), invalid UTF-8 included."""
    import random
    from data import tokenizer
    _, out, line = byte_export
    assert "tokenizer.json" in line and "no tokenizer files" not in line
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    data = tokenizer.Tokenizer("bytes", "bytes")
    assert {b for b in EVERY_UTF8_BYTE.encode()} == set(range(256)) - {0xC0, 0xC1, *range(0xF5, 0x100)}
    for text in BYTE_TEXTS:
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).tolist()
        assert hf_tok(text)["input_ids"] == ids == data.encode(text), text[:40]
        assert hf_tok.decode(ids) == text == data.decode(ids)
    rng = random.Random(0)
    for ids in [list(range(256))] + [[rng.randrange(256) for _ in range(rng.randrange(1, 12))] for _ in range(300)]:
        assert hf_tok.decode(ids) == bytes(ids).decode("utf-8", errors="replace") == data.decode(ids), ids
    assert len(hf_tok) == 256 and hf_tok.eos_token_id is None and hf_tok.bos_token_id is None  # the data has none


def test_a_byte_level_export_scores_and_generates_as_our_model_on_the_tokenized_prompt(byte_export):
    model, out, _ = byte_export
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    prompt = "def héllo(x):\n    return"
    x = hf_tok(prompt, return_tensors="pt")["input_ids"]
    assert x[0].tolist() == list(prompt.encode("utf-8"))
    assert_logits_equal(our_logits(model, x), hf_logits(theirs, x))
    with torch.no_grad():
        ours = model.generate(x, 24, temperature=0)
        their = theirs.generate(x, max_new_tokens=24, do_sample=False, attention_mask=torch.ones_like(x),
                                pad_token_id=0)
    assert their.tolist() == ours.tolist()
    assert hf_tok.decode(their[0]) == bytes(ours[0].tolist()).decode("utf-8", errors="replace")


# --- Llama 2's tokenizer, end to end --------------------------------------------------------------

def write_c4(path, docs):
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"text": d, "timestamp": "2019-04-25T12:57:54Z", "url": f"https://c4.test/{i}"}) + "\n")


def load_prepare(name):
    """A prepare script as a module, the way `python data/<name>/prepare.py` runs it."""
    spec = importlib.util.spec_from_file_location(f"prepare_{name}", os.path.join(ROOT, "data", name, "prepare.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sentencepiece_c4_prepare_train_sample_export(tmp_path, capsys, monkeypatch):
    """In this process (train.main, sample.main, hf.main take the command line's flags): a subprocess
    would import torch and transformers again for each step."""
    import datasets
    import sample
    import train
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    train_docs, val_docs = make_docs(120, seed=0), make_docs(20, seed=1)
    sp = train_sentencepiece(tmp_path / "tokenizer.model", train_docs)
    write_c4(tmp_path / "c4-train.00000-of-00001.json.gz", train_docs)
    write_c4(tmp_path / "c4-validation.00000-of-00001.json.gz", val_docs)
    data = tmp_path / "c4"
    load_prepare("c4").prepare(data_files=f"{tmp_path}/c4-train.*.json.gz", out_dir=data, num_proc=1,
                               val_data_files=f"{tmp_path}/c4-validation.*.json.gz",
                               encoding=str(tmp_path / "tokenizer.model"))
    meta = json.loads((data / "meta.json").read_text())
    assert meta["tokenizer"] == "sentencepiece:tokenizer.model" and meta["vocab_size"] == sp.get_piece_size()
    assert meta["eot_token"] == sp.eos_id() == 2 and meta["tokenizer_source"] == str(tmp_path / "tokenizer.model")
    assert (data / "tokenizer.model").read_bytes() == (tmp_path / "tokenizer.model").read_bytes()
    for split, docs in (("train", train_docs), ("val", val_docs)):  # SentencePiece's own ids, each doc + </s>
        want = [t for d in docs for t in sp.encode(d) + [sp.eos_id()]]
        assert np.fromfile(data / f"{split}.bin", dtype=meta["dtype"]).tolist() == want

    # the data's vocabulary must fit the model's: one line when it does not
    config = [os.path.join(ROOT, "config", "llama2_134m_gaussws_all_adamw.py"), f"--dataset={data}",
              f"--out_dir={tmp_path / 'out'}", "--n_layer=1", "--n_embd=64", "--n_head=2", "--ffn_hidden=128",
              "--block_size=32", "--batch_size=2", "--gradient_accumulation_steps=1", "--max_iters=2",
              "--eval_interval=2", "--eval_iters=1", "--warmup_iters=1", "--lr_decay_iters=2", "--log_interval=1",
              "--wandb_log=False", "--compile=False", "--device=cpu", "--dtype=float32"]
    with pytest.raises(Exception) as e:
        train.main(config + ["--vocab_size=256"])
    assert f"vocabulary of {sp.get_piece_size()} tokens" in one_line(e.value) and "vocab_size=256" in str(e.value)

    train.main(config)  # the config's Llama 2 vocabulary of 32000 holds the tokenizer's
    ckpt = torch.load(tmp_path / "out" / "ckpt.pt", weights_only=True)
    assert any(k.endswith(".b_i") for k in ckpt["model"])  # gaussws[all]: PQT layers, which export writes as w

    prompt = "the river bank"
    capsys.readouterr()
    sample.main([f"--out_dir={tmp_path / 'out'}", f"--start={prompt}", "--num_samples=1", "--max_new_tokens=8",
                 "--device=cpu", "--temperature=0"])
    text = capsys.readouterr().out.split("---------------")[0]
    assert text.startswith(prompt) and len(text) > len(prompt)  # SentencePiece decodes the prompt back exactly

    # export: transformers' model gives our checkpoint's logits; its tokenizer is SentencePiece's
    hf.main([f"--ckpt={tmp_path / 'out' / 'ckpt.pt'}", f"--out={tmp_path / 'hf'}"])
    assert "tokenizer.json" in capsys.readouterr().out
    args = {k: v for k, v in ckpt["model_args"].items() if k not in PQT_KEYS}
    ours = ours_from(args, {k: v for k, v in ckpt["model"].items() if not k.endswith(".b_i")})
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = torch.tensor([sp.encode(val_docs[0])[:32]])
    assert_logits_equal(our_logits(ours, x), hf_logits(theirs, x))
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for d in val_docs + [" leading space", "two  spaces", "line\nbreak", "digits 31415"]:
        assert hf_tok(d)["input_ids"] == sp.encode(d)  # no BOS, as in the data
        assert hf_tok.decode(sp.encode(d)) == sp.decode(sp.encode(d))
    assert hf_tok.eos_token_id == theirs.config.eos_token_id == sp.eos_id()


def test_convert_puts_pqt_on_a_transformers_gpt2_in_its_own_layout():
    import gaussws
    theirs = hf_gpt2()
    roles = {"attn.c_attn": "qkv", "attn.c_proj": "out", "mlp.c_fc": "up", "mlp.c_proj": "down"}  # GPT-2's names
    x = tokens()
    before = hf_logits(theirs, x)
    weights = {n: p for n, p in theirs.named_parameters()}
    gaussws.convert(theirs, "gaussws[all]", roles, seed=3)
    layer = theirs.transformer.h[0].attn.c_attn
    assert isinstance(layer, gaussws.PQTConv1D) and len(gaussws.pqt_layers(theirs)) == 8
    assert all(p is weights[n] for n, p in theirs.named_parameters() if not n.endswith("b_i"))  # kept as stored
    assert layer.b_i.shape == (1, 3)  # blocks of the stored (32, 96) weight
    torch.testing.assert_close(hf_logits(theirs, x), before, rtol=0, atol=0)  # eval: the plain layer
    theirs.train()
    h = torch.randn(2, 5, 32)
    with gaussws.TrainStep(theirs, 0):
        out = layer(h)
        # Eq. 3, on the stored layout
        w_hat = gaussws.pseudo_quantize(layer.weight.detach(), layer.b_t.detach(), layer.noise_seed)
        torch.testing.assert_close(out, h @ w_hat.float() + layer.bias, rtol=1e-5, atol=1e-6)
        assert not torch.equal(w_hat.float(), layer.weight.detach())
        theirs(x, labels=x).loss.backward()
    assert all(l.b_i.grad is not None and l.b_i.grad.abs().sum() > 0 for l in gaussws.pqt_layers(theirs))


@pytest.mark.parametrize("args, words", [([], "--out is required"), (["--ot=x"], "did you mean --out"),
                                         (["--out"], "overrides are written --key=value"),
                                         (["--out=hf", "--data_dir=/nonexistent"],
                                          "--data_dir='/nonexistent' holds no meta.json")])
def test_a_missing_or_unknown_option_is_one_line(tmp_path, args, words):
    """hf.py reads its command line as every script does (configurator): one 'error: ' line, exit 1."""
    assert words in error_line(run(tmp_path, "hf.py", *args))
    assert not os.listdir(tmp_path)  # nothing written


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_the_options_and_exits_0(tmp_path, flag):
    r = run(tmp_path, "hf.py", flag)
    assert r.returncode == 0 and r.stderr == "" and r.stdout.startswith("usage: python hf.py")
    for key in ("ckpt", "out", "data_dir"):  # configurator's --help: each key, its default and its comment
        assert any(line.strip().startswith(f"{key} = ") and "  # " in line for line in r.stdout.splitlines()), key
    assert not os.listdir(tmp_path)  # nothing written
