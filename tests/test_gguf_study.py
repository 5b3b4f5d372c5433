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

import pytest

import checkpoint
import llama_tools
import studies.__main__ as entry
import train
from conftest import ROOT
from studies import definitions as defs
from studies import exports, gguf_report, plots, runner
from studies.records import StudyError

STUDY = defs.STUDIES["gguf"]
TRUNK = STUDY["arms"][0]
SHAPE = dict(max_iters=6400, lr_decay_iters=6400, eval_interval=1600)
# ggml-common.h's block sizes by hand: (bytes per block) * 8 / (weights per block)
BITS = {"Q8_0": 34 * 8 / 32, "Q4_0": 18 * 8 / 32, "Q6_K": 210 * 8 / 256, "Q5_K": 176 * 8 / 256,
        "Q4_K": 144 * 8 / 256, "Q3_K": 110 * 8 / 256, "Q2_K": 84 * 8 / 256}


# --- the arms -----------------------------------------------------------------------------------------

def test_the_trunk_is_the_one_its_runs_under_way_were_made_with():
    """Its config, overrides, names and kept steps, written out: a change would stop its runs resuming."""
    assert TRUNK["config"] == "config/mini_gpt2_gguf.py" and TRUNK["overrides"] == {"method": "bf16", **SHAPE}
    assert TRUNK["keep"] == [4480, 5440] and TRUNK["seeds"] == (1, 2, 3)
    assert [defs.run_name(TRUNK, s) for s in (1, 2, 3)] == [
        f"gpt2_gguf-bf16-eval1600-decay6400-n6400-s{s}" for s in (1, 2, 3)]
    assert TRUNK["llama_cpp"] == ["Q8_0+imatrix", "Q4_0+imatrix", "Q4_K_M+imatrix", "Q3_K_M+imatrix",
                                  "Q2_K+imatrix", "Q4_0", "Q3_K_M", "Q3_K_S+imatrix", "Q2_K_S+imatrix"]


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
    want = [("STE phase", f, {"method": "ste[all]", "target_format": f, "pqt_start": 5440})
            for f in ("q4_0", "q4_k", "q3_k", "q2_k")]
    for mix, bits in (("Q3_K_M", 4.2708), ("Q3_K_S", 3.4375), ("Q2_K", 3.1666)):
        for kind, fmt in (("learned mix", "auto-gguf"), ("error mix", "error-gguf")):
            want.append((f"{kind} at {mix}'s size", f"{fmt}@{bits:g}",
                         {"method": "gaussws[all]", "target_format": fmt, "bits_per_weight": bits, "pqt_start": 4480,
                          "ste_start": 5440}))
    assert [(a["kind"], a["gguf"], a["overrides"]) for a in arms] == [(k, [s], {**o, **SHAPE}) for k, s, o in want]
    assert all(a["trunk"] is TRUNK and a["seeds"] == (1, 2, 3) for a in arms)
    assert defs.run_name(arms[0], 2) == "gpt2_gguf-ste_all-eval1600-decay6400-n6400-from5440-q4_0-s2"
    assert defs.run_name(arms[4], 1) == \
        "gpt2_gguf-gaussws_all-bpw4.2708-eval1600-decay6400-n6400-from4480-ste5440-auto-gguf-s1"
    assert len({n for n, _, _ in defs.runs_of(STUDY)}) == len(defs.runs_of(STUDY)) == 33


