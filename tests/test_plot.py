"""plot.py and its library figures.py on synthetic run directories: the PNGs they promise, seeds grouped,
bad input refused; and the deployment study's figures (studies.plots)."""
import json
import math
import os
import struct
import subprocess
import sys
import zlib

import pytest

import figures
import plot
from conftest import ROOT
from studies import plots as study_plots


def config(method="gaussws[all]", lr=2e-3, seed=1, **kw):
    """The keys of a train.py config.json that figures.py reads, with a tiny model's values."""
    c = dict(method=method, learning_rate=lr, optimizer="adamw", b_init=6.0, b_target=4.0, bitwidth_weight_decay=0.1,
             arch="gpt2", n_layer=2, n_embd=32, dataset="default", max_iters=40, batch_size=4, block_size=16,
             gradient_accumulation_steps=2, seed=seed, out_dir=f"out/{method}-{seed}", device="cpu",
             model_args=dict(arch="gpt2", n_layer=2, n_embd=32, block_size=16), world_size=1)
    c.update(kw)
    return c


def make_run(path, cfg, offset=0.0):
    """A run directory with a falling loss curve (and b_t drifting down for PQT runs)."""
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        for it in range(0, cfg["max_iters"] + 1, 10):
            record = {"iter": it, "train/loss": 5.0 - it / 20 + offset, "val/loss": 5.1 - it / 20 + offset}
            f.write(json.dumps(record) + "\n")
            if it:
                rec = {"iter": it, "loss": 5.0 - it / 21 + offset, "lr": 1e-3, "ms_per_iter": 10.0, "tokens_per_s": 1.0}
                if cfg["method"] != "bf16":
                    rec.update({"b_t/mean": 6 - it / 100, "b_t/min": 5.5 - it / 100, "b_t/max": 6.2})
                f.write(json.dumps(rec) + "\n")
    return str(path)


