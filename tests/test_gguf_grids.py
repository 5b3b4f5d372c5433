"""export.py's formats on llama.cpp's own grids (q4_0, q8_0, q4_k, q5_k, q3_k, q2_k, q6_k, mxfp4_row, iq4_nl,
iq4_xs) and the per-weight types a run trained at a budget (auto-gguf, error-gguf): the .safetensors and the
GGUF hold each weight's GGML blocks, which gguf's dequantizer reads back as ggml_quants.fake_quantize
of the checkpoint's master weights, bit for bit; transformers and llama.cpp run every file;
llama-quantize of the F32 file writes our Q4_0, Q8_0, IQ4_NL and IQ4_XS bytes.

The models are a one-layer GPT2 and Llama2 whose every Linear reads a width of a multiple of 256 (the
K-quants' rows: n_embd 256, GPT2's MLP 1024, Llama2's 768), on the default corpus's bytes."""
import contextlib
import importlib.util
import io
import json
import os
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

import export as E
import util
from data import tokenizer
from files import gguf_file, lowbit
from llamacpp import arithmetic, build, runtime, tools
from quant import ggml_quants
from conftest import greedy_text
from test_export import file_parts, seal
from test_gguf import (our_key, safetensors_bits_per_weight, seeded_tokens, transformers_from_export,
                       transformers_from_gguf, write_data)


# Our format names and the GGML type of each, written out; the bits per weight of each type from
# ggml-common.h's block sizes by hand: (bytes per block) * 8 / (weights per block).
TYPES = {"q4_0": "Q4_0", "q8_0": "Q8_0", "q4_k": "Q4_K", "q5_k": "Q5_K", "q3_k": "Q3_K", "q2_k": "Q2_K",
         "q6_k": "Q6_K", "mxfp4_row": "MXFP4", "iq4_nl": "IQ4_NL", "iq4_xs": "IQ4_XS"}
BITS = {"Q4_0": 18 * 8 / 32, "Q8_0": 34 * 8 / 32, "Q4_K": 144 * 8 / 256, "Q5_K": 176 * 8 / 256,
        "Q3_K": 110 * 8 / 256, "Q2_K": 84 * 8 / 256, "Q6_K": 210 * 8 / 256, "MXFP4": 17 * 8 / 32,
        "IQ4_NL": 18 * 8 / 32, "IQ4_XS": 136 * 8 / 256}
ARCHS = {"gpt2": dict(arch="gpt2", n_layer=1, n_head=4, n_embd=256, vocab_size=256, block_size=64, gelu="tanh"),
         "llama2": dict(arch="llama2", n_layer=1, n_head=4, n_kv_head=2, n_embd=256, vocab_size=256, block_size=64)}
# How close llama.cpp's val loss is to its arithmetic reproduced in our code and to ours (relative), and
# the share of the RMS of its logits' difference to the file's model the arithmetic leaves (without the
# activations' roundings reproduced: 1.0); docs/GGUF.md gives what these models measured
VAL_LOSS_TO_ARITHMETIC, VAL_LOSS_TO_OURS, RMS_LEFT = 5e-5, 3e-4, 0.5
needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="llama-cpp-python is not installed (pip install llama-cpp-python builds "
                                            "llama.cpp from source); the check runs where it is")


def make_run(out_dir, data_dir, arch, pqt=None, types=None, **arch_args):
    """A checkpoint of a tiny model (ARCHS[arch] with arch_args), seeded; its state dict. pqt: its "pqt"
    entry (a bf16 run's by default); types: {layer: GGML type name or value} saved as <layer>.ggml_type,
    the buffer an STE layer on a llama.cpp grid records (gguf's GGMLQuantizationType value, 255 before
    a budget's switch)."""
    from model import GPT, ModelConfig
    torch.manual_seed(0)
    args = {**ARCHS[arch], **arch_args}
    sd = GPT(ModelConfig(**args)).state_dict()
    for layer, t in (types or {}).items():
        value = t if isinstance(t, (int, float)) else int(gguf.GGMLQuantizationType[t])
        sd[layer + ".ggml_type"] = torch.tensor(value, dtype=torch.float32 if isinstance(t, float) else torch.uint8)
    ckpt = dict(model=sd, optimizer=[], model_args=args, iter_num=7, pqt=pqt or dict(method="bf16"),
                config=dict(dataset=str(data_dir), seed=1337, batch_size=4, block_size=64, eval_iters=1,
                            dtype="float32"))
    os.makedirs(out_dir, exist_ok=True)
    torch.save(ckpt, os.path.join(out_dir, "ckpt.pt"))
    return sd


