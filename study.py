"""The paper's comparisons at laptop scale: a named study runs its train.py runs and reports them.

    python study.py fig1b               # run (or continue) the study, then write its tables and plots
    python study.py fig1b --dry_run     # list its runs and the command of each, and the time the runs left take
    python study.py fig1b --nproc=2     # each run on 2 processes (torchrun --standalone); same losses
    python study.py fig1b --report      # its tables and plots from the runs done so far; trains nothing
    python study.py deploy --only=n3200 # only the runs whose name matches a regular expression
    python study.py                     # the options and the studies (as --help)

A study is a list of arms (a config file and --key=value overrides) times seeds. Each run is one
`python train.py CONFIG --key=value ... --seed=S --out_dir=out/study/runs/NAME`, its NAME made from
the config and the overrides, so an arm that two studies share (the bf16 run of Fig. 1b and of the
3-bit study) is trained once. Runs go one after another. A run is finished when its done.json
exists; train.py writes its checkpoint at every evaluation, and done.json is written only after
train.py exits 0 with its last evaluation at max_iters, so a run that was killed is resumed from
its last checkpoint (--init_from=resume: the same losses as an uninterrupted run), and a finished
one is skipped. A run that train.py stops as diverged (it writes diverged.json: the step, and
whether the loss, the gradient norm, the eval loss, the weights or b_t went wrong) is recorded as
diverged, not retried: the same seed diverges again.

Two runners may share the runs (two studies with the same bf16 runs, in two shells): a runner
holds a run directory's lock (.study.lock) while it trains, resumes or exports that run, and takes
it only when no train.py holds the directory either. A run held by another process is put off:
the runner does the others first, then waits for it, and skips it when the other has finished it.

Results go to out/study/<study>/: results.json and results.md (final val loss mean ± std over
seeds, tokens, wall time, b_t, and the exported model's val loss where the study exports) and
plots/ (plot.py's loss.png, bitwidth.png and paired.png). Every figure is read from the runs' own files:
metrics.jsonl, config.json, and the export reports.
"""
import collections
import hashlib
import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import checkpoint as ckpt_io
import configurator
import plot
from util import UserError, cli, git_commit, machine

REPO = os.path.dirname(os.path.abspath(__file__))
GPT2, LLAMA2 = "config/mini_gpt2.py", "config/mini_llama2.py"
HIGH_LR = 1e-2  # 5x the configs' 2e-3; our choice, to strain bf16 as the paper's unstable arm does
# At equal b_t, gaussws' R injects E[R²]/E[U²] times the noise variance of DiffQ's U(-1/2, 1/2)
# (E[U²] = 1/12). From Eq. 10: E[R²] = 4 Pr(|R|=2) + Pr(|R|=1) = 0.29215, 3.506x DiffQ's.
# The noise of Eq. 3 scales as 2^-b_t, its variance as 4^-b_t: DiffQ at b_t - log2(sqrt(3.506))
# = b_t - 0.905 injects the variance of gaussws at b_t.
_P2 = 0.75 * 2**-8  # Pr(|R| = 2), both signs
R_SQUARED = 4 * _P2 + 9 / 32 * (1 - _P2)
NOISE_BITS = round(0.5 * math.log2(R_SQUARED * 12), 3)  # 0.905


def arm(config, **overrides):
    """One setting of a study: a config file and --key=value overrides of it (not the seed)."""
    return {"config": config, "overrides": overrides}


BF16, BF16_HIGH = arm(GPT2, method="bf16"), arm(GPT2, method="bf16", learning_rate=HIGH_LR)
GAUSSWS, GAUSSWS_HIGH = arm(GPT2, method="gaussws[all]"), arm(GPT2, method="gaussws[all]", learning_rate=HIGH_LR)
DIFFQ, DIFFQ_HIGH = arm(GPT2, method="diffq[all]"), arm(GPT2, method="diffq[all]", learning_rate=HIGH_LR)
# The 3-bit regime: b_t = 2 + 4 b_i pulled toward b_target 2 by a b_i decay of 10: AdamW's decay
# alone (b_i *= 1 - lr * 10 a step, learning rates summing to about 0.22 over mini_gpt2.py's 200
# steps) leaves b_i near e^-2.2 = 0.11, b_t near 2.45 (measured: 2.47 [2.3, 2.7] over blocks, the
# loss's own gradient barely pushes back), where auto-int stores every block as int3 (ceil(b_t)).
# (config/cpu/gaussws_3bit.py: the same pull over 400 steps with a decay of 5.) Our choice.
LOW_BITS = dict(b_target=2.0, bitwidth_weight_decay=10.0)

STUDIES = {
    "fig1b": dict(
        about="Fig. 1b at laptop scale: bf16, gaussws[all] and diffq[all] at a comfortable lr (2e-3) and "
              "a high one (1e-2), from the same start (same seed) and the same batches",
        arms=[BF16, GAUSSWS, DIFFQ, BF16_HIGH, GAUSSWS_HIGH, DIFFQ_HIGH],
        seeds=(1, 2, 3), export=("auto", "mxfp6_e3m2"), export_bf16=False),
    "fig3a": dict(
        about="Fig. 3a at laptop scale: gaussws on one kind of layer at a time, b_target 0, at the high lr "
              "(where the paper looked for the source of bf16's instability)",
        arms=[BF16_HIGH] + [arm(GPT2, method=f"gaussws[{p}]", b_target=0.0, learning_rate=HIGH_LR)
                            for p in ("qkv", "out", "up", "down", "od")],
        seeds=(1,), export=("auto", "mxfp6_e3m2"), export_bf16=False),
    "fig3b": dict(
        about="Fig. 3b at laptop scale: Fig. 1b's high-lr arm with Adam-mini in place of AdamW",
        arms=[arm(GPT2, method=m, learning_rate=HIGH_LR, optimizer="adam_mini")
              for m in ("bf16", "gaussws[all]", "diffq[all]")],
        seeds=(1, 2, 3), export=("auto", "mxfp6_e3m2"), export_bf16=False),
    "fig4": dict(
        about="Fig. 4 at laptop scale: a small Llama2 with bf16, diffq[all] and gaussws[all]",
        arms=[arm(LLAMA2, method=m) for m in ("bf16", "diffq[all]", "gaussws[all]")],
        seeds=(1, 2, 3), export=("auto", "mxfp6_e3m2"), export_bf16=False),
    "3bit": dict(
        about="The 3-bit regime (beyond the paper): gaussws[all] and diffq[all] trained toward b_t <= 3, "
              "against the bf16 run quantized after training (PTQ), each exported at auto-int, int3 and mxfp4",
        arms=[BF16, arm(GPT2, method="gaussws[all]", **LOW_BITS), arm(GPT2, method="diffq[all]", **LOW_BITS)],
        seeds=(1, 2, 3), export=("auto-int", "int3", "mxfp4"), export_bf16=True),
    "noise": dict(
        about=f"DiffQ at an equal noise budget: diffq[all] with b_init and b_target lowered by "
              f"log2(sqrt(E[R²] * 12)) = {NOISE_BITS} bit, beside gaussws[all] and diffq[all] at equal b_t",
        arms=[GAUSSWS, DIFFQ, arm(GPT2, method="diffq[all]", b_init=round(6.0 - NOISE_BITS, 3),
                                                 b_target=round(4.0 - NOISE_BITS, 3))],
        seeds=(1, 2, 3), export=("auto", "mxfp6_e3m2"), export_bf16=False),
}

