"""The llama.cpp study (python -m studies gguf): its arms, their names and train.py settings (the trunk's
exactly as its runs under way were made), the bits per weight of llama-quantize's mixes on its model
(by hand, and against a real llama-quantize file where the tool is present), the export glue's command
lines and records (against stand-in scripts that follow the commands' contract), and the report on
hand-made run records against the same figures computed here by hand."""
import contextlib
import io
import json
import math
import os

import gguf
import pytest

import checkpoint
import studies.__main__ as entry
from conftest import ROOT
from llamacpp import build, tools
from studies import definitions as defs
from studies import exports, gguf_report, plots, runner
from studies.records import StudyError
from test_study import resolved

STUDY = defs.STUDIES["gguf"]
TRUNK = STUDY["arms"][0]
SHAPE = dict(max_iters=6400, lr_decay_iters=6400, eval_interval=1600)
# ggml-common.h's block sizes by hand: (bytes per block) * 8 / (weights per block)
BITS = {"Q8_0": 34 * 8 / 32, "Q4_0": 18 * 8 / 32, "Q6_K": 210 * 8 / 256, "Q5_K": 176 * 8 / 256,
        "Q4_K": 144 * 8 / 256, "Q3_K": 110 * 8 / 256, "Q2_K": 84 * 8 / 256}
SPECS = ["Q8_0+imatrix", "Q4_0+imatrix", "Q4_K_M+imatrix", "Q3_K_M+imatrix", "Q2_K+imatrix", "Q4_0", "Q3_K_M",
         "Q3_K_S+imatrix", "Q2_K_S+imatrix", "IQ2_XS+imatrix", "IQ2_M+imatrix", "IQ3_XXS+imatrix", "IQ3_S+imatrix",
         "IQ4_XS+imatrix", "IQ4_NL+imatrix", "Q5_K_M+imatrix", "Q6_K+imatrix"]
STE = ("q4_0", "q4_k", "q3_k", "q2_k", "iq4_nl", "iq4_xs")  # the STE phases' grids, in the arms' order


# --- the arms -----------------------------------------------------------------------------------------

def test_the_trunk_is_the_one_its_runs_under_way_were_made_with():
    """Its config, overrides, names and kept steps, written out: a change would stop its runs resuming."""
    assert TRUNK["config"] == "config/mini_gpt2_gguf.py" and TRUNK["overrides"] == {"method": "bf16", **SHAPE}
    assert TRUNK["keep"] == [4480, 5440] and TRUNK["seeds"] == (1, 2, 3)
    assert [defs.run_name(TRUNK, s) for s in (1, 2, 3)] == [
        f"gpt2_gguf-bf16-eval1600-decay6400-n6400-s{s}" for s in (1, 2, 3)]
    assert TRUNK["llama_cpp"] == SPECS
    # the other two studies' trunks, whose runs are under way too
    short, llama = (defs.STUDIES[name]["arms"][0] for name in ("gguf_short", "gguf_llama"))
    assert defs.run_name(short, 1) == "gpt2_gguf-bf16-eval400-decay1600-n1600-s1" and short["keep"] == [1120, 1360]
    assert defs.run_name(llama, 1) == "llama2_gguf-bf16-eval1725-decay6900-n6900-s1" and llama["keep"] == [4830, 5865]
    assert llama["config"] == "config/mini_llama2_gguf.py" and short["llama_cpp"] == llama["llama_cpp"] == SPECS


def test_every_llama_quantize_file_of_the_study_has_its_type_mix_checked_against_llama_cpps_rules():
    """tests/test_llama_tools.py checks each spec of its SPECS: the types llama.cpp's rules give each block
    Linear (Q3_K_S and Q2_K_S: the STE q3_k and q2_k phases' types on every one of this model's)."""
    from test_llama_tools import N_LAYER, SPECS, llama_cpp_mix
    assert set(TRUNK["llama_cpp"]) <= set(SPECS)
    n = defs.config_settings(defs.GGUF_CONFIG)["n_layer"]
    for spec, grid in (("Q3_K_S", "Q3_K"), ("Q2_K_S", "Q2_K")):
        assert set(llama_cpp_mix(spec, True, n).values()) == set(llama_cpp_mix(spec, True, N_LAYER).values()) == {grid}


def test_the_phase_arms_fork_from_the_trunk_with_the_overrides_written_out():
    arms = STUDY["arms"][1:]
    want = [("STE phase", f, {"method": "ste[all]", "target_format": f, "pqt_start": 5440}) for f in STE]
    for mix, bits in (("Q3_K_M", 4.2708), ("Q3_K_S", 3.4375), ("Q2_K", 3.1666)):
        for kind, fmt in (("learned mix", "auto-gguf"), ("error mix", "error-gguf")):
            want.append((f"{kind} at {mix}'s size", f"{fmt}@{bits:g}",
                         {"method": "gaussws[all]", "target_format": fmt, "bits_per_weight": bits, "pqt_start": 4480,
                          "ste_start": 5440}))
    assert [(a["kind"], a["gguf"], a["overrides"]) for a in arms] == [(k, [s], {**o, **SHAPE}) for k, s, o in want]
    assert all(a["trunk"] is TRUNK and a["seeds"] == (1, 2, 3) for a in arms)
    assert defs.run_name(arms[0], 2) == "gpt2_gguf-ste_all-eval1600-decay6400-n6400-from5440-q4_0-s2"
    assert defs.run_name(arms[4], 1) == "gpt2_gguf-ste_all-eval1600-decay6400-n6400-from5440-iq4_nl-s1"
    assert defs.run_name(arms[6], 1) == \
        "gpt2_gguf-gaussws_all-bpw4.2708-eval1600-decay6400-n6400-from4480-ste5440-auto-gguf-s1"
    assert len({n for n, _, _ in defs.runs_of(STUDY)}) == len(defs.runs_of(STUDY)) == 39


def test_the_llama_studys_arms_are_the_gpt2s_at_its_own_length_and_mix_sizes():
    """gguf_llama: the trunk, the six STE phases from 85 % of 6,900 steps, the two kinds of mixes at the sizes of
    llama.cpp's Q3_K_M, Q3_K_S and Q2_K on the Llama (3.8846, 3.4375, 2.9375) from 70 %."""
    study = defs.STUDIES["gguf_llama"]
    shape = dict(max_iters=6900, lr_decay_iters=6900, eval_interval=1725)
    want = [("STE phase", f, {"method": "ste[all]", "target_format": f, "pqt_start": 5865}) for f in STE]
    for mix, bits in (("Q3_K_M", 3.8846), ("Q3_K_S", 3.4375), ("Q2_K", 2.9375)):
        for kind, fmt in (("learned mix", "auto-gguf"), ("error mix", "error-gguf")):
            want.append((f"{kind} at {mix}'s size", f"{fmt}@{bits:g}",
                         {"method": "gaussws[all]", "target_format": fmt, "bits_per_weight": bits, "pqt_start": 4830,
                          "ste_start": 5865}))
    arms = study["arms"][1:]
    assert [(a["kind"], a["gguf"], a["overrides"]) for a in arms] == [(k, [s], {**o, **shape}) for k, s, o in want]
    assert all(a["config"] == "config/mini_llama2_gguf.py" and a["trunk"] is study["arms"][0] for a in arms)
    assert len({n for n, _, _ in defs.runs_of(study)}) == 39


