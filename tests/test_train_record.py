"""train.py's record of a run on tiny models: what diverged, what is kept, what an evaluation or a crash
leaves on disk (tests/test_train.py: learning, resume, parallelism, bad input)."""

import json
import os

import pytest

import checkpoint
import train
from util import UserError
from conftest import copy_run, digest, divergence, run_cli, run_here, tiny
from disk_faults import full_disk_open


# --- a run's record: what diverged, what is kept, what an evaluation or a crash leaves ------------

HUGE_LR = dict(init_from="resume", grad_clip=0.0, warmup_iters=0, decay_lr=False, dtype="float32", eval_interval=1)


def test_a_finite_but_diverged_model_never_replaces_the_good_checkpoint(tiny_corpus, trained, tmp_path):
    """lr 1e3: the model after step 10 is finite, its val loss about 1.8e7 nats, far above ln(256) + 1."""
    import math
    import torch
    out = copy_run(trained, tmp_path)
    before = digest(out / "ckpt.pt")
    r = run_cli(tiny(tiny_corpus, out, max_iters=20, learning_rate=1e3, **HUGE_LR))
    assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "val loss is" in line and "above ln(vocab_size) + 1" in line and "step 11" in line
    assert digest(out / "ckpt.pt") == before
    record = json.load(open(out / "diverged.json"))
    assert record["what"] == "val_loss" and record["step"] == 11 and record["checkpoint_step"] == 10
    assert record["value"] > record["limit"] == pytest.approx(math.log(256) + 1)
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert ckpt["iter_num"] == 10


def test_b_t_far_below_b_target_stops_the_run_before_a_save(tiny_corpus, trained, tmp_path):
    """b_i = -5 by hand: b_t = 4 + (-5)(6 - 4) = -6, more than 8 bits below min(b_init 6, b_target 4)."""
    import torch
    out = copy_run(trained, tmp_path)
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    for k in ckpt["model"]:
        if k.endswith(".b_i"):
            ckpt["model"][k].fill_(-5.0)
    torch.save(ckpt, out / "ckpt.pt")
    before = digest(out / "ckpt.pt")
    with pytest.raises(train.Diverged, match=r"b_t fell to -6.*below min\(b_init, b_target\) - 8 = -4 at step 11"):
        train.main(tiny(tiny_corpus, out, max_iters=20, eval_interval=1, init_from="resume"))
    assert divergence(out) == {"step": 11, "what": "b_t", "checkpoint_step": 10}
    assert digest(out / "ckpt.pt") == before


def test_non_finite_weights_the_eval_does_not_see_stop_the_run(tiny_corpus, tmp_path):
    """A NaN row of Llama2's (untied) embedding for byte 255, which the data never holds: the loss
    stays finite, the weights are not."""
    import torch
    out = tmp_path / "llama"
    train.main(tiny(tiny_corpus, out, max_iters=10, arch="llama2", bias=False))
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    ckpt["model"]["transformer.wte.weight"][255] = float("nan")
    torch.save(ckpt, out / "ckpt.pt")
    before = digest(out / "ckpt.pt")
    with pytest.raises(train.Diverged, match="the model holds non-finite values at step 11"):
        train.main(tiny(tiny_corpus, out, max_iters=20, eval_interval=1, arch="llama2", bias=False, init_from="resume"))
    assert divergence(out) == {"step": 11, "what": "model", "checkpoint_step": 10}
    assert digest(out / "ckpt.pt") == before


def test_a_resumed_run_that_no_longer_diverges_drops_the_old_record(tiny_corpus, trained, tmp_path):
    out = copy_run(trained, tmp_path)
    (out / "diverged.json").write_text(json.dumps({"step": 11, "what": "loss"}))
    train.main(tiny(tiny_corpus, out, max_iters=12, init_from="resume"))
    assert not (out / "diverged.json").exists()


