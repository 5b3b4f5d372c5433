"""python -m studies on a 2-run study of tiny models: runs finish, are skipped when done, a stopped run is resumed
to the losses of an uninterrupted one, and results.json holds the figures of the runs' own logs.
Also: every run of every named study is a command train.py accepts, with one shape and budget."""
import contextlib
import io
import json
import math
import os
import subprocess
import sys

import pytest

import studies.__main__ as entry
import train
import util
from conftest import ROOT
from studies import definitions as defs
from studies import report, runner
from studies.records import StudyError, write_json

TINY = dict(n_layer=1, n_embd=32, n_head=2, block_size=16, batch_size=2, gradient_accumulation_steps=1,
            max_iters=6, lr_decay_iters=6, warmup_iters=2, eval_interval=3, eval_iters=2, log_interval=1,
            learning_rate=3e-3, device="cpu")


@pytest.fixture(scope="module")
def tiny_config(tiny_corpus, tmp_path_factory):
    """A config file for a tiny model on the small byte corpus."""
    path = tmp_path_factory.mktemp("study_config") / "tiny.py"
    path.write_text(f"dataset = {tiny_corpus!r}\n" + "".join(f"{k} = {v!r}\n" for k, v in TINY.items()))
    return str(path)


def two_runs(config):
    return dict(about="two tiny runs", arms=[defs.arm(config, method="bf16"), defs.arm(config, method="gaussws[all]")],
                seeds=(1,), export=("auto", "mxfp6_e3m2"), export_bf16=False)