@pytest.mark.parametrize("name", ["gguf", "gguf_llama"])
def test_train_accepts_every_arm_and_each_forks_from_its_trunk(name):
    """train.py's settings check takes every arm; each resolves its switches to the overrides' steps, and
    equals the trunk in every setting a fork must share (checkpoint.read_fork's rule)."""
    trunk = resolved(defs.STUDIES[name]["arms"][0], 1)
    for a in defs.STUDIES[name]["arms"][1:]:
        c, o = resolved(a, 1), a["overrides"]
        assert (c["method"], c["target_format"], c["pqt_start"]) == (o["method"], o["target_format"], o["pqt_start"])
        assert (c["ste_start"], c["bits_per_weight"]) == (o.get("ste_start", 0), o.get("bits_per_weight", 0))
        assert [k for k in c if k not in checkpoint.FORK_FREE and c[k] != trunk.get(k)] == [], a["kind"]


# --- llama-quantize's mixes on this model --------------------------------------------------------------

def test_the_mix_budgets_are_llama_quantizes_bits_per_weight_on_each_model():
    """The GPT2: 4 layers of Linears 768x256 (qkv), 256x256 (out), 1024x256 (up), 256x1024 (down). Q3_K_M: qkv Q5_K
    in the first two layers, Q4_K after; out and down Q4_K; up Q3_K. Q3_K_S: Q3_K throughout. Q2_K: up Q2_K, the
    rest Q3_K. The Llama: 4 layers of q, k, v, out 256x256 (one query head per KV head), gate and up 768x256, down
    256x768. Q3_K_M: v Q5_K in the first two layers, Q4_K after; out and down Q4_K; q, k, gate, up Q3_K. Q2_K: v,
    out and down Q3_K, q, k, gate and up Q2_K."""
    qkv, out, up, down = 768 * 256, 256 * 256, 1024 * 256, 256 * 1024
    total = 4 * (qkv + out + up + down)
    q3_k_m = (2 * qkv * BITS["Q5_K"] + (2 * qkv + 4 * out + 4 * down) * BITS["Q4_K"] + 4 * up * BITS["Q3_K"]) / total
    q2_k = (4 * (qkv + out + down) * BITS["Q3_K"] + 4 * up * BITS["Q2_K"]) / total
    assert defs.llama_mix_bits("Q3_K_M") == pytest.approx(q3_k_m, rel=1e-12) and round(q3_k_m, 4) == 4.2708
    assert defs.llama_mix_bits("Q2_K") == pytest.approx(q2_k, rel=1e-12) and round(q2_k, 4) == 3.1667
    assert defs.llama_mix_bits("Q3_K_S") == BITS["Q3_K"] == 3.4375
    square, wide = 256 * 256, 768 * 256  # the Llama's q, k, v, out; gate, up, down
    total = 4 * (4 * square + 3 * wide)
    q3_k_m = (2 * square * BITS["Q5_K"] + (2 * square + 4 * square + 4 * wide) * BITS["Q4_K"]
              + 4 * (2 * square + 2 * wide) * BITS["Q3_K"]) / total
    q2_k = (4 * (2 * square + wide) * BITS["Q3_K"] + 4 * (2 * square + 2 * wide) * BITS["Q2_K"]) / total
    llama = defs.GGUF_LLAMA_CONFIG
    assert defs.llama_mix_bits("Q3_K_M", llama) == pytest.approx(q3_k_m, rel=1e-12) and round(q3_k_m, 4) == 3.8846
    assert defs.llama_mix_bits("Q2_K", llama) == pytest.approx(q2_k, rel=1e-12) == 2.9375
    assert defs.GGUF_MIX_BITS == {"config/mini_gpt2_gguf.py": {"Q3_K_M": 4.2708, "Q3_K_S": 3.4375, "Q2_K": 3.1666},
                                  llama: {"Q3_K_M": 3.8846, "Q3_K_S": 3.4375, "Q2_K": 2.9375}}  # never more bytes
    from quant import ggml_quants
    for t, bits in BITS.items():
        assert defs.type_bits(t) == bits == ggml_quants.bits_per_weight(t)


@pytest.fixture(scope="module", params=["config/mini_gpt2_gguf.py", "config/mini_llama2_gguf.py"])
def llama_quantized(request, tmp_path_factory):
    """A checkpoint of a study model's shape (random weights, a tiny corpus's vocabulary) as an F32 GGUF, then
    llama-quantize's Q3_K_M, Q3_K_S and Q2_K of it (no --pure: llama.cpp's own mixes): (config, {mix: path})."""
    from data import tokenizer
    from test_gguf import write_data
    from test_gguf_grids import export, make_run
    d = tmp_path_factory.mktemp("llama_mixes")
    write_data(str(d / "data"), tokenizer.Tokenizer("bytes", "bytes"))
    c = defs.config_settings(request.param)
    shape = {k: c[k] for k in ("n_layer", "n_head", "n_embd", "ffn_hidden") if k in c}
    make_run(d / "run", d / "data", c["arch"], **shape, **({"n_kv_head": c.get("n_kv_head")} if c["arch"] == "llama2"
                                                            else {}))
    rc, _, err = export(d / "run", "--format=fp32", "--gguf=True", "--eval_iters=1")
    assert rc == 0, err
    return request.param, {mix: tools.llama_quantize(d / "run" / "model-fp32.gguf", d / f"{mix}.gguf", mix,
                                                     pure=False) for mix in defs.LLAMA_MIXES}


@pytest.mark.skipif(build.llama_cpp_tool("llama-quantize") is None,
                    reason="llama-quantize not found: set LLAMA_CPP_BIN to the directory of llama.cpp's tools, or "
                    "put them on PATH, to check the mixes' table against the files it writes")
@pytest.mark.parametrize("mix", list(defs.LLAMA_MIXES))
def test_llama_quantize_gives_each_block_linear_the_tables_type(llama_quantized, mix):
    """Every block Linear of llama-quantize's file of the GPT2 (attn_qkv, attn_output, ffn_up, ffn_down) and of the
    Llama (attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down) has the type LLAMA_MIXES gives it, and
    the file's block Linears hold llama_mix_bits bits per weight (their bytes, scales included)."""
    config, files = llama_quantized
    shapes, n = defs.block_linear_shapes(config)
    seen, bits, weights = set(), 0, 0
    for t in gguf.GGUFReader(str(files[mix])).tensors:
        parts = t.name.split(".")
        if parts[0] == "blk" and parts[3] == "weight" and parts[2] in shapes:
            assert t.tensor_type.name == defs.LLAMA_MIXES[mix](parts[2], int(parts[1]), n), t.name
            assert tuple(int(x) for x in reversed(t.shape)) == shapes[parts[2]], t.name  # gguf lists the width first
            seen.add(t.name)
            bits, weights = bits + 8 * int(t.n_bytes), weights + int(t.n_elements)
    assert len(seen) == len(shapes) * n and bits / weights == pytest.approx(defs.llama_mix_bits(mix, config), rel=1e-12)


# --- the export glue against the commands' contract ----------------------------------------------------