def block_linears(sd):
    """The block Linears' weight keys of a state dict: what a bf16 run's export quantizes."""
    return [k for k in sd if k.startswith("transformer.h.") and k.endswith(".weight") and sd[k].dim() == 2]


def export(run, *argv):
    """export.py in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = util.cli(E.main, [f"--out_dir={run}", "--plot=False", *argv])
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module", params=list(ARCHS))
def grids(request, tmp_path_factory):
    """A bf16 run of each architecture exported to every GGML format and fp32 with --gguf=True: its
    architecture, run directory, master weights, export.py's JSON report per format, what it printed."""
    arch = request.param
    d = tmp_path_factory.mktemp(arch)
    write_data(str(d / "data"), tokenizer.Tokenizer("bytes", "bytes"))
    master = make_run(d / "run", d / "data", arch)
    rc, printed, err = export(d / "run", f"--format={','.join([*TYPES, 'fp32'])}", "--gguf=True", "--eval_iters=1",
                              f"--json={d / 'export.json'}")
    assert rc == 0, err
    reports = {r["format"]: r for r in json.loads((d / "export.json").read_text())["exports"]}
    return SimpleNamespace(arch=arch, run=d / "run", master=master, reports=reports, printed=printed)


def gguf_tensors(path):
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def bits(a):
    """An FP32 array's bit patterns: equal bits are equal values and equal signs of zero."""
    return np.ascontiguousarray(a, dtype=np.float32).view(np.int32)


# --- every type, bit for bit -------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", TYPES)
def test_gguf_reads_back_fake_quantize_of_the_master_weights_bit_for_bit(grids, fmt):
    """Every block Linear of model-<fmt>.gguf is of the format's GGML type and reads back (gguf's reader
    and dequantizer) as ggml_quants.fake_quantize of the checkpoint's master weight, bit for bit: the
    weights an STE run trained on that grid computed with. Embeddings BF16, norms and biases F32."""
    quantized = block_linears(grids.master)
    seen = set()
    for name, t in gguf_tensors(grids.run / f"model-{fmt}.gguf").items():
        key = our_key(name, grids.arch)
        master = grids.master[key]
        back = gguf.quants.dequantize(t.data, t.tensor_type).reshape(master.shape)
        if key in quantized:
            want = ggml_quants.fake_quantize(master.float(), TYPES[fmt]).numpy()
            assert t.tensor_type.name == TYPES[fmt] and np.array_equal(bits(back), bits(want)), (fmt, name)
            seen.add(key)
        else:
            want = master.bfloat16().float() if master.dim() == 2 else master.float()
            kind = "BF16" if master.dim() == 2 else "F32"
            assert t.tensor_type.name == kind and np.array_equal(bits(back), bits(want.numpy())), (fmt, name)
    assert seen == set(quantized)


@pytest.mark.parametrize("fmt", TYPES)
def test_the_safetensors_and_the_gguf_hold_the_same_bytes_and_values(grids, fmt):
    """The .safetensors holds each block Linear as <weight>.ggml, its type in the metadata's ggml_types:
    the very bytes of the GGUF's tensor; lowbit.load's model holds the values gguf reads from them."""
    from safetensors.torch import load_file
    path = grids.run / f"model-{fmt}.safetensors"
    raw, theirs = load_file(str(path)), gguf_tensors(grids.run / f"model-{fmt}.gguf")
    model, info = lowbit.load(str(path))
    assert info["ggml_types"] == {k: TYPES[fmt] for k in block_linears(grids.master)}
    names = {our_key(n, grids.arch): n for n in theirs}
    for key in info["ggml_types"]:
        t = theirs[names[key]]
        ours = raw[key + ".ggml"].numpy()
        assert np.array_equal(np.asarray(t.data).reshape(ours.shape), ours), key
        back = gguf.quants.dequantize(t.data, t.tensor_type).reshape(ours.shape[0], -1)
        assert np.array_equal(bits(model.state_dict()[key].numpy()), bits(back)), key
        assert f"{key}.format" not in raw