def records(run_dir):
    """metrics.jsonl read by hand: {iter: record} per kind, a later record of an iter replacing an earlier."""
    evals, logs = {}, {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            (evals if "val/loss" in r else logs)[r["iter"]] = r
    return evals, logs


@pytest.fixture(scope="module")
def finished(tiny_config, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("study"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        failed = runner.run_study("tiny", two_runs(tiny_config), root, echo=False)
    return root, failed, out.getvalue()


def test_both_runs_finish_and_results_are_written(finished):
    root, failed, printed = finished
    assert failed == 0, printed
    assert "run 1 of 2" in printed and "run 2 of 2" in printed
    for name in ("tiny-bf16-s1", "tiny-gaussws_all-s1"):
        assert json.load(open(os.path.join(root, "runs", name, "done.json")))["status"] == "finished"
        evals, _ = records(os.path.join(root, "runs", name))
        assert max(evals) == TINY["max_iters"]
    for f in ("results.json", "results.md", "plots/loss.png", "plots/bitwidth.png"):
        assert os.path.getsize(os.path.join(root, "tiny", f)) > 0


def test_results_json_holds_the_figures_of_the_runs_own_logs(finished):
    root, _, _ = finished
    results = json.load(open(os.path.join(root, "tiny", "results.json")))
    assert results["runs_finished"] == results["runs_total"] == 2
    for arm, name in zip(results["arms"], ("tiny-bf16-s1", "tiny-gaussws_all-s1")):
        evals, logs = records(os.path.join(root, "runs", name))
        last = evals[max(evals)]
        assert arm["val_loss"]["values"] == [last["val/loss"]] and arm["val_loss"]["std"] is None
        assert arm["train_loss"]["values"] == [last["train/loss"]]
        assert arm["tokens"] == [TINY["max_iters"] * TINY["batch_size"] * TINY["block_size"]]
        run = results["runs"][name]
        assert run["train_s"] == pytest.approx(sum(r["ms_per_iter"] / 1000 for r in logs.values()))  # log_interval 1
        assert run["wall_s"] > run["train_s"]
        if arm["overrides"]["method"] == "bf16":
            assert run["b_t"] is None and "export" not in run  # export where the run has PQT
        else:
            final = logs[max(logs)]
            assert run["b_t"] == {k: final[f"b_t/{k}"] for k in ("mean", "min", "max")}
            for fmt in ("auto", "mxfp6_e3m2"):
                if os.path.exists(os.path.join(ROOT, "export.py")):
                    assert isinstance(run["export"][fmt], dict), run["export"][fmt]
                    assert math.isfinite(run["export"][fmt]["val_loss"])
                    assert arm["export"][fmt]["val_loss"]["values"] == [run["export"][fmt]["val_loss"]]
                else:
                    assert run["export"][fmt] == "export unavailable"
    md = open(os.path.join(root, "tiny", "results.md")).read()
    assert f"{results['arms'][0]['val_loss']['mean']:.4f}" in md and "python -m studies tiny" in md


def cpu_model():
    with open("/proc/cpuinfo") as f:
        return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"),
                    reason="the CPU's name is read back from /proc/cpuinfo (Linux)")
def test_the_machine_is_the_one_each_run_recorded(finished):
    """train.py writes the CPU it ran on into config.json; the results name the runs' machine, not the
    report writer's."""
    root, _, _ = finished
    here = f"{cpu_model()}, {os.cpu_count()} logical cores"
    for name in ("tiny-bf16-s1", "tiny-gaussws_all-s1"):
        assert json.load(open(os.path.join(root, "runs", name, "config.json")))["versions"]["machine"] == here
    if util.cpu_id():  # and the CPU's family, model and stepping, which tell two CPUs of one name apart
        here += f" ({util.cpu_id()})"
    assert json.load(open(os.path.join(root, "tiny", "results.json")))["machine"] == here
    assert f"Machine: {here};" in open(os.path.join(root, "tiny", "results.md")).read()


def test_runs_on_other_machines_or_none_recorded_are_each_named_with_their_count():
    runs = [{"machine": "A"}, {"machine": "B"}, {"machine": "A"}]
    assert report.machines(runs) == "A (2 runs); B (1 run)"
    assert report.machines(runs[:1] * 2) == "A"
    said = report.machines([{"machine": "A"}, {"machine": None}])
    assert said == f"A (1 run); not recorded by 1 run (this report was written on {util.machine()})"


def test_each_pqt_arm_is_paired_by_seed_with_its_bf16_run(finished):
    """vs_bf16: the PQT run's last val loss minus the bf16 run's of the same seed, read by hand."""
    root, _, _ = finished
    results = json.load(open(os.path.join(root, "tiny", "results.json")))
    bf16, pqt = results["arms"]
    assert "vs_bf16" not in bf16
    last = {n: records(os.path.join(root, "runs", n))[0] for n in ("tiny-bf16-s1", "tiny-gaussws_all-s1")}
    n = TINY["max_iters"]
    want = last["tiny-gaussws_all-s1"][n]["val/loss"] - last["tiny-bf16-s1"][n]["val/loss"]
    assert pqt["vs_bf16"]["runs"] == ["tiny-bf16-s1"] and pqt["vs_bf16"]["val_loss"]["values"] == [want]
    assert pqt["vs_bf16"]["export"]["auto"]["n"] == 0  # the bf16 run is not exported in this study
    assert "Paired by seed" in open(os.path.join(root, "tiny", "results.md")).read()


def test_a_study_without_the_bf16_arm_pairs_with_the_run_another_study_made(finished, tiny_config):
    """As the noise study pairs with fig1b's bf16 runs: the table and paired.png use the bf16 run
    found in the runs directory."""
    root, _, _ = finished
    only = dict(about="gaussws only", arms=[defs.arm(tiny_config, method="gaussws[all]")], seeds=(1,), export=(),
                export_bf16=False)
    with contextlib.redirect_stdout(io.StringIO()):
        assert runner.run_study("only", only, root, echo=False) == 0
    results = json.load(open(os.path.join(root, "only", "results.json")))
    assert list(results["runs"]) == ["tiny-gaussws_all-s1"] and results["arms"][0]["vs_bf16"]["val_loss"]["n"] == 1
    assert os.path.getsize(os.path.join(root, "only", "plots", "paired.png")) > 0


def test_the_reference_of_an_arm_drops_the_keys_only_pqt_has():
    a = defs.arm("c.py", method="diffq[all]", learning_rate=0.01, b_target=2.0, bitwidth_weight_decay=10.0, b_init=5.0)
    assert defs.reference_arm(a) == defs.arm("c.py", method="bf16", learning_rate=0.01)
    assert defs.reference_arm(defs.arm("c.py", method="bf16")) is None
    assert defs.run_name(defs.reference_arm(defs.STUDIES["3bit"]["arms"][1]), 1) == "gpt2-bf16-s1"


def test_the_reference_of_a_phase_arm_is_its_bf16_trunk_with_no_phase_setting():
    """The keys a bf16 run ignores are checkpoint's (PQT_KEYS and the rest of FORK_FREE's method
    settings, figures.PQT_ONLY): the reference of every arm of every study sets none of them but
    method=bf16, and that of each deployment arm is the bf16 run of its length (its trunk)."""
    import checkpoint
    for name, s in defs.STUDIES.items():
        for a in s["arms"]:
            ref = defs.reference_arm(a)
            if ref is None:
                continue
            assert ref["overrides"]["method"] == "bf16"
            assert not set(ref["overrides"]) & (set(checkpoint.PQT_KEYS) - {"method"}), (name, ref)
            if name == "deploy":
                trunk = next(b for b in s["arms"] if b["kind"] == "bf16 + PTQ" and b["steps"] == a["steps"])
                assert defs.run_name(ref, 1) == defs.run_name(trunk, 1), a["kind"]
    phase = defs.arm("c.py", method="ste[all]", target_format="int3", pqt_start=170, max_iters=200)
    assert defs.reference_arm(phase) == defs.arm("c.py", max_iters=200, method="bf16")


def test_the_from_scratch_decay_is_computed_from_the_configs_schedule(tmp_path, monkeypatch):
    """scratch_decay takes train.py's learning rate of every step (step.get_lr) on the config's own
    schedule: b_i = exp(-decay * sum of the learning rates) ends at 0.1 within the rounding of the decay to
    0.01, on train.py's resolved config of the arm (its dry run), and a config with another schedule gets
    another decay. The committed deployment runs' names hold 10.54, 2.62 and 0.65."""
    from step import get_lr
    assert [defs.scratch_decay(n) for n in (200, 800, 3200)] == [10.54, 2.62, 0.65]
    for a in (a for a in defs.STUDIES["deploy"]["arms"] if a["kind"] == "gaussws from scratch"):
        c = resolved(a, 1)
        lrs = sum(get_lr(it, c) for it in range(c["max_iters"]))
        assert abs(math.exp(-c["bitwidth_weight_decay"] * lrs) - 0.1) <= 0.1 * math.expm1(0.005 * lrs), a["kind"]
    other = tmp_path / "other.py"
    other.write_text(f"base = {os.path.join(ROOT, defs.DEPLOY)!r}\nlearning_rate = 4e-3\nwarmup_iters = 50\n")
    monkeypatch.setattr(defs, "DEPLOY", str(other))
    c = {"decay_lr": True, "learning_rate": 4e-3, "min_lr": 2e-4, "warmup_iters": 50, "max_iters": 800,
         "lr_decay_iters": 800}
    assert defs.scratch_decay(800) == round(math.log(10) / sum(get_lr(it, c) for it in range(800)), 2) != 2.62


def test_a_report_with_no_run_done_writes_nothing(tmp_path, capsys, monkeypatch):
    """As over studies/results, which keeps fig1b's tables but not its runs: the report says so and
    leaves the tables as they are."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(entry.signal, "signal", lambda *a: None)  # keep pytest's own handlers
    (tmp_path / "fig1b").mkdir()
    (tmp_path / "fig1b" / "results.md").write_text("the committed table")
    assert entry.main(["fig1b", "--report", f"--root={tmp_path}"]) == 0
    assert "no run of fig1b is done" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path / "fig1b")) == ["results.md"]
    assert (tmp_path / "fig1b" / "results.md").read_text() == "the committed table"


def test_a_run_cut_short_is_refused_by_the_report(finished, tiny_config, tmp_path):
    """A finished run whose metrics.jsonl lost its last line (its evaluation at max_iters): one line
    naming it, and its earlier evaluation is not taken for its last."""
    import shutil
    root, _, _ = finished
    shutil.copytree(os.path.join(root, "runs"), tmp_path / "runs")
    path = tmp_path / "runs" / "tiny-gaussws_all-s1" / "metrics.jsonl"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(StudyError) as e, contextlib.redirect_stdout(io.StringIO()):
        runner.write_results("tiny", two_runs(tiny_config), str(tmp_path))
    assert str(e.value).startswith(f"{path.parent}: done.json says finished, but ") and "cut short" in str(e.value)
    assert not (tmp_path / "tiny").exists()


def test_a_second_call_skips_finished_runs(finished, tiny_config):
    root, _, _ = finished
    logs = [os.path.join(root, "runs", n, "train.log") for n in ("tiny-bf16-s1", "tiny-gaussws_all-s1")]
    before = [os.path.getsize(p) for p in logs]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert runner.run_study("tiny", two_runs(tiny_config), root, echo=False) == 0
    assert out.getvalue().count("already finished, skipped") == 2
    assert [os.path.getsize(p) for p in logs] == before  # train.py did not run


def test_a_stopped_run_is_resumed_to_the_losses_of_an_uninterrupted_one(finished, tiny_config, tmp_path):
    """Stopped after its checkpoint at step 3 with step 4 logged, as a kill during step 5 leaves it."""
    root, _, _ = finished
    a = defs.arm(tiny_config, method="gaussws[all]")
    one = dict(about="one run", arms=[a], seeds=(1,), export=(), export_bf16=False)
    name = defs.run_name(a, 1)
    run_dir = os.path.join(str(tmp_path), "runs", name)
    args = defs.train_args(a, 1, run_dir)
    # In a process of its own, as the runner starts it (not in this one, whose earlier tests may have
    # left torch in another state): the stopped run, the resumed one and the whole one then differ
    # only in where they stopped.
    subprocess.run([*runner.launcher(1), *args, "--max_iters=3"], cwd=ROOT, check=True, capture_output=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"iter": 4, "loss": 123.0, "lr": 1e-3, "ms_per_iter": 1.0, "tokens_per_s": 1.0}) + "\n")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert runner.run_study("one", one, str(tmp_path), echo=False) == 0
    assert "(resumed)" in out.getvalue()
    resumed_evals, resumed_logs = records(run_dir)
    whole_evals, whole_logs = records(os.path.join(root, "runs", name))
    assert {k: r["loss"] for k, r in resumed_logs.items()} == {k: r["loss"] for k, r in whole_logs.items()}
    assert {k: r["val/loss"] for k, r in resumed_evals.items()} == {k: r["val/loss"] for k, r in whole_evals.items()}
    results = json.load(open(os.path.join(str(tmp_path), "one", "results.json")))
    assert results["runs"][name]["val_loss"] == whole_evals[TINY["max_iters"]]["val/loss"]


def test_a_run_directory_made_with_other_arguments_is_refused(finished, tiny_config, tmp_path):
    import shutil
    root, _, _ = finished  # its copy: the finished study is the other tests' too
    run_dir = tmp_path / "runs" / "tiny-bf16-s1"
    shutil.copytree(os.path.join(root, "runs", "tiny-bf16-s1"), run_dir)
    other = dict(two_runs(tiny_config), arms=[defs.arm(tiny_config, method="bf16")])
    record = json.load(open(run_dir / "run.json"))
    record["args"] = record["args"] + ["--learning_rate=1.0"]
    write_json(str(run_dir / "run.json"), record)
    os.remove(run_dir / "done.json")
    with pytest.raises(StudyError, match="made with other arguments"):
        runner.run_study("tiny", other, str(tmp_path), echo=False)


@pytest.mark.parametrize("argv,message", [
    (["fig9"], "'fig9' is not a study"), (["fig1b", "--nproc=0"], "nproc=0: expected an integer >= 1"),
    (["fig1b", "--dry_rn"], "unknown config key 'dry_rn'; did you mean --dry_run?"),
    (["fig1b", "--root"], "--root: overrides are written --key=value"),
    (["fig1b", "--only=("], "--only='(' is not a regular expression"),
    (["fig1b", "--only=nomatch", "--dry_run"], "--only='nomatch' matches none of fig1b's 18 runs")])
def test_bad_input_is_one_line(argv, message):
    """The configurator's dialect and its one-line errors, as every script's."""
    r = subprocess.run([sys.executable, "-m", "studies", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and message in r.stderr


def resolved(a, seed):
    """train.py's resolved config for a run of a study, from its own dry run (meta device, no data)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train.main([os.path.join(ROOT, a["config"]), *(f"--{k}={v}" for k, v in a["overrides"].items()),
                    f"--seed={seed}", "--dry_run=True"])
    text = out.getvalue()
    return json.loads(text[:text.index("\n}\n") + 2])


