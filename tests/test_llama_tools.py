"""llama.cpp's quantizer beside ours (python export_gguf.py --out_dir=RUN --llama_quantize=...): the tools
found and built, the files llama-quantize writes of a run with and without an importance matrix over the
training split, and one table of them and of our files.

The run is a two-layer GPT2 of width 256 (its MLP reads 1,024: K-quant rows) trained a few steps on the
bytes of model.py. Its files are checked against what does not come from our code: gguf's reader (types,
bytes), llama.cpp's rules for its type mixes and ggml-common.h's block sizes written out here, the
importance matrix's own counts and sums of squares against the inputs of our model's Linears on the same
tokens, and llama-cpp-python's tokenizer."""
import contextlib
import importlib.util
import io
import json
import os
import stat
import subprocess
import time

import gguf
import numpy as np
import pytest
import torch

import export as E
import export_gguf
import util
from conftest import ROOT
from data import tokenizer
from files import gguf_file
from llamacpp import build, tools
from test_gguf import write_data
from test_gguf_grids import BITS, VAL_LOSS_TO_OURS


SPECS = ["Q8_0+imatrix", "Q4_0+imatrix", "Q4_K_M+imatrix", "Q3_K_M+imatrix", "Q2_K+imatrix", "Q4_0", "Q3_K_M",
         "Q3_K_S+imatrix", "Q2_K_S+imatrix", "IQ2_XS+imatrix", "IQ2_M+imatrix", "IQ3_XXS+imatrix", "IQ3_S+imatrix",
         "IQ4_XS+imatrix", "IQ4_NL+imatrix", "Q5_K_M+imatrix", "Q6_K+imatrix"]
CHUNKS = 32  # chunks of block_size (64) training tokens in the tests' importance matrix
N_LAYER = 2
# ggml-common.h: Q4_1 = fp16 d and m, 16 bytes of nibbles (32 weights); per 256 weights, IQ2_XS = fp16 d, qs 32
# uint16, scales 8 bytes; IQ2_S = fp16 d, qs 64 bytes, qh 8, scales 8; IQ3_XXS = fp16 d, qs 96 bytes; IQ3_S =
# fp16 d, qs 64 bytes, qh 8, signs 32, scales 4
BITS = {**BITS, "F32": 32.0, "Q4_1": 20 * 8 / 32, "IQ2_XS": 74 * 8 / 256, "IQ2_S": 82 * 8 / 256,
        "IQ3_XXS": 98 * 8 / 256, "IQ3_S": 110 * 8 / 256}
KEYS = ("spec", "path", "type", "imatrix", "bytes", "block_bits_per_weight", "val_loss_llama_cpp", "val_loss_source")
needs_tools = pytest.mark.skipif(
    any(build.llama_cpp_tool(name) is None for name in ("llama-quantize", "llama-imatrix"))
    or importlib.util.find_spec("llama_cpp") is None,
    reason="llama-quantize and llama-imatrix not found (set LLAMA_CPP_BIN to the directory of llama.cpp's tools, put "
           "them on PATH, or python export_gguf.py --build_llama_cpp), or llama-cpp-python not installed")