def resolved(a, seed=1):
    """train.py's resolved config of a run of arm a, from its own dry run (meta device, no data)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train.main([os.path.join(ROOT, a["config"]), *(f"--{k}={v}" for k, v in a["overrides"].items()),
                    f"--seed={seed}", "--dry_run=True"])
    text = out.getvalue()
    return json.loads(text[:text.index("\n}\n") + 2])


def test_train_accepts_every_arm_and_each_forks_from_its_trunk():
    """train.py's settings check takes every arm; each resolves its switches to the overrides' steps, and
    equals the trunk in every setting a fork must share (checkpoint.read_fork's rule)."""
    trunk = resolved(TRUNK)
    for a in STUDY["arms"][1:]:
        c, o = resolved(a), a["overrides"]
        assert (c["method"], c["target_format"], c["pqt_start"]) == (o["method"], o["target_format"], o["pqt_start"])
        assert (c["ste_start"], c["bits_per_weight"]) == (o.get("ste_start", 0), o.get("bits_per_weight", 0))
        assert [k for k in c if k not in checkpoint.FORK_FREE and c[k] != trunk.get(k)] == [], a["kind"]


# --- llama-quantize's mixes on this model --------------------------------------------------------------

def test_the_mix_budgets_are_llama_quantizes_bits_per_weight_on_this_model():
    """4 layers of Linears 768x256 (qkv), 256x256 (out), 1024x256 (up), 256x1024 (down). Q3_K_M: qkv Q5_K
    in the first two layers, Q4_K after; out and down Q4_K; up Q3_K. Q3_K_S: Q3_K throughout. Q2_K: up Q2_K,
    the rest Q3_K."""
    qkv, out, up, down = 768 * 256, 256 * 256, 1024 * 256, 256 * 1024
    total = 4 * (qkv + out + up + down)
    q3_k_m = (2 * qkv * BITS["Q5_K"] + (2 * qkv + 4 * out + 4 * down) * BITS["Q4_K"] + 4 * up * BITS["Q3_K"]) / total
    q2_k = (4 * (qkv + out + down) * BITS["Q3_K"] + 4 * up * BITS["Q2_K"]) / total
    assert defs.llama_mix_bits("Q3_K_M") == pytest.approx(q3_k_m, rel=1e-12) and round(q3_k_m, 4) == 4.2708
    assert defs.llama_mix_bits("Q2_K") == pytest.approx(q2_k, rel=1e-12) and round(q2_k, 4) == 3.1667
    assert defs.llama_mix_bits("Q3_K_S") == BITS["Q3_K"] == 3.4375
    assert defs.GGUF_MIX_BITS == {"Q3_K_M": 4.2708, "Q3_K_S": 3.4375, "Q2_K": 3.1666}  # rounded down: never more bytes
    import ggml_quants
    for t, bits in BITS.items():
        assert defs.type_bits(t) == bits == ggml_quants.bits_per_weight(t)


@pytest.fixture(scope="module")
def llama_quantized(tmp_path_factory):
    """A checkpoint of the study's model shape (random weights, a tiny corpus's vocabulary) as an F32 GGUF,
    then llama-quantize's Q3_K_M, Q3_K_S and Q2_K of it (no --pure: llama.cpp's own mixes): {mix: path}."""
    import tokenizer
    from test_gguf import write_data
    from test_gguf_grids import export, make_run
    d = tmp_path_factory.mktemp("llama_mixes")
    write_data(str(d / "data"), tokenizer.Tokenizer("bytes", "bytes"))
    c = defs.config_settings(defs.GGUF_CONFIG)
    make_run(d / "run", d / "data", "gpt2", n_layer=c["n_layer"], n_head=c["n_head"], n_embd=c["n_embd"])
    rc, _, err = export(d / "run", "--format=fp32", "--gguf=True", "--eval_iters=1")
    assert rc == 0, err
    return {mix: llama_tools.llama_quantize(d / "run" / "model-fp32.gguf", d / f"{mix}.gguf", mix, pure=False)
            for mix in defs.LLAMA_MIXES}


@pytest.mark.skipif(llama_tools.llama_cpp_tool("llama-quantize") is None,
                    reason="llama-quantize not found: set LLAMA_CPP_BIN to the directory of llama.cpp's tools, or "
                           "put them on PATH, to check the mixes' table against the files it writes")
@pytest.mark.parametrize("mix", list(defs.LLAMA_MIXES))
def test_llama_quantize_gives_each_block_linear_the_tables_type(llama_quantized, mix):
    """Every block Linear of llama-quantize's file has the type LLAMA_MIXES gives it, and the file's block
    Linears hold llama_mix_bits bits per weight (their bytes, scales included)."""
    gguf = pytest.importorskip("gguf")
    roles = {"attn_qkv": "qkv", "attn_output": "out", "ffn_up": "up", "ffn_down": "down"}
    n = defs.config_settings(defs.GGUF_CONFIG)["n_layer"]
    seen, bits, weights = 0, 0, 0
    for t in gguf.GGUFReader(str(llama_quantized[mix])).tensors:
        parts = t.name.split(".")
        if parts[0] == "blk" and parts[2] in roles and parts[3] == "weight":
            assert t.tensor_type.name == defs.LLAMA_MIXES[mix](roles[parts[2]], int(parts[1]), n), t.name
            seen, bits, weights = seen + 1, bits + 8 * int(t.n_bytes), weights + int(t.n_elements)
    assert seen == 4 * n and bits / weights == pytest.approx(defs.llama_mix_bits(mix), rel=1e-12)


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
def record(spec, path, k):
    return {"spec": spec, "path": path, "type": spec.split("+")[0], "imatrix": spec.endswith("+imatrix"),
            "bytes": 1000 + k, "block_bits_per_weight": 4.0 + k, "val_loss_llama_cpp": 1.5 + k / 100,
            "val_loss_source": "llama.cpp"}
if os.path.basename(__file__) == "export.py":
    os.makedirs(args["export_dir"], exist_ok=True)
    path = os.path.join(args["export_dir"], f"model-{args['format']}.gguf")
    open(path, "w").close()
    out = {"exports": [{"format": args["format"], "gguf": {"path": path}}]}
elif "llama_quantize" in args:
    specs = args["llama_quantize"].split(",")
    out = {"files": [record(s, os.path.join(args["export_dir"], s + ".gguf"), k) for k, s in enumerate(specs)]}
else:
    out = {"files": [record(p, p, k) for k, p in enumerate(args["gguf"].split(","))]}
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
    run = tmp_path / "runs" / "trunk"
    run.mkdir(parents=True)
    got = exports.llama_cpp_files(str(run), ["Q4_K_M+imatrix", "Q4_0"])
    (call,) = stand_ins()
    assert call[:4] == ["export_gguf.py", f"--out_dir={run}", "--llama_quantize=Q4_K_M+imatrix,Q4_0",
                        f"--export_dir={run / 'gguf'}"]
    assert call[4].startswith("--json=") and call[5:] == ["--threads=1"]
    assert got == {"Q4_K_M+imatrix": {"type": "Q4_K_M", "imatrix": True, "bytes": 1000, "block_bits_per_weight": 4.0,
                                      "val_loss_llama_cpp": 1.5, "val_loss_source": "llama.cpp",
                                      "file": "gguf/Q4_K_M+imatrix.gguf"},
                   "Q4_0": {"type": "Q4_0", "imatrix": False, "bytes": 1001, "block_bits_per_weight": 5.0,
                            "val_loss_llama_cpp": 1.51, "val_loss_source": "llama.cpp", "file": "gguf/Q4_0.gguf"}}
    assert json.loads((run / "gguf.json").read_text()) == got
    # kept: asked again, with one more, only the new one is made
    again = exports.llama_cpp_files(str(run), ["Q4_0", "Q8_0+imatrix", "Q4_K_M+imatrix"])
    assert len(stand_ins()) == 2 and stand_ins()[1][2] == "--llama_quantize=Q8_0+imatrix"
    assert again["Q4_0"] == got["Q4_0"] and again["Q8_0+imatrix"]["val_loss_llama_cpp"] == 1.5


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
    assert exports.llama_cpp_files(str(run), ["Q4_0"]) == {"Q4_0": why}
    assert not (run / "gguf.json").exists()


def test_our_files_keep_embeddings_and_head_as_llama_quantize_keeps_them():
    """export.py's --other_dtype of the glue is the type llama_tools.llama_quantize keeps them in."""
    import inspect
    keep = inspect.signature(llama_tools.llama_quantize).parameters["keep"].default
    assert {"bfloat16": "bf16", "float32": "f32"}[exports.OTHER_DTYPE] == keep


# --- the report, on hand-made records -------------------------------------------------------------------

# The trunk's val loss (train.py) per seed, and llama.cpp's val loss and bits per weight of each file per
# seed: {arm index or llama.cpp spec: ({seed: loss}, bits per weight)}. Seed 3 is done for the trunk and
# the q4_0 STE phase only, so the others are "2 of 3".
BF16 = {1: 1.200, 2: 1.210, 3: 1.190}
FILES = {"Q8_0+imatrix": ({1: 1.201, 2: 1.211, 3: 1.191}, 8.5),
         "Q4_0+imatrix": ({1: 1.230, 2: 1.244, 3: 1.226}, 4.5),
         "Q4_K_M+imatrix": ({1: 1.212, 2: 1.223, 3: 1.202}, 5.1015625),
         "Q3_K_M+imatrix": ({1: 1.260, 2: 1.276, 3: 1.252}, 4.2708333),
         "Q2_K+imatrix": ({1: 1.400, 2: 1.420, 3: 1.380}, 3.1666667),
         "Q4_0": ({1: 1.240, 2: 1.250, 3: 1.236}, 4.5), "Q3_K_M": ({1: 1.280, 2: 1.300, 3: 1.270}, 4.2708333),
         "Q3_K_S+imatrix": ({1: 1.330, 2: 1.335, 3: 1.318}, 3.4375),
         "Q2_K_S+imatrix": ({1: 1.700, 2: 1.760, 3: 1.650}, 2.625),
         1: ({1: 1.215, 2: 1.222, 3: 1.205}, 4.5),  # STE phase q4_0
         2: ({1: 1.214, 2: 1.226}, 4.5),  # STE phase q4_k
         3: ({1: 1.300, 2: 1.290}, 3.4375),  # STE phase q3_k
         4: ({1: 1.600, 2: 1.650}, 2.625),  # STE phase q2_k
         5: ({1: 1.240, 2: 1.249}, 4.2604),  # learned mix at Q3_K_M's size
         6: ({1: 1.245, 2: 1.251}, 4.2708),  # error mix at Q3_K_M's size
         7: ({1: 1.285, 2: 1.280}, 3.4300),  # learned mix at Q3_K_S's size
         8: ({1: 1.310, 2: 1.300}, 3.4375),  # error mix at Q3_K_S's size
         9: ({1: 1.350, 2: 1.330}, 3.1650),  # learned mix at Q2_K's size
         10: ({1: 1.360, 2: 1.370}, 3.1666)}  # error mix at Q2_K's size
MS = 1500.0  # each trained run's logged time a step


def write_run(root, i, seed):
    """A finished run of arm i as the runner leaves it: train.py's config.json and metrics.jsonl (its last
    evaluation and log at max_iters), the runner's run.json and done.json, the glue's gguf.json."""
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
    attempts = [{"wall_s": 60.0, "commit": "abc1234"}]
    for name, obj in (("config.json", config), ("done.json", {"status": "finished", "wall_s": 60.0}),
                      ("run.json", {"args": [], "config_sha": "x", "attempts": attempts}), ("gguf.json", gguf)):
        with open(os.path.join(d, name), "w") as f:
            json.dump(obj, f)
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in lines)