@pytest.mark.parametrize("name", list(defs.STUDIES))
def test_every_run_of_a_study_is_a_train_command_with_one_shape_budget_and_seeds(name):
    s = defs.STUDIES[name]
    configs = [resolved(a, s["seeds"][0]) for a in s["arms"]]
    shared = ("arch", "n_layer", "n_head", "n_embd", "block_size", "batch_size", "gradient_accumulation_steps",
              "max_iters", "lr_decay_iters", "warmup_iters", "dataset", "eval_interval", "eval_iters")
    lengths = {c["max_iters"] for c in configs}
    for n in lengths:  # the deployment study has three lengths; the others one
        for key in shared:
            assert len({c[key] for c in configs if c["max_iters"] == n}) == 1, f"{name}: arms differ in {key}"
    assert len(lengths) == (3 if name == "deploy" else 1)
    assert configs[0]["dataset"] == "default"
    assert s["seeds"] == ((1,) if name in ("fig3a", "deploy") else (1, 2, 3))
    names = [n for n, _, _ in defs.runs_of(s)]
    assert len(set(names)) == len(names)
    for c, a in zip(configs, s["arms"]):
        for k, v in a["overrides"].items():
            assert c[k] == v  # the override reached train.py


def test_a_run_name_is_one_setting_across_studies():
    seen = {}
    for s in defs.STUDIES.values():
        for n, a, seed in defs.runs_of(s):
            key = (a["config"], json.dumps(a["overrides"], sort_keys=True), seed)
            assert seen.setdefault(n, key) == key, f"{n} names two different runs"