# Stand-ins for export.py and export_gguf.py: each appends its command line to calls.jsonl and writes
# what the real one's --json writes (export.py: exports[0].gguf.path of the file it wrote; export_gguf.py:
# a record per file). FAIL in the environment makes them fail as the scripts do: one line, exit 1.
STAND_IN = r'''
import json, os, sys
args = dict(a[2:].split("=", 1) for a in sys.argv[1:])
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "calls.jsonl"), "a") as f:
    f.write(json.dumps([os.path.basename(__file__), *sys.argv[1:]]) + "\n")
if os.environ.get("FAIL"):
    sys.exit("error: " + os.environ["FAIL"])
def record(spec, path, k, qtype):
    return {"spec": spec, "path": path, "type": qtype, "imatrix": "+imatrix" in path, "bytes": 1000 + k,
            "block_bits_per_weight": 4.0 + k, "val_loss_llama_cpp": 1.5 + k / 100, "val_loss_source": "llama.cpp",
            "tensor_types": {"Q4_K": 2}, "tensors": {"blk.0.ffn_up.weight": {"type": "Q4_K", "weights": 9}}}
if os.path.basename(__file__) == "export.py":
    os.makedirs(args["export_dir"], exist_ok=True)
    path = os.path.join(args["export_dir"], f"model-{args['format']}.gguf")
    open(path, "w").close()
    out = {"exports": [{"format": args["format"], "gguf": {"path": path}}]}
elif "gguf" not in args:  # the F32 file first, then llama-quantize's of it
    specs = [s for s in args.get("llama_quantize", "").split(",") if s]
    files = [(None, "model-fp32.gguf", "fp32")] + [(s, s + ".gguf", s.split("+")[0]) for s in specs]
    out = {"files": [record(s, os.path.join(args["export_dir"], name), k - 1, t)
                     for k, (s, name, t) in enumerate(files)]}
else:
    out = {"files": [record(None, p, k, "ours") for k, p in enumerate(args["gguf"].split(","))]}
with open(args["json"], "w") as f:
    json.dump(out, f)
'''


@pytest.fixture
def stand_ins(tmp_path, monkeypatch):
    """A repository of the two stand-in scripts, where the glue runs them; the list of their calls."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for script in ("export.py", "export_gguf.py"):
        (repo / script).write_text(STAND_IN)
    monkeypatch.setattr(exports, "REPO", str(repo))

    def calls():
        path = repo / "calls.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return calls


def test_llama_cpp_files_run_export_gguf_once_and_keep_its_records(tmp_path, stand_ins):
    """One export_gguf.py call makes every spec asked; the F32 file's record (spec null in its --json) is kept as
    F32, its types and per-tensor types as every file's; asked again, only what is missing is made: one more
    spec, or the F32 file alone (records made before it was kept)."""
    run = tmp_path / "runs" / "trunk"
    run.mkdir(parents=True)
    got = exports.llama_cpp_files(str(run), ["Q4_K_M+imatrix", "Q4_0"])
    (call,) = stand_ins()
    assert call[:4] == ["export_gguf.py", f"--out_dir={run}", "--llama_quantize=Q4_K_M+imatrix,Q4_0",
                        f"--export_dir={run / 'gguf'}"]
    assert call[4].startswith("--json=") and call[5:] == ["--threads=1"]
    types = {"tensor_types": {"Q4_K": 2}, "tensors": {"blk.0.ffn_up.weight": {"type": "Q4_K", "weights": 9}}}
    assert got == {"F32": {"type": "fp32", "imatrix": False, "bytes": 999, "block_bits_per_weight": 3.0,
                           "val_loss_llama_cpp": 1.49, "val_loss_source": "llama.cpp", **types,
                           "file": "gguf/model-fp32.gguf"},
                   "Q4_K_M+imatrix": {"type": "Q4_K_M", "imatrix": True, "bytes": 1000, "block_bits_per_weight": 4.0,
                                      "val_loss_llama_cpp": 1.5, "val_loss_source": "llama.cpp", **types,
                                      "file": "gguf/Q4_K_M+imatrix.gguf"},
                   "Q4_0": {"type": "Q4_0", "imatrix": False, "bytes": 1001, "block_bits_per_weight": 5.0,
                            "val_loss_llama_cpp": 1.51, "val_loss_source": "llama.cpp", **types,
                            "file": "gguf/Q4_0.gguf"}}
    assert json.loads((run / "gguf.json").read_text()) == got
    # kept: asked again, with one more, only the new one is made
    again = exports.llama_cpp_files(str(run), ["Q4_0", "Q8_0+imatrix", "Q4_K_M+imatrix"])
    assert len(stand_ins()) == 2 and stand_ins()[1][2] == "--llama_quantize=Q8_0+imatrix"
    assert again["Q4_0"] == got["Q4_0"] and again["Q8_0+imatrix"]["val_loss_llama_cpp"] == 1.5
    # a record made before the F32 file's was kept: the F32 file alone is made (no --llama_quantize)
    kept = json.loads((run / "gguf.json").read_text())
    del kept["F32"]
    (run / "gguf.json").write_text(json.dumps(kept))
    assert exports.llama_cpp_files(str(run), ["Q4_0"])["F32"] == got["F32"]
    assert stand_ins()[2][:3] == ["export_gguf.py", f"--out_dir={run}", f"--export_dir={run / 'gguf'}"]


def test_trained_files_export_each_format_then_measure_them_in_llama_cpp(tmp_path, stand_ins):
    run = tmp_path / "runs" / "mix"
    run.mkdir(parents=True)
    got = exports.trained_files(str(run), ["q4_k", "auto-gguf@4.2708"])
    calls = stand_ins()
    assert [c[:-1] for c in calls[:2]] == [
        ["export.py", f"--out_dir={run}", "--format=q4_k", "--gguf=True", f"--export_dir={run / 'gguf'}",
         "--other_dtype=bfloat16", "--overwrite=True"],
        ["export.py", f"--out_dir={run}", "--format=auto-gguf", "--gguf=True", f"--export_dir={run / 'gguf'}",
         "--other_dtype=bfloat16", "--overwrite=True", calls[1][-2]]]
    assert calls[1][-2].startswith("--json=") and calls[1][-1] == "--bits_per_weight=4.2708"
    files = [os.path.realpath(run / "gguf" / f) for f in ("model-q4_k.gguf", "model-auto-gguf.gguf")]
    assert calls[2][:3] == ["export_gguf.py", f"--out_dir={run}", f"--gguf={','.join(files)}"] and len(calls) == 3
    assert got["q4_k"]["file"] == "gguf/model-q4_k.gguf" and got["q4_k"]["val_loss_llama_cpp"] == 1.5
    assert got["auto-gguf@4.2708"]["block_bits_per_weight"] == 5.0
    assert json.loads((run / "gguf.json").read_text()) == got


def test_a_failed_export_is_a_line_and_nothing_is_kept(tmp_path, stand_ins, monkeypatch):
    run = tmp_path / "runs" / "trunk"
    run.mkdir(parents=True)
    monkeypatch.setenv("FAIL", "llama-imatrix not found")
    why = "export_gguf.py failed: error: llama-imatrix not found"
    assert exports.llama_cpp_files(str(run), ["Q4_0"]) == {"F32": why, "Q4_0": why}
    assert not (run / "gguf.json").exists()


def test_our_files_keep_embeddings_and_head_as_llama_quantize_keeps_them():
    """export.py's --other_dtype of the glue is the type tools.llama_quantize keeps them in."""
    import inspect
    keep = inspect.signature(tools.llama_quantize).parameters["keep"].default
    assert {"bfloat16": "bf16", "float32": "f32"}[exports.OTHER_DTYPE] == keep


# --- the report, on hand-made records -------------------------------------------------------------------

