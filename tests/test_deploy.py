"""The deployment study (python -m studies deploy) on tiny models, end to end: the bf16 trunk keeps its
checkpoints at the fork steps, every phase arm forks there and computes what the phase run trained
whole computes, and the table holds the figures of the runs' own logs and export records, the
increase and the paired differences computed here by hand; a damaged run is refused, not averaged."""
import contextlib
import io
import json
import math
import os
import re
import shutil
import subprocess

import numpy as np
import pytest

import studies.__main__ as entry
from studies import definitions as defs
from studies import deploy_report, runner, stats

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
                min_lr=3e-4, device="cpu", dtype="float32")
    config.write_text("".join(f"{k} = {v!r}\n" for k, v in tiny.items()))
    root = str(tmp_path_factory.mktemp("deploy"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(defs, "DEPLOY", str(config))
        mp.setattr(defs, "DEPLOY_STEPS", (STEPS,))
        mp.setattr(defs, "DEPLOY_SEEDS", {STEPS: (1,)})
        mp.setattr(defs, "DEPLOY_FORMATS", {STEPS: ("int3",)})
        mp.setattr(defs, "BEST_B_T", None)  # a gaussws phase at another b_t: the same code as the 800-step sweep's
        s = dict(defs.STUDIES["deploy"], arms=defs.deploy_arms())
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            failed = runner.run_study("deploy", s, root, echo=False)
    assert failed == 0, out.getvalue()
    return root, s, out.getvalue()


def run_dir(root, a, seed=1):
    return os.path.join(root, "runs", defs.run_name(a, seed))


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


# What a run computes, in its records (not its timing); b_t only from the switch on: before it a
# phase run trained whole logs the level its PQT layers wait at, the bf16 trunk none
COMPUTED = ("loss", "lr", "train/loss", "val/loss")
B_T = ("b_t/mean", "b_t/min", "b_t/max")


def computed(recs, kind, start):
    """{iter: what the run computed} of its log ("loss") or eval ("val/loss") records."""
    return {r["iter"]: {k: r[k] for k in COMPUTED + (B_T if r["iter"] > start else ()) if k in r}
            for r in recs if kind in r}


def test_a_forked_arm_is_the_trunk_until_its_switch(deploy, tmp_path):
    """Its records up to the fork step are the trunk's (a fork starts with a copy of them), its own ones
    follow; and all of them are those of the same arm trained whole, from step 0 in one train.py (the
    bf16 steps until its switch included), evaluation for evaluation and step for step."""
    root, s, _ = deploy
    trunk = records(run_dir(root, s["arms"][0]))
    forked = [a for a in s["arms"] if a.get("trunk")]
    assert len(forked) == 6
    for a in forked:
        start = a["overrides"]["pqt_start"]
        mine = records(run_dir(root, a))
        assert [r for r in mine if r["iter"] <= start] == [r for r in trunk if r["iter"] <= start], a["kind"]
        assert max(r["iter"] for r in mine) == STEPS
        assert [r["loss"] for r in mine if r["iter"] > start and "loss" in r] != \
               [r["loss"] for r in trunk if r["iter"] > start and "loss" in r], a["kind"]  # the phase trains otherwise
        whole_dir = str(tmp_path / defs.run_name(a, 1))
        subprocess.run([*runner.launcher(1), *defs.train_args(a, 1, whole_dir), "--init_from=scratch"],
                       cwd=defs.REPO, check=True, capture_output=True)
        whole = records(whole_dir)
        assert computed(mine, "loss", start) == computed(whole, "loss", start), a["kind"]
        # the fork's evaluations also hold the trunk's at its kept steps, which the whole run does not make
        evals, whole_evals = computed(mine, "val/loss", start), computed(whole, "val/loss", start)
        assert {it: evals.get(it) for it in whole_evals} == whole_evals, a["kind"]


def records_only(root, trunk, dest):
    """The trunk's run directory as committed records keep it (studies/results): every file but its
    checkpoints and locks, under dest/runs."""
    to = os.path.join(dest, "runs", defs.run_name(trunk, 1))
    shutil.copytree(run_dir(root, trunk), to, ignore=shutil.ignore_patterns("*.pt", "*lock"))
    return to


def run_arm(s, a, root):
    """The runner on arm a alone (its trunk's records under root); (failed runs, what it printed)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        failed = runner.run_study("deploy", s, root, echo=False, only=f"^{re.escape(defs.run_name(a, 1))}$")
    return failed, out.getvalue()


def test_an_arm_whose_trunk_kept_only_its_records_forks_from_its_remade_checkpoint(deploy, tmp_path):
    """A fresh clone holds a finished trunk's records but none of its checkpoints: the runner trains the
    trunk again to the fork step beside its records, and, every loss equal to the recorded one, the arm
    forks from the remade checkpoint and logs, step for step, the losses of the same arm forked from the
    checkpoint the trunk kept when it first ran."""
    root, s, _ = deploy
    trunk = s["arms"][0]
    a = next(a for a in s["arms"] if a.get("kind") == "STE phase")
    step = a["overrides"]["pqt_start"]
    trunk_dir = records_only(root, trunk, tmp_path)
    failed, printed = run_arm(s, a, str(tmp_path))
    assert failed == 0, printed
    assert f"ckpt_{step}.pt remade, every loss to step {step} the trunk's own" in printed
    assert os.path.isfile(os.path.join(trunk_dir, f"ckpt_{step}.pt"))
    assert not os.path.exists(os.path.join(trunk_dir, "ckpt.pt"))  # the trunk's own records are left as they were
    for kind in ("loss", "val/loss"):
        assert computed(records(run_dir(str(tmp_path), a)), kind, step) == computed(records(run_dir(root, a)), kind,
                                                                                     step), kind


def test_a_dry_run_counts_the_steps_a_trunk_that_kept_only_its_records_trains_again(deploy, tmp_path, capsys):
    """The STE phase trains its last 3 steps, and its trunk trains again to its fork step, 17: 20 steps."""
    root, s, _ = deploy
    a = next(a for a in s["arms"] if a.get("kind") == "STE phase")
    records_only(root, s["arms"][0], tmp_path)
    runner.dry_run("deploy", s, str(tmp_path), 1, f"^{re.escape(defs.run_name(a, 1))}$")
    start = a["overrides"]["pqt_start"]
    assert f"1 run(s), {(STEPS - start) + start} steps" in capsys.readouterr().out  # 3 + 17


def test_a_trunk_is_trained_again_on_the_number_of_threads_its_record_holds(deploy, tmp_path, monkeypatch):
    """Its sums depend on it, whatever OMP_NUM_THREADS the runner was started with (torch takes no more
    threads than the CPU has cores: one in the record, two for the runner)."""
    root, s, _ = deploy
    a = next(a for a in s["arms"] if a.get("kind") == "STE phase")
    trunk_dir = records_only(root, s["arms"][0], tmp_path)
    config = json.load(open(os.path.join(trunk_dir, "config.json")))
    config["versions"]["threads"] = 1
    with open(os.path.join(trunk_dir, "config.json"), "w") as f:
        json.dump(config, f)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    _, printed = run_arm(s, a, str(tmp_path))
    assert "on its 1 thread(s)" in printed
    remade = json.load(open(os.path.join(trunk_dir, runner.REMADE, "config.json")))
    assert remade["versions"]["threads"] == 1


@pytest.mark.parametrize("at, stopped", [(1, 1), (2, 17)])
def test_a_remade_trunk_whose_losses_differ_from_its_records_forks_nothing(deploy, tmp_path, at, stopped):
    """Another machine that rounds otherwise, as a record changed in its last bit stands for here: the
    runner says where the remade trunk first differs, keeps no checkpoint for the arm, and does not run it.
    A difference at the trunk's first logged step stops the remade run there, not at the fork step."""
    root, s, _ = deploy
    trunk = s["arms"][0]
    a = next(a for a in s["arms"] if a.get("kind") == "STE phase")
    trunk_dir = records_only(root, trunk, tmp_path)
    path = os.path.join(trunk_dir, "metrics.jsonl")
    rows = records(trunk_dir)
    i = next(k for k, r in enumerate(rows) if r["iter"] == at and "loss" in r)
    recorded = rows[i]["loss"]
    rows[i]["loss"] = float(np.nextafter(np.float32(recorded), np.float32(np.inf)))  # one float32 ulp above
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    failed, printed = run_arm(s, a, str(tmp_path))
    assert failed == 1
    line = next(line for line in printed.splitlines() if "not remade" in line)
    assert f"at step {at} its loss is {recorded!r} where the trunk recorded {rows[i]['loss']!r}" in line
    assert not any(name.endswith(".pt") for name in os.listdir(trunk_dir))
    assert max(r["iter"] for r in records(os.path.join(trunk_dir, runner.REMADE))) == stopped
    arm_dir = run_dir(str(tmp_path), a)  # the arm did not start: its directory holds the runner's lock alone
    assert not [name for name in os.listdir(arm_dir) if not name.endswith("lock")]


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
    assert math.isclose(learned["mean"],
                        mixes["learned mix 3.5 bits"]["val_loss"] - mixes["error mix 3.5 bits"]["val_loss"])
    assert "vs_error_mix" not in rows["error mix 3.5 bits", "error-int@3.5"]
    assert "vs_error_mix" not in rows["STE phase", "int3"]
    # the control: the learned mix's phases, its blocks ranked by their own error at the switch
    control, learned_arm = (next(a for a in s["arms"] if a["kind"] == k) for k in
                            ("gaussws phase + error mix 3.5 bits", "learned mix 3.5 bits"))
    same = ("method", "pqt_start", "ste_start", "bits_per_weight")
    assert {k: control["overrides"][k] for k in same} == {k: learned_arm["overrides"][k] for k in same}
    assert control["overrides"]["target_format"] == "error-int"
    assert learned_arm["overrides"]["target_format"] == "auto-int"
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
                "exported": {"mean": sum(v) / len(v) if v else None}, "increase_pct": {"mean": 1.0},
                "exported_by_seed": by_seed}
    rows = [row("bf16 + PTQ", "int3", 800, {"1": 2.0}), row("STE phase", "int3", 800, {"1": 1.5}),
            row("bf16 + PTQ", "int3", 3200, {"1": 1.60, "2": 1.70, "3": 1.65}),
            row("STE phase", "int3", 3200, {"1": 1.20, "2": 1.22, "3": 1.21}),
            row("gaussws phase", "int3", 3200, {"1": 1.25, "2": 1.18}),  # a seed short, gaps of +0.05 and -0.04
            row("bf16 + PTQ", "error-int@3.5", 3200, {"1": 1.33}),
            row("learned mix 3.5 bits", "auto-int@3.5", 3200, {"1": 1.16}),
            row("error mix 3.5 bits", "error-int@3.5", 3200, {"2": 1.18}),
            row("STE phase", "int4", 3200, {})]  # nothing finished: no finding
    f = deploy_report.deploy_findings(rows)
    assert [(x["steps"], x["group"]) for x in f] == [
        (3200, "int3"), (3200, "int2/3/4 mix at 3.5 bits"), (800, "int3")]
    int3 = f[0]
    assert int3["best"]["arm"] == "STE phase" and [o["arm"] for o in int3["others"]] == ["gaussws phase", "bf16 + PTQ"]
    gauss, ptq = int3["others"]
    assert gauss["minus_best"]["n"] == 2 and math.isclose(gauss["minus_best"]["mean"], 0.005)
    sd = math.sqrt(2 * 0.045 ** 2)  # of the gaps 0.05 and -0.04
    # t(0.975, 1) = 12.706 as tables print it (to 1e-4)
    assert math.isclose(gauss["minus_best"]["ci95"], 12.706 * sd / math.sqrt(2), rel_tol=1e-4)
    assert gauss["verdict"] == "inside the noise"
    assert math.isclose(ptq["minus_best"]["mean"], 0.44) and ptq["verdict"] == "outside the noise"
    mix = f[1]
    assert mix["best"]["arm"] == "learned mix 3.5 bits"
    assert [(o["arm"], o["minus_best"]["n"], o["verdict"]) for o in mix["others"]] == [
        ("error mix 3.5 bits", 0, "no common seed"), ("bf16 + PTQ", 1, "one seed")]
    text = "\n".join(deploy_report.findings_markdown(f))
    assert "bf16 + PTQ (error-int@3.5) +0.1700 (n=1, one seed)" in text
    assert "error mix 3.5 bits (no common seed)" in text
    assert "**800 steps (4.0 tokens/param), int3**: STE phase is lowest (exported val loss 1.5000" in text


def test_the_interval_is_students_t():
    """The 95 % half-width of three values, t(0.975, 2) = 4.303 (as tables print it) times the standard error."""
    s = stats.interval([1.0, 2.0, 4.0])
    sd = math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2)
    assert math.isclose(s["ci95"], 4.303 * sd / math.sqrt(3), rel_tol=1e-4)