def test_diffq_arm_at_equal_noise_matches_gaussws_noise_variance():
    """The lowered b_t makes DiffQ's noise variance (1/12 of the scale squared, U(-1/2, 1/2)) equal to
    gaussws' E[R²] at the b_t of gaussws: E[R²] measured on R as gaussws samples it."""
    import gaussws
    # 4 x 128 x 128 draws (tensors this small run eagerly): E[R²] within 5 standard errors (0.0019)
    r2 = float(sum((gaussws.sample_r((128, 128), seed=s).double() ** 2).mean() for s in range(4)) / 4)
    assert abs(r2 - 0.292) < 0.01
    arm = defs.STUDIES["noise"]["arms"][2]["overrides"]
    assert arm["method"] == "diffq[all]" and arm["b_init"] - arm["b_target"] == pytest.approx(2.0)
    for b_gaussws, b_diffq in ((6.0, arm["b_init"]), (4.0, arm["b_target"])):
        var_gaussws = r2 * 4.0 ** (1 - b_gaussws)  # Eq. 3: noise R * 2^(1 - b_t) per unit of block max
        var_diffq = 1 / 12 * 4.0 ** (1 - b_diffq)
        assert math.isclose(var_gaussws, var_diffq, rel_tol=0.03)


# Config files whose text stays as it is: run directories under way record the file's SHA-256 (run.json's
# config_sha), which the runner checks before it resumes them; their first line still names study.py.
KEPT = ("config/mini_gpt2_gguf.py",)