@pytest.mark.parametrize("fmt", TYPES)
def test_the_files_size_is_the_types_bits_per_weight_and_the_report_says_so(grids, fmt):
    """The block Linears take the type's bits per weight (ggml-common.h's block sizes, by hand) in the GGUF
    and in the .safetensors (both counted here from the files); the report prints them and the GGUF's bytes."""
    want = BITS[TYPES[fmt]]
    assert ggml_quants.bits_per_weight(TYPES[fmt]) == want
    tensors, quantized = gguf_tensors(grids.run / f"model-{fmt}.gguf"), block_linears(grids.master)
    mine = [t for n, t in tensors.items() if our_key(n, grids.arch) in quantized]
    assert 8 * sum(int(t.n_bytes) for t in mine) / sum(int(t.n_elements) for t in mine) == want
    assert safetensors_bits_per_weight(grids.run / f"model-{fmt}.safetensors") == want
    report = grids.reports[fmt]
    size = os.path.getsize(grids.run / f"model-{fmt}.gguf")
    assert report["bits_per_weight"] == report["gguf"]["bits_per_weight"] == want
    assert report["gguf"]["file_bytes"] == size and report["gguf"]["exact"]
    assert f"model-{fmt}.gguf ({size:,} bytes, " in grids.printed
    assert f"the quantized Linears: {want:.3f} bits per weight (in the .safetensors: {want:.3f})" in grids.printed


# --- transformers ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", TYPES)
def test_transformers_reads_every_type_and_computes_the_exported_model_bit_for_bit(grids, fmt, tmp_path):
    """transformers 5.24 dequantizes every one of these types (through gguf's dequantizer): its model of the
    GGUF gives, bit for bit in FP32, the logits of its model of lowbit.load's weights (hf.py), and ours
    within FP32 rounding."""
    ours, _ = lowbit.load(str(grids.run / f"model-{fmt}.safetensors"))
    theirs = transformers_from_gguf(grids.run, fmt, ours.config)
    twin = transformers_from_export(grids.run / f"model-{fmt}.safetensors", tmp_path / fmt, tanh=False)
    x = seeded_tokens(256)
    with torch.no_grad():
        a, b, c = theirs(x).logits, twin(x).logits, ours(x, torch.zeros_like(x))[0]
    assert torch.equal(a, b), fmt
    assert (a - c).abs().max().item() <= 1e-5 * (1 + c.abs().max().item()), fmt


# --- llama.cpp ------------------------------------------------------------------------------------------

def q8_k_reference(x):
    """ggml's quantize_row_q8_K_ref and dequantize_row_q8_K, written out in numpy FP32 a block at a time:
    per 256 values, max = the first value of largest magnitude, iscale = -127 / max, q = nearest_int(iscale
    * x) (FP32 product, then the 1.5 * 2^23 trick: half to even), at most 127; d = 1 / iscale; 0 if all 0."""
    out = np.zeros_like(x)
    for row in range(x.shape[0]):
        for start in range(0, x.shape[1], 256):
            v = x[row, start:start + 256]
            j = int(np.argmax(np.abs(v)))  # numpy's argmax: the first of the largest, as the C loop's strict >
            if v[j] == 0:
                continue
            iscale = np.float32(-127) / v[j]
            shifted = (iscale * v).astype(np.float32) + np.float32(12582912)
            q = np.minimum((shifted.view(np.int32) & 0x007FFFFF) - 0x00400000, 127)
            out[row, start:start + 256] = q.astype(np.float32) * (np.float32(1) / iscale)
    return out