@pytest.mark.parametrize("df,table", [(1, 12.706), (2, 4.303), (3, 3.182), (5, 2.571), (6, 2.447), (10, 2.228),
                                      (30, 2.042), (120, 1.980)])
def test_the_t_quantile_is_the_tables_for_any_degrees_of_freedom(df, table):
    """t(0.975, df) as printed in tables of Student's t (3 decimals); exact where it has a closed form:
    tan(pi (p - 1/2)) for 1 degree of freedom, (2p - 1) / sqrt(2 p (1 - p)) for 2."""
    t = stats.t_quantile(0.975, df)
    assert abs(t - table) <= 5e-4
    exact = {1: math.tan(math.pi * 0.475), 2: 0.95 / math.sqrt(2 * 0.975 * 0.025)}
    if df in exact:
        assert math.isclose(t, exact[df], rel_tol=1e-12)
    assert math.isclose(stats.t_cdf(t, df), 0.975, rel_tol=1e-12)


def test_the_interval_of_seven_values_uses_six_degrees_of_freedom():
    values = [1.0, 2.0, 4.0, 3.0, 2.5, 1.5, 3.5]
    s = stats.interval(values)
    sd = math.sqrt(sum((v - 2.5) ** 2 for v in values) / 6)
    assert s["n"] == 7 and math.isclose(s["ci95"], 2.447 * sd / math.sqrt(7), rel_tol=1e-4)


