"""study.py's deployment study on tiny models, end to end: the bf16 trunk keeps its checkpoints at the
fork steps, every phase arm forks there and is the trunk until then, and the table holds the
figures of the runs' own logs and export records, the increase and the paired differences computed
here by hand."""
import contextlib
import io
import json
import math
import os

import numpy as np
import pytest

import study

STEPS = 20


@pytest.fixture(scope="module")
def deploy(tmp_path_factory):
    """The deploy study at one length of 20 steps, int3, one seed, on a tiny model: (root, study, printed)."""
    d = tmp_path_factory.mktemp("deploy_data")
    rng = np.random.default_rng(0)
    words = [b"def ", b"return ", b"self", b"(x)", b": ", b"\n", b"    ", b"import os", b" = ", b"1"]
    ids = np.frombuffer(b"".join(words[i] for i in rng.integers(0, len(words), 5000)), dtype=np.uint8).astype(np.uint16)
    ids[: len(ids) * 9 // 10].tofile(d / "train.bin")
    ids[len(ids) * 9 // 10:].tofile(d / "val.bin")
    (d / "meta.json").write_text(json.dumps({"vocab_size": 256, "tokenizer": "bytes", "dtype": "uint16"}))
    config = d / "tiny_deploy.py"
    tiny = dict(dataset=str(d), n_layer=1, n_embd=64, n_head=2, block_size=16, batch_size=2,
                gradient_accumulation_steps=1, warmup_iters=2, eval_iters=2, log_interval=1, learning_rate=3e-3,
                device="cpu", dtype="float32")
    config.write_text("".join(f"{k} = {v!r}\n" for k, v in tiny.items()))
    root = str(tmp_path_factory.mktemp("deploy"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(study, "DEPLOY", str(config))
        mp.setattr(study, "DEPLOY_STEPS", (STEPS,))
        mp.setattr(study, "DEPLOY_SEEDS", {STEPS: (1,)})
        mp.setattr(study, "DEPLOY_FORMATS", {STEPS: ("int3",)})
        s = dict(study.STUDIES["deploy"], arms=study.deploy_arms())
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            failed = study.run_study("deploy", s, root, echo=False)
    assert failed == 0, out.getvalue()
    return root, s, out.getvalue()


def run_dir(root, a, seed=1):
    return os.path.join(root, "runs", study.run_name(a, seed))


def records(path):
    with open(os.path.join(path, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_every_arm_finishes_and_the_trunk_keeps_its_fork_steps(deploy):
    root, s, _ = deploy
    kinds = [a["kind"] for a in s["arms"]]
    assert kinds == ["bf16 + PTQ", "STE phase", "gaussws phase", "diffq phase", "learned mix 3.5 bits",
                     "error mix 3.5 bits", "gaussws from scratch"]
    for a in s["arms"]:
        assert json.load(open(os.path.join(run_dir(root, a), "done.json")))["status"] == "finished"
    trunk = s["arms"][0]
    assert trunk["keep"] == [round(0.7 * STEPS), round(0.85 * STEPS)]
    for step in trunk["keep"]:
        assert os.path.exists(os.path.join(run_dir(root, trunk), f"ckpt_{step}.pt"))


def test_a_forked_arm_is_the_trunk_until_its_switch(deploy):
    """Its records up to the fork step are the trunk's (the same losses), its own ones follow."""
    root, s, _ = deploy
    trunk = records(run_dir(root, s["arms"][0]))
    for a in s["arms"][1:-1]:
        start = a["overrides"]["pqt_start"]
        mine = records(run_dir(root, a))
        assert [r for r in mine if r["iter"] <= start] == [r for r in trunk if r["iter"] <= start], a["kind"]
        assert max(r["iter"] for r in mine) == STEPS
        assert [r["loss"] for r in mine if r["iter"] > start and "loss" in r] != \
               [r["loss"] for r in trunk if r["iter"] > start and "loss" in r], a["kind"]  # the phase trains otherwise


def test_the_table_holds_the_runs_own_figures_and_the_paired_differences(deploy):
    root, s, _ = deploy
    results = json.load(open(os.path.join(root, "deploy", "results.json")))
    assert results["runs_finished"] == results["runs_total"] == len(s["arms"])
    trunk_dir = run_dir(root, s["arms"][0])
    trunk_val = [r for r in records(trunk_dir) if "val/loss" in r][-1]["val/loss"]
    trunk_export = json.load(open(os.path.join(trunk_dir, "export.json")))
    rows = {(r["arm"], r["format"]): r for r in results["rows"]}
    assert len(rows) == len(results["rows"]) == 2 + len(s["arms"]) - 1  # the trunk at int3 and at the budget
    for a in s["arms"]:
        d = run_dir(root, a)
        last = [r for r in records(d) if "val/loss" in r][-1]
        exported = json.load(open(os.path.join(d, "export.json")))
        for fmt in a["export"]:
            row = rows[a["kind"], fmt]
            assert row["val_loss"]["mean"] == last["val/loss"] and last["iter"] == STEPS
            assert row["exported"]["mean"] == exported[fmt]["val_loss"]
            assert math.isclose(row["increase_pct"]["mean"], 100 * (exported[fmt]["val_loss"] / trunk_val - 1))
            if a is s["arms"][0]:
                continue
            ptq = fmt if fmt in trunk_export else "error-int@3.5"
            assert math.isclose(row["vs_ptq"]["mean"], exported[fmt]["val_loss"] - trunk_export[ptq]["val_loss"])
            assert row["vs_ptq"]["n"] == 1 and row["vs_ptq"]["ci95"] is None  # one seed: no interval
    # the learned allocation against the same budget ranked by each block's own error, both STE-finished
    mixes = {a["kind"]: json.load(open(os.path.join(run_dir(root, a), "export.json")))[a["export"][0]]
             for a in s["arms"] if " mix " in a["kind"]}
    learned = rows["learned mix 3.5 bits", "auto-int@3.5"]["vs_error_mix"]
    assert math.isclose(learned["mean"], mixes["learned mix 3.5 bits"]["val_loss"] - mixes["error mix 3.5 bits"]["val_loss"])
    assert "vs_error_mix" not in rows["error mix 3.5 bits", "error-int@3.5"] and "vs_error_mix" not in rows["STE phase", "int3"]
    table = open(os.path.join(root, "deploy", "results.md")).read()
    assert f"{rows['STE phase', 'int3']['exported']['mean']:.4f}" in table
    for f in ("increase.png", "pareto.png"):
        assert os.path.getsize(os.path.join(root, "deploy", "plots", f)) > 0


def test_the_interval_is_students_t():
    """The 95 % half-width of three values, t(0.975, 2) = 4.303 times the standard error."""
    s = study.interval([1.0, 2.0, 4.0])
    sd = math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2)
    assert math.isclose(s["ci95"], 4.303 * sd / math.sqrt(3))


def test_the_dry_run_lists_every_arm_with_its_command(capsys):
    assert study.main(["deploy", "--dry_run"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "python train.py" in line]
    runs = study.runs_of(study.STUDIES["deploy"])
    assert len(lines) == len(runs) == 83
    for line, (name, a, seed) in zip(lines, runs):
        assert f"--out_dir=out/study/runs/{name}" in line and f"--seed={seed}" in line
        assert all(f"--{k}=" in line for k in a["overrides"])