def test_mini_configs_say_which_figure_they_mirror_and_a_study_uses_each():
    import glob
    import re
    paths = sorted(glob.glob(os.path.join(ROOT, "config", "mini_*.py")))
    assert paths
    used = {a["config"] for s in defs.STUDIES.values() for a in s["arms"]}
    for p in paths:
        with open(p) as f:
            first = f.readline()  # a paper figure at laptop scale, or a study beyond the paper by its command
        named = re.findall(r"`python -m studies ([\w|]+)`", first)
        if os.path.relpath(p, ROOT) not in KEPT:
            assert re.match(r"# Fig\. \d+[ab]?\b", first) or named, \
                f"{p}: the first line must name the figure it mirrors or the study it is the base of"
            assert all(set(n.split("|")) <= set(defs.STUDIES) for n in named), f"{p}: {named} names no study"
        assert os.path.relpath(p, ROOT) in used, f"{p} is in no study"


def test_3bit_arms_decay_alone_brings_b_t_below_3():
    """AdamW's decoupled decay of b_i (b_i *= 1 - lr * decay each step, lr train.py's warmup + cosine
    schedule of the run's resolved config) leaves b_t = b_target + b_i (b_init - b_target) under 3 by
    the end."""
    from step import get_lr
    for a in defs.STUDIES["3bit"]["arms"][1:]:
        s = resolved(a, 1)
        b_i = 1.0
        for it in range(s["max_iters"]):
            b_i *= 1 - get_lr(it, s) * s["bitwidth_weight_decay"]
        assert s["b_target"] + b_i * (s["b_init"] - s["b_target"]) < 3.0 - 0.3, a