# The trunk's val loss (train.py, PyTorch) per seed, llama.cpp's of its F32 file, and llama.cpp's val loss and
# bits per weight of each file per seed: {arm index or llama.cpp spec: ({seed: loss}, bits per weight)}. Seed 3
# is done for the trunk and the q4_0 STE phase only, so the others are "2 of 3". The IQ files are llama.cpp's
# best of their bytes here: IQ4_NL beats Q4_0, IQ4_XS Q3_K_M, IQ3_S Q3_K_S, IQ3_XXS Q2_K.
BF16 = {1: 1.200, 2: 1.210, 3: 1.190}
F32 = {1: 1.2005, 2: 1.2098, 3: 1.1904}
FILES = {"Q8_0+imatrix": ({1: 1.201, 2: 1.211, 3: 1.191}, 8.5),
         "Q4_0+imatrix": ({1: 1.230, 2: 1.244, 3: 1.226}, 4.5),
         "Q4_K_M+imatrix": ({1: 1.212, 2: 1.223, 3: 1.202}, 5.1015625),
         "Q3_K_M+imatrix": ({1: 1.260, 2: 1.276, 3: 1.252}, 4.2708333),
         "Q2_K+imatrix": ({1: 1.400, 2: 1.420, 3: 1.380}, 3.1666667),
         "Q4_0": ({1: 1.240, 2: 1.250, 3: 1.236}, 4.5), "Q3_K_M": ({1: 1.280, 2: 1.300, 3: 1.270}, 4.2708333),
         "Q3_K_S+imatrix": ({1: 1.330, 2: 1.335, 3: 1.318}, 3.4375),
         "Q2_K_S+imatrix": ({1: 1.700, 2: 1.760, 3: 1.650}, 2.625),
         "IQ2_XS+imatrix": ({1: 1.900, 2: 1.950, 3: 1.880}, 2.390625),
         "IQ2_M+imatrix": ({1: 1.500, 2: 1.520, 3: 1.480}, 2.8541667),
         "IQ3_XXS+imatrix": ({1: 1.360, 2: 1.375, 3: 1.350}, 3.09375),
         "IQ3_S+imatrix": ({1: 1.310, 2: 1.320, 3: 1.300}, 3.4375),
         "IQ4_XS+imatrix": ({1: 1.235, 2: 1.250, 3: 1.229}, 4.25),
         "IQ4_NL+imatrix": ({1: 1.228, 2: 1.240, 3: 1.222}, 4.5),
         "Q5_K_M+imatrix": ({1: 1.205, 2: 1.215, 3: 1.195}, 5.8098958),
         "Q6_K+imatrix": ({1: 1.202, 2: 1.212, 3: 1.192}, 6.5625),
         1: ({1: 1.215, 2: 1.222, 3: 1.205}, 4.5),  # STE phase q4_0
         2: ({1: 1.214, 2: 1.226}, 4.5),  # STE phase q4_k
         3: ({1: 1.300, 2: 1.290}, 3.4375),  # STE phase q3_k
         4: ({1: 1.600, 2: 1.650}, 2.625),  # STE phase q2_k
         5: ({1: 1.214, 2: 1.225}, 4.5),  # STE phase iq4_nl
         6: ({1: 1.218, 2: 1.230}, 4.25),  # STE phase iq4_xs
         7: ({1: 1.240, 2: 1.249}, 4.2604),  # learned mix at Q3_K_M's size
         8: ({1: 1.245, 2: 1.251}, 4.2708),  # error mix at Q3_K_M's size
         9: ({1: 1.285, 2: 1.280}, 3.4300),  # learned mix at Q3_K_S's size
         10: ({1: 1.310, 2: 1.300}, 3.4375),  # error mix at Q3_K_S's size
         11: ({1: 1.350, 2: 1.330}, 3.1650),  # learned mix at Q2_K's size
         12: ({1: 1.360, 2: 1.370}, 3.1666)}  # error mix at Q2_K's size
MS = 1500.0  # each trained run's logged time a step
# The types of the learned mix at Q2_K's size per seed, as export_gguf.py records each tensor's
MIX_TYPES = {1: {"blk.0.attn_output.weight": "Q4_K", "blk.0.ffn_up.weight": "Q2_K"},
             2: {"blk.0.attn_output.weight": "Q3_K", "blk.0.ffn_up.weight": "Q2_K"}}


def tensors_record(types):
    return {n: {"type": t, "bits_per_weight": BITS[t], "weights": 65536} for n, t in types.items()}


def write_run(root, i, seed, kept=True):
    """A finished run of arm i as the runner leaves it: train.py's config.json and metrics.jsonl (its last
    evaluation and log at max_iters), the runner's run.json and done.json, the glue's gguf.json (with the
    trunk's F32 file and each file's per-tensor types where kept, else as the study's first records)."""
    a = STUDY["arms"][i]
    d = os.path.join(root, "runs", defs.run_name(a, seed))
    os.makedirs(d)
    c = defs.config_settings(a["config"])
    config = {**c, **a["overrides"], "seed": seed, "b_init": 6.0, "b_target": 4.0, "bitwidth_weight_decay": 0.1,
              "model_args": {"vocab_size": 256}, "device": "cpu", "world_size": 1,
              "versions": {"torch": "2.13.0+cpu", "machine": "test machine"}}
    first = a["overrides"].get("pqt_start", 0) if a.get("trunk") else 0
    loss = BF16[seed] + 0.01 * i  # train.py's: the trunk's is BF16's
    lines = [{"iter": first, "train/loss": 2.0, "val/loss": 2.0},
             {"iter": first + 10, "loss": 2.0, "lr": 1e-3, "ms_per_iter": MS, "tokens_per_s": 1.0},
             {"iter": 6400, "loss": loss, "lr": 2e-4, "ms_per_iter": MS, "tokens_per_s": 1.0},
             {"iter": 6400, "train/loss": loss, "val/loss": loss}]
    specs = a.get("llama_cpp") or a["gguf"]
    gguf = {s: {"type": s, "imatrix": s.endswith("+imatrix"), "bytes": 1000, "val_loss_source": "llama.cpp",
                "block_bits_per_weight": FILES[s if a.get("llama_cpp") else i][1],
                "val_loss_llama_cpp": FILES[s if a.get("llama_cpp") else i][0][seed], "file": None} for s in specs}
    if kept and a.get("llama_cpp"):
        gguf["F32"] = {"type": "fp32", "imatrix": False, "bytes": 4000, "val_loss_source": "llama.cpp",
                       "block_bits_per_weight": 32.0, "val_loss_llama_cpp": F32[seed], "file": None}
    if kept and not a.get("llama_cpp"):
        types = MIX_TYPES[seed] if i == 11 else {"blk.0.ffn_up.weight": "Q4_K"}
        gguf[specs[0]]["tensors"] = tensors_record(types)
    attempts = [{"wall_s": 60.0, "commit": "abc1234"}]
    for name, obj in (("config.json", config), ("done.json", {"status": "finished", "wall_s": 60.0}),
                      ("run.json", {"args": [], "config_sha": "x", "attempts": attempts}), ("gguf.json", gguf)):
        with open(os.path.join(d, name), "w") as f:
            json.dump(obj, f)
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in lines)


def report(root):
    """The study's report of the runs under root: (results.json, results.md, the paths written)."""
    with contextlib.redirect_stdout(io.StringIO()):
        written = runner.write_results("gguf", STUDY, root)
    with open(os.path.join(root, "gguf", "results.json")) as f:
        results = json.load(f)
    with open(os.path.join(root, "gguf", "results.md")) as f:
        return results, f.read(), written


def write_study(tmp_path):
    """The hand-made runs of FILES as they stand (seeds 1-2 of every arm, seed 3 of the trunk and the q4_0 STE
    phase) under a new root: its path."""
    root = str(tmp_path / "root")
    for i in range(len(STUDY["arms"])):
        for seed in (1, 2, 3) if i in (0, 1) else (1, 2):
            write_run(root, i, seed)
    return root