def png_size(path):
    """Width and height from the PNG's IHDR chunk, read by hand (PNG spec 11.2.2), and whether the
    file's first chunk is intact."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    crc = struct.unpack(">I", data[16 + length:20 + length])[0]
    assert crc == zlib.crc32(data[12:16 + length]), "IHDR CRC mismatch"
    return struct.unpack(">II", data[16:24])


def drawn_fraction(path):
    """Share of pixels that are not the white background: a figure with its lines has many."""
    import matplotlib.image
    img = matplotlib.image.imread(path)[..., :3]
    return float((img.min(axis=-1) < 0.9).mean())


@pytest.fixture
def runs(tmp_path):
    return [make_run(tmp_path / "g1", config(seed=1)), make_run(tmp_path / "g2", config(seed=2), offset=0.05),
            make_run(tmp_path / "g3", config(seed=3), offset=-0.05),
            make_run(tmp_path / "b1", config("bf16", seed=1), 0.1)]


def test_draws_loss_bitwidth_and_paired_pngs_of_the_expected_size(runs, tmp_path):
    out = tmp_path / "plots"
    plot.main([*runs, f"--out={out}"])
    for name in ("loss.png", "bitwidth.png", "paired.png"):
        path = out / name
        assert png_size(path) == (int(figures.FIGSIZE[0] * figures.DPI), int(figures.FIGSIZE[1] * figures.DPI))
        assert os.path.getsize(path) > 10_000
        assert drawn_fraction(path) > 0.02  # axes, ticks, text and the curves; a blank canvas has none


def test_a_pqt_run_is_paired_with_the_bf16_run_of_its_seed_and_settings(runs, tmp_path):
    """g1 (seed 1) has a bf16 twin 0.1 above it: its val loss minus the twin's is -0.1 at every eval.
    g2, g3 (seeds 2, 3) have none; a bf16 run at another lr is no twin; b_target (which bf16 does not
    read) does not stop a pairing."""
    groups = figures.group_seeds([figures.read_run(d) for d in runs])
    (i, curves), = figures.paired_curves(groups)
    assert groups[i][0]["config"]["method"] == "gaussws[all]" and len(curves) == 1
    assert sorted(curves[0]) == [it * 2 * 4 * 16 for it in range(0, 41, 10)]
    assert all(v == pytest.approx(-0.1) for v in curves[0].values())
    other_lr = make_run(tmp_path / "b_lr", config("bf16", lr=1e-2, seed=2))
    low_bits = make_run(tmp_path / "g_low", config(seed=1, b_target=2.0, bitwidth_weight_decay=10.0), offset=0.3)
    groups = figures.group_seeds([figures.read_run(d) for d in [*runs, other_lr, low_bits]])
    paired = {groups[i][0]["config"]["b_target"]: curves for i, curves in figures.paired_curves(groups)}
    assert sorted(paired) == [2.0, 4.0] and len(paired[4.0]) == 1
    assert all(v == pytest.approx(0.2) for v in paired[2.0][0].values())


def test_no_paired_png_without_a_bf16_twin(runs, tmp_path):
    written = figures.make_plots(runs[:3], str(tmp_path / "plots"))
    assert [os.path.basename(p) for p in written] == ["loss.png", "bitwidth.png"]


def test_a_twin_given_apart_is_paired_with_but_not_drawn(runs, tmp_path):
    """The bf16 run b1 as twin_dirs: g1 is paired with it (-0.1), and it is no setting of its own."""
    gaussws = [figures.read_run(d) for d in runs[:3]]
    groups = figures.group_seeds(gaussws)
    (i, curves), = figures.paired_curves(groups, [figures.read_run(runs[3])])
    assert len(groups) == 1 and i == 0 and len(curves) == 1
    assert all(v == pytest.approx(-0.1) for v in curves[0].values())
    written = figures.make_plots(runs[:3], str(tmp_path / "plots"), twin_dirs=[runs[3]])
    assert [os.path.basename(p) for p in written] == ["loss.png", "bitwidth.png", "paired.png"]


def test_no_bitwidth_png_without_pqt_runs(tmp_path):
    run = make_run(tmp_path / "b", config("bf16"))
    written = figures.make_plots([run], str(tmp_path / "plots"))
    assert [os.path.basename(p) for p in written] == ["loss.png"]
    assert not os.path.exists(tmp_path / "plots" / "bitwidth.png")


@pytest.mark.parametrize("make", ["empty_dir", "missing_dir", "binary_metrics"])
def test_a_directory_without_metrics_is_refused_with_one_line(runs, tmp_path, make):
    bad = tmp_path / "not_a_run"
    if make != "missing_dir":
        bad.mkdir()
    if make == "binary_metrics":  # a run's config and a damaged log: bytes that are not UTF-8
        (bad / "config.json").write_bytes(open(os.path.join(runs[0], "config.json"), "rb").read())
        (bad / "metrics.jsonl").write_bytes(bytes(range(128, 256)))
    out = tmp_path / "plots"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "plot.py"), runs[0], str(bad), f"--out={out}"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode != 0
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert "metrics.jsonl" in r.stderr and str(bad) in r.stderr
    assert not out.exists(), "nothing is written when an input is bad"


def test_seeds_of_one_setting_are_grouped_and_labels_name_method_lr_optimizer(runs):
    groups = figures.group_seeds([figures.read_run(d) for d in runs])
    assert [[r["config"]["seed"] for r in g] for g in groups] == [[1, 2, 3], [1]]
    names, title = figures.labels(groups)
    assert names == ["gaussws[all], lr 0.002, adamw, b_t 6→4, b_i decay 0.1", "bf16, lr 0.002, adamw"]
    assert "gpt2 2 layers x 32" in title and "1-3 seeds per line" in title


def test_another_learning_rate_is_another_setting(tmp_path):
    a = figures.read_run(make_run(tmp_path / "a", config(lr=2e-3)))
    b = figures.read_run(make_run(tmp_path / "b", config(lr=1e-2)))
    assert len(figures.group_seeds([a, b])) == 2


def test_mean_and_band_over_seeds():
    xs, mean, lo, hi = figures.mean_band([{0: 3.0, 10: 2.0}, {0: 4.0, 10: 1.0}, {0: 5.0}])
    assert xs == [0, 10] and mean == [4.0, 1.5] and lo == [3.0, 1.0] and hi == [5.0, 2.0]


def test_a_resumed_log_counts_each_step_once_the_later_record_winning(tmp_path):
    """A run killed at step 30 after its checkpoint at 20 logs 30 again when resumed."""
    path = tmp_path / "metrics.jsonl"
    recs = [{"iter": 10, "loss": 3.0}, {"iter": 20, "loss": 2.5}, {"iter": 20, "train/loss": 2.4, "val/loss": 2.6},
            {"iter": 30, "loss": 9.9}, {"iter": 20, "train/loss": 2.4, "val/loss": 2.6}, {"iter": 30, "loss": 2.2}]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"iter": 40, "lo')  # cut short by a kill
    evals, logs = figures.read_metrics(str(path))
    assert [(r["iter"], r["loss"]) for r in logs] == [(10, 3.0), (20, 2.5), (30, 2.2)]
    assert [(r["iter"], r["val/loss"]) for r in evals] == [(20, 2.6)]


def test_a_run_that_ended_has_no_last_line_cut_short(tmp_path):
    """The records of a run that ended are read whole: a last line cut short (a full disk, a crash) is
    one line naming the file and the line, where a running run's is left out."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"iter": 10, "loss": 3.0}) + "\n" + '{"iter": 20, "train/loss": 2.4, "val/lo')
    assert figures.read_metrics(str(path)) == ([], [{"iter": 10, "loss": 3.0}])
    with pytest.raises(figures.PlotError, match=r"metrics.jsonl line 2 is cut short: '\{\"iter\": 20"):
        figures.read_metrics(str(path), whole=True)
    path.write_text(json.dumps({"iter": "10", "loss": 3.0}) + "\n")  # a record train.py does not write
    with pytest.raises(figures.PlotError, match="line 1 is not a JSON record with an integer 'iter'"):
        figures.read_metrics(str(path))


def test_a_phase_run_is_paired_with_its_bf16_run_and_a_forked_one_is_the_whole_one(tmp_path):
    """What only PQT reads comes from checkpoint's key sets (PQT_KEYS, FORK_FREE): a phase run (its
    switch, target format, budget and STE phase) pairs with the bf16 run of its other settings, and a
    phase run forked from that bf16 run is one setting with the phase run trained whole."""
    import checkpoint
    assert set(checkpoint.PQT_KEYS) | {"bitwidth_weight_decay", "bitwidth_lambda"} <= figures.PQT_ONLY
    assert not figures.PQT_ONLY & {"learning_rate", "max_iters", "eval_interval", "optimizer", "n_layer"}
    phases = dict(pqt_start=28.0, target_format="auto-int", ste_start=34.0, bits_per_weight=3.5)
    bf16 = make_run(tmp_path / "bf16", config("bf16", **{k: checkpoint.PQT_DEFAULTS[k] for k in phases}), 0.1)
    whole = make_run(tmp_path / "whole", config(**phases, fork_from=""))
    forked = make_run(tmp_path / "forked", config(**phases, fork_from=str(tmp_path / "bf16" / "ckpt_28.pt")))
    groups = figures.group_seeds([figures.read_run(d) for d in (bf16, whole, forked)])
    assert [len(g) for g in groups] == [1, 2]  # the forked run is a second run of the whole one's setting
    (i, curves), = figures.paired_curves(groups)
    assert i == 1 and len(curves) == 2  # each run of the phase setting with the bf16 run of its seed
    assert all(v == pytest.approx(-0.1) for c in curves for v in c.values())


def test_tokens_count_every_process_and_micro_step(runs):
    run = figures.read_run(runs[0])
    assert run["tokens_per_iter"] == 2 * 4 * 16  # gradient_accumulation_steps x batch_size x block_size


def test_a_config_json_that_train_py_did_not_write_is_refused_with_one_line(tmp_path):
    run = make_run(tmp_path / "r", config())
    with open(os.path.join(run, "config.json"), "w") as f:
        json.dump({"method": "bf16"}, f)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "plot.py"), run, f"--out={tmp_path / 'plots'}"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "lacks learning_rate" in r.stderr


