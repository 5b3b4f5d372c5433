"""export_gguf.py: GGUF files of export.py's models, read by gguf's own reader and dequantizer, by
transformers (model and tokenizer) and, where llama-cpp-python is installed, by llama.cpp itself.

The models are tiny (2 layers, n_embd 64) and their tokenizers are built here: a tiktoken BPE with
GPT-2's split pattern trained on this repository's model.py, a SentencePiece BPE model trained on
the same text, and the default corpus's bytes."""
import importlib.util
import io
import json
import os
import struct
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

import export as E
import util
from data import tokenizer
from data import loader
from files import gguf_file, lowbit
from llamacpp import arithmetic, runtime


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = open(os.path.join(ROOT, "model.py"), encoding="utf-8").read()
PROBES = ["def forward(self, x):\n        return x", "Hello world", "two  spaces and\ttabs", "héllo 数据 🙂",
          "x = 12345 + 0.5", "line\n\nbreak "]
EXACT = {"mxfp4": "MXFP4", "int4": "Q4_0", "int8": "Q8_0"}  # the GGUF type of each, by hand from the table
FORMATS = ["mxfp4", "int4", "int8", "mxfp8_e4m3", "auto"]
# llama.cpp's tensor names for our keys, written out (the module maps them with gguf.TENSOR_NAMES)
GGUF_NAMES = {"gpt2": {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output",
                       "ln_2": "ffn_norm", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"},
              "llama2": {"ln_1": "attn_norm", "attn.q": "attn_q", "attn.k": "attn_k", "attn.v": "attn_v",
                         "attn.out": "attn_output", "ln_2": "ffn_norm", "mlp.gate": "ffn_gate", "mlp.up": "ffn_up",
                         "mlp.down": "ffn_down"}}
TOP_NAMES = {"transformer.wte.weight": "token_embd.weight", "transformer.wpe.weight": "position_embd.weight",
             "transformer.ln_f.weight": "output_norm.weight", "transformer.ln_f.bias": "output_norm.bias",
             "lm_head.weight": "output.weight"}


def our_key(name, arch):
    """Our state-dict key of a GGUF tensor name."""
    inverse = {v: k for k, v in TOP_NAMES.items()}
    if name in inverse:
        return inverse[name]
    _, i, part, suffix = name.split(".")
    return f"transformer.h.{i}.{ {v: k for k, v in GGUF_NAMES[arch].items()}[part] }.{suffix}"


# --- tokenizers and data built here -------------------------------------------------------------

def tiny_tiktoken(n_merges=60):
    """A tiktoken Encoding with GPT-2's split pattern: byte-pair merges learned on TEXT, as GPT-2's were."""
    import regex
    import tiktoken
    from tiktoken_ext.openai_public import r50k_pat_str
    ranks = {bytes([b]): b for b in range(256)}
    words = [[bytes([c]) for c in w.encode()] for w in regex.findall(r50k_pat_str, TEXT)]
    for _ in range(n_merges):
        counts = {}
        for w in words:
            for pair in zip(w, w[1:]):
                counts[pair] = counts.get(pair, 0) + 1
        a, b = max(counts, key=counts.get)
        ranks[a + b] = len(ranks)
        merged = []
        for w in words:
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged.append(out)
        words = merged
    return tiktoken.Encoding(name="tinygpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": len(ranks)})


def tiny_sentencepiece():
    """A SentencePiece BPE model as Llama 2's (byte fallback, no normalization, spaces kept), trained on TEXT."""
    import sentencepiece as spm
    f = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXT.splitlines()), model_writer=f, vocab_size=400,
                                   model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, character_coverage=1.0, unk_id=0, bos_id=1,
                                   eos_id=2, pad_id=-1, minloglevel=2)
    return f.getvalue()