@pytest.fixture
def reported(tmp_path):
    """The report of the hand-made runs (seeds 1-2 of every arm, seed 3 of the trunk and the q4_0 STE
    phase): (root, results.json, results.md, the paths written)."""
    root = write_study(tmp_path)
    return (root, *report(root))


def loss(key, seed):
    return FILES[key][0][seed]


def test_each_file_is_in_the_class_of_its_bits_per_weight():
    """The GPT2's and the Llama's files: Q5_K_M (5.81) and Q6_K; Q4_K_M (5.10, the Llama's 4.82); 4.5; IQ4_XS with
    Q3_K_M (4.27, the Llama's 3.88); 3.44; IQ3_XXS, Q2_K and IQ2_M (the Llama's 2.70); Q2_K_S with IQ2_XS."""
    classes = {"8.5": (8.5,), "~5.5-6.6": (5.8098958, 6.5625), "~5.1": (5.1015625, 4.82), "~4.5": (4.5,),
               "~3.9-4.3": (4.25, 4.2708333, 3.8846), "~3.4": (3.4375, 3.43),
               "~2.7-3.2": (3.09375, 3.1666667, 2.8541667, 2.9375, 2.697), "~2.3-2.6": (2.625, 2.390625, 2.337)}
    assert {b: gguf_report.size_class(b) for bits in classes.values() for b in bits} == {
        b: label for label, bits in classes.items() for b in bits}


def test_the_rows_hold_each_files_llama_cpp_loss_and_its_increase_over_f32_and_bf16(reported):
    _, results, text, _ = reported
    rows = {(r["arm"], r["spec"]): r for r in results["rows"]}
    assert len(rows) == 17 + 12
    r = rows["llama.cpp Q4_0+imatrix", "Q4_0+imatrix"]
    assert r["seeds"] == 3 and r["seeds_total"] == 3 and r["class"] == "~4.5" and r["imatrix"] and r["llama_cpp"]
    assert r["val_loss"]["mean"] == pytest.approx((1.230 + 1.244 + 1.226) / 3, rel=1e-12)
    for base, key in ((BF16, "increase_pct"), (F32, "increase_f32_pct")):
        increases = [100 * (loss("Q4_0+imatrix", s) / base[s] - 1) for s in (1, 2, 3)]
        assert r[key]["mean"] == pytest.approx(sum(increases) / 3, rel=1e-12)
    assert r["f32_by_seed"] == {str(s): v for s, v in F32.items()}
    q4_k = rows["STE phase", "q4_k"]
    assert q4_k["seeds"] == 2 and q4_k["seeds_total"] == 3 and not q4_k["llama_cpp"]
    assert q4_k["trained_steps"] == 960 and q4_k["train_min"]["mean"] == pytest.approx(MS * 960 / 60e3)
    assert rows["learned mix at Q3_K_M's size", "auto-gguf@4.2708"]["class"] == "~3.9-4.3"
    assert "| ~4.5 | STE phase | q4_k | 2 of 3 |" in text


def test_the_findings_name_the_lowest_file_of_each_class_and_each_others_paired_gap(reported):
    """Recomputed by hand from FILES: the lowest mean in the ~4.5 class, every other file's difference to it
    over their common seeds with t(0.975, n - 1) from tables (4.303 for 3 seeds, 12.706 for 2)."""
    _, results, text, _ = reported
    findings = {f["class"]: f for f in results["findings"]}
    assert list(findings) == ["8.5", "~5.5-6.6", "~5.1", "~4.5", "~3.9-4.3", "~3.4", "~2.7-3.2", "~2.3-2.6"]
    f = findings["~4.5"]
    # means over seeds 1 and 2, the seeds all have: STE q4_0 1.2185 (1.214 over its 3), STE iq4_nl 1.2195, STE
    # q4_k 1.220, IQ4_NL+imatrix 1.234, Q4_0+imatrix 1.237, Q4_0 1.245
    assert (f["best"]["arm"], f["best"]["spec"], f["best"]["seeds"]) == ("STE phase", "q4_0", 3)
    assert [(o["arm"], o["spec"]) for o in f["others"]] == [
        ("STE phase", "iq4_nl"), ("STE phase", "q4_k"), ("llama.cpp IQ4_NL+imatrix", "IQ4_NL+imatrix"),
        ("llama.cpp Q4_0+imatrix", "Q4_0+imatrix"), ("llama.cpp Q4_0", "Q4_0")]
    by = {o["spec"]: o for o in f["others"]}
    for spec, seeds, t in (("q4_k", (1, 2), 12.706), ("Q4_0+imatrix", (1, 2, 3), 4.303)):
        key = 2 if spec == "q4_k" else spec
        gaps = [loss(key, s) - loss(1, s) for s in seeds]
        mean = sum(gaps) / len(gaps)
        sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / (len(gaps) - 1))
        d = by[spec]["minus_best"]
        assert d["n"] == len(seeds) and d["mean"] == pytest.approx(mean, rel=1e-9)
        assert d["ci95"] == pytest.approx(t * sd / math.sqrt(len(seeds)), rel=1e-4)
        assert by[spec]["verdict"] == ("inside the noise" if abs(mean) <= d["ci95"] else "outside the noise")
    assert by["q4_k"]["verdict"] == "inside the noise" and by["Q4_0+imatrix"]["verdict"] == "outside the noise"
    over = [100 * (loss(1, s) / F32[s] - 1) for s in (1, 2, 3)]
    assert f["best"]["increase_f32_pct"] == pytest.approx(sum(over) / 3, rel=1e-12)
    assert ("**~4.5 bits per weight**: STE phase (q4_0) is lowest (llama.cpp val loss 1.2140, "
            f"{sum(over) / 3:+.2f} % over the F32 file (llama.cpp), ") in text
    assert "3 of 3 seeds" in text


def test_files_are_ranked_over_the_seeds_they_all_have_not_each_over_its_own(tmp_path, monkeypatch):
    """Seed 3 is easier than seeds 1 and 2 (every file's loss lower), and only q4_0 has it: over its own seeds
    q4_0's mean (1.214) is below q4_k's (1.217 here), yet q4_k is lower in both seeds they share. The findings
    and the user's table name q4_k the lowest of ~4.5 bits, and the user's table gives llama.cpp's file over
    q4_k's seeds."""
    monkeypatch.setitem(FILES, 2, ({1: 1.212, 2: 1.222}, 4.5))
    results, text, _ = report(write_study(tmp_path))
    f = next(f for f in results["findings"] if f["class"] == "~4.5")
    assert (f["best"]["spec"], f["best"]["seeds"]) == ("q4_k", 2)
    assert [o["spec"] for o in f["others"]][:2] == ["q4_0", "iq4_nl"]
    size = next(s for s in results["for_a_user"]["sizes"] if s["class"] == "~4.5")
    assert size["ours"]["spec"] == "q4_k" and size["reference"]["seeds"] == 2
    mean, half = share_by_hand(2, "IQ4_NL+imatrix", (1, 2))
    assert size["removed"]["mean"] == pytest.approx(mean, rel=1e-9)
    assert size["removed"]["ci95"] == pytest.approx(half, rel=1e-4)


# Each trained file's reference: llama.cpp's imatrix file of the lowest mean loss among those of no more bits
REFERENCES = {1: "IQ4_NL+imatrix", 2: "IQ4_NL+imatrix", 5: "IQ4_NL+imatrix", 6: "IQ4_XS+imatrix",
              7: "IQ4_XS+imatrix",  # 4.2604 bits: Q3_K_M's 4.2708 is more bytes
              8: "IQ4_XS+imatrix", 9: "IQ3_XXS+imatrix",  # 3.43 bits: Q3_K_S's and IQ3_S's 3.4375 are more
              3: "IQ3_S+imatrix", 10: "IQ3_S+imatrix", 11: "IQ3_XXS+imatrix", 12: "IQ3_XXS+imatrix",
              4: "Q2_K_S+imatrix"}