@pytest.fixture
def reported(tmp_path):
    """The report of the hand-made runs (seeds 1-2 of every arm, seed 3 of the trunk and the q4_0 STE
    phase): (root, results.json, results.md, the paths written)."""
    root = str(tmp_path / "root")
    for i, a in enumerate(STUDY["arms"]):
        for seed in (1, 2, 3) if i in (0, 1) else (1, 2):
            write_run(root, i, seed)
    with contextlib.redirect_stdout(io.StringIO()):
        written = runner.write_results("gguf", STUDY, root)
    with open(os.path.join(root, "gguf", "results.json")) as f:
        results = json.load(f)
    with open(os.path.join(root, "gguf", "results.md")) as f:
        text = f.read()
    return root, results, text, written


def loss(key, seed):
    return FILES[key][0][seed]


def test_each_file_is_in_the_class_of_its_bits_per_weight():
    got = {b: gguf_report.size_class(b) for b in (8.5, 5.1015625, 4.5, 4.2708333, 3.4375, 3.1666667, 2.625)}
    assert got == {8.5: "8.5", 5.1015625: "~5.1", 4.5: "~4.5", 4.2708333: "~3.4-4.3", 3.4375: "~3.4-4.3",
                   3.1666667: "~2.6-3.2", 2.625: "~2.6-3.2"}