def test_the_longest_length_runs_the_gaussws_int3_phase_also_at_the_sweeps_best_b_t():
    arms = defs.deploy_arms()
    longest = [a for a in arms if a["steps"] == max(defs.DEPLOY_STEPS) and a["export"] == ["int3"]
               and a["kind"].startswith("gaussws phase")]
    assert [a["kind"] for a in longest] == ["gaussws phase", f"gaussws phase b_t {defs.BEST_B_T:g}"]
    assert longest[0]["overrides"]["target_format"] == "int3" and "b_init" not in longest[0]["overrides"]
    swept = next(a for a in arms if a["steps"] == 800 and a["kind"] == longest[1]["kind"])
    length = ("max_iters", "lr_decay_iters", "eval_interval", "pqt_start")
    assert {k: v for k, v in longest[1]["overrides"].items() if k not in length} == \
        {k: v for k, v in swept["overrides"].items() if k not in length}


def test_the_dry_run_lists_every_arm_with_its_command(capsys):
    assert entry.main(["deploy", "--dry_run"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "python train.py" in line]
    runs = defs.runs_of(defs.STUDIES["deploy"])
    assert len(lines) == len(runs) == 89
    for line, (name, a, seed) in zip(lines, runs):
        assert f"--out_dir=out/study/runs/{name}" in line and f"--seed={seed}" in line
        assert all(f"--{k}=" in line for k in a["overrides"])


# --- a damaged run is refused, never averaged in -------------------------------------------------

def rewrite(run_dir_, change):
    """metrics.jsonl with change(records) written back as train.py writes it (NaN as JSON's NaN)."""
    path = os.path.join(run_dir_, "metrics.jsonl")
    recs = change(records(run_dir_))
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)