def test_an_evaluation_leaves_the_runs_config_and_metrics_as_they_are(tiny_corpus, trained, tmp_path, capsys):
    out = copy_run(trained, tmp_path)
    files = {f: (out / f).read_bytes() for f in ("config.json", "metrics.jsonl", "ckpt.pt")}
    train.main(tiny(tiny_corpus, out, max_iters=10, init_from="resume", eval_only=True, learning_rate=0.5))
    assert "step 10: train loss" in capsys.readouterr().out
    assert {f: (out / f).read_bytes() for f in files} == files


class Killed(BaseException):
    """What a kill -9 at that point leaves, in this process: nothing after it runs."""


def test_an_overwrite_killed_before_its_first_save_leaves_no_checkpoint_to_resume(tiny_corpus, trained, tmp_path,
                                                                                   monkeypatch):
    out = copy_run(trained, tmp_path)

    def killed(*args, **kwargs):
        raise Killed()
    monkeypatch.setattr(checkpoint, "save_run", killed)
    with pytest.raises(Killed):  # the new run (another lr) is killed at its first save, step 4
        train.main(tiny(tiny_corpus, out, max_iters=10, eval_interval=4, learning_rate=1e-3, overwrite=True))
    monkeypatch.undo()
    assert not (out / "ckpt.pt").exists()  # the replaced run's checkpoint went before the new run began
    with open(out / "metrics.jsonl") as f:
        assert [json.loads(line)["iter"] for line in f] == [0, 1, 2, 3, 4, 4]  # the new run's only (log, eval at 4)
    with pytest.raises(UserError, match="holds no checkpoint"):
        train.main(tiny(tiny_corpus, out, max_iters=10, init_from="resume"))


def full_disk_on(monkeypatch, marker):
    """open() and os.fdopen() as on a full disk for data that holds `marker`: the file is opened (a "w"
    truncates it), the write raises ENOSPC. Every open of any module goes through them (util's atomic
    writes through os.fdopen), old code's and new code's."""
    import builtins
    monkeypatch.setattr(builtins, "open", full_disk_open(builtins.open, marker))
    monkeypatch.setattr(os, "fdopen", full_disk_open(os.fdopen, marker))


def test_a_crash_while_resuming_rewrites_no_metrics_in_place(tiny_corpus, trained, tmp_path, monkeypatch):
    """The kept lines go to a temporary file renamed over metrics.jsonl: a write that fails there
    (here a full disk) leaves every record up to the checkpoint."""
    out = copy_run(trained, tmp_path)
    with open(out / "metrics.jsonl", "a") as f:  # a crashed continuation's record, to be dropped
        f.write(json.dumps({"iter": 11, "loss": 1.0}) + "\n")
    before = (out / "metrics.jsonl").read_bytes()
    full_disk_on(monkeypatch, '"iter"')
    with pytest.raises(UserError) as error:
        train.main(tiny(tiny_corpus, out, max_iters=12, init_from="resume"))
    monkeypatch.undo()
    assert "No space left on device" in str(error.value) and "\n" not in str(error.value)
    assert (out / "metrics.jsonl").read_bytes() == before
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]


def test_a_full_disk_at_config_json_is_one_line_and_keeps_the_old_one(tiny_corpus, trained, tmp_path, monkeypatch):
    out = copy_run(trained, tmp_path)
    files = {f: (out / f).read_bytes() for f in ("config.json", "metrics.jsonl", "ckpt.pt")}
    full_disk_on(monkeypatch, '"model_args"')
    with pytest.raises(UserError) as error:
        train.main(tiny(tiny_corpus, out, max_iters=12, init_from="resume"))
    monkeypatch.undo()
    assert "config.json: No space left on device" in str(error.value) and "\n" not in str(error.value)
    assert {f: (out / f).read_bytes() for f in files} == files
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]


def test_a_full_disk_at_a_metrics_line_is_one_line_and_keeps_the_checkpoint(tiny_corpus, trained, tmp_path,
                                                                           monkeypatch):
    out = copy_run(trained, tmp_path)
    before = digest(out / "ckpt.pt")
    full_disk_on(monkeypatch, '"iter": 12')  # the log line of step 12 finds the disk full
    with pytest.raises(UserError) as error:
        train.main(tiny(tiny_corpus, out, max_iters=14, eval_interval=2, init_from="resume"))
    monkeypatch.undo()
    message = str(error.value)
    assert "metrics.jsonl: No space left on device" in message and "\n" not in message
    assert f"the last good checkpoint is {out / 'ckpt.pt'}, step 10" in message
    assert digest(out / "ckpt.pt") == before
    with open(out / "metrics.jsonl") as f:
        assert max(json.loads(line)["iter"] for line in f) == 11