def long_and_short_runs(tmp_path):
    """A 400-step run and a 50-step one beside it, as train.py logs them: the loss every 10 steps,
    an evaluation every 100 (the long run: 5 points) or every 25 (the short run: 3 points). The short
    run is still high (about 3.6 and up) where the long one ends (about 1.3)."""
    runs = []
    for name, steps, eval_every in (("long", 400, 100), ("short", 50, 25)):
        cfg = config("bf16" if name == "long" else "gaussws[all]", max_iters=steps)
        path = tmp_path / name
        os.makedirs(path)
        (path / "config.json").write_text(json.dumps(cfg))
        loss = lambda it: 1.2 + 4.3 * math.exp(-it / 60)  # noqa: E731 (5.5 at step 0, ln(256) ~ 5.5)
        with open(path / "metrics.jsonl", "w") as f:
            for it in range(0, steps + 1):
                if it % eval_every == 0:
                    f.write(json.dumps({"iter": it, "train/loss": loss(it), "val/loss": loss(it) + 0.05}) + "\n")
                if it and it % 10 == 0:
                    f.write(json.dumps({"iter": it, "loss": loss(it) + 0.02, "ms_per_iter": 1.0}) + "\n")
        runs.append(str(path))
    return runs


@pytest.fixture
def drawn(monkeypatch):
    """The figures figures.py saves, kept for their Axes (recorded at savefig, before it closes them)."""
    import matplotlib.figure
    figures, savefig = {}, matplotlib.figure.Figure.savefig

    def record(fig, path, *args, **kw):
        figures[os.path.basename(str(path))] = fig
        return savefig(fig, path, *args, **kw)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    return figures