def test_the_rows_hold_each_files_llama_cpp_loss_and_its_increase_over_bf16(reported):
    _, results, _, _ = reported
    rows = {(r["arm"], r["spec"]): r for r in results["rows"]}
    assert len(rows) == 9 + 10
    r = rows["llama.cpp Q4_0+imatrix", "Q4_0+imatrix"]
    assert r["seeds"] == 3 and r["seeds_total"] == 3 and r["class"] == "~4.5" and r["imatrix"] and r["llama_cpp"]
    assert r["val_loss"]["mean"] == pytest.approx((1.230 + 1.244 + 1.226) / 3, rel=1e-12)
    increases = [100 * (loss("Q4_0+imatrix", s) / BF16[s] - 1) for s in (1, 2, 3)]
    assert r["increase_pct"]["mean"] == pytest.approx(sum(increases) / 3, rel=1e-12)
    q4_k = rows["STE phase", "q4_k"]
    assert q4_k["seeds"] == 2 and q4_k["seeds_total"] == 3 and not q4_k["llama_cpp"]
    assert q4_k["trained_steps"] == 960 and q4_k["train_min"]["mean"] == pytest.approx(MS * 960 / 60e3)
    assert rows["learned mix at Q3_K_M's size", "auto-gguf@4.2708"]["class"] == "~3.4-4.3"
    assert "| ~4.5 | STE phase | q4_k | 2 of 3 |" in reported[2]