def test_a_full_disk_at_the_locks_pid_is_one_line_and_releases_the_lock(tiny_corpus, trained, tmp_path, monkeypatch):
    import errno
    import checkpoint
    out = copy_run(trained, tmp_path)
    files = {f: (out / f).read_bytes() for f in ("config.json", "metrics.jsonl", "ckpt.pt")}

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(UserError) as error:
        train.main(tiny(tiny_corpus, out, max_iters=12, init_from="resume"))
    monkeypatch.undo()
    assert ".lock: No space left on device" in str(error.value) and "\n" not in str(error.value)
    assert {f: (out / f).read_bytes() for f in files} == files
    checkpoint.lock(str(out)).release()  # not held any more


def test_a_full_disk_inside_torch_save_is_one_line_and_keeps_the_checkpoint(tiny_corpus, trained, tmp_path,
                                                                           monkeypatch):
    """torch.save turns the file's ENOSPC into RuntimeError "unexpected pos N vs M"."""
    import errno
    import io
    import checkpoint
    out = copy_run(trained, tmp_path)
    before = digest(out / "ckpt.pt")

    class FillsUp(io.FileIO):
        written = 0

        def write(self, b):
            FillsUp.written += len(b)
            if FillsUp.written > 100_000:
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().write(b)
    monkeypatch.setattr(checkpoint.os, "fdopen", lambda fd, mode: FillsUp(fd, "wb"))
    with pytest.raises(UserError) as error:
        train.main(tiny(tiny_corpus, out, max_iters=12, eval_interval=2, init_from="resume"))
    monkeypatch.undo()
    message = str(error.value)
    assert "No space left on device" in message and "unchanged" in message and "\n" not in message
    assert digest(out / "ckpt.pt") == before
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]


def dead_pid():
    """A pid no process has: above the kernel's largest (pid_max is at most 2^22), where a just-exited
    child's pid could be given to another process."""
    return 999_999_999


def test_the_next_run_removes_the_temporaries_of_dead_writers_only(tiny_corpus, trained, tmp_path):
    out = copy_run(trained, tmp_path)
    dead, live = dead_pid(), os.getpid()
    stale = [f".ckpt.pt.{dead}.0123abcd.tmp", f".metrics.jsonl.{dead}.89abcdef.tmp"]
    kept = [f".ckpt.pt.{live}.0123abcd.tmp", "notes.tmp", "ckpt.dcp.0123abcd"]  # a live writer's; not ours
    for name in stale + kept[:2]:
        (out / name).write_bytes(b"partial")
    (out / "ckpt.dcp.0badf00d").mkdir()  # a sharded save killed before its symlink swap
    (out / "ckpt.dcp.0badf00d" / ".metadata").write_bytes(b"partial")
    (out / "ckpt.dcp.0123abcd").mkdir()  # a directory of the same name, but nothing DCP wrote
    train.main(tiny(tiny_corpus, out, max_iters=12, init_from="resume"))
    left = set(os.listdir(out))
    assert not left & set(stale + ["ckpt.dcp.0badf00d"]) and set(kept) <= left


def test_weights_that_do_not_fit_the_checkpoints_model_args_are_one_line(tiny_corpus, trained, tmp_path, capsys):
    import torch
    out = copy_run(trained, tmp_path)
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    ckpt["model"]["transformer.wte.weight"] = ckpt["model"]["transformer.wte.weight"][:, :32].clone()
    torch.save(ckpt, out / "ckpt.pt")
    before = digest(out / "ckpt.pt")
    r = run_here(tiny(tiny_corpus, out, max_iters=20, init_from="resume"), capsys)
    assert r.returncode == 1, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "do not fit the model its model_args describe" in line and "size mismatch for transformer.wte.weight" in line
    assert digest(out / "ckpt.pt") == before