def test_dry_run_lists_every_run_with_its_command_and_nproc_uses_torchrun(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # main() works in the repository; the test's directory is restored after
    assert entry.main(["fig3a", "--dry_run", f"--root={tmp_path}"]) == 0
    lines = [l for l in capsys.readouterr().out.splitlines() if "[to run]" in l]
    assert len(lines) == 6 and all("python train.py config/mini_gpt2.py" in l for l in lines)
    assert entry.main(["fig4", "--dry_run", "--nproc=2", f"--root={tmp_path}"]) == 0
    lines = [l for l in capsys.readouterr().out.splitlines() if "[to run]" in l]
    assert len(lines) == 9
    torchrun = "-m torch.distributed.run --standalone --nproc_per_node=2 train.py config/mini_llama2.py"
    assert all(torchrun in l for l in lines)


# --- two runners, divergences, hand-edited records ---------------------------------------------

def test_a_run_whose_lock_is_held_is_not_touched(tiny_config, tmp_path):
    """As a second runner finds a run the first is training (before its first checkpoint): train.py's
    lock of the directory is held, metrics.jsonl holds that run's first records. Nothing is deleted,
    train.py is not started, the run is put off (BUSY)."""
    import checkpoint
    a = defs.arm(tiny_config, method="bf16")
    run_dir = tmp_path / "runs" / defs.run_name(a, 1)
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text(json.dumps({"iter": 0, "train/loss": 5.5, "val/loss": 5.5}) + "\n")
    before = sorted(os.listdir(run_dir)), (run_dir / "metrics.jsonl").read_bytes()
    for name in (".lock", ".study.lock"):  # a train.py's lock, then another runner's
        with checkpoint.lock(str(run_dir), name=name):
            result = runner.train_one(defs.run_name(a, 1), a, 1, str(tmp_path), 1, False)
        assert (sorted(f for f in os.listdir(run_dir) if not f.endswith("lock")),
                (run_dir / "metrics.jsonl").read_bytes()) == before
        assert result == runner.BUSY


def test_a_runner_does_the_free_runs_first_then_waits_for_the_held_one(tiny_config, tmp_path, monkeypatch):
    """Run 1 is held by another process; the runner trains run 2, then waits for run 1 (the holder lets
    go when the runner starts to wait) and trains it: both runs whole, one record each."""
    import checkpoint
    config = two_runs(tiny_config)
    names = [n for n, _, _ in defs.runs_of(config)]
    held = checkpoint.lock(os.path.join(str(tmp_path), "runs", names[0]))
    real_claim, order = runner.claim, []

    def claim(run_dir, wait):
        order.append((os.path.basename(run_dir), wait))
        if wait:
            held.release()  # the other process ends
        return real_claim(run_dir, wait)
    monkeypatch.setattr(runner, "claim", claim)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert runner.run_study("tiny", config, str(tmp_path), echo=False) == 0
    assert order == [(names[0], False), (names[1], False), (names[0], True)]
    assert f"{names[0]} is in use by another process; back to it after the others" in out.getvalue()
    for n in names:
        assert json.load(open(tmp_path / "runs" / n / "done.json"))["status"] == "finished"
        evals, logs = records(tmp_path / "runs" / n)
        assert max(evals) == TINY["max_iters"] and sorted(logs) == list(range(1, TINY["max_iters"] + 1))


def test_any_divergence_train_py_records_is_a_result_not_a_failure(tiny_config, tmp_path):
    """lr 1e30 makes the model after step 0 NaN: train.py stops at the eval of step 1 ("eval loss is
    {...}", not "loss is nan"). The run is recorded as diverged there, and not run again."""
    a = defs.arm(tiny_config, method="bf16", learning_rate=1e30, grad_clip=0.0, warmup_iters=0, decay_lr=False,
                  dtype="float32", eval_interval=1)
    one = dict(about="one diverging run", arms=[a], seeds=(1,), export=(), export_bf16=False)
    run_dir = tmp_path / "runs" / defs.run_name(a, 1)
    with contextlib.redirect_stdout(io.StringIO()):
        assert runner.run_study("one", one, str(tmp_path), echo=False) == 0
    done = json.load(open(run_dir / "done.json"))
    assert (done["status"], done["step"], done["what"]) == ("diverged", 1, "eval_loss")
    results = json.load(open(tmp_path / "one" / "results.json"))
    assert results["arms"][0]["diverged"] == [{"seed": 1, "step": 1, "what": "eval_loss"}]
    log = (run_dir / "train.log").read_bytes()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert runner.run_study("one", one, str(tmp_path), echo=False) == 0
    assert "already diverged, skipped" in out.getvalue() and (run_dir / "train.log").read_bytes() == log


@pytest.mark.parametrize("record,text", [
    ("done.json", "{not json"), ("done.json", '{"status": "done"}'), ("done.json", '["finished"]'),
    ("run.json", '{"args": "x", "attempts": []}'), ("run.json", '{"args": [], "attempts": [{"wall_s": "1"}]}'),
    ("export.json", '{"auto": 1.5}'), ("export.json", "\xff\xfe"),
])
def test_a_hand_edited_record_is_one_line_and_changes_nothing(finished, tiny_config, tmp_path, record, text):
    import shutil
    root, _, _ = finished
    copy = tmp_path / "root"
    shutil.copytree(os.path.join(root, "runs", "tiny-gaussws_all-s1"), copy / "runs" / "tiny-gaussws_all-s1")
    path = copy / "runs" / "tiny-gaussws_all-s1" / record
    path.write_bytes(text.encode("latin-1"))
    files = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    config = dict(about="gaussws only", arms=[defs.arm(tiny_config, method="gaussws[all]")], seeds=(1,),
                  export=("auto",), export_bf16=False)
    with pytest.raises(StudyError) as e, contextlib.redirect_stdout(io.StringIO()):
        runner.run_study("tiny", config, str(copy), echo=False)
    message = str(e.value)
    assert str(path) in message and "\n" not in message and "move it away" in message
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file() and p.parent != copy / "tiny"} == files


