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
        mp.setattr(study, "BEST_B_T", None)  # a gaussws phase at another b_t: the same code as the 800-step sweep's
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
                     "error mix 3.5 bits", "gaussws phase + error mix 3.5 bits", "gaussws from scratch"]
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
            assert row["exported"]["mean"] == row["exported_by_seed"]["1"] == exported[fmt]["val_loss"]
            assert math.isclose(row["increase_pct"]["mean"], 100 * (exported[fmt]["val_loss"] / trunk_val - 1))
            # its own steps' time: the median logged step time of the steps after its fork, times their count
            first = a["overrides"].get("pqt_start", 0) if a["trunk"] else 0
            ms = sorted(r["ms_per_iter"] for r in records(d) if "ms_per_iter" in r and r["iter"] > first)
            median = (ms[(len(ms) - 1) // 2] + ms[len(ms) // 2]) / 2
            assert row["trained_steps"] == STEPS - first
            assert math.isclose(row["train_min"]["mean"], median * (STEPS - first) / 60e3)
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
    # the control: the learned mix's phases, its blocks ranked by their own error at the switch
    control, learned_arm = (next(a for a in s["arms"] if a["kind"] == k) for k in
                            ("gaussws phase + error mix 3.5 bits", "learned mix 3.5 bits"))
    same = ("method", "pqt_start", "ste_start", "bits_per_weight")
    assert {k: control["overrides"][k] for k in same} == {k: learned_arm["overrides"][k] for k in same}
    assert control["overrides"]["target_format"] == "error-int" and learned_arm["overrides"]["target_format"] == "auto-int"
    table = open(os.path.join(root, "deploy", "results.md")).read()
    assert f"{rows['STE phase', 'int3']['exported']['mean']:.4f}" in table
    best = min((r for r in results["rows"] if r["format"] == "int3"), key=lambda r: r["exported"]["mean"])
    assert f"**{STEPS} steps" in table and f"int3**: {best['arm']} is lowest (exported val loss " \
        f"{best['exported']['mean']:.4f}" in table
    for f in ("increase.png", "pareto.png"):
        assert os.path.getsize(os.path.join(root, "deploy", "plots", f)) > 0


def test_the_findings_name_the_lowest_arm_and_each_others_paired_gap_and_whether_it_is_noise():
    """Hand-made rows: per length (longest first) and deployment format (the mixes at one budget are
    one), the lowest mean exported loss, then the others' differences to it over their common seeds."""
    def row(arm, fmt, steps, by_seed):
        v = list(by_seed.values())
        return {"arm": arm, "format": fmt, "steps": steps, "seeds": len(v), "tokens_per_param": steps / 200,
                "exported": {"mean": sum(v) / len(v) if v else None}, "increase_pct": {"mean": 1.0}, "exported_by_seed": by_seed}
    rows = [row("bf16 + PTQ", "int3", 800, {"1": 2.0}), row("STE phase", "int3", 800, {"1": 1.5}),
            row("bf16 + PTQ", "int3", 3200, {"1": 1.60, "2": 1.70, "3": 1.65}),
            row("STE phase", "int3", 3200, {"1": 1.20, "2": 1.22, "3": 1.21}),
            row("gaussws phase", "int3", 3200, {"1": 1.25, "2": 1.18}),  # a seed short, gaps of +0.05 and -0.04
            row("bf16 + PTQ", "error-int@3.5", 3200, {"1": 1.33}),
            row("learned mix 3.5 bits", "auto-int@3.5", 3200, {"1": 1.16}),
            row("error mix 3.5 bits", "error-int@3.5", 3200, {"2": 1.18}),
            row("STE phase", "int4", 3200, {})]  # nothing finished: no finding
    f = study.deploy_findings(rows)
    assert [(x["steps"], x["group"]) for x in f] == [
        (3200, "int3"), (3200, "int2/3/4 mix at 3.5 bits"), (800, "int3")]
    int3 = f[0]
    assert int3["best"]["arm"] == "STE phase" and [o["arm"] for o in int3["others"]] == ["gaussws phase", "bf16 + PTQ"]
    gauss, ptq = int3["others"]
    assert gauss["minus_best"]["n"] == 2 and math.isclose(gauss["minus_best"]["mean"], 0.005)
    sd = math.sqrt(2 * 0.045 ** 2)  # of the gaps 0.05 and -0.04
    assert math.isclose(gauss["minus_best"]["ci95"], 12.706 * sd / math.sqrt(2)) and gauss["verdict"] == "inside the noise"
    assert math.isclose(ptq["minus_best"]["mean"], 0.44) and ptq["verdict"] == "outside the noise"
    mix = f[1]
    assert mix["best"]["arm"] == "learned mix 3.5 bits"
    assert [(o["arm"], o["minus_best"]["n"], o["verdict"]) for o in mix["others"]] == [
        ("error mix 3.5 bits", 0, "no common seed"), ("bf16 + PTQ", 1, "one seed")]
    text = "\n".join(study.findings_markdown(f))
    assert "bf16 + PTQ (error-int@3.5) +0.1700 (n=1, one seed)" in text and "error mix 3.5 bits (no common seed)" in text
    assert "**800 steps (4.0 tokens/param), int3**: STE phase is lowest (exported val loss 1.5000" in text


def test_the_interval_is_students_t():
    """The 95 % half-width of three values, t(0.975, 2) = 4.303 times the standard error."""
    s = study.interval([1.0, 2.0, 4.0])
    sd = math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2)
    assert math.isclose(s["ci95"], 4.303 * sd / math.sqrt(3))


def test_the_longest_length_runs_the_gaussws_int3_phase_also_at_the_sweeps_best_b_t():
    arms = study.deploy_arms()
    longest = [a for a in arms if a["steps"] == max(study.DEPLOY_STEPS) and a["export"] == ["int3"]
               and a["kind"].startswith("gaussws phase")]
    assert [a["kind"] for a in longest] == ["gaussws phase", f"gaussws phase b_t {study.BEST_B_T:g}"]
    assert longest[0]["overrides"]["target_format"] == "int3" and "b_init" not in longest[0]["overrides"]
    swept = next(a for a in arms if a["steps"] == 800 and a["kind"] == longest[1]["kind"])
    assert {k: v for k, v in longest[1]["overrides"].items() if k not in ("max_iters", "lr_decay_iters", "eval_interval",
                                                                       "pqt_start")} == \
        {k: v for k, v in swept["overrides"].items() if k not in ("max_iters", "lr_decay_iters", "eval_interval", "pqt_start")}


def test_the_dry_run_lists_every_arm_with_its_command(capsys):
    assert study.main(["deploy", "--dry_run"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "python train.py" in line]
    runs = study.runs_of(study.STUDIES["deploy"])
    assert len(lines) == len(runs) == 89
    for line, (name, a, seed) in zip(lines, runs):
        assert f"--out_dir=out/study/runs/{name}" in line and f"--seed={seed}" in line
        assert all(f"--{k}=" in line for k in a["overrides"])