def test_llama_cpps_activations_against_a_k_quant_weight_are_q8_k():
    """llama.cpp's CPU matmul quantizes a Linear's input to its weight type's vec_dot_type: Q8_K for Q2_K ...
    Q6_K and IQ4_XS (ggml-cpu.c). The rounding LlamaCppArithmetic applies is ggml's reference Q8_K, written out here,
    on values spread over 40 octaves, with ties of +a and -a, zero blocks and exact halves."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 512, generator=gen) * torch.exp2(torch.randint(-20, 20, (64, 1), generator=gen).float())
    x[3, 256:] = 0.0  # an all-zero block
    x[4, :256] = torch.linspace(-127, 127, 256).round()  # +127 and -127 tie; integers: the steps are exact
    x[5, :256] = torch.arange(256) % 7 - 3.5  # halves of the step
    want = q8_k_reference(x.numpy())
    for qtype in (*arithmetic.K_QUANTS, gguf.GGMLQuantizationType.IQ4_XS):
        assert np.array_equal(bits(arithmetic.ACTIVATIONS[qtype](x).numpy()), bits(want)), qtype.name


def q8_0_x86(x):
    """ggml-cpu's quantize_row_q8_0 for x86 (AVX), which llama.cpp's CPU matmul runs on a Linear's input
    against Q4_0, Q8_0, MXFP4 and IQ4_NL, in numpy FP32: per 32 values, d = amax / 127 in FP16, id = 127 / amax
    (one correctly rounded division), q = x * id rounded half to even."""
    v = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(v).max(-1, keepdims=True)
    inverse = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, np.float32(1)), np.float32(0))
    q = np.rint((v * inverse).astype(np.float32))
    return (q * (amax / np.float32(127)).astype(np.float16).astype(np.float32)).reshape(x.shape)


def test_llama_cpps_activations_against_a_32_weight_block_are_x86s_q8_0():
    """The rounding LlamaCppArithmetic applies against Q4_0, Q8_0, MXFP4 and IQ4_NL is x86's Q8_0 (written out
    here): 127 / amax divided once, where torch's 127 / tensor multiplies by a reciprocal and is a step
    off at a quarter of the values."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4096, 256, generator=gen) * torch.exp2(torch.randint(-20, 20, (4096, 1), generator=gen).float())
    want = q8_0_x86(x.numpy())
    for qtype in (gguf.GGMLQuantizationType[t] for t in ("Q4_0", "Q8_0", "MXFP4", "IQ4_NL")):
        assert np.array_equal(bits(arithmetic.ACTIVATIONS[qtype](x).numpy()), bits(want)), qtype.name


@needs_llama_cpp
@pytest.mark.parametrize("fmt", TYPES)
def test_llama_cpps_logits_and_val_loss_of_every_type_are_ours_within_the_bound(grids, fmt):
    """python export_gguf.py's check on train.py's evaluation batches: llama.cpp's logits are the file's
    model's within twice the effect of its roundings (Q8_K activations against the K-quants and IQ4_XS, Q8_0
    against Q4_0, Q8_0, MXFP4, IQ4_NL; docs/GGUF.md), the arithmetic accounts for most of that difference
    (RMS_LEFT), and its val loss is its arithmetic's within VAL_LOSS_TO_ARITHMETIC and ours (export.py's, FP32)
    within VAL_LOSS_TO_OURS."""
    r = runtime.check_llama_cpp(str(grids.run / f"model-{fmt}.gguf"), eval_iters=1, plain_cpu=True)
    left = r["rms_logit_difference_arithmetic"] / r["rms_logit_difference_file"]
    print(f"llama.cpp {grids.arch} {fmt}: val loss to its arithmetic "
          f"{r['val_loss_llama_cpp'] / r['val_loss_arithmetic'] - 1:+.1e}, to ours "
          f"{r['val_loss_llama_cpp'] / r['val_loss'] - 1:+.1e}; logits to the file's model "
          f"{r['max_logit_difference_file']:.2e}, the roundings' effect {r['rounding_effect']:.2e}; RMS left by "
          f"the arithmetic {left:.2f}")
    assert r["tokens"] == 4 * 64 and r["val_loss"] == pytest.approx(grids.reports[fmt]["val_loss"], rel=1e-6)
    assert 0 < r["rounding_effect"] and r["max_logit_difference_file"] <= 2 * r["rounding_effect"] and r["within_bound"]
    assert r["val_loss_llama_cpp"] == pytest.approx(r["val_loss_arithmetic"], rel=VAL_LOSS_TO_ARITHMETIC)
    assert r["val_loss_llama_cpp"] == pytest.approx(r["val_loss"], rel=VAL_LOSS_TO_OURS)
    assert left < RMS_LEFT and r["same_next_token"] > 0.9