def test_each_trained_file_removes_a_share_of_the_best_llama_cpp_file_of_no_more_bytes(reported):
    """(L_ref - L_file) / (L_ref - L_F32) per seed, L_ref the best llama.cpp imatrix file of no more bits per weight
    (whatever its type: REFERENCES, by hand), L_F32 llama.cpp's loss of the seed's F32 file; and the same with the
    trunk's PyTorch val loss; each mean with its 95 % interval over the seeds."""
    _, results, text, _ = reported
    shares = {s["spec"]: s for f in results["findings"] for s in f["shares"]}
    mixes = {f"{m}@{b}" for m in ("auto-gguf", "error-gguf") for b in ("4.2708", "3.4375", "3.1666")}
    assert set(shares) == {*STE, *mixes}
    specs = {i: STUDY["arms"][i]["gguf"][0] for i in REFERENCES}
    for i, ref in REFERENCES.items():
        got = shares[specs[i]]
        assert got["reference"]["arm"] == f"llama.cpp {ref}", specs[i]
        seeds = (1, 2, 3) if i == 1 else (1, 2)
        for base, key in ((F32, "removed"), (BF16, "removed_pytorch")):
            per_seed = [(loss(ref, s) - loss(i, s)) / (loss(ref, s) - base[s]) for s in seeds]
            mean = sum(per_seed) / len(per_seed)
            sd = math.sqrt(sum((v - mean) ** 2 for v in per_seed) / (len(per_seed) - 1))
            assert got[key]["n"] == len(seeds) and got[key]["mean"] == pytest.approx(mean, rel=1e-9)
            assert got[key]["ci95"] == pytest.approx({3: 4.303, 2: 12.706}[len(seeds)] * sd / math.sqrt(len(seeds)),
                                                     rel=1e-4)
        assert got["f32_lacking"] == []
    assert ("Share of the loss of llama.cpp IQ4_XS+imatrix (4.2500 bits per weight, the best llama.cpp file of no "
            "more bytes) removed: STE phase (iq4_xs) at 4.2500 bits: over the F32 file ") in text


def share_by_hand(ours, ref, seeds):
    """(L_ref - L_ours) / (L_ref - L_F32) per seed: its mean and 95 % interval (t from tables)."""
    per_seed = [(loss(ref, s) - loss(ours, s)) / (loss(ref, s) - F32[s]) for s in seeds]
    mean = sum(per_seed) / len(per_seed)
    sd = math.sqrt(sum((v - mean) ** 2 for v in per_seed) / (len(per_seed) - 1))
    return mean, {3: 4.303, 2: 12.706}[len(seeds)] * sd / math.sqrt(len(seeds))


def test_the_users_table_gives_per_size_our_lowest_file_against_llama_cpps_best_of_no_more_bytes(tmp_path,
                                                                                                monkeypatch):
    """Per size class with a trained file: the lowest one (by hand from FILES: q4_0 at 4.5, the iq4_xs STE
    phase at 4.25, the learned mix at 3.43, the learned mix at 3.165, q2_k at 2.625), its reference
    (REFERENCES), the share it removes and whether the share's interval lies at or above half. The iq4_xs
    phase is made to remove about 85 % here, the one size that meets it. Then the lowest trained file of
    2.6-3.2 bits against Q3_K_M+imatrix, paired by seed."""
    monkeypatch.setitem(FILES, 6, ({1: 1.206, 2: 1.215}, 4.25))
    results, text, _ = report(write_study(tmp_path))
    sizes = {s["class"]: s for s in results["for_a_user"]["sizes"]}
    want = {"~4.5": 1, "~3.9-4.3": 6, "~3.4": 9, "~2.7-3.2": 11, "~2.3-2.6": 4}
    assert list(sizes) == list(want)
    for label, i in want.items():
        got, spec = sizes[label], STUDY["arms"][i]["gguf"][0]
        assert (got["ours"]["spec"], got["reference"]["spec"]) == (spec, REFERENCES[i])
        mean, half = share_by_hand(i, REFERENCES[i], (1, 2, 3) if i == 1 else (1, 2))
        assert got["removed"]["mean"] == pytest.approx(mean, rel=1e-9)
        assert got["removed"]["ci95"] == pytest.approx(half, rel=1e-4)
        assert got["goal_met"] == (mean - half >= 0.5)
    assert [label for label, s in sizes.items() if s["goal_met"]] == ["~3.9-4.3"]
    ref_over = sum(100 * (loss("IQ4_XS+imatrix", s) / F32[s] - 1) for s in (1, 2)) / 2  # ours' seeds, not its 3
    ours_over = sum(100 * (loss(6, s) / F32[s] - 1) for s in (1, 2)) / 2
    assert (f"| ~3.9-4.3 | llama.cpp IQ4_XS+imatrix, 4.25 bits | {ref_over:+.2f} % | STE phase (iq4_xs), 4.25 bits | "
            f"{ours_over:+.2f} % | " in text) and text.count("| yes |") == 1 and text.count("| no |") == 4
    # 2.6-3.2 bits: q2_k (2.625, mean 1.625), the learned mix (3.165, 1.34), the error mix (3.1666, 1.365)
    small = results["for_a_user"]["small"]
    assert (small["ours"]["spec"], small["versus"]["spec"]) == ("auto-gguf@3.1666", "Q3_K_M+imatrix")
    gaps = [loss(11, s) - loss("Q3_K_M+imatrix", s) for s in (1, 2)]
    assert small["minus_versus"]["mean"] == pytest.approx(sum(gaps) / 2, rel=1e-9)
    assert not small["at_least_as_good"] and small["verdict"] == "inside the noise"
    assert "minus llama.cpp Q3_K_M+imatrix at 4.27 bits: +0.0720 ± 0.2287 (n=2) in val loss" in text


def test_the_report_gives_both_denominators_per_seed(reported):
    _, _, text, _ = reported
    for seed in (1, 2, 3):
        assert (f"| {seed} | {BF16[seed]:.5f} | {F32[seed]:.5f} | {100 * (F32[seed] / BF16[seed] - 1):+.4f} % |"
                in text)


def test_the_report_gives_each_trained_files_types_per_seed_and_per_tensor(reported):
    """The learned mix at Q2_K's size chose per seed as MIX_TYPES says: counted, and tensor by tensor."""
    _, results, text, _ = reported
    row = next(r for r in results["rows"] if r["spec"] == "auto-gguf@3.1666")
    assert row["tensors_by_seed"] == {str(s): tensors_record(t) for s, t in MIX_TYPES.items()}
    assert ("- learned mix at Q2_K's size (auto-gguf@3.1666): seed 1 Q2_K x1, Q4_K x1 (3.1650 bits per weight); "
            "seed 2 Q2_K x1, Q3_K x1 (3.1650 bits per weight).") in text
    assert "  | blk.0.attn_output.weight | Q4_K | Q3_K |" in text and "  | blk.0.ffn_up.weight | Q2_K | Q2_K |" in text


