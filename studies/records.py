"""What the runner keeps in a run directory beside train.py's files, how it is read and written, and the
check that a run the runner marked done has the records of one.

    <run>/done.json     {"status": "finished" or "diverged", "wall_s", "step" and "what" if diverged}
    <run>/run.json      the train.py arguments and config file it was made with, and every attempt
    <run>/export.json   export.py's val loss per exported format
    <run>/gguf.json     llama.cpp's val loss, size and bits per weight of each GGUF file of the run
    <run>/.study.lock   held by the runner that trains, resumes or exports the run

A run is done when its done.json exists; the runner writes it only after train.py has finished the
run (its last evaluation at max_iters, every loss finite and sane) or recorded its divergence
(diverged.json). The report reads a done run again through the same check (read_done): a run whose
records do not bear out its done.json (cut short, a NaN or absurd loss, marked diverged by hand) is
refused in one line, never averaged in.
"""
import json
import math
import os

import checkpoint as ckpt_io
import figures
from step import insanity
from util import UserError, read_record

STUDY_LOCK = ".study.lock"  # a runner's lock of a run directory (train.py's own is .lock)
GGUF_NUMBERS = ("val_loss_llama_cpp", "block_bits_per_weight", "bytes")  # in each file's record of gguf.json


class StudyError(UserError):
    """Bad input or a state the runner will not touch; the message is one line."""


def is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# The form of each record the runner keeps in a run directory; read_json refuses any other.
FORMS = {
    "done.json": ('{"status": "finished" or "diverged", "wall_s": seconds, "step": its step if diverged}',
                  lambda r: r.get("status") in ("finished", "diverged") and is_number(r.get("wall_s"))
                  and (r["status"] == "finished" or isinstance(r.get("step"), int))),
    "run.json": ('{"args": [...], "config_sha": "...", "attempts": [{"wall_s": seconds, "commit": "...", ...}]}',
                 lambda r: isinstance(r.get("args"), list) and isinstance(r.get("attempts"), list)
                 and all(isinstance(x, dict) and is_number(x.get("wall_s")) and isinstance(x.get("commit"), str)
                         for x in r["attempts"])),
    "export.json": ('{format: {"val_loss": number, ...}}',
                    lambda r: all(isinstance(e, dict) and is_number(e.get("val_loss")) for e in r.values())),
    "gguf.json": ('{spec: {"val_loss_llama_cpp": number, "block_bits_per_weight": number, "bytes": number, ...}}',
                  lambda r: all(isinstance(e, dict) and all(is_number(e.get(k)) for k in GGUF_NUMBERS)
                                for e in r.values())),
}


def read_json(path):
    """A record of the runner, or None where there is none. One that is not JSON, or not of its form
    (FORMS: hand-edited, damaged) is a StudyError naming the file (util.read_record)."""
    form, ok = FORMS.get(os.path.basename(path), ("a JSON object", lambda r: True))
    return read_record(path, f"a record of the study runner (expected {form})", ok, StudyError,
                       "fix it, or move it away for the runner to redo what it records")


def write_text(path, text):
    """Written whole or not at all: a reader never sees half a file (checkpoint.write_text)."""
    try:
        ckpt_io.write_text(path, text)
    except ckpt_io.CheckpointError as e:
        raise StudyError(str(e)) from None


def write_json(path, obj):
    write_text(path, json.dumps(obj, indent=1))


# --- a done run's records --------------------------------------------------------------------------

def bad_loss(value, vocab_size, trained):
    """Why a loss of a run train.py let go on is not one, or None: a cross-entropy is a finite number
    >= 0, and an evaluated val loss after the first step passes train.py's own rule (step.insanity:
    at most ln(vocab_size) + VAL_LOSS_MARGIN). vocab_size None: the first rule alone."""
    if not (is_number(value) and math.isfinite(value) and value >= 0):
        return f"{value!r} (a loss is a finite number >= 0)"
    broken = vocab_size and insanity({"val": value}, None, vocab_size, 0.0, trained)
    return f"{value:.4g}, above train.py's limit {broken[2]:.4f}" if broken else None