@pytest.mark.skipif(build.llama_cpp_tool("llama-quantize") is None,
                    reason="llama-quantize not found: set LLAMA_CPP_BIN to the directory of llama.cpp's tools, or "
                    "put them on PATH, to compare its Q4_0, Q8_0, IQ4_NL and IQ4_XS files with ours")
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "iq4_nl", "iq4_xs"])
def test_llama_quantize_of_the_f32_file_writes_our_q4_0_q8_0_and_iq4_bytes(grids, fmt, tmp_path):
    """llama-quantize --pure (no importance matrix) of model-fp32.gguf, embeddings and head kept in BF16 as
    ours: every tensor of its file has the type and the bytes of our model-<fmt>.gguf's."""
    dst = tools.llama_quantize(grids.run / "model-fp32.gguf", tmp_path / "theirs.gguf", TYPES[fmt])
    theirs, ours = gguf_tensors(dst), gguf_tensors(grids.run / f"model-{fmt}.gguf")
    assert set(theirs) == set(ours)
    for name, t in theirs.items():
        assert t.tensor_type == ours[name].tensor_type, name
        assert np.array_equal(np.asarray(t.data).view(np.uint8), np.asarray(ours[name].data).view(np.uint8)), name


# --- one type per weight: what a run trained at a budget ---------------------------------------------------

# The GGML type each block Linear's STE trained on, by role: every type at least once over the two models.
MIX = {"gpt2": {"attn.c_attn": "IQ4_XS", "attn.c_proj": "Q8_0", "mlp.c_fc": "Q2_K", "mlp.c_proj": "Q4_K"},
       "llama2": {"attn.q": "Q3_K", "attn.k": "Q4_0", "attn.v": "Q5_K", "attn.out": "IQ4_NL", "mlp.gate": "Q2_K",
                  "mlp.up": "MXFP4", "mlp.down": "Q6_K"}}
BUDGET = 4.5  # the bits per weight the runs below trained their types at


def trained_types(arch, n_layer=1):
    """{layer: GGML type name} of MIX in every block."""
    return {f"transformer.h.{i}.{role}": t for i in range(n_layer) for role, t in MIX[arch].items()}


def budget_pqt(target="auto-gguf", budget=BUDGET):
    """The "pqt" entry of an STE run trained on per-weight GGML types at a budget."""
    return dict(method="ste[all]", target_format=target, bits_per_weight=budget, pqt_start=5.0)