def last_eval(recs, key, value):
    r = [r for r in recs if "val/loss" in r][-1]
    r[key] = value
    return recs


def cut_last_line(run_dir_, chars=25):
    path = os.path.join(run_dir_, "metrics.jsonl")
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:-chars])


def mark_diverged(run_dir_):
    path = os.path.join(run_dir_, "done.json")
    done = json.load(open(path))
    with open(path, "w") as f:
        json.dump({**done, "status": "diverged", "step": 10, "what": "loss"}, f)


def divergence_beside(run_dir_):
    with open(os.path.join(run_dir_, "diverged.json"), "w") as f:
        json.dump({"step": 10, "what": "loss", "value": "nan"}, f)


# How a finished run's records get damaged, and what the refusal says
DAMAGES = {
    "last line cut short": (cut_last_line, "is cut short"),
    "final-step records lost": (lambda d: rewrite(d, lambda rs: [r for r in rs if r["iter"] < STEPS]),
                                f"not of max_iters={STEPS}"),
    "NaN val loss": (lambda d: rewrite(d, lambda rs: last_eval(rs, "val/loss", float("nan"))), "is nan"),
    "absurd val loss": (lambda d: rewrite(d, lambda rs: last_eval(rs, "val/loss", 1e6)), "above train.py's limit"),
    "negative train loss": (lambda d: rewrite(d, lambda rs: last_eval(rs, "train/loss", -1.0)), "is -1.0"),
    "a logged loss that is inf": (lambda d: rewrite(d, lambda rs: [{**r, "loss": float("inf")} if r["iter"] == 5
                                                                   and "loss" in r else r for r in rs]),
                                  "its loss at step 5 is inf"),
    "marked diverged by hand": (mark_diverged, f"its records hold an evaluation of step {STEPS}, past its "
                                               f"divergence at step 10"),
    "finished beside a divergence record": (divergence_beside, "train.py recorded a divergence at step 10"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_the_report_refuses_a_damaged_run_in_one_line_and_writes_nothing(deploy, tmp_path, damage):
    """A finished run (the STE phase) whose records no longer bear out its done.json: the report is one
    line naming the run and what is wrong, and no file of the study is written."""
    import shutil
    from studies import records as study_records
    root, s, _ = deploy
    copy = tmp_path / "root"
    shutil.copytree(root, copy)
    d = run_dir(str(copy), s["arms"][1])
    make, said = DAMAGES[damage]
    make(d)
    before = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file() and not p.name.endswith("lock")}
    with pytest.raises(study_records.StudyError) as e, contextlib.redirect_stdout(io.StringIO()):
        runner.write_results("deploy", s, str(copy))
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{d}: done.json says") and said in message, message
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file() and not p.name.endswith("lock")} == before