def write_data(d, tok):
    """train.bin/val.bin (TEXT's documents, the end-of-sequence token after each) and meta.json."""
    os.makedirs(d, exist_ok=True)
    docs = TEXT.split("\n\n\n")
    ids = []
    for doc in docs:
        ids += tok.encode(doc) + ([tok.eot] if tok.eot is not None else [])
    ids = np.array(ids, dtype=np.uint16)
    ids[: len(ids) * 9 // 10].tofile(os.path.join(d, "train.bin"))
    ids[len(ids) * 9 // 10:].tofile(os.path.join(d, "val.bin"))
    for name, blob in tok.files.items():  # the tokenizer's files, which meta.json names
        with open(os.path.join(d, name), "wb") as f:
            f.write(blob)
    meta = {**tok.meta(), "vocab_size": tok.vocab_size, "dtype": "uint16"}
    with open(os.path.join(d, "meta.json"), "w") as f:
        json.dump(meta, f)
    return meta


def make_checkpoint(out_dir, data_dir, **arch_args):
    """A tiny model with b_i on every block Linear: b_t 0.5 (auto: mxfp4) on the attention, b_t in
    [3.5, 5] (auto: mxfp6_e3m2 and mxfp8_e4m3) on the MLP."""
    from model import GPT, ModelConfig
    torch.manual_seed(0)
    args = {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 64, **arch_args}
    sd = GPT(ModelConfig(**args)).state_dict()
    gen = torch.Generator().manual_seed(0)
    for key in [k for k in sd if k.startswith("transformer.h.") and k.endswith(".weight") and sd[k].dim() == 2]:
        shape = (-(-sd[key].shape[0] // 32), -(-sd[key].shape[1] // 32))
        b_t = torch.full(shape, 0.5) if ".attn." in key else 3.5 + 1.5 * torch.rand(shape, generator=gen)
        sd[key[:-7] + ".b_i"] = (b_t - 4.0) / 2.0  # Eq. 11 with b_init 6, b_target 4
    ckpt = dict(model=sd, optimizer=[], model_args=args, iter_num=7, pqt=dict(method="gaussws[all]", b_init=6.0,
                b_target=4.0), config=dict(dataset=data_dir, seed=1337, batch_size=4, block_size=64, eval_iters=2,
                                           dtype="float32"))
    os.makedirs(out_dir, exist_ok=True)
    torch.save(ckpt, os.path.join(out_dir, "ckpt.pt"))


CASES = {  # the two models: a tanh-GELU GPT2 with tiktoken's BPE, a Llama2 with GQA and SentencePiece
    "gpt2": dict(arch="gpt2", gelu="tanh", vocab_size=320),  # 317 tokens, padded as train.py may pad
    "llama2": dict(arch="llama2", n_kv_head=2, vocab_size=400),
    "bytes": dict(arch="gpt2", vocab_size=256, bias=False),  # the default corpus: bytes, nanoGPT's exact GELU
}


@pytest.fixture(scope="module", params=list(CASES))
def exported(request, tmp_path_factory):
    """(case, run directory, the data's Tokenizer, export.py's JSON report per format) of one export of
    FORMATS with --gguf=True."""
    import contextlib
    import tiktoken
    case = request.param
    d = tmp_path_factory.mktemp(case)
    if case == "gpt2":
        enc = tiny_tiktoken()
        tiktoken.registry.ENCODINGS[enc.name] = enc  # what tiktoken.get_encoding(name) returns from now on
        tok = tokenizer.load(enc)
    elif case == "llama2":
        tok = tokenizer.Tokenizer("sentencepiece", "tokenizer.model", {"tokenizer.model": tiny_sentencepiece()})
    else:
        tok = tokenizer.Tokenizer("bytes", "bytes")
    write_data(str(d / "data"), tok)
    make_checkpoint(str(d / "run"), str(d / "data"), **CASES[case])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = util.cli(E.main, [f"--out_dir={d / 'run'}", f"--format={','.join(FORMATS)}", "--gguf=True",
                    f"--json={d / 'export.json'}", "--plot=False", "--eval_iters=1"])
    assert rc == 0
    return case, d / "run", tok, {r["format"]: r for r in json.loads((d / "export.json").read_text())["exports"]}


def gguf_weights(path):
    """{GGUF name: (type name, float32 array)} by gguf's own reader and dequantizer."""
    return {t.name: (t.tensor_type.name, gguf.quants.dequantize(t.data, t.tensor_type))
            for t in gguf.GGUFReader(str(path)).tensors}


def seeded_tokens(n_vocab):
    """The tokens export_gguf measures logits on: 64 drawn from a generator seeded 0."""
    return torch.randint(0, n_vocab, (1, 64), generator=torch.Generator().manual_seed(0))


# --- gguf's own reader -------------------------------------------------------------------------------

def test_gguf_reader_gives_back_the_exported_weights_exactly(exported):
    """mxfp4 -> MXFP4, int4 -> Q4_0, int8 -> Q8_0: gguf.GGUFReader and gguf.quants.dequantize return
    export.load's dequantized weights, every one; embeddings and head in the export's BF16, norms and
    biases in F32, GPT2's head left to its embedding."""
    case, run, _, reports = exported
    for fmt, qtype in EXACT.items():
        model, info = lowbit.load(str(run / f"model-{fmt}.safetensors"))
        ours = model.state_dict()
        got = gguf_weights(run / f"model-{fmt}.gguf")
        arch = model.config.arch
        assert ("output.weight" in got) == (arch == "llama2")
        for name, (kind, w) in got.items():
            key = our_key(name, arch)
            if key not in ours:
                continue
            want = ours[key].numpy()
            assert np.array_equal(w.reshape(want.shape), want), (fmt, name)
            expected = qtype if key in info["quantized"] else "F32" if want.ndim == 1 else "BF16"
            assert kind == expected, (fmt, name)
        zero_biases = [name for name in got if our_key(name, arch) not in ours]  # llama.cpp's GPT-2 needs them
        assert all(name.endswith(".bias") and not got[name][1].any() for name in zero_biases)
        assert len(zero_biases) == (6 * 2 + 1 if case == "bytes" else 0)  # 2 norms, 4 Linears a block; ln_f
        assert len(got) - len(zero_biases) == len(ours) - (arch == "gpt2")  # all but GPT2's tied head
        assert reports[fmt]["gguf"]["exact"] and reports[fmt]["gguf"]["changed"] == []


def test_the_file_states_the_model_and_the_data_tokenizer(exported):
    """The hyper-parameters under llama.cpp's keys (GQA as head_count_kv, Llama's rotary base and width),
    the tokenizer llama.cpp should build, the data's end-of-sequence token, no BOS."""
    case, run, tok, _ = exported
    field = {k: f.contents() for k, f in gguf.GGUFReader(str(run / "model-int8.gguf")).fields.items()}
    arch = "llama" if case == "llama2" else "gpt2"
    want = {"general.architecture": arch, f"{arch}.context_length": 64, f"{arch}.embedding_length": 64,
            f"{arch}.block_count": 2, f"{arch}.attention.head_count": 4,
            f"{arch}.feed_forward_length": 256 if arch == "gpt2" else 256 * -(-8 * 64 // 3 // 256),
            "tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": False}
    if arch == "llama":
        want.update({"llama.attention.head_count_kv": 2, "llama.rope.dimension_count": 16,
                     "llama.rope.freq_base": 10000.0, "tokenizer.ggml.model": "llama",
                     "tokenizer.ggml.eos_token_id": 2})
        assert field["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    else:
        assert field["gpt2.attention.layer_norm_epsilon"] == pytest.approx(1e-5)
    if case == "gpt2":
        want.update({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
                     "tokenizer.ggml.eos_token_id": tok.eot, "tokenizer.ggml.bos_token_id": tok.eot})
        assert len(field["tokenizer.ggml.merges"]) >= 60  # every merge the 60 learned ones imply
    if case == "bytes":  # no end-of-sequence token in the data: NUL, which text never holds
        want.update({"tokenizer.ggml.model": "llama", "tokenizer.ggml.eos_token_id": 0,
                     "tokenizer.ggml.add_space_prefix": False})
    assert {k: field[k] for k in want} == want
    assert len(field["tokenizer.ggml.tokens"]) == CASES[case]["vocab_size"]


def ggml_q8_0(w):
    """Q8_0 of weights (m, n) by ggml's reference (quantize_row_q8_0_ref), computed here from the weights
    alone: per 32 weights of a row, d = amax / 127 and q = roundf(w * (1 / d)) in FP32 (halves away from
    zero), d stored in FP16. Returns (the values read back, d before its FP16 rounding), float64."""
    v = w.astype(np.float32).reshape(w.shape[0], -1, 32)
    d = np.abs(v).max(-1, keepdims=True) / np.float32(127)
    inverse = np.where(d > 0, np.float32(1) / np.where(d > 0, d, np.float32(1)), np.float32(0))
    x = (v * inverse).astype(np.float64)
    q = np.sign(x) * np.floor(np.abs(x) + 0.5)
    return (d.astype(np.float16).astype(np.float64) * q).reshape(w.shape), d.astype(np.float64)


def exact_or_ggml_rounding(back, w):
    """Per GGUF block (32 weights of a row): the weights exactly (our own scale held them), or ggml's
    reference Q8_0 rounding of them; True per block where the latter moved a weight."""
    blocks = lambda a: a.reshape(w.shape[0], -1, 32)  # noqa: E731
    reference, _ = ggml_q8_0(w)
    exact = (blocks(back) == blocks(w)).all(-1)
    assert (exact | (blocks(back) == blocks(reference)).all(-1)).all()
    return ~exact


def test_fp8_goes_to_q8_0_each_weight_within_gguf_rounding(exported):
    """mxfp8_e4m3 -> Q8_0 (GGUF has no FP8): each block is either exact or ggml's rounding of it, computed
    here from the weights alone (ggml_q8_0: d = amax / 127 in FP32, stored in FP16), which moves a weight by
    at most half a step plus 127 times d's FP16 rounding (2^-11 of d); the report's figures are those of
    the file."""
    case, run, _, reports = exported
    model, _ = lowbit.load(str(run / "model-mxfp8_e4m3.safetensors"))
    ours = model.state_dict()
    report = reports["mxfp8_e4m3"]["gguf"]
    changed = {c["tensor"]: c for c in report["changed"]}
    assert changed and not report["exact"]
    moved = []
    for t in gguf.GGUFReader(str(run / "model-mxfp8_e4m3.gguf")).tensors:
        if t.tensor_type != gguf.GGMLQuantizationType.Q8_0:
            continue
        w = ours[our_key(t.name, model.config.arch)].double().numpy()
        back = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(w.shape)
        moved.append(exact_or_ggml_rounding(back, w).any())
        _, d = ggml_q8_0(w)
        diff = (back - w).reshape(w.shape[0], -1, 32)
        assert (np.abs(diff) <= d * (0.5 + 128 * 2 ** -11)).all(), t.name
        c = changed[t.name]
        assert c["max_abs"] == pytest.approx(np.abs(diff).max(), rel=1e-12)
        assert c["rel_rms"] == pytest.approx(np.sqrt((diff ** 2).sum() / (w ** 2).sum()), rel=1e-9)
        assert c["weights_changed"] == int((diff != 0).sum())
    assert any(moved)


def safetensors_bits_per_weight(path):
    """Bits per quantized weight of an exported file, from its header read by hand: the bytes of every
    quantized weight's tensors (format ids, codes, scales) over the weights' count."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    shapes = json.loads(header.pop("__metadata__")["quantized"])
    size = {k: e["data_offsets"][1] - e["data_offsets"][0] for k, e in header.items()}
    quantized = sum(b for k, b in size.items() if any(k.startswith(w + ".") for w in shapes))
    return 8 * quantized / sum(m * n for m, n in shapes.values())


def test_auto_takes_one_type_per_tensor_and_reports_its_bits(exported):
    """auto mixes formats per block; GGUF holds one type per tensor: the all-mxfp4 attention stays MXFP4
    (exactly), the MLP of mxfp6_e3m2 and mxfp8_e4m3 blocks goes to Q8_0; bits per weight by hand, of the
    GGUF and of the .safetensors beside it."""
    case, run, _, reports = exported
    report = reports["auto"]["gguf"]
    types = report["quantized_types"]
    assert {n: t for n, t in types.items() if "attn" in n} == {n: "MXFP4" for n in types if "attn" in n}
    assert {n: t for n, t in types.items() if "ffn" in n} == {n: "Q8_0" for n in types if "ffn" in n}
    model, info = lowbit.load(str(run / "model-auto.safetensors"))
    got = gguf_weights(run / "model-auto.gguf")
    weights = {n: model.state_dict()[our_key(n, model.config.arch)].numel() for n in types}
    bits = {"MXFP4": 8 * 17 / 32, "Q8_0": 8 * 34 / 32}  # bytes per 32-weight block: scale + codes
    assert report["bits_per_weight"] == pytest.approx(
        sum(bits[types[n]] * weights[n] for n in types) / sum(weights.values()), rel=1e-12)
    for n in types:
        if types[n] == "MXFP4":
            want = model.state_dict()[our_key(n, model.config.arch)].numpy()
            assert np.array_equal(got[n][1].reshape(want.shape), want), n
    by_hand = safetensors_bits_per_weight(run / "model-auto.safetensors")
    assert 4 < by_hand < 8 and report["bits_per_weight_safetensors"] == pytest.approx(by_hand, rel=1e-12)


# The table of docs/GGUF.md, written out: each format's GGUF type for the quantized Linears, and how the
# values get there. auto and auto-int per layer: make_checkpoint's b_t gives the attention mxfp4 (auto)
# or int2 (auto-int) blocks, the MLP mxfp6_e3m2 and mxfp8_e4m3 (auto) or int4 and int5 (auto-int).
TABLE = {"mxfp4": ("MXFP4", "exact"), **{f"int{b}": ("Q4_0", "exact") for b in (2, 3, 4)},
         **{f"int{b}": ("Q8_0", "exact") for b in range(5, 9)}, "mxfp6_e2m3": ("Q8_0", "exact"),
         "bf16": ("BF16", "exact"), "fp32": ("F32", "exact"),
         **{f: ("Q8_0", "ggml's rounding") for f in ("mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2")},
         **{f: ("F16 or BF16", "the cast of smaller error") for f in ["fp16"] + [f"int{b}" for b in range(9, 17)]}}
LAYERS = {"auto": {"attn": ("MXFP4", "exact"), "ffn": ("Q8_0", "ggml's rounding")},
          "auto-int": {"attn": ("Q4_0", "exact"), "ffn": ("Q8_0", "exact")}}


@pytest.fixture(scope="module")
def every_format(tmp_path_factory):
    """The bytes GPT2 of make_checkpoint exported to every format of TABLE, and auto and auto-int."""
    d = tmp_path_factory.mktemp("every")
    write_data(str(d / "data"), tokenizer.Tokenizer("bytes", "bytes"))
    make_checkpoint(str(d / "run"), str(d / "data"), arch="gpt2", vocab_size=256)
    rc = util.cli(E.main, [f"--out_dir={d / 'run'}", f"--format={','.join([*TABLE, *LAYERS])}", "--gguf=True",
                           "--evaluate=False", "--plot=False", f"--json={d / 'export.json'}"])
    assert rc == 0
    return d / "run", {r["format"]: r["gguf"] for r in json.loads((d / "export.json").read_text())["exports"]}


@pytest.mark.parametrize("fmt", [*TABLE, *LAYERS])
def test_every_format_of_the_table_is_read_back_as_the_table_says(every_format, fmt):
    """gguf's reader and dequantizer give, for every quantized Linear, the type of the table and the
    exported weights exactly, or ggml's Q8_0 rounding of them (computed here), or their FP16 or BF16
    cast (torch's), whichever of the two is closer."""
    run, reports = every_format
    model, info = lowbit.load(str(run / f"model-{fmt}.safetensors"))
    ours, same = model.state_dict(), []
    for name, (kind, back) in gguf_weights(run / f"model-{fmt}.gguf").items():
        key = our_key(name, "gpt2")
        if key not in info["quantized"]:
            continue
        want_type, how = LAYERS[fmt]["attn" if "attn" in name else "ffn"] if fmt in LAYERS else TABLE[fmt]
        w = ours[key].double().numpy()
        back = back.astype(np.float64).reshape(w.shape)
        same.append(np.array_equal(back, w))
        if how == "exact":
            assert kind == want_type and np.array_equal(back, w), (fmt, name, kind)
        elif how == "ggml's rounding":
            assert kind == want_type, (fmt, name, kind)
            exact_or_ggml_rounding(back, w)
        else:
            casts = {t: ours[key].to(dtype).double().numpy() for t, dtype in (("F16", torch.float16),
                                                                             ("BF16", torch.bfloat16))}
            error = {t: ((c - w) ** 2).sum() for t, c in casts.items()}
            assert kind == min(error, key=error.get) and np.array_equal(back, casts[kind]), (fmt, name, kind)
    assert reports[fmt]["exact"] == all(same), fmt  # the report says whether any weight moved


def bf16_values():
    """Every positive finite BF16 value, as float64."""
    return torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).double()


def test_a_bf16_scale_is_an_fp16_value_from_2_to_the_minus_17_to_65280():
    """The range of integer scales Q4_0/Q8_0 hold exactly, over every BF16 value: all of [2^-17, 65280],
    and it is tight: the BF16 values just outside it are not FP16 values."""
    v = bf16_values()
    exact = v.to(torch.float16).double() == v
    inside = (v >= 2 ** -17) & (v <= 65280)
    assert exact[inside].all() and inside.sum() == 33 * 128  # the octaves 2^-17 .. 2^15, the last ending at 65280
    assert not exact[v < 2 ** -17][-1] and not exact[v > 65280][0]


BELOW = (2 - 2 ** -7) * 2 ** -18  # the BF16 value below 2^-17: 127.5 steps of FP16's subnormals (2^-24)


@pytest.mark.parametrize("fmt, scales", [("int8", [2 ** -17, BELOW, 2 ** -6, 65280.0]),
                                         ("int4", [2 ** -17, BELOW, 65280.0, 65536.0])])
def test_scales_outside_fp16_fall_back_to_ggufs_quantizer_and_are_counted(fmt, scales, tmp_path):
    """A weight of four 32x32 blocks with the given integer scales: a block whose scale FP16 holds is
    exact in GGUF; the others are gguf's own quantization of the block (gguf.quants.quantize), and the
    report counts the weights that moved."""
    bits = int(fmt[3:])
    top, qtype = 2 ** (bits - 1) - 1, gguf.GGMLQuantizationType.Q8_0 if bits == 8 else gguf.GGMLQuantizationType.Q4_0
    q = torch.randint(-top, top + 1, (128, 32), generator=torch.Generator().manual_seed(bits)).double()
    q[::32, 0] = top  # each block's largest weight reaches the top level: its scale is the one given
    w = (q * torch.tensor(scales, dtype=torch.float64).repeat_interleave(32)[:, None]).float()
    tensors = {f"w.{k}": v for k, v in lowbit.quantize_weight("w", w, torch.full((4, 1), lowbit.BY_NAME[fmt],
                                                                                  dtype=torch.uint8)).items()}
    assert tensors[f"w.{fmt}.scales"].double().tolist() == scales
    chosen, data, back = gguf_file.choose(w.double().numpy(), gguf_file.block_layout(tensors, "w", 128, 32))
    assert chosen == qtype and np.array_equal(gguf.quants.dequantize(data, qtype), back)
    fits = np.repeat([s >= 2 ** -17 and s <= 65280 for s in scales], 32)
    assert np.array_equal(back[fits], w.numpy()[fits])
    theirs = gguf.quants.quantize(w.numpy(), qtype)
    assert np.array_equal(data[~fits], theirs[~fits]) and not np.array_equal(back[~fits], w.numpy()[~fits])
    path = tmp_path / "w.gguf"
    path.write_bytes(b"")
    report = gguf_file.summary([gguf_file.Tensor("w", qtype, data, back, w.double().numpy(), True)], str(path), 8)
    assert report["changed"][0]["weights_changed"] == int((back != w.numpy()).sum()) > 0


# --- transformers ----------------------------------------------------------------------------------

def transformers_from_gguf(run, fmt, config):
    """transformers' model of the GGUF file. Its GGUF reader takes GPT-2's context (n_ctx) but sizes the
    position table by n_positions, which it leaves at 1024: given here, as a user of a shorter model must."""
    from transformers import AutoModelForCausalLM
    extra = {"n_positions": config.block_size} if config.arch == "gpt2" else {}
    return AutoModelForCausalLM.from_pretrained(str(run), gguf_file=f"model-{fmt}.gguf", dtype=torch.float32,
                                                **extra).eval()


def transformers_from_export(path, out_dir, tanh):
    """transformers' model of export.load's dequantized weights, written by hf.py (the independent route)."""
    from files import pretrained
    from transformers import AutoModelForCausalLM
    model, info = lowbit.load(str(path))
    pretrained.save_pretrained(info["model_args"], model.state_dict(), str(out_dir))
    extra = {"activation_function": "gelu_new"} if tanh else {}  # llama.cpp's GELU, for an exact-GELU GPT2
    return AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32, **extra).eval()


def test_transformers_reads_the_file_and_computes_the_exported_model_bit_for_bit(exported, tmp_path):
    """mxfp4, int4, int8: transformers' model from the GGUF file gives, bit for bit in FP32, the logits
    of transformers' model of export.load's weights (hf.py), and within FP32 rounding ours; the
    exact-GELU GPT2 differs by the GELU only (bit for bit against the tanh GELU)."""
    case, run, tok, reports = exported
    for fmt in EXACT:
        ours, _ = lowbit.load(str(run / f"model-{fmt}.safetensors"))
        theirs = transformers_from_gguf(run, fmt, ours.config)
        twin = transformers_from_export(run / f"model-{fmt}.safetensors", tmp_path / fmt, tanh=case == "bytes")
        x = seeded_tokens(tok.vocab_size)
        with torch.no_grad():
            a, b, c = theirs(x).logits, twin(x).logits, ours(x, torch.zeros_like(x))[0]
        assert torch.equal(a, b), fmt
        measured = reports[fmt]["gguf"]["max_logit_difference"]
        if case == "bytes":  # the GELU, measured at export time: transformers' tanh GELU shows the same
            assert (a - c).abs().max().item() == pytest.approx(measured, abs=1e-5 * (1 + c.abs().max().item()))
            assert any("exact GELU" in note for note in reports[fmt]["gguf"]["notes"])
        else:
            assert (a - c).abs().max().item() <= 1e-5 * (1 + c.abs().max().item()), fmt
            assert measured == 0.0 and reports[fmt]["gguf"]["notes"] == []


def test_transformers_logits_of_the_rounded_formats_are_the_measured_ones(exported):
    """mxfp8_e4m3 and auto (Q8_0 rounding) and the exact-GELU GPT2: the difference to the exported model
    export_gguf reports is the one transformers' model of the file shows, on the same tokens."""
    case, run, tok, reports = exported
    for fmt in ("mxfp8_e4m3", "auto"):
        ours, _ = lowbit.load(str(run / f"model-{fmt}.safetensors"))
        theirs = transformers_from_gguf(run, fmt, ours.config)
        x = seeded_tokens(tok.vocab_size)
        with torch.no_grad():
            a, c = theirs(x).logits, ours(x, torch.zeros_like(x))[0]
        report = reports[fmt]["gguf"]
        assert report["max_logit_difference"] > 0
        assert (a - c).abs().max().item() == pytest.approx(report["max_logit_difference"],
                                                           abs=1e-5 * (1 + c.abs().max().item()))
        assert report["val_loss_exported"] == reports[fmt]["val_loss"]  # export.py's own evaluation of the file


def test_transformers_tokenizer_encodes_as_the_data_did(exported):
    """transformers' tokenizer from the file encodes as the data's (tiktoken, SentencePiece). For the
    bytes it prepends a space ("▁"): its GGUF SentencePiece reader ignores tokenizer.ggml.add_space_prefix
    = false (llama.cpp honours it, see the llama.cpp test); a text that starts with a space reads the same."""
    from transformers import AutoTokenizer
    case, run, tok, _ = exported
    theirs = AutoTokenizer.from_pretrained(str(run), gguf_file="model-int8.gguf")
    for text in PROBES:
        got = theirs.encode(text, add_special_tokens=False)
        assert got == ([0x20] if case == "bytes" else []) + tok.encode(text), text
        if case == "bytes":
            assert theirs.encode(" " + text, add_special_tokens=False) == tok.encode(" " + text)


# --- llama.cpp ---------------------------------------------------------------------------------------

needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed (pip install llama-cpp-python builds llama.cpp from source); "
           "the check runs where it is")


def test_llama_cpps_activations_against_a_block_weight_are_ggufs_q8_0():
    """The rounding LlamaCppArithmetic applies to a Linear's input against a Q4_0, Q8_0 or MXFP4 weight
    is gguf's own Q8_0 quantization of it (quantize, dequantize), on values spread over 40 octaves."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=gen) * torch.exp2(torch.randint(-20, 20, (64, 1), generator=gen).float())
    x[3, 32:64] = 0.0  # an all-zero block
    Q = gguf.GGMLQuantizationType
    theirs = gguf.quants.dequantize(gguf.quants.quantize(x.numpy(), Q.Q8_0), Q.Q8_0)
    for qtype in (Q.Q4_0, Q.Q8_0, Q.MXFP4):
        assert np.array_equal(arithmetic.ACTIVATIONS[qtype](x).numpy(), theirs)


@needs_llama_cpp
def test_llama_cpp_runs_the_file_with_our_tokens_and_logits(exported):
    """llama.cpp loads every file, tokenizes a text as the data did, and its logits at every position of
    it are the file's model's (model_from_gguf: its weights, llama.cpp's GELU) within twice the effect of
    llama.cpp's own roundings, reproduced in our code (LlamaCppArithmetic; docs/GGUF.md derives the
    bound), with our next token."""
    case, run, tok, _ = exported
    text = PROBES[0] + " " + PROBES[3]
    ids = tok.encode(text)
    x = torch.tensor([ids])
    for fmt in FORMATS:
        path = run / f"model-{fmt}.gguf"
        llm = runtime.llama_cpp_model(path, 64, plain_cpu=True)  # AMX: see there
        for probe in PROBES + [text]:
            assert llm.tokenize(probe.encode("utf-8"), add_bos=False, special=False) == tok.encode(probe), (fmt, probe)
        llm.eval(ids)
        theirs = torch.tensor(np.array(llm.scores[:len(ids)]), dtype=torch.float32)
        model, info = lowbit.load(str(run / f"model-{fmt}.safetensors"))
        file_model = gguf_file.model_from_gguf(str(path), info["model_args"])
        with torch.no_grad():
            ours, exact = model(x, x)[0][0], file_model(x, x)[0][0]
            with arithmetic.LlamaCppArithmetic(file_model, str(path)):
                rounded = file_model(x, x)[0][0]
        effect, worst = (rounded - exact).abs().max().item(), (theirs - exact).abs().max().item()
        print(f"llama.cpp {case} {fmt}: max |logit difference| {worst:.2e} to the file's model, its roundings' "
              f"effect {effect:.2e}, to their arithmetic {(theirs - rounded).abs().max():.2e}")
        assert 0 < effect and worst <= 2 * effect, fmt
        # the derivation's premise: llama.cpp's distance to its arithmetic (summation order, a few boundary
        # crossings) is below the roundings' effect; a rounding missing from the arithmetic breaks it
        assert (theirs - rounded).abs().max().item() <= effect, fmt
        assert theirs[-1].argmax() == ours[-1].argmax(), fmt
        del llm


# --- bad input -----------------------------------------------------------------------------------------

def test_an_existing_gguf_file_stops_the_export_before_anything_is_written(tmp_path):
    """python export.py --gguf=True with model-<format>.gguf there: one line, exit 1, no traceback, the
    file kept, no other file written (the safetensors of the formats before it neither)."""
    write_data(str(tmp_path / "data"), tokenizer.Tokenizer("bytes", "bytes"))
    make_checkpoint(str(tmp_path / "run"), str(tmp_path / "data"), arch="gpt2", vocab_size=256)
    (tmp_path / "run" / "model-mxfp4.gguf").write_bytes(b"keep")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "export.py"), f"--out_dir={tmp_path / 'run'}",
                        "--format=int8,mxfp4", "--gguf=True", "--plot=False"], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert p.returncode == 1 and p.stderr.strip().count("\n") == 0 and "Traceback" not in p.stderr
    assert "model-mxfp4.gguf exists; pass --overwrite=True" in p.stderr
    assert sorted(os.listdir(tmp_path / "run")) == ["ckpt.pt", "model-mxfp4.gguf"]
    assert (tmp_path / "run" / "model-mxfp4.gguf").read_bytes() == b"keep"


def _hf_tokenizer_data(d):
    """Data whose tokenizer is a Hugging Face tokenizer.json (a word-level one, with </s>)."""
    from tokenizers import Tokenizer, models
    os.makedirs(d)
    (d / "tokenizer.json").write_text(Tokenizer(models.WordLevel({"a": 0, "</s>": 1}, unk_token="a")).to_str())
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    np.zeros(200, dtype=np.uint16).tofile(d / "train.bin")
    np.zeros(200, dtype=np.uint16).tofile(d / "val.bin")
    (d / "meta.json").write_text(json.dumps({"tokenizer": "tokenizers:tokenizer.json", "eot_token": 1,
                                             "vocab_size": 2}))


def _other_pattern_data(d):
    """Data of a tiktoken encoding that splits text otherwise than GPT-2 (here: on spaces only)."""
    import tiktoken
    enc = tiny_tiktoken(2)
    tiktoken.registry.ENCODINGS["spaces"] = tiktoken.Encoding(
        name="spaces", pat_str=r"\S+|\s+", mergeable_ranks=enc._mergeable_ranks, special_tokens={"<|endoftext|>": 258})
    write_data(str(d), tokenizer.load(tiktoken.get_encoding("spaces")))


@pytest.mark.parametrize("what, arch_args, argv, message", [
    ("rows of 48", dict(n_embd=48, n_head=2), ["--format=bf16,mxfp4"], "--format=mxfp4 cannot go to GGUF"),
    ("--save=False", {}, ["--format=int8", "--save=False"], "drop --save=False"),
    ("tokenizer.json", {}, ["--format=int8"], "GGUF export writes tiktoken, SentencePiece and byte vocabularies"),
    ("tiktoken pattern", {}, ["--format=int8"], "splits text with a pattern other than GPT-2's"),
    ("non-finite", {}, ["--format=int8"], "non-finite values"),
])
def test_what_gguf_cannot_hold_is_refused_in_one_line_and_nothing_written(what, arch_args, argv, message, tmp_path,
                                                                           capsys):
    data = tmp_path / "data"
    if what == "tokenizer.json":
        _hf_tokenizer_data(data)
    elif what == "tiktoken pattern":
        _other_pattern_data(data)
    else:
        write_data(str(data), tokenizer.Tokenizer("bytes", "bytes"))
    vocab = json.loads((data / "meta.json").read_text())["vocab_size"]
    make_checkpoint(str(tmp_path / "run"), str(data), **{"arch": "gpt2", "vocab_size": vocab, **arch_args})
    if what == "non-finite":
        ckpt = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)
        ckpt["model"]["transformer.h.0.mlp.c_fc.weight"][0, 0] = float("inf")
        torch.save(ckpt, tmp_path / "run" / "ckpt.pt")
    rc = util.cli(E.main, [f"--out_dir={tmp_path / 'run'}", "--gguf=True", "--plot=False", "--evaluate=False", *argv])
    err = capsys.readouterr().err
    assert rc == 1 and err.strip().count("\n") == 0 and message in err, err
    assert os.listdir(tmp_path / "run") == ["ckpt.pt"]


@needs_llama_cpp
@pytest.mark.parametrize("exported", ["llama2"], indirect=True)
def test_a_file_llama_cpp_computes_another_model_of_fails_the_check_in_one_line(exported, monkeypatch, capsys):
    """The bound sees a model llama.cpp does not compute though it differs by as little as an RMSNorm
    epsilon of 3e-5 for the 1e-5 the file declares (docs/GGUF.md): python export_gguf.py --gguf=F then exits
    1 with one line."""
    import export_gguf
    _, run, _, _ = exported
    real = gguf_file.model_from_gguf
    monkeypatch.setattr(gguf_file, "model_from_gguf", lambda path, model_args, *a: real(
        path, {**model_args, "norm_eps": 3e-5}, *a))
    rc = util.cli(export_gguf.main, [f"--gguf={run / 'model-int8.gguf'}", "--plain_cpu=True", "--eval_iters=1"])
    out, err = capsys.readouterr()
    ours = [line for line in err.splitlines() if line.startswith("error: ")]  # beside llama.cpp's own log lines
    assert rc == 1 and len(ours) == 1 and "Traceback" not in err, err
    assert "more than twice the effect of its own roundings" in ours[0] and "does not compute the model" in ours[0]
    assert "max |logit difference|" in out  # both terms reported before


@needs_llama_cpp
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_llama_cpp_check_reports_our_val_loss_and_llama_cpps(exported, fmt):
    """python export_gguf.py --gguf=...: our val loss is export.py's in FP32 on train.py's evaluation
    batches; llama.cpp's logits are within the bound (twice the effect of its roundings) of the file's
    model, and its val loss is that of its arithmetic in our code within 1e-5 and ours within 1e-4
    (docs/GGUF.md)."""
    case, run, _, _ = exported
    r = runtime.check_llama_cpp(str(run / f"model-{fmt}.gguf"), eval_iters=1, plain_cpu=True)
    model, info = lowbit.load(str(run / f"model-{fmt}.safetensors"))
    config, directory = info["config"], loader.data_dir(info["config"]["dataset"])
    data = loader.open_split(directory, "val", loader.read_meta(directory), 64)
    ours = loader.estimate_loss(model, {"val": data}, seed=config["seed"], eval_iters=1,
                                batch_size=config["batch_size"], block_size=64, device="cpu")["val"]  # FP32
    assert r["val_loss"] == pytest.approx(ours, rel=1e-6)
    print(f"llama.cpp check {case} {fmt}: val loss to its arithmetic "
          f"{r['val_loss_llama_cpp'] / r['val_loss_arithmetic'] - 1:+.1e}, "
          f"to ours {r['val_loss_llama_cpp'] / r['val_loss'] - 1:+.1e}; logits to the file's model "
          f"{r['max_logit_difference_file']:.2e}, the roundings' effect {r['rounding_effect']:.2e}")
    assert r["tokens"] == 4 * 64 and r["within_bound"]
    assert 0 < r["rounding_effect"] and r["max_logit_difference_file"] <= 2 * r["rounding_effect"]
    assert r["val_loss_llama_cpp"] == pytest.approx(r["val_loss_arithmetic"], rel=1e-5)
    assert r["val_loss_llama_cpp"] == pytest.approx(r["val_loss"], rel=1e-4)
    assert r["same_next_token"] > 0.9