def test_records_made_before_the_f32_file_and_the_types_were_kept_are_reported_as_lacking_them(tmp_path, stand_ins,
                                                                                              monkeypatch):
    """The study's first records (no F32 file, no per-tensor types), their run directories without checkpoints:
    the F32 file cannot be made (export_gguf.py fails, here its stand-in), the report says what lacks and gives
    the shares over PyTorch's loss alone, inventing none."""
    monkeypatch.setenv("FAIL", "no checkpoint at the run")
    root = str(tmp_path / "root")
    for i in (0, 1, 11):
        for seed in (1, 2):
            write_run(root, i, seed, kept=False)
    results, text, _ = report(root)
    assert {c[0] for c in stand_ins()} == {"export_gguf.py"}  # the F32 file asked for, and only it
    share = next(s for f in results["findings"] for s in f["shares"] if s["spec"] == "q4_0")
    assert share["f32_lacking"] == ["1", "2"] and share["removed"]["n"] == 0 and share["removed_pytorch"]["n"] == 2
    assert ("STE phase (q4_0) at 4.5000 bits: over the F32 file not recorded (no llama.cpp loss of the F32 file for "
            "seeds 1, 2), over bf16 ") in text
    assert "the F32 file's llama.cpp loss not recorded" in text and "| 1 | 1.20000 | not recorded |" in text
    assert "- STE phase (q4_0): seed 1 not recorded; seed 2 not recorded." in text
    size = next(s for s in results["for_a_user"]["sizes"] if s["class"] == "~4.5")
    assert size["goal_met"] is None and size["removed_pytorch"]["n"] == 2
    assert "| STE phase (q4_0), 4.50 bits | - | F32 not recorded; over bf16 " in text
    rows = {r["spec"]: r for r in results["rows"]}
    assert rows["Q4_0+imatrix"]["increase_f32_pct"]["n"] == 0 and rows["Q4_0+imatrix"]["increase_pct"]["n"] == 2


def test_the_figures_curves_are_each_files_loss_over_its_seeds_bf16_and_the_lowest_trained_file_at_each_size(
        reported):
    """gguf.png's points: per file the mean and standard deviation over its seeds of 100 (L_file - L_bf16) /
    L_bf16, L_bf16 the trunk's val loss of the same seed; the trained curve the trained file with the lowest
    mean at each size, the mixes counted at the size of llama.cpp's type they match."""
    import statistics
    _, results, _, _ = reported

    def point(key):
        losses, bits = FILES[key]
        inc = [100 * (losses[s] - BF16[s]) / BF16[s] for s in losses]
        return bits, statistics.mean(inc), statistics.stdev(inc)

    curves = plots.gguf_curves(results["rows"])
    got = {kind: [(b, pytest.approx(m, rel=1e-9), pytest.approx(sd, rel=1e-9)) for b, m, sd, _ in points]
           for kind, points in curves.items()}
    imatrix = sorted(point(k) for k in FILES if isinstance(k, str) and k.endswith("+imatrix"))
    assert got["llama-quantize with imatrix"] == imatrix
    assert [label for *_, label in curves["llama-quantize with imatrix"]] == [
        "IQ2_XS", "Q2_K_S", "IQ2_M", "IQ3_XXS", "Q2_K", "IQ3_S", "Q3_K_S", "IQ4_XS", "Q3_K_M", "IQ4_NL", "Q4_0",
        "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"]
    assert got["llama-quantize without imatrix"] == sorted(point(k) for k in ("Q4_0", "Q3_K_M"))
    # q4_0, q4_k, iq4_nl; q3_k and the mixes at Q3_K_S's size; q2_k; iq4_xs (4.25 rounds to 4.2); the mixes at
    # Q3_K_M's; at Q2_K's
    sizes = [(1, 2, 5), (3, 9, 10), (4,), (6,), (7, 8), (11, 12)]
    want = sorted(min((point(i) for i in size), key=lambda p: p[1]) for size in sizes)
    assert got["trained files, lowest at each size"] == want
    assert [label for *_, label in curves["trained files, lowest at each size"]] == [
        "q2_k", "auto-gguf@3.1666", "auto-gguf@3.4375", "iq4_xs", "auto-gguf@4.2708", "q4_0"]


def test_the_figures_trained_curve_ranks_a_sizes_files_over_the_seeds_they_share(tmp_path, monkeypatch):
    """q4_0's seed 3 (only q4_0 has it) lies close to its bf16: over its own seeds q4_0's mean increase is the
    lowest of ~4.5 bits, yet q4_k's is lower in both seeds they share. The curve takes q4_k, as the tables do."""
    monkeypatch.setitem(FILES, 1, ({1: 1.215, 2: 1.224, 3: 1.192}, 4.5))
    monkeypatch.setitem(FILES, 2, ({1: 1.212, 2: 1.222}, 4.5))

    def increases(key):
        return {s: 100 * (v - BF16[s]) / BF16[s] for s, v in FILES[key][0].items()}
    q4_0, q4_k = increases(1), increases(2)
    assert sum(q4_0.values()) / 3 < sum(q4_k.values()) / 2  # the fixture's point: own seeds rank q4_0 first
    assert all(q4_k[s] < q4_0[s] for s in (1, 2))
    results, _, _ = report(write_study(tmp_path))
    curve = plots.gguf_curves(results["rows"])["trained files, lowest at each size"]
    assert [label for bits, *_, label in curve if bits == 4.5] == ["q4_k"]


def test_the_figure_is_written(reported):
    root, _, _, written = reported
    path = os.path.join(root, "gguf", "plots", "gguf.png")
    assert path in written
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_mix_finished_before_its_trunk_is_reported_without_an_increase_over_bf16(tmp_path):
    """A runner can finish a phase arm while its seed's trunk still trains: the class whose lowest file is
    that arm's has no bf16 loss to compare with, and says so instead of an increase."""
    root = str(tmp_path / "root")
    for i in (7, 11):  # the learned mixes at Q3_K_M's and Q2_K's size of seed 1, and no finished trunk
        write_run(root, i, 1)
    results, text, _ = report(root)
    assert ("- **~2.7-3.2 bits per weight**: learned mix at Q2_K's size (auto-gguf@3.1666) is lowest (llama.cpp val "
            f"loss {loss(11, 1):.4f}, no finished bf16 trunk, 3.1650 bits per weight, 1 of 3 seeds).") in text
    assert "| ~3.9-4.3 | learned mix at Q3_K_M's size | auto-gguf@4.2708 | 1 of 3 | 4.2604 |" in text
    assert "over bf16 (PyTorch)" not in text.split("## The files")[0] and "No finished bf16 trunk yet." in text
    assert os.path.exists(os.path.join(root, "gguf", "plots", "gguf.png"))  # without the points it cannot place


def test_the_report_refuses_a_run_cut_short_in_one_line_and_writes_nothing(tmp_path):
    root = str(tmp_path / "root")
    for i in range(len(STUDY["arms"])):
        write_run(root, i, 1)
    d = os.path.join(root, "runs", defs.run_name(STUDY["arms"][3], 1))
    with open(os.path.join(d, "metrics.jsonl"), "rb+") as f:
        f.truncate(os.path.getsize(os.path.join(d, "metrics.jsonl")) - 25)
    with pytest.raises(StudyError) as e, contextlib.redirect_stdout(io.StringIO()):
        runner.write_results("gguf", STUDY, root)
    assert "\n" not in str(e.value) and str(e.value).startswith(f"{d}: done.json says finished, but ")
    assert not os.path.exists(os.path.join(root, "gguf"))