def test_a_bad_root_is_one_line(tmp_path, monkeypatch, capsys):
    """From the shell once (no traceback, exit 1), then each case through the same cli() in-process."""
    (tmp_path / "file").write_text("x")
    r = subprocess.run([sys.executable, "-m", "studies", "fig3a", f"--root={tmp_path / 'file'}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error: --root=") and "is a file" in line
    monkeypatch.setattr(entry.signal, "signal", lambda *a: None)  # keep pytest's own handlers
    for root, message in ((tmp_path / "file", "is a file"), (tmp_path / "file" / "below", "is a file"),
                          ("/proc/no_such_dir/study", "cannot make")):
        for dry in ([], ["--dry_run"]):
            status = util.cli(entry.main, ["fig3a", f"--root={root}", *dry])
            err = capsys.readouterr().err
            if dry and root == "/proc/no_such_dir/study":  # a dry run makes nothing, so cannot fail to
                assert status == 0, err
                continue
            assert status == 1, err
            (line,) = err.strip().splitlines()
            assert line.startswith("error: --root=") and message in line
    assert (tmp_path / "file").read_text() == "x"


# --- the dry run's estimate of the time left, and --help -------------------------------------------

def config_max_iters(path):
    """max_iters as the config file writes it, read by hand."""
    import re
    with open(os.path.join(ROOT, path)) as f:
        return int(re.search(r"^max_iters = (\d+)", f.read(), re.M).group(1))


def estimate(capsys, argv):
    """(seconds, runs, steps, seconds per step) of the dry run's last line, and that line."""
    import re
    assert entry.main(argv) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    m = re.fullmatch(r"time left: about [\d.]+ (?:h|min) \(([\d,]+) s: (\d+) run\(s\), ([\d,]+) steps at ([\d.]+) s a "
                     r"step, .*\)", line)
    assert m, line
    return float(m[1].replace(",", "")), int(m[2]), int(m[3].replace(",", "")), float(m[4]), line


def test_a_dry_run_gives_the_time_left_at_the_finished_runs_seconds_per_step(tmp_path, capsys, monkeypatch):
    """fig1b's 18 runs of config/mini_gpt2.py's length: two finished in 100 s and 300 s (1 s a step), one
    stopped with its last evaluation (and checkpoint) at step 100, fifteen not begun."""
    monkeypatch.chdir(ROOT)
    steps = config_max_iters("config/mini_gpt2.py")
    names = [n for n, _, _ in defs.runs_of(defs.STUDIES["fig1b"])]
    for name, wall in ((names[0], 100.0), (names[5], 300.0)):
        os.makedirs(tmp_path / "runs" / name)
        (tmp_path / "runs" / name / "done.json").write_text(json.dumps({"status": "finished", "wall_s": wall}))
    stopped = tmp_path / "runs" / names[7]
    os.makedirs(stopped)
    (stopped / "ckpt.pt").write_bytes(b"")
    (stopped / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"iter": 0, "train/loss": 5.5, "val/loss": 5.5}, {"iter": 50, "loss": 3.0},
        {"iter": 50, "train/loss": 3.0, "val/loss": 3.1}, {"iter": 100, "train/loss": 2.5, "val/loss": 2.6},
        {"iter": 110, "loss": 2.4}]))
    rate = (100.0 + 300.0) / (2 * steps)
    want_steps = 15 * steps + (steps - 100)
    seconds, runs, got_steps, got_rate, line = estimate(capsys, ["fig1b", "--dry_run", f"--root={tmp_path}"])
    assert (runs, got_steps) == (16, want_steps) and got_rate == pytest.approx(rate, abs=1e-3)
    assert seconds == pytest.approx(want_steps * rate, abs=1) and "2 finished run(s)" in line