def test_a_short_run_beside_a_long_one_is_inside_both_loss_axes(tmp_path, drawn):
    """Every line's points past the first fifth of its own tokens (the warmup's fall) lie inside
    the axes, and its last point too; the x axis starts at 0 and reaches the longest run's end. The
    points are read back from each matplotlib line and checked against the metrics written above."""
    runs = long_and_short_runs(tmp_path)
    figures.make_plots(runs, str(tmp_path / "plots"))
    train_ax, val_ax = drawn["loss.png"].axes
    tokens = 2 * 4 * 16  # tokens per step of config()
    for ax, key, kind in ((train_ax, "loss", "logs"), (val_ax, "val/loss", "evals")):
        lines = ax.get_lines()
        assert len(lines) == 2  # one per run: both are drawn
        (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
        assert x0 <= 0 and x1 >= 400 * tokens
        for line, run in zip(lines, runs):
            evals, logs = figures.read_metrics(os.path.join(run, "metrics.jsonl"))
            want = [(r["iter"] * tokens, r[key]) for r in (logs if kind == "logs" else evals)]
            xs, ys = line.get_xdata(), line.get_ydata()
            # the line is this run's data (approx of flat lists: pytest 9.2 refuses approx of nested data)
            assert len(xs) == len(ys) == len(want)
            assert list(xs) == pytest.approx([x for x, _ in want]) and list(ys) == pytest.approx([y for _, y in want])
            end = xs[-1]
            for x, y in zip(xs, ys):
                if x >= 0.2 * end or x == end:
                    assert x0 <= x <= x1 and y0 <= y <= y1, (os.path.basename(run), key, x, y, (y0, y1))


def test_val_lines_have_markers_and_the_panels_say_what_pqn_on_and_off_mean(tmp_path, drawn):
    figures.make_plots(long_and_short_runs(tmp_path), str(tmp_path / "plots"))
    train_ax, val_ax = drawn["loss.png"].axes
    assert all(line.get_marker() not in (None, "None", "", " ") for line in val_ax.get_lines())
    assert len(val_ax.get_lines()[1].get_xdata()) == 3  # the short run's three evaluations, each a marker
    train_text = train_ax.get_title() + " " + train_ax.get_ylabel()
    val_text = val_ax.get_title() + " " + val_ax.get_ylabel()
    assert "PQN on" in train_text and "noise" in train_text
    assert "PQN off" in val_text and "no noise" in val_text


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_the_usage_and_exits_0(flag):
    """The configurator's --help: the usage, then each key with its default and its comment."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "plot.py"), flag], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0 and r.stderr == ""
    lines = r.stdout.splitlines()
    assert lines[0] == "usage: python plot.py RUN_DIR [RUN_DIR ...] [--out=DIR]"
    (out,) = [line.strip() for line in lines if line.strip().startswith("out = ")]
    assert out.split("  # ") == ["out = 'plots'", "the directory loss.png, bitwidth.png and paired.png are written to"]


@pytest.mark.parametrize("argv,message", [
    (["--outt=x"], "unknown config key 'outt'; did you mean --out?"),
    (["--out"], "--out: overrides are written --key=value"),
    ([], "no run directory given"),
    (["--out=/proc/plots"], "--out='/proc/plots' cannot take the figures"),
    (["--out="], "--out='' cannot take the figures")])
def test_a_bad_command_line_is_the_configurators_one_line_error(runs, tmp_path, argv, message):
    """plot.py speaks the configurator's dialect: an unknown key or a bare --key of a string is its
    one-line error, exit status 1, nothing drawn."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    r = subprocess.run([sys.executable, os.path.join(ROOT, "plot.py"), *(runs[:1] if argv else []), *argv],
                       capture_output=True, text=True, timeout=120, cwd=cwd)
    (line,) = r.stderr.strip().splitlines()
    assert r.returncode == 1 and line.startswith("error: ") and message in line
    assert not os.listdir(cwd)