@pytest.mark.parametrize("arch", ARCHS)
def test_auto_gguf_writes_the_type_each_weight_trained_on(arch, tmp_path):
    """--format=auto-gguf --bits_per_weight=B of a run trained at B (its <layer>.ggml_type buffers, all
    chosen): each block Linear in its own type in both files, read back by gguf's dequantizer as
    fake_quantize of its master weight on that type; the bits per weight are the mix's, by hand, within B."""
    write_data(str(tmp_path / "data"), tokenizer.Tokenizer("bytes", "bytes"))
    master = make_run(tmp_path / "run", tmp_path / "data", arch, pqt=budget_pqt(), types=trained_types(arch))
    rc, printed, err = export(tmp_path / "run", "--format=auto-gguf", f"--bits_per_weight={BUDGET}", "--gguf=True",
                              "--evaluate=False", f"--json={tmp_path / 'export.json'}")
    assert rc == 0, err
    assert f"auto-gguf at {BUDGET:g} bits per weight: the GGML type each weight trained on, chosen at the run's step " \
           f"5" in printed
    want = {layer + ".weight": t for layer, t in trained_types(arch).items()}
    _, info = lowbit.load(str(tmp_path / "run" / "model-auto-gguf.safetensors"))
    assert info["ggml_types"] == want
    for name, t in gguf_tensors(tmp_path / "run" / "model-auto-gguf.gguf").items():
        key = our_key(name, arch)
        if key in want:
            back = gguf.quants.dequantize(t.data, t.tensor_type).reshape(master[key].shape)
            assert t.tensor_type.name == want[key], name
            assert np.array_equal(bits(back), bits(ggml_quants.fake_quantize(master[key].float(), want[key]).numpy()))
    weights = {k: master[k].numel() for k in want}
    mean = sum(BITS[want[k]] * n for k, n in weights.items()) / sum(weights.values())
    report = json.loads((tmp_path / "export.json").read_text())["exports"][0]
    assert report["bits_per_weight"] == report["gguf"]["bits_per_weight"] == pytest.approx(mean, rel=1e-12)
    assert mean <= BUDGET and report["gguf"]["exact"]


@needs_llama_cpp
def test_llama_cpp_runs_a_per_weight_mix(tmp_path):
    """The Llama2 of MIX (seven types in one file, IQ4_NL among them) loads and runs in llama.cpp within the
    bound."""
    write_data(str(tmp_path / "data"), tokenizer.Tokenizer("bytes", "bytes"))
    make_run(tmp_path / "run", tmp_path / "data", "llama2", pqt=budget_pqt(), types=trained_types("llama2"))
    assert export(tmp_path / "run", "--format=auto-gguf", f"--bits_per_weight={BUDGET}", "--gguf=True",
                  "--evaluate=False")[0] == 0
    r = runtime.check_llama_cpp(str(tmp_path / "run" / "model-auto-gguf.gguf"), eval_iters=1, plain_cpu=True)
    assert r["within_bound"] and 0 < r["rounding_effect"]
    assert r["val_loss_llama_cpp"] == pytest.approx(r["val_loss_arithmetic"], rel=VAL_LOSS_TO_ARITHMETIC)


UNCHOSEN = 255  # a <layer>.ggml_type before the budget's switch chose it
BAD = {  # (the run: arch_args, pqt, types), the command line, what the one line says
    "a width q4_k cannot hold": ((dict(n_embd=64), None, None), ["--format=q4_k"],
                                 "has rows of 64 weights (its input width), and Q4_K blocks rows of a multiple of 256"),
    "a width q4_0 cannot hold": ((dict(n_embd=48), None, None), ["--format=q4_0"],
                                 "has rows of 48 weights (its input width), and Q4_0 blocks rows of a multiple of 32"),
    "a width no type of 32 holds": ((dict(n_embd=48), None, None), ["--format=q4_k"],
                                    "Q4_K blocks rows of a multiple of 256: export one of our 32x32-block formats"),
    "auto-gguf of a bf16 run": (({}, None, None), ["--format=auto-gguf", f"--bits_per_weight={BUDGET:g}"],
                                "and this run trained none (method 'bf16', target_format 'none'): train a run with "
                                f"--target_format=auto-gguf --bits_per_weight={BUDGET:g}"),
    "auto-gguf at another budget": (({}, budget_pqt(), "mix"), ["--format=auto-gguf", "--bits_per_weight=3.5"],
                                    f"this run trained auto-gguf at {BUDGET:g} bits per weight: export it with "
                                    f"--format=auto-gguf --bits_per_weight={BUDGET:g}"),
    "error-gguf of an auto-gguf run": (({}, budget_pqt(), "mix"),
                                       ["--format=error-gguf", f"--bits_per_weight={BUDGET:g}"],
                                       f"this run trained auto-gguf at {BUDGET:g} bits per weight"),
    "types not chosen yet": (({}, budget_pqt(), UNCHOSEN), ["--format=auto-gguf", f"--bits_per_weight={BUDGET:g}"],
                             "saved before the run chose them (step 5"),
    "a type export never writes": (({}, budget_pqt(), 1), ["--format=auto-gguf", f"--bits_per_weight={BUDGET:g}"],
                                   ".ggml_type is 1, none of llama.cpp's types export writes"),
    "a type edited above the budget": (({}, budget_pqt(), "mix, c_fc Q8_0"),
                                       ["--format=auto-gguf", f"--bits_per_weight={BUDGET:g}"],
                                       "the types this checkpoint records hold 6.1042 bits per weight, more than the "
                                       "budget: its ggml_type buffers were changed after training"),
    "a type of another dtype": (({}, budget_pqt(), 10.5), ["--format=auto-gguf", f"--bits_per_weight={BUDGET:g}"],
                                ".ggml_type is 10.5 (torch.float32), not the one uint8 GGML type id train.py saves"),
    "no budget": (({}, budget_pqt(), "mix"), ["--format=auto-gguf"], "pass that --bits_per_weight (the run's own)"),
    "a budget below q2_k": (({}, budget_pqt(), "mix"), ["--format=error-gguf", "--bits_per_weight=2"],
                            "expected a mean of 2.625 (q2_k) to 8.5 (q8_0) bits per weight"),
}