# --- the deployment study (beyond the paper): where PQT pays against PTQ and STE-QAT -------------
# A bf16 run per training length is the trunk; every phase arm forks from its checkpoint at the
# arm's switch step (train.py --fork_from): until the switch a phase run *is* the bf16 run (the
# same weights, optimizer state, batches and seed; tests/test_phase.py), so it spends exactly the
# bf16 run's tokens and only its phase is trained again. Our choices: the lengths (1, 4 and 16
# tokens per parameter of mini_gpt2_deploy.py's 0.8M parameters), a phase of the last 15 % (ParetoQ:
# about 10 %), 3 seeds at the longest and 1 elsewhere, the 3.5-bit budget of the mixed arms.
DEPLOY = "config/mini_gpt2_deploy.py"
DEPLOY_STEPS = (200, 800, 3200)
DEPLOY_SEEDS = {200: (1,), 800: (1,), 3200: (1, 2, 3)}
DEPLOY_FORMATS = {200: ("int3", "int4"), 800: ("int3", "int4"), 3200: ("int3", "int2", "int4", "mxfp4")}
# Element bits per weight of the mixed-precision arms (int2/int3/int4 per block, export.py's budget):
# half-way between int3 and int4, so that the ranking decides which blocks get the fourth bit. At a
# whole 3.0 every ranking gives uniform int3 here: a block gets int4 before another gets int3 only
# where their b_t (or errors, in bits) differ by more than a bit, and a phase moves b_t by about the
# sum of its learning rates, a few hundredths of a bit.
BUDGET = 3.5
PHASE = 0.85  # where the phases start, as a fraction of the run: the last 15 %
MIX_PHASE = 0.7  # where the learned mix's gaussws phase starts (it learns the b_t that allocate, then STE from PHASE)
SWEEP_B_T = (3.0, 4.0)  # the gaussws int3 phase's b_t swept at 800 steps, beside the matched level 3.49
# The sweep's lowest exported int3 loss (one seed; docs/study/deploy/results.md): the longest length
# runs the gaussws int3 phase at it too, beside the matched level. None: the matched level alone.
BEST_B_T = 4.0


def scratch_decay(steps):
    """bitwidth_weight_decay that brings b_i from 1 to 0.1 over a run from scratch: AdamW multiplies b_i
    by (1 - lr * decay) a step, so b_i ends near exp(-decay * sum of the learning rates)."""
    warmup, top, low = 25, 2e-3, 2e-4
    lrs = [top * (i + 1) / (warmup + 1) if i < warmup else
           low + 0.5 * (1 + math.cos(math.pi * (i - warmup) / (steps - warmup))) * (top - low) for i in range(steps)]
    return round(math.log(10) / sum(lrs), 2)