def test_a_dry_run_before_any_run_finished_says_its_default_and_counts_a_fork_from_its_switch(tmp_path, capsys,
                                                                                              monkeypatch):
    """The deployment study's 200-step runs, none begun: a run that forks from its bf16 trunk (those that
    name --pqt_start) trains from its switch step only; the others all 200 steps."""
    import re
    monkeypatch.chdir(ROOT)
    assert entry.main(["deploy", "--dry_run", f"--root={tmp_path}", "--only=-n200-"]) == 0
    commands = [l for l in capsys.readouterr().out.splitlines() if "[to run]" in l]
    want = 0
    for c in commands:
        n = int(re.search(r"--max_iters=(\d+)", c)[1])
        start = re.search(r"--pqt_start=(\d+)", c)
        want += n - (int(start[1]) if start else 0)
    seconds, runs, steps, rate, line = estimate(capsys, ["deploy", "--dry_run", f"--root={tmp_path}", "--only=-n200-"])
    assert runs == len(commands) > 5 and steps == want < 200 * runs
    assert rate == runner.DEFAULT_STEP_S and "no run has finished here yet" in line
    assert seconds == pytest.approx(want * runner.DEFAULT_STEP_S, abs=1)


def test_the_runners_eta_counts_the_steps_left_not_the_runs_left(tmp_path, capsys, monkeypatch):
    """The llama.cpp study's seed 1: its 6400-step trunk finished in 6400 s (1 s a step); the line that
    starts the next run gives the steps its 12 forks train (from their --pqt_start) at 1 s a step, not
    the trunk's time for each of them (6400 s each), which once said 85 h where 3 h were left."""
    import re

    class Started(Exception):
        pass

    def train_one(*args):
        raise Started

    monkeypatch.chdir(ROOT)
    only = "-s1$"
    assert entry.main(["gguf", "--dry_run", f"--root={tmp_path}", f"--only={only}"]) == 0
    commands = [l for l in capsys.readouterr().out.splitlines() if "[to run]" in l]
    trunk = [c for c in commands if "--pqt_start" not in c]
    assert len(trunk) == 1 and len(commands) == 13
    want = sum(int(re.search(r"--max_iters=(\d+)", c)[1]) - int(re.search(r"--pqt_start=(\d+)", c)[1])
               for c in commands if c not in trunk)
    name = next(n for n, a, _ in defs.runs_of(defs.STUDIES["gguf"]) if "-bf16-" in n and n.endswith("-s1"))
    os.makedirs(tmp_path / "runs" / name)
    (tmp_path / "runs" / name / "done.json").write_text(json.dumps({"status": "finished", "wall_s": 6400.0}))
    for step in defs.STUDIES["gguf"]["arms"][0]["keep"]:  # the checkpoints it kept for its forks (else it is
        (tmp_path / "runs" / name / f"ckpt_{step}.pt").write_bytes(b"")  # trained again first: remake_steps)
    monkeypatch.setattr(runner, "train_one", train_one)
    with pytest.raises(Started):
        runner.run_study("gguf", defs.STUDIES["gguf"], str(tmp_path), only=only)
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.endswith(f"ETA {runner.duration(want)} for the 12 run(s) not done, one after another"), line
    assert want == 6 * 960 + 6 * 1920 and runner.duration(want) == "4.8 h"


@pytest.mark.parametrize("argv", [["--help"], ["-h"], []])
def test_help_prints_the_usage_with_each_option_and_study_and_exits_0(argv):
    """--help (and no study named) prints the usage, each study with its count of runs, and each key
    with its default and the comment of its defaults' line (the configurator's help)."""
    r = subprocess.run([sys.executable, "-m", "studies", *argv], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stderr == ""
    lines = [l.strip() for l in r.stdout.splitlines()]
    assert lines[0] == "usage: python -m studies NAME [--dry_run] [--report] [--nproc=N] [--root=DIR] [--only=REGEX]"
    for name, s in defs.STUDIES.items():
        assert sum(l.startswith(f"{name} ") for l in lines) == 1, name
        assert f"{name} {len(defs.runs_of(s)):3d} runs  {s['about']}".split() in [l.split() for l in lines]
    for key, value in entry.DEFAULTS.items():
        (line,) = [l for l in lines if l.startswith(f"{key} = ")]
        assert line.startswith(f"{key} = {value!r}") and len(line.split("  # ")[1]) > 20, line