def bad_gguf_entry(record, vocab_size):
    """Why one file's record of gguf.json is not a measurement llama.cpp could have made, or None: its val loss
    held to bad_loss's rules (vocab_size: the run's, for train.py's limit; None: finite and >= 0 alone), its
    bytes a whole number > 0, its block Linears' bits per weight in (0, 32]."""
    lacking = [k for k in GGUF_NUMBERS if not is_number(record.get(k))]
    if lacking:
        return f"no {lacking[0]}"
    why = bad_loss(record["val_loss_llama_cpp"], vocab_size, trained=True)
    bits, size = record["block_bits_per_weight"], record["bytes"]
    if why:
        return f"val_loss_llama_cpp {why}"
    if not (math.isfinite(bits) and 0 < bits <= 32):
        return f"block_bits_per_weight {bits!r} (the bits per weight of a GGML type are in (0, 32])"
    if not (math.isfinite(size) and size == int(size) and size > 0):
        return f"bytes {size!r} (a file's size is a whole number > 0)"
    return None


def check_gguf_files(run_dir, files, vocab_size):
    """A StudyError (one line naming the run's gguf.json and the file) for the first record of files ({spec:
    record, or why there is none}) that is no measurement (bad_gguf_entry), which a report must not average."""
    for spec, record in files.items():
        why = isinstance(record, dict) and bad_gguf_entry(record, vocab_size)
        if why:
            raise StudyError(f"{os.path.join(run_dir, 'gguf.json')}: the record of {spec} holds {why}; remove that "
                             f"record, and the runner measures the file again")


def insane_record(run, until):
    """The first record of a run before step `until` (None: all) whose losses train.py would not have
    let pass (bad_loss), as a line, or None."""
    vocab_size = run["config"].get("model_args", {}).get("vocab_size")
    for kind, keys, limit in (("logs", ("loss",), None), ("evals", ("train/loss", "val/loss"), vocab_size)):
        for r in run[kind]:
            if until is not None and r["iter"] >= until:
                break
            for key in keys:
                why = bad_loss(r.get(key), limit if key == "val/loss" else None, r["iter"] > 0)
                if why:
                    return f"its {key} at step {r['iter']} is {why}"
    return None


def damage(run, done, max_iters, diverged):
    """Why a run's records (figures.read_run's) do not bear out its done.json `done`, or None.
    max_iters: the step its arm trains to; diverged: train.py's divergence record (None where none).
    A finished run has its last evaluation and its last log at max_iters, and every loss finite and
    sane; a diverged one the divergence train.py recorded (where its diverged.json is kept), no
    evaluation past it, and its records sane until then. A resumed run repeats its steps bit for
    bit, so no attempt of a run that diverged got past the step where it diverged."""
    if run["config"].get("max_iters") != max_iters:
        return f"its config.json says max_iters={run['config'].get('max_iters')!r}, its arm {max_iters}"
    last_eval = run["evals"][-1]["iter"] if run["evals"] else None
    last_log = run["logs"][-1]["iter"] if run["logs"] else None
    if done["status"] == "finished":
        if diverged is not None:
            return f"train.py recorded a divergence at step {diverged['step']} (diverged.json)"
        if last_eval != max_iters or last_log != max_iters:
            return (f"its records end with the evaluation of step {last_eval} and the log of step {last_log}, "
                    f"not of max_iters={max_iters} (cut short?)")
        return insane_record(run, None)
    step = done["step"]
    if diverged is not None and (diverged["step"], diverged["what"]) != (step, done.get("what", diverged["what"])):
        return f"train.py recorded the divergence at step {diverged['step']} ({diverged['what']}), not {step}"
    if not 0 <= step <= max_iters:
        return f"its divergence step {step} is outside 0..max_iters={max_iters}"
    if last_eval is not None and last_eval > step:  # train.py evaluates no step past the one it stopped at
        return f"its records hold an evaluation of step {last_eval}, past its divergence at step {step}"
    return insane_record(run, step)


def checked_run(run_dir, done, max_iters):
    """(figures.read_run's records read whole, why they do not bear out done or None); (None, why)
    where the records cannot be read (a line cut short, a diverged.json train.py did not write)."""
    try:
        run = figures.read_run(run_dir, whole=True)
        diverged = ckpt_io.read_divergence(run_dir)
    except UserError as e:
        return None, str(e)
    return run, damage(run, done, max_iters, diverged)


def read_done(run_dir, done, max_iters):
    """The records of a run its done.json says is done, checked (checked_run): a StudyError of one line
    for a run whose records do not bear it out, which a report must not average in."""
    run, why = checked_run(run_dir, done, max_iters)
    if why:
        raise StudyError(f"{run_dir}: done.json says {done['status']}, but {why}; move the run directory away "
                         f"for the runner to train it again")
    return run