@pytest.mark.parametrize("damage", ["last line cut short", "NaN val loss", "final-step records lost"])
def test_the_runner_does_not_mark_finished_a_run_whose_records_are_damaged(deploy, tmp_path, damage):
    """train.py exited 0, but the run's records are not a finished run's: no done.json, the run is
    tried again (finish returns None) and the runner says why."""
    import shutil
    root, s, _ = deploy
    a = s["arms"][1]
    d = str(tmp_path / "runs" / defs.run_name(a, 1))
    shutil.copytree(run_dir(root, a), d)
    os.remove(os.path.join(d, "done.json"))
    DAMAGES[damage][0](d)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        done = runner.finish(defs.run_name(a, 1), a, d, json.load(open(os.path.join(d, "run.json"))), 0, [])
    assert done is None and not os.path.exists(os.path.join(d, "done.json"))
    assert "train.py exited 0, but" in out.getvalue() and DAMAGES[damage][1] in out.getvalue()


def test_the_committed_deploy_report_refuses_a_run_cut_short(tmp_path, capsys, monkeypatch):
    """python -m studies deploy --report over a copy of studies/results whose 3200-step gaussws int3
    phase (seed 2) lost the last 25 characters of its metrics.jsonl (its evaluation at step 3200): one
    line, exit status 1, the results as they were; its step-2400 loss is not taken as its last."""
    import shutil
    import util
    results = os.path.join(defs.REPO, "studies", "results")
    copy = tmp_path / "results"
    shutil.copytree(os.path.join(results, "runs"), copy / "runs")
    shutil.copytree(os.path.join(results, "deploy"), copy / "deploy")
    name = "gpt2_deploy-gaussws_all-eval800-decay3200-n3200-from2720-int3-s2"
    cut_last_line(copy / "runs" / name)
    before = {p: p.read_bytes() for p in (copy / "deploy").rglob("*") if p.is_file()}
    monkeypatch.chdir(defs.REPO)  # main() works in the repository; the test's directory is restored after
    monkeypatch.setattr(entry.signal, "signal", lambda *a: None)  # keep pytest's own handlers
    assert util.cli(entry.main, ["deploy", "--report", f"--root={copy}"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: {copy / 'runs' / name}: done.json says finished, but ") and "cut short" in line
    assert {p: p.read_bytes() for p in (copy / "deploy").rglob("*") if p.is_file()} == before