def test_a_diverged_line_whose_late_values_are_nan_still_sets_the_axis():
    """A run that diverged early logs NaN after its first points: the axis covers its finite values."""
    lo, hi = figures.loss_ylim([([0, 10, 100], [5.0, float("nan"), float("inf")])])
    assert lo < 5.0 < hi
    lo, hi = figures.loss_ylim([([0, 10, 20, 30], [5.0, 3.0, float("nan"), float("inf")]), ([0, 100], [5.5, 2.0])])
    assert lo < 2.0 and 3.0 < hi < 5.0  # the first fifth of each line may be above the axis


def deploy_row(arm, fmt, steps, tpp, increase, exported, bits):
    one = lambda v: {"mean": v, "std": None, "n": 1}  # noqa: E731
    return {"arm": arm, "format": fmt, "steps": steps, "seeds": 1, "tokens_per_param": tpp,
            "increase_pct": one(increase), "exported": one(exported), "bits_per_weight": one(bits)}


def test_deploy_figures_keep_an_arm_in_one_colour_and_every_point_in_view(tmp_path, drawn):
    """increase.png has a panel per format (the mixes at one budget share one), each with a line per arm;
    an arm has one colour and marker in every panel and in pareto.png, arms differ in colour; a +230 %
    next to a +0.1 % and a loss of 3.7 next to 1.16 are all inside the axes."""
    rows = [deploy_row(arm, fmt, steps, steps / 200, inc, loss, bits)
            for arm, fmt, bits, incs, losses in (("bf16 + PTQ", "int3", 3.02, (0.2, 43.0), (2.33, 1.62)),
                                                 ("bf16 + PTQ", "int2", 2.02, (60.0, 230.0), (3.1, 3.73)),
                                                 ("bf16 + PTQ", "error-int@3.5", 3.52, (0.1, 17.7), (2.32, 1.33)),
                                                 ("STE phase", "int3", 3.02, (0.03, 7.3), (2.32, 1.21)),
                                                 ("learned mix 3.5 bits", "auto-int@3.5", 3.52, (0.06, 2.8),
                                                  (2.32, 1.16)))
            for steps, inc, loss in zip((200, 3200), incs, losses)]
    study_plots.plot_deploy(rows, str(tmp_path), longest=3200)
    (pareto_ax,) = drawn["pareto.png"].axes
    panels = {ax.get_title(): ax for ax in drawn["increase.png"].axes}
    assert set(panels) == {"int3", "int2", "int2/3/4 mix at 3.5 bits"}
    lines = {(title, c.get_label()): c.lines[0] for title, ax in panels.items() for c in ax.containers}
    assert set(lines) == {("int3", "bf16 + PTQ"), ("int3", "STE phase"), ("int2", "bf16 + PTQ"),
                          ("int2/3/4 mix at 3.5 bits", "bf16 + PTQ (error-int@3.5)"),
                          ("int2/3/4 mix at 3.5 bits", "learned mix 3.5 bits")}
    for (title, label), line in lines.items():
        rs = [r for r in rows if label.startswith(r["arm"]) and study_plots.deploy_panel(r["format"]) == title]
        assert list(line.get_xdata()) == [r["tokens_per_param"] for r in rs]
        assert list(line.get_ydata()) == [r["increase_pct"]["mean"] for r in rs]
        y0, y1 = panels[title].get_ylim()
        assert all(y0 <= y <= y1 for y in line.get_ydata())
    ptq = [line for (_, label), line in lines.items() if label.startswith("bf16 + PTQ")]
    assert len({line.get_color() for line in ptq}) == 1 and len({line.get_marker() for line in ptq}) == 1
    assert len({line.get_color() for line in lines.values()}) == 3  # one per arm
    legend = [t.get_text() for t in drawn["increase.png"].legends[0].get_texts()]
    assert sorted(legend) == sorted({label for _, label in lines})  # each once
    lines = {label: line for (_, label), line in lines.items()}
    colour = {r["arm"]: lines[r["arm"]].get_color() for r in rows}
    points = [c.lines[0] for c in pareto_ax.containers]
    drawn_points = sorted((float(p.get_xdata()[0]), float(p.get_ydata()[0]), p.get_color()) for p in points)
    assert drawn_points == sorted((r["bits_per_weight"]["mean"], r["exported"]["mean"], colour[r["arm"]])
                                  for r in rows if r["steps"] == 3200)
    py0, py1 = pareto_ax.get_ylim()
    assert all(py0 <= y <= py1 for _, y, _ in drawn_points)