def deploy_arm(kind, fmt, steps, export, trunk=None, **overrides):
    a = arm(DEPLOY, **overrides, max_iters=steps, lr_decay_iters=steps, eval_interval=steps // 4)
    return {**a, "kind": kind, "format": fmt, "steps": steps, "seeds": DEPLOY_SEEDS[steps], "export": export,
            "trunk": trunk}


def deploy_arms():
    """Every arm of the deployment study: per length its bf16 trunk, the arms that fork from it, then
    the arms from scratch (the costliest, last)."""
    arms, bits = [], f"{BUDGET:g}"
    for n in DEPLOY_STEPS:
        phase = round(PHASE * n)
        trunk = deploy_arm("bf16 + PTQ", "", n, [*DEPLOY_FORMATS[n], f"error-int@{bits}"], method="bf16")
        forks, scratch = [], []
        for f in DEPLOY_FORMATS[n]:
            forks.append(deploy_arm("STE phase", f, n, [f], trunk, method="ste[all]", target_format=f, pqt_start=phase))
            # b_t at the level matched to the format's rounding error (train.matched_b_t)
            forks.append(deploy_arm("gaussws phase", f, n, [f], trunk, method="gaussws[all]", target_format=f,
                                    pqt_start=phase))
            if n == DEPLOY_STEPS[-1] and f == "int3" and BEST_B_T is not None:  # the 800-step sweep's pick
                forks.append(deploy_arm(f"gaussws phase b_t {BEST_B_T:g}", f, n, [f], trunk, method="gaussws[all]",
                                        pqt_start=phase, b_init=BEST_B_T, b_target=BEST_B_T))
            forks.append(deploy_arm("diffq phase", f, n, [f], trunk, method="diffq[all]", target_format=f, pqt_start=phase))
            scratch.append(deploy_arm("gaussws from scratch", f, n, [f], method="gaussws[all]", target_format=f,
                                      bitwidth_weight_decay=scratch_decay(n)))
        forks.append(deploy_arm(f"learned mix {bits} bits", "int3", n, [f"auto-int@{bits}"], trunk,
                                method="gaussws[all]", target_format="auto-int", bits_per_weight=BUDGET,
                                pqt_start=round(MIX_PHASE * n), ste_start=phase))
        forks.append(deploy_arm(f"error mix {bits} bits", "int3", n, [f"error-int@{bits}"], trunk, method="ste[all]",
                                target_format="error-int", bits_per_weight=BUDGET, pqt_start=phase))
        if n == DEPLOY_STEPS[-1]:  # the learned mix's phases exactly, only the ranking by error: the allocator alone
            forks.append(deploy_arm(f"gaussws phase + error mix {bits} bits", "int3", n, [f"error-int@{bits}"], trunk,
                                    method="gaussws[all]", target_format="error-int", bits_per_weight=BUDGET,
                                    pqt_start=round(MIX_PHASE * n), ste_start=phase))
        if n == 800:
            forks += [deploy_arm(f"gaussws phase b_t {b:g}", "int3", n, ["int3"], trunk, method="gaussws[all]",
                                 pqt_start=phase, b_init=b, b_target=b) for b in SWEEP_B_T]
            forks += [deploy_arm(f"{kind} 50 %", "int3", n, ["int3"], trunk, method=method, target_format="int3",
                                 pqt_start=n // 2) for kind, method in (("STE phase", "ste[all]"),
                                                                        ("gaussws phase", "gaussws[all]"))]
        trunk["keep"] = sorted({a["overrides"]["pqt_start"] for a in forks})
        arms += [trunk, *forks, *scratch]
    return arms


STUDIES["deploy"] = dict(
    about="Where PQT pays (beyond the paper): bf16 + PTQ against a PQT (gaussws, diffq) or STE-QAT (torchao) "
          "phase over the last 15 %, gaussws from scratch, and learned mixed precision, over 1-16 tokens per parameter",
    arms=deploy_arms(), seeds=(1,), export=(), export_bf16=True, report="deploy")

# --- the llama.cpp study (beyond the paper): trained GGUF files against llama-quantize -------------
# A model llama.cpp can K-quantize (config/mini_gpt2_gguf.py: every Linear input width a multiple of
# 256), one bf16 trunk per seed trained to 8 tokens per parameter; its phases fork from the trunk's
# checkpoints at 70 % (the learned mix's gaussws phase) and 85 % (the STE phases), as the deployment
# study's do, and llama.cpp's own quantizer starts from its last one.
GGUF_CONFIG = "config/mini_gpt2_gguf.py"
GGUF_STEPS = 6400
GGUF_SEEDS = (1, 2, 3)


def gguf_arms():
    """The llama.cpp study's arms: per seed, the bf16 trunk, kept at the phases' fork steps."""
    trunk = arm(GGUF_CONFIG, method="bf16", max_iters=GGUF_STEPS, lr_decay_iters=GGUF_STEPS,
                eval_interval=GGUF_STEPS // 4)
    trunk.update(kind="bf16", seeds=GGUF_SEEDS, keep=sorted({round(MIX_PHASE * GGUF_STEPS), round(PHASE * GGUF_STEPS)}))
    return [trunk]


STUDIES["gguf"] = dict(
    about="Trained GGUF files against llama.cpp's quantizer (beyond the paper): STE phases on llama.cpp's grids "
          "and learned per-tensor types, against llama-quantize with an importance matrix, judged by llama.cpp",
    arms=gguf_arms(), seeds=GGUF_SEEDS, export=(), export_bf16=False)

SHORT = {"method": "", "learning_rate": "lr", "optimizer": "", "b_init": "binit", "b_target": "btarget",
         "bitwidth_weight_decay": "bwd", "target_format": "", "pqt_start": "from", "ste_start": "ste",
         "bits_per_weight": "bpw", "max_iters": "n", "lr_decay_iters": "decay", "eval_interval": "eval"}
STUDY_LOCK = ".study.lock"  # a runner's lock of a run directory (train.py's own is .lock)
BUSY = "busy"  # train_one: another process holds the run


class StudyError(UserError):
    """Bad input or a state the runner will not touch; the message is one line."""


def run_name(a, seed):
    """A directory name for one run, readable and unique for (config, overrides, seed)."""
    stem = os.path.basename(a["config"])[:-3].removeprefix("mini_")
    keys = sorted(a["overrides"], key=lambda k: (k != "method", k))
    value = {k: f"{v:g}" if isinstance(v, float) else str(v) for k, v in a["overrides"].items()}
    parts = [stem] + [SHORT.get(k, k) + value[k] for k in keys] + [f"s{seed}"]
    return re.sub(r"[^A-Za-z0-9.=+-]+", "_", "-".join(parts)).strip("_").replace("_-", "-")


def runs_of(study):
    """[(name, arm, seed)] of a study: every arm with every seed, arms first."""
    return [(run_name(a, s), a, s) for a in study["arms"] for s in a.get("seeds", study["seeds"])]


def train_args(a, seed, out_dir):
    """train.py's arguments for one run (without --init_from)."""
    return [a["config"], *(f"--{k}={v}" for k, v in a["overrides"].items()), f"--seed={seed}", f"--out_dir={out_dir}"]


def launcher(nproc):
    if nproc == 1:
        return [sys.executable, "train.py"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "train.py"]


def _number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# The form of each record the runner keeps in a run directory; read_json refuses any other.
FORMS = {
    "done.json": ('{"status": "finished" or "diverged", "wall_s": seconds, "step": its step if diverged}',
                  lambda r: r.get("status") in ("finished", "diverged") and _number(r.get("wall_s"))
                  and (r["status"] == "finished" or isinstance(r.get("step"), int))),
    "run.json": ('{"args": [...], "config_sha": "...", "attempts": [{"wall_s": seconds, "commit": "...", ...}]}',
                 lambda r: isinstance(r.get("args"), list) and isinstance(r.get("attempts"), list)
                 and all(isinstance(x, dict) and _number(x.get("wall_s")) and isinstance(x.get("commit"), str)
                         for x in r["attempts"])),
    "export.json": ('{format: {"val_loss": number, ...}}',
                    lambda r: all(isinstance(e, dict) and _number(e.get("val_loss")) for e in r.values())),
}


def read_json(path):
    """A record of the runner, or None where there is none. One that is not JSON, or not of its form
    (FORMS: hand-edited, damaged) is a StudyError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise StudyError(f"cannot read {path} ({type(e).__name__}: {str(e)[:200]}); fix it, or move it away "
                         f"for the runner to redo what it records") from None
    form, ok = FORMS.get(os.path.basename(path), ("a JSON object", lambda r: True))
    if not isinstance(record, dict) or not ok(record):
        raise StudyError(f"{path} is not a record of study.py (expected {form}); fix it, or move it away for "
                         f"the runner to redo what it records")
    return record


def write_json(path, obj):
    """Written whole or not at all: a reader never sees half a file (checkpoint.write_text)."""
    try:
        ckpt_io.write_text(path, json.dumps(obj, indent=1))
    except ckpt_io.CheckpointError as e:
        raise StudyError(str(e)) from None


def file_sha(path):
    with open(os.path.join(REPO, path), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def check_run_dir(run_dir, args, config):
    """run.json records what a run directory was made with; refuse one made with other settings."""
    record = read_json(os.path.join(run_dir, "run.json"))
    want = {"args": args, "config_sha": file_sha(config)}
    if record is not None and {k: record.get(k) for k in want} != want:
        what = "its config file has changed" if record.get("args") == args else "other arguments"
        raise StudyError(f"{run_dir} was made with {what} (see its run.json); move it away to run it again")
    return record or {**want, "attempts": []}


def claim(run_dir, wait):
    """This runner's hold on a run directory: its STUDY_LOCK, taken when no train.py holds the
    directory's own lock either (another runner's, or one started by hand). None where either is
    held, or with wait, once both are free. The train.py lock is let go at once, for the train.py
    this runner starts; no other runner can come between, as each takes STUDY_LOCK first."""
    held = None
    try:
        held = ckpt_io.lock(run_dir, wait=wait, name=STUDY_LOCK)
        ckpt_io.lock(run_dir, wait=wait).release()
        return held
    except ckpt_io.CheckpointError as e:
        if held:
            held.release()
        if isinstance(e, ckpt_io.Busy):
            return None
        raise StudyError(str(e)) from None


def train_one(name, a, seed, root, nproc, echo, wait=False):
    """Run (or resume) one run to its end, holding claim(run_dir). Returns its done.json record (of
    this runner or of another that finished it first), BUSY when another process holds the run and
    not wait, or None if train.py failed and did not record a divergence (the run is then tried
    again on the next call)."""
    run_dir = os.path.join(root, "runs", name)
    held = claim(run_dir, wait)
    if held is None:
        return BUSY
    with held:
        return read_json(os.path.join(run_dir, "done.json")) or launch(name, a, seed, run_dir, nproc, echo)


def launch(name, a, seed, run_dir, nproc, echo):
    """train.py on one run, new or resumed; its done.json record, or None (train_one). A trunk (an arm
    with "keep") is trained in segments that stop at each kept step, whose checkpoint is kept as
    ckpt_<step>.pt for the arms that fork there (a resumed run repeats an uninterrupted one, and an
    evaluation changes no state). An arm with a "trunk" starts from that run's ckpt_<pqt_start>.pt."""
    args = train_args(a, seed, run_dir)
    record = check_run_dir(run_dir, args, a["config"])
    ckpt = os.path.join(run_dir, "ckpt.pt")
    resume = os.path.exists(ckpt)  # else a new run: train.py starts its metrics afresh
    start = [f"--init_from={'resume' if resume else 'scratch'}"]
    if a.get("trunk") and not resume:
        fork = os.path.join(os.path.dirname(run_dir), run_name(a["trunk"], seed), f"ckpt_{a['overrides']['pqt_start']}.pt")
        if not os.path.exists(fork):
            print(f"  {name}: its trunk {run_name(a['trunk'], seed)} has not kept {os.path.basename(fork)} yet; run it first")
            return None
        start = ["--init_from=scratch", f"--fork_from={fork}"]
    for step in a.get("keep", ()):
        kept_ckpt = os.path.join(run_dir, f"ckpt_{step}.pt")
        if os.path.exists(kept_ckpt):
            continue
        rc, tail = run_train(launcher(nproc) + args + [f"--max_iters={step}"] + start, nproc, run_dir, record, echo)
        if rc != 0:
            return finish(name, run_dir, record, rc, tail)
        try:
            ckpt_io.copy(ckpt, kept_ckpt)
        except ckpt_io.CheckpointError as e:
            raise StudyError(str(e)) from None
        start = ["--init_from=resume"]
    rc, tail = run_train(launcher(nproc) + args + start, nproc, run_dir, record, echo)
    return finish(name, run_dir, record, rc, tail)


def run_train(cmd, nproc, run_dir, record, echo):
    """One train.py process, its output echoed and appended to train.log, the attempt recorded in
    run.json. Returns (exit status, the last lines of its output)."""
    attempt = {"command": shlex.join(["python", *cmd[1:]]), "nproc": nproc, "commit": git_commit(),
               "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    t0, tail = time.time(), []
    with open(os.path.join(run_dir, "train.log"), "a") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            for line in proc.stdout:
                log.write(line)
                tail = (tail + [line.rstrip()])[-20:]
                if echo:
                    print("    " + line, end="", flush=True)
            rc = proc.wait()
        except BaseException:  # Ctrl-C or a kill of the runner: stop train.py too, keep the time it ran
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            record["attempts"].append({**attempt, "wall_s": time.time() - t0, "exit": "interrupted"})
            write_json(os.path.join(run_dir, "run.json"), record)
            raise
    record["attempts"].append({**attempt, "wall_s": time.time() - t0, "exit": rc})
    write_json(os.path.join(run_dir, "run.json"), record)
    return rc, tail


def finish(name, run_dir, record, rc, tail):
    """done.json of a run whose last train.py exited with rc, or None when it failed."""
    wall_s = sum(x["wall_s"] for x in record["attempts"])
    try:  # train.py's record of a divergence, written only by the attempt that stopped (it exits 3)
        diverged = ckpt_io.read_divergence(run_dir) if rc else None
    except ckpt_io.CheckpointError as e:
        print(f"  {name}: {e}")
        return None
    if rc == 0:
        run = plot.read_run(run_dir)
        if not run["evals"] or run["evals"][-1]["iter"] != run["config"]["max_iters"]:
            print(f"  {name}: train.py exited 0 without its evaluation at max_iters; see {run_dir}/train.log")
            return None
        done = {"status": "finished", "wall_s": wall_s}
    elif diverged:
        done = {"status": "diverged", "step": diverged["step"], "what": diverged["what"], "wall_s": wall_s}
    else:
        print(f"  {name}: train.py failed (exit {rc}): {tail[-1] if tail else ''}; see {run_dir}/train.log")
        return None
    write_json(os.path.join(run_dir, "done.json"), done)
    return done


def export_losses(run_dir, formats):
    """{format: val loss of the run's checkpoint exported at that format, or why there is none}.

    The one place that knows export.py's command line: `python export.py --out_dir=RUN
    --format=F1,F2 --json=PATH --save=False` writes one JSON object to PATH whose "exports" hold a record
    per format with its "val_loss" (on train.py's evaluation batches), "val_loss_unquantized" and
    "bits_per_weight". export.py also draws the b_t histograms per layer role of a PQT checkpoint
    (bitwidths.png in the run directory). Records are kept in the run directory (export.json), so
    each format is exported once. Without export.py: "export unavailable".
    """
    try:  # one runner exports a run at a time; the other then finds the records
        with ckpt_io.lock(run_dir, wait=True, name=STUDY_LOCK):
            return _export_losses(run_dir, formats)
    except ckpt_io.CheckpointError as e:
        raise StudyError(str(e)) from None


def _export_losses(run_dir, formats):
    """export_losses under the run's lock. A format "F@B" is F at a budget of B bits per weight
    (export.py --bits_per_weight=B), one export.py call per budget."""
    cache_path = os.path.join(run_dir, "export.json")
    cache = read_json(cache_path) or {}
    missing = [f for f in formats if f not in cache]
    if missing and not os.path.exists(os.path.join(REPO, "export.py")):
        return {f: cache.get(f, "export unavailable") for f in formats}
    for budget in dict.fromkeys(f.partition("@")[2] for f in missing):
        group = [f for f in missing if f.partition("@")[2] == budget]
        with tempfile.TemporaryDirectory() as tmp:
            report = os.path.join(tmp, "export.json")
            cmd = [sys.executable, "export.py", f"--out_dir={run_dir}",
                   f"--format={','.join(f.partition('@')[0] for f in group)}", f"--json={report}", "--save=False"]
            r = subprocess.run(cmd + ([f"--bits_per_weight={budget}"] if budget else []), cwd=REPO,
                               capture_output=True, text=True)
            if r.returncode != 0:
                last = (r.stderr.strip() or r.stdout.strip() or "no output").splitlines()[-1]
                return {f: cache.get(f, f"export failed: {last}") for f in formats}
            try:
                with open(report) as fh:
                    records = {e["format"]: e for e in json.load(fh)["exports"]}
            except (OSError, ValueError, KeyError, TypeError) as e:
                return {f: cache.get(f, f"export.py's --json file is not the JSON expected ({type(e).__name__})")
                        for f in formats}
        for f in group:
            record = records.get(f.partition("@")[0], {})
            if not isinstance(record.get("val_loss"), (int, float)):
                return {f: cache.get(f, f"export.py reported no val_loss for {f}") for f in formats}
            cache[f] = {k: record.get(k) for k in ("val_loss", "val_loss_unquantized", "bits_per_weight")}
        write_json(cache_path, cache)
    return {f: cache[f] for f in formats}


def stats(values):
    """mean, sample standard deviation (n - 1; None for one value), n."""
    n = len(values)
    if not n:
        return {"mean": None, "std": None, "n": 0, "values": []}
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else None
    return {"mean": mean, "std": std, "n": n, "values": values}


def run_figures(run_dir, done, run=None):
    """The figures of one run, from its own metrics.jsonl and config.json (`run`: plot.read_run's, if read)."""
    run = run or plot.read_run(run_dir)
    last_eval, last_log = run["evals"][-1], (run["logs"][-1] if run["logs"] else {})
    config = run["config"]
    train_s = 0.0  # training time logged by train.py: ms per step times the steps since the previous log line
    prev = 0
    for r in run["logs"]:
        train_s += r["ms_per_iter"] / 1000 * (r["iter"] - prev)
        prev = r["iter"]
    return {
        "status": done["status"], "diverged_at": done.get("step"), "diverged_what": done.get("what"),
        "iter": last_eval["iter"], "tokens": last_eval["iter"] * run["tokens_per_iter"],
        "val_loss": last_eval["val/loss"], "train_loss": last_eval["train/loss"],
        "wall_s": done["wall_s"], "train_s": train_s,
        "b_t": {k: last_log[f"b_t/{k}"] for k in ("mean", "min", "max")} if "b_t/mean" in last_log else None,
        "method": config["method"], "seed": config["seed"], "torch": config.get("versions", {}).get("torch"),
        "machine": config.get("versions", {}).get("machine"),
        "device": config.get("device"), "world_size": config.get("world_size"),
    }


def machines(runs):
    """The machines the runs record (train.py's config.json), each with its count of runs; runs that
    record none (made before train.py recorded it) are said to be so, with the machine writing this."""
    runs = list(runs)
    recorded = collections.Counter(f["machine"] for f in runs if f.get("machine"))
    unrecorded = len(runs) - sum(recorded.values())
    parts = [f"{m} ({n} run{'s' if n > 1 else ''})" for m, n in sorted(recorded.items())] if len(recorded) != 1 or unrecorded \
        else list(recorded)
    if unrecorded:
        parts.append(f"not recorded by {unrecorded} run{'s' if unrecorded > 1 else ''} (this report was written on "
                     f"{machine()})")
    return "; ".join(parts) or machine()


def reference_arm(a):
    """The bf16 arm an arm is paired with: the same config and overrides, method bf16 (None for a
    bf16 arm). With the same seed the two start from the same weights and see the same batches,
    so their difference per seed is free of the seed-to-seed spread."""
    if a["overrides"].get("method", "bf16") == "bf16":
        return None
    return arm(a["config"], **{**{k: v for k, v in a["overrides"].items() if k not in plot.PQT_ONLY}, "method": "bf16"})


def paired(entry, a, study, root, runs):
    """entry["vs_bf16"]: per seed, this arm's val loss (and exported val loss per format) minus its
    reference bf16 run's (exported at the same format: quantized after training), mean ± std over
    the seeds where both finished. The reference run is read from its directory whether or not it is
    one of this study's arms (it then has to have been run, e.g. by the study that has it)."""
    ref = reference_arm(a)
    if ref is None:
        return
    val, exports = [], {f: [] for f in study["export"]}
    for seed in study["seeds"]:
        mine, ref_name = runs.get(run_name(a, seed)), run_name(ref, seed)
        ref_dir = os.path.join(root, "runs", ref_name)
        done = read_json(os.path.join(ref_dir, "done.json"))
        if mine is None or mine["status"] != "finished" or not done or done["status"] != "finished":
            continue
        ref_val = (runs.get(ref_name) or run_figures(ref_dir, done))["val_loss"]  # read already if in this study
        val.append(mine["val_loss"] - ref_val)
        ref_export = read_json(os.path.join(ref_dir, "export.json")) or {}  # export_losses' cache
        for f in exports:
            e, r = mine.get("export", {}).get(f), ref_export.get(f)
            if isinstance(e, dict) and isinstance(r, dict):
                exports[f].append(e["val_loss"] - r["val_loss"])
    entry["vs_bf16"] = {"reference": arm_label(ref), "runs": [run_name(ref, s) for s in study["seeds"]],
                        "val_loss": stats(val), "export": {f: stats(v) for f, v in exports.items()}}


def summarize(name, study, root):
    """results.json's content: per run and per arm (mean ± std over seeds), from the runs' files."""
    runs, arms = {}, []
    for a in study["arms"]:
        names = [run_name(a, s) for s in study["seeds"]]
        figures = []
        for n in names:
            run_dir = os.path.join(root, "runs", n)
            done = read_json(os.path.join(run_dir, "done.json"))
            if done is None:
                continue
            runs[n] = fig = run_figures(run_dir, done)
            if study["export"] and (fig["method"] != "bf16" or study["export_bf16"]) and done["status"] == "finished":
                fig["export"] = export_losses(run_dir, study["export"])
                histogram = os.path.join(run_dir, "bitwidths.png")  # export.py's figure of a PQT run
                fig["b_t_histogram"] = histogram if os.path.exists(histogram) else None
            figures.append(fig)
        ok = [f for f in figures if f["status"] == "finished"]
        entry = {"config": a["config"], "overrides": a["overrides"], "runs": names, "finished": len(ok),
                 "diverged": [{"seed": f["seed"], "step": f["diverged_at"], "what": f["diverged_what"]}
                              for f in figures if f["status"] == "diverged"],
                 "val_loss": stats([f["val_loss"] for f in ok]), "train_loss": stats([f["train_loss"] for f in ok]),
                 "tokens": sorted({f["tokens"] for f in ok}), "wall_s": stats([f["wall_s"] for f in figures]),
                 "b_t": {k: stats([f["b_t"][k] for f in ok if f["b_t"]]) for k in ("mean", "min", "max")}}
        if ok and "export" in ok[0]:
            entry["export"] = {}
            for fmt in study["export"]:
                done_ = [f["export"][fmt] for f in ok if isinstance(f["export"][fmt], dict)]
                # the increase over the unquantized loss export.py measured on the same batches
                # (train.py's last evaluation where export.py did not report it)
                increase = [100 * (e["val_loss"] / (e["val_loss_unquantized"] or f["val_loss"]) - 1)
                            for f, e in ((f, f["export"][fmt]) for f in ok) if isinstance(e, dict)]
                bits = [e["bits_per_weight"] for e in done_ if isinstance(e.get("bits_per_weight"), (int, float))]
                why = sorted({f["export"][fmt] for f in ok if not isinstance(f["export"][fmt], dict)})
                entry["export"][fmt] = {"val_loss": stats([e["val_loss"] for e in done_]),
                                        "increase_pct": stats(increase), "bits_per_weight": stats(bits), "missing": why}
        arms.append(entry)
    for entry, a in zip(arms, study["arms"]):  # after all arms: a reference's exports are then written
        paired(entry, a, study, root, runs)
    return {"study": name, "about": study["about"], "command": f"python study.py {name}", "seeds": list(study["seeds"]),
            "machine": machines(runs.values()), "torch": sorted({f["torch"] for f in runs.values() if f["torch"]}),
            "devices": sorted({f"{f['device']} x{f['world_size']}" for f in runs.values()}),
            "commits": sorted({x["commit"] for n in runs for x in (read_json(os.path.join(root, "runs", n, "run.json")) or {}).get("attempts", [])}),
            "runs_finished": len(runs), "runs_total": len(runs_of(study)), "arms": arms, "runs": runs}


def fmt_stats(s, digits=4, pct=False, signed=False):
    if not s["n"]:
        return "-"
    unit = " %" if pct else ""
    mean = f"{s['mean']:+.{digits}f}" if pct or signed else f"{s['mean']:.{digits}f}"
    return mean + unit if s["std"] is None else f"{mean} ± {s['std']:.{digits}f}{unit}"


def arm_label(a):
    return " ".join([os.path.basename(a["config"])] + [f"{k}={v}" for k, v in a["overrides"].items()])


def markdown(results):
    """results.md: the table a README can take whole."""
    lines = [f"# {results['study']}: {results['about']}", "",
             f"Command: `{results['command']}`. Machine: {results['machine']}; device {', '.join(results['devices']) or '-'}; "
             f"torch {', '.join(results['torch']) or '-'}; commit {', '.join(results['commits']) or '-'}. "
             f"Runs finished: {results['runs_finished']} of {results['runs_total']}. Seeds {results['seeds']}; "
             f"± is the standard deviation over seeds (n - 1); losses are the last evaluation's (PQN off).", ""]
    export_formats = sorted({f for a in results["arms"] for f in a.get("export", {})},
                            key=lambda f: [f for a in results["arms"] for f in a.get("export", {})].index(f))
    head = ["arm", "seeds done", "val loss", "train loss", "tokens", "wall min/run", "b_t mean [min, max]"]
    head += [f"val loss at {f} (increase)" for f in export_formats]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for a in results["arms"]:
        seeds = f"{a['finished']}" + (f" (+{len(a['diverged'])} diverged at step " +
                                      ", ".join(str(d["step"]) for d in a["diverged"]) + ")" if a["diverged"] else "")
        b = a["b_t"]
        bits = "-" if not b["mean"]["n"] else f"{b['mean']['mean']:.2f} [{b['min']['mean']:.2f}, {b['max']['mean']:.2f}]"
        wall = "-" if not a["wall_s"]["n"] else f"{a['wall_s']['mean'] / 60:.1f}"
        row = [arm_label(a), seeds, fmt_stats(a["val_loss"]), fmt_stats(a["train_loss"]),
               ", ".join(f"{t:,}" for t in a["tokens"]) or "-", wall, bits]
        for f in export_formats:
            e = a.get("export", {}).get(f)
            if e is None:
                row.append("-")
            elif e["val_loss"]["n"]:
                bits = f", {e['bits_per_weight']['mean']:.2f} bits/w" if e["bits_per_weight"]["n"] else ""
                row.append(f"{fmt_stats(e['val_loss'])} ({fmt_stats(e['increase_pct'], 2, pct=True)}{bits})")
            else:
                row.append("; ".join(e["missing"]) or "-")
        lines.append("| " + " | ".join(row) + " |")
    pairs = [a for a in results["arms"] if a.get("vs_bf16")]
    if pairs:
        exported = [f for f in export_formats if any(a["vs_bf16"]["export"].get(f, {}).get("n") for a in pairs)]
        head = ["arm", "paired with", "seeds", "val loss − bf16's"]
        head += [f"exported at {f} − bf16 at {f}" for f in exported]
        lines += ["", "Paired by seed with the bf16 run of the same settings (same initial weights, same batches): "
                  "the difference of the final val losses (negative: lower than bf16's), and of the exported "
                  "models' (the bf16 run quantized after training), mean ± std over seeds.", "",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for a in pairs:
            v = a["vs_bf16"]
            row = [arm_label(a), v["reference"], str(v["val_loss"]["n"]), fmt_stats(v["val_loss"], signed=True)]
            row += [fmt_stats(v["export"][f], signed=True) if f in v["export"] else "-" for f in exported]
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", "b_t: the last log line's mean, min and max over all blocks, averaged over seeds. "
              "Increase: the exported model's val loss over the unquantized checkpoint's on the same batches "
              "(export.py), in %, mean ± std over seeds; bits/w: export.py's bits per quantized weight, scales included. "
              "Plots: plots/loss.png, plots/bitwidth.png, plots/paired.png; the b_t histograms per layer role of each exported PQT "
              "run: runs/<run>/bitwidths.png (export.py).", ""]
    return "\n".join(lines)


def write_results(name, study, root):
    if study.get("report") == "deploy":
        return write_deploy(name, study, root)
    out = os.path.join(root, name)
    os.makedirs(out, exist_ok=True)
    results = summarize(name, study, root)
    write_json(os.path.join(out, "results.json"), results)
    try:
        ckpt_io.write_text(os.path.join(out, "results.md"), markdown(results))
    except ckpt_io.CheckpointError as e:
        raise StudyError(str(e)) from None
    run_dirs = [os.path.join(root, "runs", n) for n in results["runs"]]
    # the bf16 runs the paired table used that are not this study's (the noise study's are fig1b's)
    twins = sorted({os.path.join(root, "runs", n) for a in results["arms"] if a.get("vs_bf16")
                    for n in a["vs_bf16"]["runs"] if n not in results["runs"]})
    twins = [d for d in twins if (read_json(os.path.join(d, "done.json")) or {}).get("status") == "finished"]
    written = plot.make_plots(run_dirs, os.path.join(out, "plots"), title_prefix=name, twin_dirs=twins) if run_dirs else []
    return [os.path.join(out, "results.json"), os.path.join(out, "results.md"), *written]


# --- the deployment study's tables and plots --------------------------------------------------

T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571}  # Student's t, 97.5 % quantile, by degrees of freedom


def interval(values):
    """stats() with the half-width of a 95 % confidence interval of the mean (None below 2 values)."""
    s = stats(values)
    s["ci95"] = T95[s["n"] - 1] * s["std"] / math.sqrt(s["n"]) if s["n"] > 1 else None
    return s


def parameters(config):
    """The model's parameter count (embeddings included), built on the meta device from config.json."""
    import torch
    from model import GPT, ModelConfig
    with torch.device("meta"):
        return GPT(ModelConfig(**config["model_args"])).get_num_params(non_embedding=False)


def deploy_runs(study, root):
    """{(arm index, seed): figures} of every finished deployment run, its exports measured."""
    runs = {}
    for i, a in enumerate(study["arms"]):
        for seed in a["seeds"]:
            run_dir = os.path.join(root, "runs", run_name(a, seed))
            done = read_json(os.path.join(run_dir, "done.json"))
            if done is None:
                continue
            run = plot.read_run(run_dir)
            fig = run_figures(run_dir, done, run)
            if done["status"] == "finished":
                fig["export"] = export_losses(run_dir, a["export"])
                fig["params"] = parameters(run["config"])
            first = a["overrides"].get("pqt_start", 0) if a.get("trunk") else 0  # a fork's earlier records are its trunk's
            fig["trained_steps"] = a["steps"] - first
            # Its own steps' time: the median logged step time (robust to a runner paused on a shared
            # machine, which done.json's wall_s counts), times its steps.
            ms = [r["ms_per_iter"] for r in run["logs"] if r["iter"] > first]
            fig["train_min"] = statistics.median(ms) * fig["trained_steps"] / 60e3 if ms else None
            runs[i, seed] = fig
    return runs


def deploy_rows(study, runs):
    """One row per (arm, exported format): the unquantized and exported val loss, the increase of the
    exported loss over the bf16 run's (same length and seed), and the
    exported loss minus PTQ's (the trunk exported at the same format, or at the same budget by each
    block's own error for the learned mix) and, for the mixes, minus uniform STE int3's and int4's (the
    formats their budget lies between), and for the learned mix minus the error-ranked mix's (the same
    budget allocated by each block's own error, then finished by STE), paired by seed."""
    arms = study["arms"]
    index = {id(a): i for i, a in enumerate(arms)}
    ste = {(a["steps"], a["format"]): i for i, a in enumerate(arms) if a["kind"] == "STE phase"}
    error_mix = {a["steps"]: i for i, a in enumerate(arms) if a["kind"] == f"error mix {BUDGET:g} bits"}
    rows = []
    for i, a in enumerate(arms):
        trunk = index[id(a["trunk"])] if a.get("trunk") else next(
            j for j, b in enumerate(arms) if b["kind"] == "bf16 + PTQ" and b["steps"] == a["steps"])
        for fmt in a["export"]:
            ptq = fmt if fmt in arms[trunk]["export"] else f"error-int@{BUDGET:g}"
            done = [(s, runs[i, s]) for s in a["seeds"] if runs.get((i, s), {}).get("status") == "finished"
                    and isinstance(runs[i, s]["export"].get(fmt), dict)]
            row = {"arm": a["kind"], "steps": a["steps"], "format": fmt, "settings": arm_label(a), "seeds": len(done),
                   "diverged": [s for s in a["seeds"] if runs.get((i, s), {}).get("status") == "diverged"],
                   "tokens_per_param": done[0][1]["tokens"] / done[0][1]["params"] if done else None,
                   "val_loss": stats([f["val_loss"] for _, f in done]),
                   "exported": stats([f["export"][fmt]["val_loss"] for _, f in done]),
                   "exported_by_seed": {str(s): f["export"][fmt]["val_loss"] for s, f in done},
                   "bits_per_weight": stats([f["export"][fmt]["bits_per_weight"] for _, f in done
                                             if isinstance(f["export"][fmt].get("bits_per_weight"), (int, float))]),
                   # over the bf16 run of the same length and seed: what the format costs the model one
                   # would otherwise have (an STE run's own unquantized loss is of weights it never uses)
                   "increase_pct": stats([100 * (f["export"][fmt]["val_loss"] / runs[trunk, s]["val_loss"] - 1)
                                          for s, f in done if runs.get((trunk, s), {}).get("status") == "finished"]),
                   "wall_min": stats([f["wall_s"] / 60 for _, f in done]),
                   "train_min": stats([f["train_min"] for _, f in done if f["train_min"] is not None]),
                   "trained_steps": done[0][1]["trained_steps"] if done else None}
            mix = fmt.startswith(("auto-int", "error-int"))
            learned = fmt.startswith("auto-int")
            for key, j, other in (("vs_ptq", trunk, ptq), ("vs_ste_int3", ste.get((a["steps"], "int3")), "int3"),
                                  ("vs_ste_int4", ste.get((a["steps"], "int4")), "int4"),
                                  ("vs_error_mix", error_mix.get(a["steps"]) if learned else None,
                                   f"error-int@{BUDGET:g}")):
                if j is None or j == i or (key != "vs_ptq" and not mix):
                    continue
                diffs = [f["export"][fmt]["val_loss"] - runs[j, s]["export"][other]["val_loss"] for s, f in done
                         if isinstance(runs.get((j, s), {}).get("export", {}).get(other), dict)]
                row[key] = {"against": f"{arms[j]['kind']} at {other}", **interval(diffs)}
            rows.append(row)
    return rows


def deploy_findings(rows):
    """Per length and deployment format, longest length first: the arm whose exported model has the
    lowest mean val loss, and each other arm's exported loss minus the winner's, paired by seed, with
    whether its 95 % interval holds 0 (inside the noise)."""
    groups = {}
    for r in rows:
        if r["seeds"]:
            groups.setdefault((r["steps"], plot.deploy_panel(r["format"])), []).append(r)
    findings = []
    for (steps, group), rs in sorted(groups.items(), key=lambda kv: -kv[0][0]):
        rs = sorted(rs, key=lambda r: r["exported"]["mean"])
        best, others = rs[0], []
        for r in rs[1:]:
            seeds = sorted(set(r["exported_by_seed"]) & set(best["exported_by_seed"]), key=int)
            d = interval([r["exported_by_seed"][s] - best["exported_by_seed"][s] for s in seeds])
            verdict = ("one seed" if d["n"] == 1 else "no common seed" if not d["n"]
                       else "inside the noise" if abs(d["mean"]) <= d["ci95"] else "outside the noise")
            others.append({"arm": r["arm"], "format": r["format"], "increase_pct": r["increase_pct"]["mean"],
                           "minus_best": d, "verdict": verdict})
        findings.append({"steps": steps, "tokens_per_param": best["tokens_per_param"], "group": group,
                         "best": {"arm": best["arm"], "format": best["format"], "seeds": best["seeds"],
                                  "exported": best["exported"]["mean"], "increase_pct": best["increase_pct"]["mean"]},
                         "others": others})
    return findings


def at_budget(r):
    """" (error-int@3.5)" for an arm that is not itself a mix but was exported as one (PTQ)."""
    return f" ({r['format']})" if "@" in r["format"] and " mix " not in r["arm"] else ""


def findings_markdown(findings):
    lines = []
    for f in findings:
        b = f["best"]
        at = at_budget(b)
        line = (f"- **{f['steps']} steps ({f['tokens_per_param']:.1f} tokens/param), {f['group']}**: {b['arm']}{at} "
                f"is lowest (exported val loss {b['exported']:.4f}, {b['increase_pct']:+.2f} % over bf16, "
                f"{b['seeds']} seed{'s' if b['seeds'] > 1 else ''})")
        behind = []
        for o in f["others"]:
            d, at = o["minus_best"], at_budget(o)
            if not d["n"]:
                behind.append(f"{o['arm']}{at} (no common seed)")
                continue
            ci = f" ± {d['ci95']:.4f}" if d["ci95"] is not None else ""
            behind.append(f"{o['arm']}{at} {d['mean']:+.4f}{ci} (n={d['n']}, {o['verdict']})")
        lines.append(line + ("; then " + ", ".join(behind) if behind else "") + ".")
    return lines


def deploy_markdown(results):
    lines = [f"# {results['study']}: {results['about']}", "",
             f"Command: `{results['command']}`. Machine: {results['machine']}; torch {', '.join(results['torch']) or '-'}; "
             f"commits {', '.join(results['commits']) or '-'}. Runs finished: {results['runs_finished']} of "
             f"{results['runs_total']}. Val losses are the last evaluation's (20 fixed batches of train.py), the "
             "exported model's on the same batches (export.py); the increase is the exported val loss over the "
             "bf16 run's of the same length and seed; ± is the standard deviation over seeds; the paired "
             "columns give the mean difference by seed with its 95 % interval (Student's t; none for one seed). "
             "Every phase arm trains exactly the bf16 run's steps and tokens: it is that run until its switch and "
             "forks from its checkpoint there, so its time is the phase's own: its steps times its median logged "
             "time a step (a runner paused on the shared machine does not count; each run's done.json has its "
             "wall time, results.json both). The two mixes end on the same STE phase over the last "
             f"{100 - 100 * PHASE:.0f} %; the learned one leaves bf16 earlier, at {100 * MIX_PHASE:.0f} %, for the "
             "gaussws phase whose b_t allocate its formats.", ""]
    head = ["steps (tokens/param)", "arm", "exported at", "seeds", "val loss", "exported val loss", "increase",
            "bits/w", "− PTQ (paired)", "− STE int3 (paired)", "− STE int4 (paired)", "− error mix (paired)",
            "own train min (steps)"]
    lines += ["## What it says", "",
              "Per length and deployment format, the arm with the lowest exported val loss, then each other "
              "arm's exported val loss minus that one's, paired by seed (95 % interval; inside the noise when it "
              "holds 0, one seed gives none):", "", *findings_markdown(results["findings"]), "", "## The runs", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results["rows"]:
        tpp = f"{r['steps']} ({r['tokens_per_param']:.1f})" if r["tokens_per_param"] else str(r["steps"])
        seeds = str(r["seeds"]) + (f" (+{len(r['diverged'])} diverged)" if r["diverged"] else "")
        paired = []
        for key in ("vs_ptq", "vs_ste_int3", "vs_ste_int4", "vs_error_mix"):
            p = r.get(key)
            if not p or not p["n"]:
                paired.append("-")
            else:
                ci = f" ± {p['ci95']:.4f}" if p["ci95"] is not None else ""
                paired.append(f"{p['mean']:+.4f}{ci} (n={p['n']})")
        bits = f"{r['bits_per_weight']['mean']:.2f}" if r["bits_per_weight"]["n"] else "-"
        wall = f"{r['train_min']['mean']:.1f} ({r['trained_steps']})" if r["train_min"]["n"] else "-"
        lines.append("| " + " | ".join([tpp, r["arm"], r["format"], seeds, fmt_stats(r["val_loss"]),
                                        fmt_stats(r["exported"]), fmt_stats(r["increase_pct"], 2, pct=True), bits,
                                        *paired, wall]) + " |")
    lines += ["", "Arms (their train.py overrides of config/mini_gpt2_deploy.py):", ""]
    for label in dict.fromkeys(f"- {r['arm']}, {r['steps']} steps: `{r['settings']}`" for r in results["rows"]):
        lines.append(label)
    lines += ["", "Plots: plots/increase.png (the exported model's loss increase against tokens per parameter), "
              "plots/pareto.png (exported val loss against bits per weight at the longest length).", ""]
    return "\n".join(lines)


def write_deploy(name, study, root):
    out = os.path.join(root, name)
    os.makedirs(os.path.join(out, "plots"), exist_ok=True)
    runs = deploy_runs(study, root)
    rows = deploy_rows(study, runs)
    commits = sorted({x["commit"] for a in study["arms"] for s in a["seeds"]
                      for x in (read_json(os.path.join(root, "runs", run_name(a, s), "run.json")) or {}).get("attempts", [])})
    results = {"study": name, "about": study["about"], "command": f"python study.py {name}", "machine": machines(runs.values()),
               "torch": sorted({f["torch"] for f in runs.values() if f["torch"]}), "commits": commits,
               "runs_finished": len(runs), "runs_total": len(runs_of(study)), "rows": rows,
               "findings": deploy_findings(rows)}
    write_json(os.path.join(out, "results.json"), results)
    try:
        ckpt_io.write_text(os.path.join(out, "results.md"), deploy_markdown(results))
    except ckpt_io.CheckpointError as e:
        raise StudyError(str(e)) from None
    written = [os.path.join(out, "results.json"), os.path.join(out, "results.md")]
    if any(r["seeds"] for r in rows):
        written += plot.plot_deploy(rows, os.path.join(out, "plots"), longest=max(r["steps"] for r in rows))
    return written


def run_study(name, study, root="out/study", nproc=1, echo=True, only=""):
    """Train every run of the study not yet done (only those whose name matches the regular expression
    `only`, if given), then write its results. Returns the number of runs that failed (0 when all
    finished or diverged)."""
    todo = [r for r in runs_of(study) if re.search(only, r[0])]
    failed, walls = 0, []
    # every run in turn; one that another process holds goes to the end, to be waited for there
    queue = collections.deque((k, run, a, seed, False) for k, (run, a, seed) in enumerate(todo, 1))
    while queue:
        k, run, a, seed, wait = queue.popleft()
        done = read_json(os.path.join(root, "runs", run, "done.json"))
        if done is not None:
            print(f"[{name}] run {k} of {len(todo)}: {run} already {done['status']}, skipped", flush=True)
            walls.append(done["wall_s"])
            continue
        left = len(todo) - k + 1
        eta = f"ETA {sum(walls) / len(walls) * left / 60:.0f} min" if walls else "ETA after the first run"
        resume = os.path.exists(os.path.join(root, "runs", run, "ckpt.pt"))
        print(f"[{name}] run {k} of {len(todo)}: {run}{' (resumed)' if resume else ''}"
              f"{', waiting for the process that holds it' if wait else ''}, {eta}", flush=True)
        done = train_one(run, a, seed, root, nproc, echo, wait)
        if done == BUSY:
            print(f"[{name}] run {k} of {len(todo)}: {run} is in use by another process; back to it after the "
                  f"others", flush=True)
            queue.append((k, run, a, seed, True))
        elif done is None:
            failed += 1
        else:
            walls.append(done["wall_s"])
            print(f"[{name}] run {k} of {len(todo)}: {run} {done['status']} in {done['wall_s'] / 60:.1f} min", flush=True)
    for path in write_results(name, study, root):
        print(f"[{name}] wrote {path}")
    if failed:
        print(f"[{name}] {failed} run(s) failed; run the same command again to retry them")
    return failed


USAGE = """usage: python study.py [STUDY] [--dry_run] [--report] [--nproc=N] [--root=DIR] [--only=REGEX]
  STUDY         the study to run (or continue), then report; none: this list
  --dry_run     list the study's runs, each one's state and command, and the time the runs left take; trains nothing
  --report      write the study's tables and plots from the runs done so far; trains nothing
  --nproc=N     each run on N processes (torchrun --standalone), the same losses (default: 1)
  --root=DIR    where the runs (DIR/runs) and the results (DIR/STUDY) go (default: out/study)
  --only=REGEX  only the runs whose name matches the regular expression
  -h, --help    print this and exit"""


def print_usage():
    print(USAGE + "\nstudies:")
    for n, study in STUDIES.items():
        print(f"  {n:6s} {len(runs_of(study)):3d} runs  {study['about']}")


# --- the time a dry run says the runs left take --------------------------------------------------
# Every study's runs have one shape (config/mini_gpt2.py's 4-layer, 128-wide model on 2 x 16 x 128
# tokens a step; mini_llama2.py and mini_gpt2_deploy.py alike): config/mini_gpt2.py records 0.75 s a
# step, measured on one core of a 2-core CPU. The estimate until a run of the study has finished here.
DEFAULT_STEP_S = 0.75


def arm_steps(a):
    """(first, last) step a run of arm a trains: from 0, or from its fork step (an arm with a trunk
    starts from the trunk's checkpoint at pqt_start), to max_iters (its override, else its config's)."""
    last = a["overrides"].get("max_iters")
    if last is None:
        chain = configurator.file_settings(os.path.join(REPO, a["config"]))
        last = next((s["max_iters"] for _, s in reversed(chain) if "max_iters" in s), None)
    if last is None:
        raise StudyError(f"{a['config']} sets no max_iters, nor does the arm {arm_label(a)}; a study's run must say "
                         f"how long it trains")
    return (a["overrides"]["pqt_start"] if a.get("trunk") else 0), last


def steps_left(run_dir, a):
    """The steps a run not yet done still trains: all of arm_steps', less those up to its checkpoint
    where it resumes (train.py writes it at every evaluation: the last one in metrics.jsonl)."""
    first, last = arm_steps(a)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(os.path.join(run_dir, "ckpt.pt")) and os.path.isfile(metrics):
        evals, _ = plot.read_metrics(metrics)
        first = max([first] + [r["iter"] for r in evals[-1:]])
    return max(last - first, 0)


def time_left(study, todo, root):
    """One line: the wall time the runs of todo not yet done take, at the seconds per step of the
    study's runs finished under root (their wall time over the steps they trained, all attempts
    together, evaluations included), else at DEFAULT_STEP_S."""
    finished, spent, trained = 0, 0.0, 0
    for run, a, _ in runs_of(study):
        done = read_json(os.path.join(root, "runs", run, "done.json"))
        if done and done["status"] == "finished":
            first, last = arm_steps(a)
            finished, spent, trained = finished + 1, spent + done["wall_s"], trained + last - first
    left = [(run, a) for run, a, _ in todo if read_json(os.path.join(root, "runs", run, "done.json")) is None]
    steps = sum(steps_left(os.path.join(root, "runs", run), a) for run, a in left)
    if trained:
        rate, how = spent / trained, f"the wall time per step of the {finished} finished run(s) here"
    else:
        rate, how = DEFAULT_STEP_S, "no run has finished here yet: config/mini_gpt2.py's 0.75 s a step on a 2-core CPU"
    seconds = steps * rate
    about = f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"
    return (f"time left: about {about} ({seconds:,.0f} s: {len(left)} run(s), {steps:,} steps at {rate:.3f} s a step, "
            f"{how})")


def parse(argv):
    names, opts = [], {"nproc": 1, "dry_run": False, "report": False, "root": "out/study", "only": ""}
    for arg in argv:
        if not arg.startswith("--"):
            names.append(arg)
            continue
        key, sep, value = arg[2:].partition("=")
        if key in ("dry_run", "report") and value in ("", "True", "False"):
            opts[key] = value != "False"
        elif key == "nproc" and sep and value.isdigit() and int(value) >= 1:
            opts["nproc"] = int(value)
        elif key == "root" and sep and value:
            opts["root"] = value
        elif key == "only" and sep and value:
            try:
                re.compile(value)
            except re.error as e:
                raise StudyError(f"--only={value!r} is not a regular expression ({e})") from None
            opts["only"] = value
        else:
            raise StudyError(f"bad option {arg!r}; accepted: --nproc=N (N >= 1), --dry_run, --report, --root=DIR, "
                             f"--only=REGEX (--help says more)")
    if len(names) > 1 or names and names[0] not in STUDIES:
        raise StudyError(f"{' '.join(names)!r} is not a study; usage: {USAGE.splitlines()[0][len('usage: '):]}; "
                         f"studies: {', '.join(STUDIES)}")
    return (names or [None])[0], opts


def check_root(root, made):
    """--root must be a directory, or a path where one can be made (made: make it, with runs/, now)."""
    parent = root
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise StudyError(f"--root={root}: {parent} is a file; expected a directory (or a path where one can be made)")
    if made:
        try:
            os.makedirs(os.path.join(root, "runs"), exist_ok=True)
        except OSError as e:
            raise StudyError(f"--root={root}: cannot make {os.path.join(root, 'runs')} ({e.strerror}); choose a "
                             f"writable directory") from None
        if not os.access(os.path.join(root, "runs"), os.W_OK | os.X_OK):
            raise StudyError(f"--root={root}: {os.path.join(root, 'runs')} is not writable; choose a writable directory")


def _interrupted(signum, frame):
    raise KeyboardInterrupt


def main(argv):
    # Ctrl-C, and a kill, stop the run in progress and record the time it ran (launch), also where
    # the shell started the runner in the background with SIGINT ignored
    signal.signal(signal.SIGINT, _interrupted)
    signal.signal(signal.SIGTERM, _interrupted)
    if "-h" in argv or "--help" in argv:
        print_usage()
        return 0
    name, opts = parse(argv)
    if name is None:
        print_usage()
        return 0
    study = STUDIES[name]
    # Config paths and train.py's out_dir are the repository's; --root may be given from anywhere.
    root = os.path.abspath(opts["root"])
    check_root(root, made=not opts["dry_run"])
    os.chdir(REPO)
    opts["root"] = root if os.path.relpath(root).startswith("..") else os.path.relpath(root)
    if opts["dry_run"]:
        return dry_run(name, study, opts)
    if opts["report"]:  # the tables and plots of the runs done so far, training nothing
        for path in write_results(name, study, opts["root"]):
            print(f"[{name}] wrote {path}")
        return 0
    return 1 if run_study(name, study, opts["root"], opts["nproc"], only=opts["only"]) else 0


def dry_run(name, study, opts):
    """The runs (those --only keeps), each with its state and command, then time_left's estimate."""
    todo = [r for r in runs_of(study) if re.search(opts["only"], r[0])]
    print(f"{name}: {study['about']}\n{len(todo)} runs:")
    for k, (run, a, seed) in enumerate(todo, 1):
        run_dir = os.path.join(opts["root"], "runs", run)
        done = read_json(os.path.join(run_dir, "done.json"))
        state = done["status"] if done else "resume" if os.path.exists(os.path.join(run_dir, "ckpt.pt")) else "to run"
        print(f"{k:3d}. [{state}] {shlex.join(['python', *launcher(opts['nproc'])[1:], *train_args(a, seed, run_dir)])}")
    print(time_left(study, todo, opts["root"]))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(cli(main))
    except KeyboardInterrupt:
        print("\ninterrupted; run the same command again to resume", file=sys.stderr)
        sys.exit(130)