def test_the_findings_name_the_lowest_file_of_each_class_and_each_others_paired_gap(reported):
    """Recomputed by hand from FILES: the lowest mean in the ~4.5 class, every other file's difference to it
    over their common seeds with t(0.975, n - 1) from tables (4.303 for 3 seeds, 12.706 for 2)."""
    _, results, text, _ = reported
    findings = {f["class"]: f for f in results["findings"]}
    assert list(findings) == ["8.5", "~5.1", "~4.5", "~3.4-4.3", "~2.6-3.2"]
    f = findings["~4.5"]
    # means: STE q4_0 1.214, STE q4_k 1.220 (2 seeds), Q4_0+imatrix 1.2333, Q4_0 1.242
    assert (f["best"]["arm"], f["best"]["spec"], f["best"]["seeds"]) == ("STE phase", "q4_0", 3)
    assert [(o["arm"], o["spec"]) for o in f["others"]] == [
        ("STE phase", "q4_k"), ("llama.cpp Q4_0+imatrix", "Q4_0+imatrix"), ("llama.cpp Q4_0", "Q4_0")]
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
    assert "**~4.5 bits per weight**: STE phase (q4_0) is lowest (llama.cpp val loss 1.2140" in text
    assert "3 of 3 seeds" in text


def test_the_share_of_llama_cpps_imatrix_loss_each_trained_file_removes(reported):
    """(L_ref - L_file) / (L_ref - L_bf16) per seed, L_ref llama.cpp's imatrix file of the class, L_bf16 the
    trunk's val loss of the seed; its mean and 95 % interval over the seeds."""
    _, results, text, _ = reported
    findings = {f["class"]: f for f in results["findings"]}
    shares = {s["spec"]: s for s in findings["~4.5"]["shares"]}
    assert shares["q4_0"]["reference"]["arm"] == "llama.cpp Q4_0+imatrix"
    per_seed = [(loss("Q4_0+imatrix", s) - loss(1, s)) / (loss("Q4_0+imatrix", s) - BF16[s]) for s in (1, 2, 3)]
    mean = sum(per_seed) / 3
    sd = math.sqrt(sum((v - mean) ** 2 for v in per_seed) / 2)
    got = shares["q4_0"]["removed"]
    assert got["n"] == 3 and got["mean"] == pytest.approx(mean, rel=1e-9)
    assert got["ci95"] == pytest.approx(4.303 * sd / math.sqrt(3), rel=1e-4)
    assert set(shares) == {"q4_0", "q4_k"}  # the trained files of the class, not llama.cpp's
    # each trained file against llama.cpp's imatrix file nearest its size: the pure types against Q3_K_S
    # and Q2_K_S (the same bytes), the mixes against Q3_K_M, Q3_K_S and Q2_K (whose sizes they are trained at)
    refs = {s["spec"]: (s["reference"]["arm"], s["removed"]["mean"]) for f in findings.values() for s in f["shares"]}
    for spec, i, ref in (("q3_k", 3, "Q3_K_S+imatrix"), ("auto-gguf@4.2708", 5, "Q3_K_M+imatrix"),
                         ("error-gguf@4.2708", 6, "Q3_K_M+imatrix"), ("auto-gguf@3.4375", 7, "Q3_K_S+imatrix"),
                         ("error-gguf@3.4375", 8, "Q3_K_S+imatrix"), ("q2_k", 4, "Q2_K_S+imatrix"),
                         ("auto-gguf@3.1666", 9, "Q2_K+imatrix"), ("error-gguf@3.1666", 10, "Q2_K+imatrix")):
        want = [(loss(ref, s) - loss(i, s)) / (loss(ref, s) - BF16[s]) for s in (1, 2)]
        assert refs[spec] == (f"llama.cpp {ref}", pytest.approx(sum(want) / 2, rel=1e-9)), spec
    assert set(refs) == {"q4_0", "q4_k", "q3_k", "q2_k", *(f"{m}@{b}" for m in ("auto-gguf", "error-gguf")
                                                             for b in ("4.2708", "3.4375", "3.1666"))}
    assert "Share of llama.cpp Q4_0+imatrix's loss over bf16 (4.5000 bits per weight) removed: " in text
    # the trained files of one reference in the order of their mean loss
    assert ("Share of llama.cpp Q3_K_S+imatrix's loss over bf16 (3.4375 bits per weight) removed: learned mix at "
            "Q3_K_S's size (auto-gguf@3.4375) at 3.4300 bits ") in text
    assert "; STE phase (q3_k) at 3.4375 bits " in text


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
    assert [label for *_, label in curves["llama-quantize with imatrix"]] == ["Q2_K_S", "Q2_K", "Q3_K_S", "Q3_K_M",
                                                                              "Q4_0", "Q4_K_M", "Q8_0"]
    assert got["llama-quantize without imatrix"] == sorted(point(k) for k in ("Q4_0", "Q3_K_M"))
    sizes = [(1, 2), (3, 7, 8), (4,), (5, 6), (9, 10)]  # q4_0, q4_k; q3_k and the mixes at Q3_K_S's size; q2_k;
    # the mixes at Q3_K_M's; at Q2_K's
    want = sorted(min((point(i) for i in size), key=lambda p: p[1]) for size in sizes)
    assert got["trained files, lowest at each size"] == want
    assert [label for *_, label in curves["trained files, lowest at each size"]] == [
        "q2_k", "auto-gguf@3.1666", "auto-gguf@3.4375", "auto-gguf@4.2708", "q4_0"]


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
    for i in (5, 9):  # the learned mixes at Q3_K_M's and Q2_K's size of seed 1, and no finished trunk
        write_run(root, i, 1)
    with contextlib.redirect_stdout(io.StringIO()):
        runner.write_results("gguf", STUDY, root)
    with open(os.path.join(root, "gguf", "results.md")) as f:
        text = f.read()
    assert ("- **~2.6-3.2 bits per weight**: learned mix at Q2_K's size (auto-gguf@3.1666) is lowest (llama.cpp val "
            f"loss {loss(9, 1):.4f}, no finished bf16 trunk, 3.1650 bits per weight, 1 of 3 seeds).") in text
    assert "| ~3.4-4.3 | learned mix at Q3_K_M's size | auto-gguf@4.2708 | 1 of 3 | 4.2604 |" in text
    assert "over bf16, " not in text.split("## The files")[0]
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
    assert len(runs) == 33
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