def command(script, *argv):
    """A script's main through util.cli in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = util.cli(script.main, list(map(str, argv)))
    return rc, out.getvalue(), err.getvalue()


def train_run(d):
    """data/ (the bytes of model.py) and run/: the GPT2 trained 12 steps by train.py, bf16 (no method)."""
    import train
    write_data(str(d / "data"), tokenizer.Tokenizer("bytes", "bytes"))
    with contextlib.redirect_stdout(io.StringIO()):
        train.main([f"--dataset={d / 'data'}", f"--out_dir={d / 'run'}", f"--n_layer={N_LAYER}", "--n_head=4",
                    "--n_embd=256", "--block_size=64", "--batch_size=4", "--max_iters=12", "--eval_interval=12",
                    "--eval_iters=1", "--warmup_iters=2", "--method=bf16", "--dtype=float32", "--device=cpu",
                    "--compile=False"])
    return d / "run"


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """The trained run, our q4_k export of it, and the command with every spec of SPECS and that file:
    its JSON, what it printed, the export directory."""
    d = tmp_path_factory.mktemp("llama_cpp")
    run = train_run(d)
    rc, _, err = command(E, f"--out_dir={run}", "--format=q4_k", "--gguf=True", "--plot=False", "--device=cpu",
                         f"--json={d / 'export.json'}")
    assert rc == 0, err
    rc, printed, err = command(export_gguf, f"--out_dir={run}", f"--llama_quantize={','.join(SPECS)}",
                               f"--gguf={run / 'model-q4_k.gguf'}", f"--imatrix_chunks={CHUNKS}", "--threads=1",
                               "--plain_cpu=True", f"--json={d / 'table.json'}")
    assert rc == 0, err
    summary = json.loads((d / "table.json").read_text())
    return dict(d=d, run=run, dir=run / "llama.cpp", summary=summary, printed=printed,
                rows={r["spec"] or os.path.basename(r["path"]): r for r in summary["files"]},
                export=json.loads((d / "export.json").read_text())["exports"][0])


def tensors(path):
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def blocks(n_layer, arch="gpt2"):
    """llama.cpp's names of a GPT2's block Linears, written out."""
    return [f"blk.{i}.{name}.weight" for i in range(n_layer) for name in ("attn_qkv", "attn_output", "ffn_up",
                                                                           "ffn_down")]


def llama_cpp_mix(qtype, imatrix, n_layer):
    """{tensor: type} of a GPT2's block Linears in llama-quantize's file of qtype (not --pure), written out from
    llama_tensor_get_type_impl (src/llama-quant.cpp of llama-cpp-python 0.3.36's llama.cpp): GPT2's fused
    attn_qkv is its attn_v (category_is_attn_v), with one query head per key head (n_gqa 1); use_more_bits
    picks the first eighth, the last eighth and every third layer between for more bits. Each mix's own type
    (IQ2_M's is IQ2_S) where no rule changes it; the types in the order attn_qkv, attn_output, ffn_up, ffn_down."""
    def more(i):
        return i < n_layer // 8 or i >= 7 * n_layer // 8 or (i - n_layer // 8) % 3 == 2
    mix = {}
    for i in range(n_layer):
        first = i < n_layer // 8  # the first eighth of ffn_down
        if qtype == "IQ2_XS":  # attn_v Q2_K (n_gqa below 4), the first eighth's ffn_down Q2_K
            types = ("Q2_K", "IQ2_XS", "IQ2_XS", "Q2_K" if first else "IQ2_XS")
        elif qtype == "IQ2_M":  # attn_v, attn_output and the first eighth's ffn_down IQ3_S, the rest IQ2_S
            types = ("IQ3_S", "IQ3_S", "IQ2_S", "IQ3_S" if first else "IQ2_S")
        elif qtype == "IQ3_XXS":  # attn_output IQ3_S; without an imatrix attn_v IQ3_S, ffn_down Q4_K / Q3_K
            types = ("IQ3_XXS" if imatrix else "IQ3_S", "IQ3_S", "IQ3_XXS",
                     "IQ3_XXS" if imatrix else "Q4_K" if first else "Q3_K")
        elif qtype in ("IQ4_XS", "IQ4_NL"):  # without an imatrix the first eighth's ffn_down Q5_K
            types = (qtype, qtype, qtype, "Q5_K" if first and not imatrix else qtype)
        elif qtype == "Q5_K_M":
            types = ("Q6_K" if more(i) else "Q5_K", "Q5_K", "Q5_K", "Q6_K" if more(i) else "Q5_K")
        elif qtype == "Q4_K_M":
            types = ("Q6_K" if more(i) else "Q4_K", "Q4_K", "Q4_K", "Q6_K" if more(i) else "Q4_K")
        elif qtype == "Q3_K_M":
            types = ("Q5_K" if i < 2 else "Q4_K", "Q4_K", "Q3_K", "Q5_K" if i < n_layer // 16 else "Q4_K")
        elif qtype == "Q2_K":
            types = ("Q3_K", "Q3_K", "Q2_K", "Q3_K")
        elif qtype == "Q3_K_S":  # its exceptions are for mixtures of experts only
            types = ("Q3_K",) * 4
        elif qtype == "Q2_K_S":  # attn_v is Q4_K only from 4 query heads a key head
            types = ("Q2_K", "Q2_K", "Q2_K", "Q4_K" if i < n_layer // 8 else "Q2_K")
        elif qtype == "Q4_0":  # with an importance matrix the first eighth's ffn_down is Q4_1
            types = ("Q4_0", "Q4_0", "Q4_0", "Q4_1" if imatrix and i < n_layer // 8 else "Q4_0")
        else:
            types = (qtype,) * 4
        mix.update(zip(blocks(n_layer)[4 * i:4 * i + 4], types))
    return mix


# --- the files and the table ---------------------------------------------------------------------------

@needs_tools
def test_the_command_writes_llama_cpps_files_and_one_table_of_them_and_ours(table):
    """model-fp32.gguf (and its .safetensors), imatrix.gguf and llama-<TYPE>[-imatrix].gguf per spec in
    <run>/llama.cpp; the JSON has one record per file, ours included, with the keys the study runner reads;
    the table prints a row of each."""
    names = {"model-fp32.gguf", "model-fp32.safetensors", "imatrix.gguf", "manifest.json"}
    names |= {f"llama-{s.replace('+imatrix', '-imatrix')}.gguf" for s in SPECS}
    assert set(os.listdir(table["dir"])) == names
    files = table["summary"]["files"]
    assert [r["spec"] for r in files] == [None, *SPECS, None]
    assert [r["path"] for r in files][-1] == str(table["run"] / "model-q4_k.gguf")
    for r in files:
        assert all(k in r for k in KEYS), r
        assert r["val_loss_source"] == files[0]["val_loss_source"]
        assert r["relative_change"] == pytest.approx(r["val_loss_llama_cpp"] / r["val_loss_source"] - 1, rel=1e-9)
    assert [r["imatrix"] for r in files[1:-1]] == ["+imatrix" in s for s in SPECS]
    assert [r["type"] for r in files] == ["fp32", *(s.split("+")[0] for s in SPECS), "q4_k"]
    assert table["summary"]["imatrix"]["chunks"] == CHUNKS and table["summary"]["imatrix"]["context"] == 64
    for r in files:
        name = os.path.basename(r["path"]) if r["path"].startswith(str(table["dir"])) else r["path"]
        assert f"{name} " in table["printed"] and f"{r['val_loss_llama_cpp']:.5f}" in table["printed"]


@needs_tools
@pytest.mark.parametrize("spec", SPECS)
def test_each_llama_quantize_file_has_llama_cpps_type_mix_and_keeps_the_rest(table, spec):
    """gguf's reader: the block Linears of llama-quantize's file in the types llama.cpp's rules give (written out
    here), and the table's record of each; every other tensor (embeddings BF16, norms and biases F32) the F32
    file's, byte for byte."""
    qtype, imatrix = spec.split("+")[0], spec.endswith("+imatrix")
    theirs = tensors(table["dir"] / f"llama-{spec.replace('+imatrix', '-imatrix')}.gguf")
    f32 = tensors(table["dir"] / "model-fp32.gguf")
    want = llama_cpp_mix(qtype, imatrix, N_LAYER)
    assert {n: theirs[n].tensor_type.name for n in want} == want
    assert set(theirs) == set(f32)
    for name, t in f32.items():
        if name not in want:
            assert theirs[name].tensor_type == t.tensor_type and t.tensor_type.name in ("BF16", "F32"), name
            assert np.array_equal(np.asarray(theirs[name].data).view(np.uint8), np.asarray(t.data).view(np.uint8))
    row = table["rows"][spec]
    assert row["tensor_types"] == {t: list(want.values()).count(t) for t in sorted(set(want.values()))}
    assert row["tensors"] == {n: dict(type=t, bits_per_weight=BITS[t], weights=int(theirs[n].n_elements))
                              for n, t in want.items()}  # each tensor's own: what a mix chose


@needs_tools
def test_bytes_are_the_files_size_and_bits_per_weight_is_counted_by_hand(table):
    """bytes: the size on disk; block bits per weight: ggml-common.h's bits of each block Linear's type (BITS,
    written out) weighted by its weights, from gguf's reader; each tensor's bytes are its type's."""
    for r in table["summary"]["files"]:
        found = tensors(r["path"])
        mine = [found[n] for n in blocks(N_LAYER)]
        for t in mine:
            assert 8 * int(t.n_bytes) / int(t.n_elements) == BITS[t.tensor_type.name], (r["path"], t.name)
        by_hand = sum(BITS[t.tensor_type.name] * int(t.n_elements) for t in mine) / sum(int(t.n_elements) for t in mine)
        assert r["bytes"] == os.path.getsize(r["path"])
        assert r["block_bits_per_weight"] == pytest.approx(by_hand, rel=1e-12), r["path"]
    assert table["rows"]["Q8_0+imatrix"]["block_bits_per_weight"] == 8.5
    assert table["rows"]["model-q4_k.gguf"]["block_bits_per_weight"] == 4.5


@needs_tools
def test_the_importance_matrix_is_llama_imatrix_over_the_training_split_and_changes_the_files(table):
    """imatrix.gguf counts CHUNKS chunks of the model's context for every block Linear, and its sums of squared
    inputs are those of our model of the F32 file (gguf's dequantizer) on the same training tokens (llama.cpp's
    tokens of the text, each chunk found in train.bin) within 1e-3 (measured 3e-4: llama.cpp's FP16 attention;
    the tokens one position off: 4 % to 23 %); with it llama-quantize
    writes other Q4_0 and K-quant bytes than without, in the same types."""
    import llama_cpp
    reader = gguf.GGUFReader(str(table["dir"] / "imatrix.gguf"))
    assert reader.fields["imatrix.chunk_count"].contents() == CHUNKS
    assert reader.fields["imatrix.chunk_size"].contents() == 64
    sums = {t.name[:-len(".in_sum2")]: np.asarray(t.data, dtype=np.float64) for t in reader.tensors
            if t.name.endswith(".in_sum2")}
    counts = {t.name[:-len(".counts")]: float(t.data[0]) for t in reader.tensors if t.name.endswith(".counts")}
    assert set(sums) == set(blocks(N_LAYER)) and set(counts.values()) == {CHUNKS * 64}
    run = tools.open_run(str(table["run"]), "", 0, CHUNKS)
    text = tools.imatrix_text(run).encode("utf-8")
    vocab = llama_cpp.Llama(str(table["dir"] / "model-fp32.gguf"), vocab_only=True, verbose=False)
    ids = vocab.tokenize(text, add_bos=False, special=True)
    assert len(ids) == (CHUNKS + 1) * 64
    train = np.fromfile(table["d"] / "data" / "train.bin", dtype=np.uint16).tobytes()
    chunks = torch.tensor(ids[:CHUNKS * 64]).view(CHUNKS, 64)
    for chunk in chunks:
        at = train.find(np.asarray(chunk, dtype=np.uint16).tobytes())
        assert at >= 0 and at % 2 == 0
    ours = gguf_file.model_from_gguf(str(table["dir"] / "model-fp32.gguf"), run.ckpt["model_args"])
    names = {v: k for k, v in gguf_file.gguf_names(ours.config).items()}
    squares = {}
    hooks = [ours.get_submodule(names[n][:-len(".weight")]).register_forward_hook(
        lambda m, args, out, n=n: squares.__setitem__(n, squares.get(n, 0) + args[0].double().square().sum((0, 1))))
        for n in sums]
    with torch.no_grad():
        ours(chunks)
    for h in hooks:
        h.remove()
    for name, want in sums.items():
        assert np.allclose(want, squares[name].numpy(), rtol=1e-3, atol=0), name  # one token off: 4 % and more
    for qtype in ("Q4_0", "Q3_K_M"):
        on, off = tensors(table["dir"] / f"llama-{qtype}-imatrix.gguf"), tensors(table["dir"] / f"llama-{qtype}.gguf")
        for name in blocks(N_LAYER):
            assert on[name].tensor_type == off[name].tensor_type
            assert not np.array_equal(np.asarray(on[name].data), np.asarray(off[name].data)), (qtype, name)


@needs_tools
def test_llama_cpps_val_loss_of_the_f32_file_is_ours_within_the_tolerance(table):
    """On train.py's evaluation batches: llama.cpp's val loss of model-fp32.gguf is our model of the file's
    within VAL_LOSS_TO_OURS (docs/GGUF.md); the source's is the checkpoint's model's by train.py's own
    estimator; our file's row has export.py's val loss of it, through its GGUF's model."""
    from data import loader
    f32 = table["rows"]["model-fp32.gguf"]
    assert f32["val_loss_llama_cpp"] == pytest.approx(f32["val_loss_file"], rel=VAL_LOSS_TO_OURS)
    run = tools.open_run(str(table["run"]), "", 0, CHUNKS)
    config = run.ckpt["config"]
    data = loader.open_split(loader.data_dir(config["dataset"]), "val", run.meta, 64)
    source = loader.estimate_loss(run.model, {"val": data}, seed=config["seed"], eval_iters=config["eval_iters"],
                                  batch_size=config["batch_size"], block_size=64, device="cpu")["val"]
    assert f32["val_loss_source"] == pytest.approx(source, rel=1e-6)
    ours, exported = table["rows"]["model-q4_k.gguf"], table["export"]
    assert ours["val_loss_file"] == pytest.approx(exported["gguf"]["val_loss"], rel=1e-6)
    assert ours["val_loss_llama_cpp"] == pytest.approx(ours["val_loss_file"], rel=VAL_LOSS_TO_OURS)
    assert table["summary"]["evaluation"] == dict(batches=1, tokens=4 * 64)


@needs_tools
def test_files_are_reused_only_when_made_from_the_same_inputs(table, tmp_path):
    """Again with the same inputs every file is reused, untouched; a file whose bytes changed is made again, and
    another chunk count makes the importance matrix and the files quantized with it again, not the others.
    (On a copy of the run and its files: the manifest names no folder.)"""
    import shutil
    shutil.copytree(table["run"], tmp_path / "run")
    run, d = tmp_path / "run", tmp_path / "run" / "llama.cpp"
    before = {n: os.stat(d / n).st_mtime_ns for n in os.listdir(d) if n.endswith(".gguf")}
    data = bytearray((d / "llama-Q4_0.gguf").read_bytes())
    data[-1] ^= 0x01
    # what a command killed mid-write left goes (pid 999999999 runs nowhere); a live writer's stays
    stale = [".llama-Q4_0.gguf.999999999.0badf00d.tmp", ".imatrix.gguf.999999999.0badf00d.tmp.gguf"]
    live = f".llama-Q4_K_M-imatrix.gguf.{os.getpid()}.0badf00d.tmp"
    for name in [*stale, live]:
        (d / name).write_bytes(b"partial")
    (d / "llama-Q4_0.gguf").write_bytes(bytes(data))
    rc, _, err = command(export_gguf, f"--out_dir={run}", "--llama_quantize=Q4_0,Q4_0+imatrix,Q4_K_M+imatrix",
                         f"--imatrix_chunks={CHUNKS}", "--plain_cpu=True", f"--json={tmp_path / 'again.json'}")
    assert rc == 0, err
    again = {r["spec"] or "fp32": r["reused"] for r in json.loads((tmp_path / "again.json").read_text())["files"]}
    assert again == {"fp32": True, "Q4_0": False, "Q4_0+imatrix": True, "Q4_K_M+imatrix": True}
    assert os.stat(d / "llama-Q4_0-imatrix.gguf").st_mtime_ns == before["llama-Q4_0-imatrix.gguf"]
    assert (d / "llama-Q4_0.gguf").read_bytes() != bytes(data)
    assert not any((d / name).exists() for name in stale) and (d / live).exists()
    rc, _, err = command(export_gguf, f"--out_dir={run}", "--llama_quantize=Q4_0,Q4_0+imatrix",
                         f"--imatrix_chunks={CHUNKS - 1}", "--plain_cpu=True", f"--json={tmp_path / 'other.json'}")
    assert rc == 0, err
    other = json.loads((tmp_path / "other.json").read_text())
    assert other["imatrix"]["reused"] is False and other["imatrix"]["chunks"] == CHUNKS - 1
    assert {r["spec"] or "fp32": r["reused"] for r in other["files"]} == {"fp32": True, "Q4_0": True,
                                                                         "Q4_0+imatrix": False}


def test_build_commands_fetch_the_pinned_source_and_build_the_three_tools(tmp_path):
    """pip downloads the source distribution of the llama-cpp-python constraints.txt pins (read here by hand);
    cmake configures its vendor/llama.cpp with Ninja, Release, static, no tests/examples/server/app/OpenSSL,
    not for this CPU alone, and builds llama-quantize, llama-imatrix and llama-perplexity."""
    import sys
    with open(os.path.join(ROOT, "constraints.txt")) as f:
        (pinned,) = [line.split("==")[1].strip() for line in f if line.lower().startswith("llama_cpp_python==")]
    assert build.pinned_version() == pinned
    (_, download, _), (_, configure, _), (_, compile_, _) = build.build_commands(pinned, str(tmp_path), 2)
    assert download == [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        f"llama-cpp-python=={pinned}", "-d", str(tmp_path)]
    source = os.path.join(str(tmp_path), f"llama_cpp_python-{pinned}", "vendor", "llama.cpp")
    assert configure[:5] == ["cmake", "-S", source, "-B", os.path.join(str(tmp_path), "build")]
    assert set(configure[5:]) == {"-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF",
                                  "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF",
                                  "-DLLAMA_OPENSSL=OFF", "-DGGML_NATIVE=OFF", "-DBUILD_SHARED_LIBS=OFF"}
    assert compile_ == ["cmake", "--build", os.path.join(str(tmp_path), "build"), "--target", "llama-quantize",
                        "llama-imatrix", "llama-perplexity", "-j", "2"]


def fake_tools(folder, names):
    """Executables that do nothing, named names, in folder."""
    os.makedirs(folder, exist_ok=True)
    for name in names:
        path = os.path.join(folder, name)
        with open(path, "w") as f:
            f.write("#!/bin/sh\nexit 0\n")
        os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)


def test_the_tools_are_found_in_llama_cpp_bin_then_path_then_the_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    bin_dir = cache / "pqt" / f"llama.cpp-{build.pinned_version()}" / "bin"
    assert build.cache_bin() == str(bin_dir)
    fake_tools(bin_dir, ["llama-quantize"])
    fake_tools(tmp_path / "path", ["llama-quantize"])
    fake_tools(tmp_path / "env", ["llama-quantize"])
    monkeypatch.delenv("LLAMA_CPP_BIN", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert build.llama_cpp_tool("llama-quantize") == str(bin_dir / "llama-quantize")
    monkeypatch.setenv("PATH", str(tmp_path / "path"))
    assert build.llama_cpp_tool("llama-quantize") == str(tmp_path / "path" / "llama-quantize")
    monkeypatch.setenv("LLAMA_CPP_BIN", str(tmp_path / "env"))
    assert build.llama_cpp_tool("llama-quantize") == str(tmp_path / "env" / "llama-quantize")
    assert build.llama_cpp_tool("llama-imatrix") is None  # $LLAMA_CPP_BIN, where set, is the only place


def test_a_build_without_cmake_or_with_a_failing_download_is_one_line_and_fills_no_cache(tmp_path, monkeypatch):
    """Without cmake and ninja on PATH the build stops before any download; a pip download that fails (no index
    reachable) is its last line, the whole output in build.log; the cache stays empty either way."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    rc, _, err = command(export_gguf, "--build_llama_cpp")
    assert rc == 1 and err.count("\n") == 1 and "cmake and ninja not found: building llama.cpp's tools needs" in err
    assert not os.path.exists(tmp_path / "cache")
    fake_tools(tmp_path / "bin", ["cmake", "ninja"])
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no registry; a folder of no packages to find it in
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))
    rc, _, err = command(export_gguf, "--build_llama_cpp")
    assert rc == 1 and err.count("\n") == 1, err
    assert "pip download of llama-cpp-python's source failed (exit status 1): ERROR: " in err
    assert f"(the whole output: {tmp_path / 'cache' / 'pqt'}" in err
    assert not os.path.exists(build.cache_bin())


@pytest.mark.skipif(build.llama_cpp_tool("llama-quantize") is None,
                    reason="llama-quantize not found: set LLAMA_CPP_BIN to the directory of llama.cpp's tools")
def test_every_type_the_command_takes_is_one_llama_quantize_lists():
    shown = subprocess.run([build.llama_cpp_tool("llama-quantize"), "--help"], capture_output=True, text=True)
    listed = {line.split()[2] for line in (shown.stdout + shown.stderr).splitlines() if " or " in line
              and line.split()[1:2] == ["or"]}
    assert set(tools.QUANTIZE_TYPES) <= listed, set(tools.QUANTIZE_TYPES) - listed


# --- what the command refuses ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def untrained(tmp_path_factory):
    """A run of the tests' model, untrained (what the refusals need)."""
    from test_gguf_grids import make_run
    d = tmp_path_factory.mktemp("refused")
    write_data(str(d / "data"), tokenizer.Tokenizer("bytes", "bytes"))
    make_run(d / "run", d / "data", "gpt2", n_layer=N_LAYER)
    return d


REFUSED = {  # the command line (RUN: the run), what the one line says, what the command checks before it
    "an unknown type": (["--out_dir=RUN", "--llama_quantize=Q4_Z"], "'Q4_Z' is not a llama-quantize type", ()),
    "not +imatrix": (["--out_dir=RUN", "--llama_quantize=Q4_0+imat"], "'Q4_0+imat' is not a llama-quantize type",
                     ()),
    "a type gguf cannot read": (["--out_dir=RUN", "--llama_quantize=Q2_0"], "'Q2_0' is not a llama-quantize type",
                                ()),
    "no run": (["--llama_quantize=Q4_0"], "--llama_quantize quantizes a run's checkpoint: pass --out_dir=RUN", ()),
    "a table's option to check one file": (["--gguf=RUN/model.gguf", "--json=RUN/x.json"],
                                           "--json is for the table of a run's files", ()),
    "a negative count to check one file": (["--gguf=RUN/model.gguf", "--eval_iters=-1"],
                                           "--eval_iters take a count >= 1", ()),
    "a missing run": (["--out_dir=RUN/nowhere", "--llama_quantize=Q4_0"], "no checkpoint at", ()),
    "too many chunks": (["--out_dir=RUN", "--llama_quantize=Q4_0+imatrix", "--imatrix_chunks=100000"],
                        "--imatrix_chunks=100000: the training split holds", ()),
    "a missing tool": (["--out_dir=RUN", "--llama_quantize=Q4_0+imatrix", "LLAMA_CPP_BIN"],
                       "llama-quantize not found (not in $LLAMA_CPP_BIN", ()),
    "a file of another model": (["--out_dir=RUN", "--gguf=OTHER"], "holds another model or data than",
                                ("llama_cpp",)),
    "another tool's file": (["--out_dir=RUN", "--llama_quantize=Q4_0", "FOREIGN"],
                            "has no manifest.json of this command", ("llama_cpp", "llama-quantize")),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_the_command_refuses_is_one_line_and_nothing_written(untrained, case, tmp_path, monkeypatch):
    """Bad specs, a missing run or tool, too many chunks, a file of another model, another tool's file where the
    files would go: one line, exit status 1, nothing written."""
    argv, message, needs = REFUSED[case]
    if "llama_cpp" in needs and importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python not installed: the command requires it before it reaches this check")
    if "llama-quantize" in needs and build.llama_cpp_tool("llama-quantize") is None:
        pytest.skip("llama-quantize not found (LLAMA_CPP_BIN): the command requires it before it reaches this check")
    run, export_dir, foreign = untrained / "run", tmp_path / "out", []
    if "LLAMA_CPP_BIN" in argv:
        monkeypatch.setenv("LLAMA_CPP_BIN", str(tmp_path))  # a folder without the tools
    if "FOREIGN" in argv:
        export_dir.mkdir()
        (export_dir / "llama-Q4_0.gguf").write_bytes(b"theirs")
        foreign = ["llama-Q4_0.gguf"]
    if "--gguf=OTHER" in argv:
        from test_gguf_grids import make_run
        make_run(tmp_path / "other", untrained / "data", "gpt2", n_layer=1)
        assert command(E, f"--out_dir={tmp_path / 'other'}", "--format=q4_0", "--gguf=True", "--evaluate=False",
                       "--plot=False")[0] == 0
    argv = [a.replace("RUN", str(run)).replace("OTHER", str(tmp_path / "other" / "model-q4_0.gguf"))
            for a in argv if a not in ("LLAMA_CPP_BIN", "FOREIGN")]
    before = sorted(os.listdir(run))
    rc, _, err = command(export_gguf, *argv, f"--export_dir={export_dir}")
    assert rc == 1 and err.count("\n") == 1 and message in err, err
    assert sorted(os.listdir(run)) == before
    assert not export_dir.exists() or sorted(os.listdir(export_dir)) == foreign


# --- a llama.cpp tool that fails quietly, writes the wrong file or hangs ------------------------------------

# Stand-ins for llama-quantize and llama-imatrix (sh): each finds the file it is to write (the temporary name the
# command gives it) and writes nothing, random bytes, another GGUF (the model's F32 file), or hangs (a child
# that sleeps, its pid in hung.pid). A stand-in llama-imatrix says the chunk count it was asked for, as the real
# one does, so that what it wrote is what the command checks next.
FAKE = r'''#!/bin/sh
out=""; model=""; chunks=""; prev=""
for a in "$@"; do
  case "$prev" in -m) model="$a";; --chunks) chunks="$a";; esac
  case "$a" in *.tmp|*.tmp.gguf) out="$a";; *.gguf) [ -z "$model" ] && model="$a";; esac
  prev="$a"
done
[ -n "$chunks" ] && echo "computing over $chunks chunks"
case "{what}" in
  garbage) head -c 5000 /dev/urandom > "$out";;
  another) cp "$model" "$out";;
  hang) sleep 600 & echo $! > "{folder}/hung.pid"; wait;;
esac
exit 0
'''
FAULTS = {  # the spec, the stand-in that misbehaves and how, what the one line says
    "quantize writes nothing": ("Q4_0", "llama-quantize", "nothing", "exited 0 and wrote no file"),
    "quantize writes garbage": ("Q4_0", "llama-quantize", "garbage", "exited 0 and wrote a file gguf cannot read"),
    "quantize writes the F32 file": ("Q4_0", "llama-quantize", "another",
                                     "exited 0 and wrote a file that says general.file_type None, not Q4_0's"),
    "quantize hangs": ("Q4_0", "llama-quantize", "hang", "did not finish within 2 s and was stopped"),
    "imatrix writes nothing": ("Q4_0+imatrix", "llama-imatrix", "nothing", "exited 0 and wrote no file"),
    "imatrix writes garbage": ("Q4_0+imatrix", "llama-imatrix", "garbage", "exited 0 and wrote a file gguf cannot"),
    "imatrix writes the F32 file": ("Q4_0+imatrix", "llama-imatrix", "another", "exited 0 and wrote a file that says "
                                    "{'imatrix.chunk_count': None, 'imatrix.chunk_size': None}, not 4 chunks"),
    "imatrix hangs": ("Q4_0+imatrix", "llama-imatrix", "hang", "did not finish within 2 s and was stopped"),
}


def alive(pid):
    """Whether process pid runs (a zombie no longer does)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def faked(untrained):
    """One export directory for every fault: model-fp32.gguf is made once and reused, as it would be."""
    return untrained / "faked"


@pytest.mark.parametrize("case", FAULTS)
def test_a_tool_that_fails_quietly_writes_another_file_or_hangs_is_one_line_and_nothing_is_kept(
        untrained, faked, case, tmp_path, monkeypatch):
    """The tool's file is read back before it gets its name or a manifest entry (a GGUF of the model's tensors in
    the type asked; an importance matrix of every block Linear over the chunks asked); a call past its time limit
    (--tool_timeout=2 here; 30 for the fakes that end at once, which a busy machine may start slowly) is stopped
    with its children. Either way: one line naming the tool and where to get a working one, exit status 1, and no
    file of it, no temporary and no manifest entry left; asked again, the command does not reuse anything of it."""
    spec, tool, what, message = FAULTS[case]
    folder = tmp_path / "bin"
    folder.mkdir()
    for name in ("llama-quantize", "llama-imatrix"):
        (folder / name).write_text(FAKE.replace("{what}", what if name == tool else "nothing")
                                   .replace("{folder}", str(folder)))
        os.chmod(folder / name, 0o755)
    monkeypatch.setenv("LLAMA_CPP_BIN", str(folder))
    argv = [f"--out_dir={untrained / 'run'}", f"--llama_quantize={spec}", f"--export_dir={faked}",
            "--imatrix_chunks=4", f"--tool_timeout={2 if what == 'hang' else 30}", "--plain_cpu=True"]
    for _ in range(1 if what == "hang" else 2):
        started = time.time()
        rc, _, err = command(export_gguf, *argv)
        assert rc == 1 and err.count("\n") == 1 and message in err, err
        assert err.startswith(f"error: {tool} (") and f"{folder / tool} is broken or not llama.cpp's" in err \
            if what != "hang" else err.startswith(f"error: {tool} (") and "--tool_timeout=SECONDS" in err, err
        assert time.time() - started < 60
        manifest = json.loads((faked / "manifest.json").read_text())
        assert set(manifest["files"]) == {"model-fp32.gguf", "model-fp32.safetensors"}
        assert sorted(os.listdir(faked)) == ["manifest.json", "model-fp32.gguf", "model-fp32.safetensors"]
    if what == "hang":
        # SIGKILL is delivered at once but the child dies when next scheduled: on a loaded machine that takes a
        # moment, so wait for it (it sleeps 600 s: a child left running is still caught)
        pid, deadline = int((folder / "hung.pid").read_text()), time.time() + 20
        while alive(pid) and time.time() < deadline:
            time.sleep(0.1)
        assert not alive(pid)


def test_each_call_of_a_tool_has_a_time_limit_from_its_work(untrained, tmp_path, monkeypatch):
    """llama-quantize may take TOOL_FLOOR_S plus the F32 file's weights (counted here with gguf's reader) at its
    type's QUANTIZE_WEIGHTS_PER_S (IQ2_XS: the slower IQ2 rate); llama-imatrix TOOL_FLOOR_S plus 2 multiply-adds
    per weight (the same) and token of its chunks at IMATRIX_FLOPS_PER_S; --tool_timeout=S sets S for every
    call; the build's steps theirs."""
    limits = []

    def spy(argv, what, limit, log=None):
        limits.append((os.path.basename(argv[0]), limit))
        return 1, "error: stopped by the test"
    monkeypatch.setattr(tools, "run_tool", spy)
    folder = tmp_path / "bin"
    fake_tools(folder, ["llama-quantize", "llama-imatrix"])
    monkeypatch.setenv("LLAMA_CPP_BIN", str(folder))
    run = untrained / "run"
    for spec, tool_timeout in (("Q4_0", 0), ("IQ2_XS", 0), ("Q4_0+imatrix", 0), ("Q4_0", 7.5)):
        rc, _, err = command(export_gguf, f"--out_dir={run}", f"--llama_quantize={spec}", "--imatrix_chunks=4",
                             f"--export_dir={tmp_path / 'out'}", f"--tool_timeout={tool_timeout}")
        assert rc == 1 and "failed (exit status 1): error: stopped by the test" in err, err
    weights = sum(int(t.n_elements) for t in gguf.GGUFReader(str(tmp_path / "out" / "model-fp32.gguf")).tensors)
    floor = build.TOOL_FLOOR_S
    rates = tools.QUANTIZE_WEIGHTS_PER_S
    assert limits == [("llama-quantize", floor + weights / rates[""]),
                      ("llama-quantize", floor + weights / rates["IQ2"]),
                      ("llama-imatrix", floor + 2 * weights * 4 * 64 / tools.IMATRIX_FLOPS_PER_S),
                      ("llama-quantize", 7.5)]
    steps = build.build_commands("0.3.36", str(tmp_path), 64)
    cores = min(64, os.cpu_count())
    assert [s[2] for s in steps] == [build.BUILD_SECONDS[k] for k in ("download", "configure")] + \
        [build.BUILD_SECONDS["build"] / cores]


def test_a_build_without_a_network_says_so_in_one_line(tmp_path, monkeypatch):
    """pip, finding no index that answers, ends with "No matching distribution found"; the line says the cause:
    no package index answered (here: a port nothing listens on), and what to do instead."""
    fake_tools(tmp_path / "bin", ["cmake", "ninja"])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    for key, value in (("PIP_INDEX_URL", "http://127.0.0.1:9/simple"), ("PIP_RETRIES", "1"), ("PIP_TIMEOUT", "2"),
                       ("PIP_FIND_LINKS", str(tmp_path / "empty")), ("PIP_EXTRA_INDEX_URL", "")):
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("PIP_NO_INDEX", raising=False)
    rc, _, err = command(export_gguf, "--build_llama_cpp")
    assert rc == 1 and err.count("\n") == 1, err
    assert "pip download of llama-cpp-python's source failed: no package index answered (" in err
    assert "Connection refused" in err and "set LLAMA_CPP_BIN to the directory of llama.cpp's tools" in err
    assert not os.path.exists(build.cache_bin())