@pytest.mark.parametrize("key, value, says", [
    ("val_loss_llama_cpp", float("nan"), "val_loss_llama_cpp nan (a loss is a finite number >= 0)"),
    ("val_loss_llama_cpp", -1.0, "val_loss_llama_cpp -1.0 (a loss is a finite number >= 0)"),
    ("val_loss_llama_cpp", 1e9, "val_loss_llama_cpp 1e+09, above train.py's limit 6.5452"),  # ln(256) + 1
    ("bytes", 0, "bytes 0 (a file's size is a whole number > 0)"),
    ("block_bits_per_weight", float("inf"), "block_bits_per_weight inf (the bits per weight of a GGML type are in"),
])
def test_the_report_refuses_a_llama_cpp_loss_train_py_would_not_pass_in_one_line_and_writes_nothing(
        tmp_path, key, value, says):
    """gguf.json's records are held to what a measurement can be, as metrics.jsonl's losses are: llama.cpp's val
    loss finite, >= 0 and within step.insanity's limit for the run's vocabulary, the file's size and bits per
    weight positive (a val loss of -1 made a file "lowest" at -67 % over bf16)."""
    root = str(tmp_path / "root")
    for i in range(len(STUDY["arms"])):
        write_run(root, i, 1)
    path = os.path.join(root, "runs", defs.run_name(STUDY["arms"][3], 1), "gguf.json")
    with open(path) as f:
        records = json.load(f)
    (spec,) = records
    records[spec][key] = value
    with open(path, "w") as f:
        json.dump(records, f)
    with pytest.raises(StudyError) as e, contextlib.redirect_stdout(io.StringIO()):
        runner.write_results("gguf", STUDY, root)
    assert "\n" not in str(e.value) and str(e.value).startswith(f"{path}: the record of {spec} holds {says}")
    assert not os.path.exists(os.path.join(root, "gguf"))
    made = exports._gguf_records(os.path.dirname(path), [spec, "Q8_0"], lambda run_dir, specs: {
        "Q8_0": {**records[spec], "type": "Q8_0"}})  # export_gguf.py's record of such a file: not kept either
    assert made["Q8_0"].startswith(f"export_gguf.py reported {says}")
    with open(path) as f:
        assert "Q8_0" not in json.load(f)


def test_the_dry_run_lists_every_run_and_each_arms_cost(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # main() works in the repository; the test's directory is restored after
    assert entry.main(["gguf", "--dry_run", f"--root={tmp_path}"]) == 0
    out = capsys.readouterr().out
    runs = [line for line in out.splitlines() if "[to run]" in line]
    assert len(runs) == 39
    assert runs[0].endswith("python train.py config/mini_gpt2_gguf.py --method=bf16 --max_iters=6400 "
                            f"--lr_decay_iters=6400 --eval_interval=1600 --seed=1 --out_dir="
                            f"{os.path.join(str(tmp_path), 'runs', 'gpt2_gguf-bf16-eval1600-decay6400-n6400-s1')}")
    total = 0.0
    for a in STUDY["arms"]:
        steps = 6400 - a["overrides"].get("pqt_start", 0) if a.get("trunk") else 6400
        minutes = steps * a["step_s"] / 60
        total += 3 * steps * a["step_s"]
        assert f"{steps:,} steps x {a['step_s']:.2f} s = {minutes:.0f} min a run, x 3 seeds" in out, a["kind"]
    assert f"in all {total / 3600:.1f} h on one core" in out
    assert "then, in the report, llama-quantize of its last checkpoint: Q8_0+imatrix, Q4_0+imatrix" in out


def test_the_report_counts_the_types_each_kind_of_mix_gave_each_tensor(reported):
    """Over every size and seed (write_run: the learned mix at Q2_K's size chose MIX_TYPES, every other mix
    ffn_up Q4_K; seeds 1 and 2 of each of the three sizes), counted here by hand."""
    _, results, text, _ = reported
    assert results["chosen"] == {
        "learned mix": {"runs": 6, "tensors": {"blk.0.ffn_up.weight": {"Q4_K": 4, "Q2_K": 2},
                                               "blk.0.attn_output.weight": {"Q4_K": 1, "Q3_K": 1}}},
        "error mix": {"runs": 6, "tensors": {"blk.0.ffn_up.weight": {"Q4_K": 6}}}}
    assert "| blk.0.ffn_up.weight | Q2_K 2, Q4_K 4 |" in text and "| blk.0.ffn_up.weight | Q4_K 6 |" in text


# A trunk's sensitivity.json as python -m studies.sensitivity writes it: three tensors, two upgrades
SENSITIVITY = {"checkpoint": "ckpt_4480.pt", "iter_num": 4480, "types": ["q2_k", "q3_k", "q4_k"], "val_loss": 1.0,
               "batches": 20, "tensors": [{"tensor": f"transformer.h.0.{m}", "role": m, "numel": 65536, "loss": {},
                                           "proxy": {}} for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc")],
               "upgrades": {"q2_k->q3_k": {"loss_per_bit": [2.0, 3.0, 1.0], "proxy_per_bit": [5.0, 1.0, 9.0],
                                           "spearman": -0.5},
                            "q3_k->q4_k": {"loss_per_bit": [1.0, 2.0, 3.0], "proxy_per_bit": [1.0, 2.0, 3.0],
                                           "spearman": 1.0}}}


def test_the_report_ranks_each_trunks_tensors_by_loss_and_by_proxy_from_its_kept_measure(tmp_path):
    """Seed 1's trunk keeps a sensitivity.json (SENSITIVITY), seed 2's none and no checkpoint to make one: the
    ranks (1: the largest drop per bit) by hand, Spearman as recorded; seed 2 says why it has none."""
    root = str(tmp_path / "root")
    for i, a in enumerate(STUDY["arms"]):
        for seed in (1, 2):
            write_run(root, i, seed)
    with open(os.path.join(root, "runs", defs.run_name(STUDY["arms"][0], 1), "sensitivity.json"), "w") as f:
        json.dump(SENSITIVITY, f)
    results, text, _ = report(root)
    assert results["sensitivity_step"] == 4480 and results["sensitivity"]["1"] == SENSITIVITY
    assert results["sensitivity_ranks"] == {"1": {
        "q2_k->q3_k": {"tensors": [t["tensor"] for t in SENSITIVITY["tensors"]], "loss_rank": [2, 1, 3],
                       "proxy_rank": [2, 3, 1], "spearman": -0.5},
        "q3_k->q4_k": {"tensors": [t["tensor"] for t in SENSITIVITY["tensors"]], "loss_rank": [3, 2, 1],
                       "proxy_rank": [3, 2, 1], "spearman": 1.0}}}
    assert "- seed 2: no sensitivity.json of step 4480 and no ckpt_4480.pt to measure" in text
    assert "**q2_k->q3_k**: rank by loss / by proxy per seed (Spearman seed 1 -0.50)" in text
    assert "| blk.0.attn_output.weight | 1 / 3 |" in text and "| blk.0.attn_qkv.weight | 2 / 2 |" in text


def test_the_report_gives_what_the_runs_took_from_their_records(reported):
    """write_run logs MS a step and 60 s of wall time each: the trunks' 6,400 steps, the phases' own steps
    (960 of an STE phase, 1,920 of a mix) at 1.5 s, summed over the 25 phase runs."""
    _, results, text, _ = reported
    cost = results["cost"]
    assert cost["trunks"] == {str(s): {"step_s": 1.5, "train_h": pytest.approx(6400 * 1.5 / 3600),
                                       "wall_h": pytest.approx(60 / 3600)} for s in (1, 2, 3)}
    assert cost["phase_runs"] == 25 and cost["phases_h"] == pytest.approx((13 * 960 + 12 * 1920) * 1.5 / 3600)
    assert "- the 25 finished phase runs' own steps: 14.8 h (1.50-1.50 s a step, each run's median)" in text