@pytest.mark.parametrize("case", BAD)
def test_what_a_ggml_format_cannot_export_is_one_line_and_nothing_written(case, tmp_path):
    (arch_args, pqt, types), argv, message = BAD[case]
    write_data(str(tmp_path / "data"), tokenizer.Tokenizer("bytes", "bytes"))
    # by hand, ggml-common.h's bytes per block: c_attn 196,608 weights IQ4_XS (4.25 bits), c_proj 65,536 Q8_0 (8.5),
    # c_fc 262,144 Q2_K (2.625), mlp.c_proj 262,144 Q4_K (4.5): 4.1458 bits per weight; 6.1042 with c_fc in Q8_0
    mix = trained_types("gpt2")
    if types is not None:
        types = {"mix": mix, "mix, c_fc Q8_0": {**mix, "transformer.h.0.mlp.c_fc": "Q8_0"}}.get(types) or \
            dict.fromkeys(mix, types)
    make_run(tmp_path / "run", tmp_path / "data", "gpt2", pqt=pqt, types=types, **arch_args)
    rc, _, err = export(tmp_path / "run", *argv, "--gguf=True", "--evaluate=False")
    assert rc == 1 and err.strip().count("\n") == 0 and message in err, err
    assert os.listdir(tmp_path / "run") == ["ckpt.pt"]


# --- damaged and malformed files ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def q4_k(tmp_path_factory):
    """The GPT2's model-q4_k.safetensors and .gguf."""
    d = tmp_path_factory.mktemp("q4_k")
    write_data(str(d / "data"), tokenizer.Tokenizer("bytes", "bytes"))
    make_run(d / "run", d / "data", "gpt2")
    assert export(d / "run", "--format=q4_k", "--gguf=True", "--evaluate=False")[0] == 0
    return d / "run"


UP = "transformer.h.0.mlp.c_fc.weight"  # 1024 rows of 256 weights: one Q4_K block of 144 bytes a row


def test_sample_py_generates_from_a_file_of_a_llama_cpp_type(q4_k, capsys):
    """sample.py reads model-q4_k.safetensors through lowbit.load, and decodes greedily as the model of the
    master weights does with its block Linears fake-quantized to Q4_K and the rest in BF16 (export's
    other_dtype), decoded here by hand."""
    import sample
    from model import GPT, ModelConfig
    sample.main([f"--init_from={q4_k / 'model-q4_k.safetensors'}", "--start=def ", "--num_samples=1",
                 "--max_new_tokens=8", "--temperature=0.0", "--device=cpu"])
    text = capsys.readouterr().out.split("\n---------------")[0]
    master = torch.load(q4_k / "ckpt.pt", weights_only=True)["model"]
    quantized = block_linears(master)
    model = GPT(ModelConfig(**ARCHS["gpt2"])).eval()
    model.load_state_dict({k: ggml_quants.fake_quantize(v.float(), "q4_k") if k in quantized else v.bfloat16().float()
                           for k, v in master.items()})
    assert text == greedy_text(model, "def ", 8)


def nan_scale(t):
    t = t.clone()
    t[0, :2] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)  # the first block's d: FP16 NaN
    return t


def set_types(change):
    return lambda tensors, metadata: metadata.update(ggml_types=json.dumps({**json.loads(metadata["ggml_types"]),
                                                                            **change}))


MALFORMED = {  # a change to the file's tensors and metadata, sealed with valid checksums -> what the line says
    "blocks a byte short": (lambda t, m: t.update({f"{UP}.ggml": t[f"{UP}.ggml"][:, :-1].clone()}),
                            f"{UP}.ggml should be torch.uint8 (1024, 144) for the Q4_K blocks of {UP}"),
    "another type's size": (set_types({UP: "Q6_K"}), f"{UP}.ggml should be torch.uint8 (1024, 210) for the Q6_K"),
    "a type export never writes": (set_types({UP: "Q4_1"}), "ggml_types names 'Q4_1', none of the GGML types"),
    "a weight not quantized": (set_types({"transformer.wte.weight": "Q4_K"}),
                               "ggml_types names transformer.wte.weight, which is not one of its quantized weights"),
    "no ggml_types": (lambda t, m: m.pop("ggml_types"), "lacks the metadata entry 'ggml_types'"),
    "ids beside the blocks": (lambda t, m: t.update({f"{UP}.format": torch.zeros(32, 8, dtype=torch.uint8)}),
                              "holds tensors the model does not have"),
    "a NaN scale": (lambda t, m: t.update({f"{UP}.ggml": nan_scale(t[f"{UP}.ggml"])}), f"{UP} holds 256 non-finite"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_ggml_file_with_valid_checksums_is_refused_in_one_line(q4_k, case, tmp_path):
    change, message = MALFORMED[case]
    tensors, metadata = file_parts(q4_k / "model-q4_k.safetensors")
    change(tensors, metadata)
    with pytest.raises(lowbit.ExportError) as e:
        lowbit.load(seal(tmp_path / "model.safetensors", tensors, metadata))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_flipped_byte_in_ggml_blocks_is_refused_in_one_line(q4_k, tmp_path):
    """In the .safetensors and in the .gguf: the checksums export wrote catch it before anything is used."""
    from test_export import flip_byte
    path = tmp_path / "model-q4_k.safetensors"
    path.write_bytes(flip_byte(f"{UP}.ggml")((q4_k / "model-q4_k.safetensors").read_bytes()))
    with pytest.raises(lowbit.ExportError, match=f"tensor {UP}.ggml does not match its checksum"):
        lowbit.load(str(path))
    data = bytearray((q4_k / "model-q4_k.gguf").read_bytes())
    t = gguf_tensors(q4_k / "model-q4_k.gguf")["blk.0.ffn_up.weight"]
    data[int(t.data_offset) + 1000] ^= 0x01
    path = tmp_path / "model-q4_k.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(gguf_file.GGUFError, match="tensor blk.0.ffn_up.weight does not match its checksum"):
        gguf_file.read(str(path))


def test_a_ggml_file_has_export_version_3_and_another_version_is_one_line(q4_k, tmp_path):
    """A file with GGML-typed weights has export version 3 (an export.py that reads version 2 only refuses it
    in one line, as this one refuses a 4); the files of our 32x32 formats keep version 2 (test_export)."""
    tensors, metadata = file_parts(q4_k / "model-q4_k.safetensors")
    assert metadata["pqt_export"] == "3" and json.loads(metadata["ggml_types"])[UP] == "Q4_K"
    metadata["pqt_export"] = "4"
    with pytest.raises(lowbit.ExportError, match="has export version '4'; this export.py reads '2' and '3'"):
        lowbit.load(seal(tmp_path / "model.safetensors", tensors, metadata))
