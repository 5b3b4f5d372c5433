"""The runner: every run of a study not yet done, one after another, each one `python train.py CONFIG
--key=value ... --seed=S --out_dir=ROOT/runs/NAME`, then the study's report.

A run is finished when its done.json exists; train.py writes its checkpoint at every evaluation, and
done.json is written only after train.py exits 0 with its records whole (records.checked_run: the last
evaluation at max_iters, every loss finite and sane), so a run that was killed is resumed from its
last checkpoint (--init_from=resume: the same losses as an uninterrupted run), and a finished one is
skipped. A run that train.py stops as diverged (it writes diverged.json: the step, and whether the
loss, the gradient norm, the eval loss, the weights or b_t went wrong) is recorded as diverged, not
retried: the same seed diverges again. An arm forks from its trunk's kept checkpoint; a trunk known
only by its records (committed ones lack checkpoints) is trained again to that step, and the arm forks
from the result only if every loss is the recorded one, bit for bit (remake_kept).

Two runners may share the runs (two studies with the same bf16 runs, in two shells): a runner holds a
run directory's lock (.study.lock) while it trains, resumes or exports that run, and takes it only
when no train.py holds the directory either. A run held by another process is put off: the runner
does the others first, then waits for it, and skips it when the other has finished it.
"""
import collections
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import checkpoint as ckpt_io
import figures
from studies.definitions import REPO, arm_label, arm_steps, run_name, runs_of, train_args
from studies.deploy_report import write_deploy
from studies.gguf_report import write_gguf
from studies.records import STUDY_LOCK, StudyError, checked_run, read_json, write_json
from studies.report import write_report
from util import git_commit

BUSY = "busy"  # train_one: another process holds the run


def launcher(nproc):
    if nproc == 1:
        return [sys.executable, "train.py"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "train.py"]


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
        fork = fork_checkpoint(a, seed, os.path.dirname(run_dir), nproc, echo)
        if fork is None:
            return None
        start = ["--init_from=scratch", f"--fork_from={fork}"]
    rc, tail, start = train_segments(args, run_dir, record, start, a.get("keep", ()), nproc, echo)
    if rc == 0:
        rc, tail = run_train(launcher(nproc) + args + start, nproc, run_dir, record, echo)
    return finish(name, a, run_dir, record, rc, tail)


def train_segments(args, run_dir, record, start, steps, nproc, echo, env=None):
    """train.py (in env) to each step of steps in turn from start, each one's checkpoint kept as
    ckpt_<step>.pt (a step already kept is not trained again). Returns (exit status, output's tail, the
    start of what follows): the status of the segment that failed, else 0."""
    for step in steps:
        kept_ckpt = os.path.join(run_dir, f"ckpt_{step}.pt")
        if os.path.exists(kept_ckpt):
            continue
        rc, tail = run_train(launcher(nproc) + args + [f"--max_iters={step}"] + start, nproc, run_dir, record, echo,
                             env)
        if rc != 0:
            return rc, tail, start
        try:
            ckpt_io.copy(os.path.join(run_dir, "ckpt.pt"), kept_ckpt)
        except ckpt_io.CheckpointError as e:
            raise StudyError(str(e)) from None
        start = ["--init_from=resume"]
    return 0, [], start


# --- a trunk's kept checkpoint, remade --------------------------------------------------------------
# A study's records are kept (studies/results) but not its checkpoints, so on a fresh clone, or another
# machine, a finished trunk lacks the ckpt_<step>.pt its arms fork from. The runner then trains the trunk
# again to that step, beside its records (TRUNK/remade), and lets the arm fork from the result only if
# every loss it logged on the way is bit for bit the one the trunk recorded: a resumed or repeated run
# repeats an uninterrupted one, so equal losses say the remade checkpoint is the trunk's. It runs on the
# trunk's recorded number of threads; any other kind of CPU or torch that changes a bit is refused, and
# the arm is not run.
REMADE = "remade"


def fork_checkpoint(a, seed, runs, nproc, echo):
    """The checkpoint arm a (seed) forks from, its trunk's ckpt_<pqt_start>.pt under runs; remade
    (remake_kept) when the trunk finished without it. None while the trunk has not reached it, or when
    it could not be remade."""
    trunk, step = run_name(a["trunk"], seed), a["overrides"]["pqt_start"]
    trunk_dir = os.path.join(runs, trunk)
    fork = os.path.join(trunk_dir, f"ckpt_{step}.pt")
    if os.path.exists(fork):
        return fork
    done = read_json(os.path.join(trunk_dir, "done.json"))
    if done is None or done["status"] != "finished":
        print(f"  {run_name(a, seed)}: its trunk {trunk} has not kept {os.path.basename(fork)} yet; run it first")
        return None
    return remake_kept(a["trunk"], seed, trunk_dir, step, nproc, echo)


def remake_kept(trunk_arm, seed, trunk_dir, step, nproc, echo):
    """The finished trunk's ckpt_<step>.pt, made again: train.py on the trunk's own arguments in
    trunk_dir/remade (resumed there if stopped), to the kept steps up to step; copied into trunk_dir
    only when its losses are the trunk's (first_difference). None, with one line saying why, if not."""
    trunk, fork = os.path.basename(trunk_dir), os.path.join(trunk_dir, f"ckpt_{step}.pt")
    scratch = os.path.join(trunk_dir, REMADE)
    held = claim(scratch, wait=True)  # a second runner remaking the same trunk waits, then takes its result
    with held:
        if os.path.exists(fork):
            return fork
        # on the trunk's own number of threads, which its sums depend on (its config.json's record)
        threads = (read_json(os.path.join(trunk_dir, "config.json")) or {}).get("versions", {}).get("threads")
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None
        print(f"  {trunk} finished without keeping {os.path.basename(fork)} (its records only): training it again "
              f"to step {step} in {scratch}{f' on its {threads} thread(s)' if threads else ''}, its losses checked "
              f"against its records", flush=True)
        args = train_args(trunk_arm, seed, scratch)
        record = check_run_dir(scratch, args, trunk_arm["config"])
        resume = os.path.exists(os.path.join(scratch, "ckpt.pt"))
        start = [f"--init_from={'resume' if resume else 'scratch'}"]
        # first to the trunk's first logged step, checked before the long way to the fork step: a CPU or
        # thread count that rounds otherwise is told in a minute, not hours later
        probe = [] if resume else [min((i for i, _ in logged_losses(trunk_dir, step) if i > 0), default=step)]
        for steps in (probe, [k for k in trunk_arm.get("keep", ()) if k <= step]):
            rc, tail, start = train_segments(args, scratch, record, start, steps, nproc, echo, env)
            if rc != 0:
                print(f"  {trunk}: remaking ckpt_{step}.pt, train.py failed (exit {rc}): {tail[-1] if tail else ''}; "
                      f"see {scratch}/train.log")
                return None
            differs = first_difference(scratch, trunk_dir, max(steps, default=0))
            if differs:
                print(f"  {trunk}: not remade: {differs}, so its checkpoint would not be the trunk's (another "
                      f"machine, thread count or torch); the arms that fork from it are not run (remove {scratch} "
                      f"and the trunk's done.json to train the trunk again, and its arms after it)")
                return None
        try:
            ckpt_io.copy(os.path.join(scratch, f"ckpt_{step}.pt"), fork)
        except ckpt_io.CheckpointError as e:
            raise StudyError(str(e)) from None
        print(f"  {trunk}: ckpt_{step}.pt remade, every loss to step {step} the trunk's own", flush=True)
        return fork


def logged_losses(run_dir, step):
    """{(iter, key): value} of every loss metrics.jsonl holds up to step (train.py's logged training
    loss and each evaluation's), a later record of an iter replacing an earlier (a resumed run logs the
    steps after its checkpoint again)."""
    losses = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r["iter"] <= step:
                losses.update({(r["iter"], k): v for k, v in r.items() if k in ("loss", "train/loss", "val/loss")})
    return losses


def first_difference(remade, trunk_dir, step):
    """'' when the remade run logged every loss the trunk recorded up to step, each bit for bit equal;
    else what differs first. (Its evaluations where it stopped to be checked are its own: an evaluation
    changes no state.)"""
    try:
        made, kept = logged_losses(remade, step), logged_losses(trunk_dir, step)
    except (OSError, ValueError, KeyError) as e:
        return f"its metrics.jsonl could not be read ({e})"
    for it, key in sorted(kept):
        if made.get((it, key)) != kept.get((it, key)):
            return (f"at step {it} its {key} is {made.get((it, key))!r} where the trunk recorded "
                    f"{kept.get((it, key))!r}")
    return ""


def run_train(cmd, nproc, run_dir, record, echo, env=None):
    """One train.py process (in env, else this one's), its output echoed and appended to train.log, the
    attempt recorded in run.json. Returns (exit status, the last lines of its output)."""
    attempt = {"command": shlex.join(["python", *cmd[1:]]), "nproc": nproc, "commit": git_commit(),
               "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    t0, tail = time.time(), []
    with open(os.path.join(run_dir, "train.log"), "a") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
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


def finish(name, a, run_dir, record, rc, tail):
    """done.json of a run of arm a whose last train.py exited with rc, or None when it failed: an
    exit 0 whose records are not a finished run's (records.checked_run) is a failure too."""
    wall_s = sum(x["wall_s"] for x in record["attempts"])
    try:  # train.py's record of a divergence, written only by the attempt that stopped (it exits 3)
        diverged = ckpt_io.read_divergence(run_dir) if rc else None
    except ckpt_io.CheckpointError as e:
        print(f"  {name}: {e}")
        return None
    if rc == 0:
        done = {"status": "finished", "wall_s": wall_s}
        _, why = checked_run(run_dir, done, arm_steps(a)[1])
        if why:
            print(f"  {name}: train.py exited 0, but {why}; see {run_dir}/train.log")
            return None
    elif diverged:
        done = {"status": "diverged", "step": diverged["step"], "what": diverged["what"], "wall_s": wall_s}
    else:
        print(f"  {name}: train.py failed (exit {rc}): {tail[-1] if tail else ''}; see {run_dir}/train.log")
        return None
    write_json(os.path.join(run_dir, "done.json"), done)
    return done


def write_results(name, study, root):
    """The study's report (the deployment or llama.cpp study's own, else report.write_report) under
    root/name from the runs done so far; the paths written. With no run done, nothing is written (a
    report of nothing would replace one of the runs elsewhere)."""
    if not any(read_json(os.path.join(root, "runs", run, "done.json")) for run, _, _ in runs_of(study)):
        print(f"[{name}] no run of {name} is done under {os.path.join(root, 'runs')}: nothing to report, "
              f"{os.path.join(root, name)} is left as it is")
        return []
    write = {"deploy": write_deploy, "gguf": write_gguf}.get(study.get("report"), write_report)
    return write(name, study, root)


def run_study(name, study, root="out/study", nproc=1, echo=True, only=""):
    """Train every run of the study not yet done (only those whose name matches the regular expression
    `only`, if given), then write its results. Returns the number of runs that failed (0 when all
    finished or diverged)."""
    todo = [r for r in runs_of(study) if re.search(only, r[0])]
    failed = 0
    # every run in turn; one that another process holds goes to the end, to be waited for there
    queue = collections.deque((k, run, a, seed, False) for k, (run, a, seed) in enumerate(todo, 1))
    while queue:
        k, run, a, seed, wait = queue.popleft()
        said = f"[{name}] run {k} of {len(todo)}: {run}"
        done = read_json(os.path.join(root, "runs", run, "done.json"))
        if done is not None:
            print(f"{said} already {done['status']}, skipped", flush=True)
            continue
        seconds, runs, _, _ = seconds_left(study, todo, root)
        eta = f"ETA {duration(seconds)} for the {runs} run(s) not done, one after another"
        resume = os.path.exists(os.path.join(root, "runs", run, "ckpt.pt"))
        print(f"{said}{' (resumed)' if resume else ''}{', waiting for the process that holds it' if wait else ''}, "
              f"{eta}", flush=True)
        done = train_one(run, a, seed, root, nproc, echo, wait)
        if done == BUSY:
            print(f"{said} is in use by another process; back to it after the others", flush=True)
            queue.append((k, run, a, seed, True))
        elif done is None:
            failed += 1
        else:
            print(f"{said} {done['status']} in {done['wall_s'] / 60:.1f} min", flush=True)
    for path in write_results(name, study, root):
        print(f"[{name}] wrote {path}")
    if failed:
        print(f"[{name}] {failed} run(s) failed; run the same command again to retry them")
    return failed


# --- the time a dry run says the runs left take --------------------------------------------------
# Every study's runs have one shape (config/mini_gpt2.py's 4-layer, 128-wide model on 2 x 16 x 128
# tokens a step; mini_llama2.py and mini_gpt2_deploy.py alike): config/mini_gpt2.py records 0.75 s a
# step, measured on one core of a 2-core CPU. The estimate until a run of the study has finished here.
DEFAULT_STEP_S = 0.75


def steps_left(run_dir, a):
    """The steps a run not yet done still trains: all of arm_steps', less those up to its checkpoint
    where it resumes (train.py writes it at every evaluation: the last one in metrics.jsonl)."""
    first, last = arm_steps(a)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(os.path.join(run_dir, "ckpt.pt")) and os.path.isfile(metrics):
        evals, _ = figures.read_metrics(metrics)
        first = max([first] + [r["iter"] for r in evals[-1:]])
    return max(last - first, 0)


def remake_steps(todo, root):
    """{TRUNK/remade: (steps, trunk arm)}: the steps each finished trunk that kept no checkpoint trains
    again for the runs of todo not yet begun that fork from it (remake_kept), to the latest of their fork
    steps, less those its remade run has trained already."""
    upto = {}
    for run, a, seed in todo:
        if not a.get("trunk") or os.path.exists(os.path.join(root, "runs", run, "ckpt.pt")):
            continue
        trunk_dir, step = os.path.join(root, "runs", run_name(a["trunk"], seed)), a["overrides"]["pqt_start"]
        done = read_json(os.path.join(trunk_dir, "done.json"))
        if done and done["status"] == "finished" and not os.path.exists(os.path.join(trunk_dir, f"ckpt_{step}.pt")):
            scratch = os.path.join(trunk_dir, REMADE)
            upto[scratch] = (max(upto.get(scratch, (0,))[0], step), a["trunk"])
    return {scratch: (step - remade_to(scratch), trunk) for scratch, (step, trunk) in upto.items()}


def remade_to(scratch):
    """The step a trunk's remade run would resume from: its last evaluation, where it keeps ckpt.pt."""
    metrics = os.path.join(scratch, "metrics.jsonl")
    if not (os.path.exists(os.path.join(scratch, "ckpt.pt")) and os.path.isfile(metrics)):
        return 0
    evals, _ = figures.read_metrics(metrics)
    return max([0] + [r["iter"] for r in evals[-1:]])


def seconds_left(study, todo, root):
    """(seconds, runs, steps, how): the wall time the runs of todo not yet done take, their count and
    steps (with those of the trunks trained again for them: remake_steps), at the seconds per step of the study's runs finished under root (their wall time over the
    steps they trained, all attempts together, evaluations included), else at each arm's own measured
    seconds a step where the study gives it (step_s), else at DEFAULT_STEP_S; how says which."""
    finished, spent, trained = 0, 0.0, 0
    for run, a, _ in runs_of(study):
        done = read_json(os.path.join(root, "runs", run, "done.json"))
        if done and done["status"] == "finished":
            first, last = arm_steps(a)
            finished, spent, trained = finished + 1, spent + done["wall_s"], trained + last - first
    left = [(run, a, seed) for run, a, seed in todo if read_json(os.path.join(root, "runs", run, "done.json")) is None]
    # each run's steps, and those of the trunks trained again for them (remake_steps), with their arm
    steps = {run: (steps_left(os.path.join(root, "runs", run), a), a) for run, a, _ in left}
    steps.update(remake_steps(left, root))
    if trained:
        seconds = sum(n for n, _ in steps.values()) * spent / trained
        how = f"the wall time per step of the {finished} finished run(s) here"
    else:
        seconds = sum(n * a.get("step_s", DEFAULT_STEP_S) for n, a in steps.values())
        how = ("no run has finished here yet: each arm's measured time a step where its study gives one (step_s), "
               "else config/mini_gpt2.py's 0.75 s a step on a 2-core CPU")
    return seconds, len(left), sum(n for n, _ in steps.values()), how


def duration(seconds):
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def time_left(study, todo, root):
    """One line: seconds_left's estimate of the runs of todo not yet done, and how it was made."""
    seconds, runs, total, how = seconds_left(study, todo, root)
    rate = seconds / total if total else 0.0
    return (f"time left: about {duration(seconds)} ({seconds:,.0f} s: {runs} run(s), {total:,} steps at {rate:.3f} s "
            f"a step, {how})")


def arm_costs(study):
    """Lines: each arm that gives its measured seconds a step (step_s), the steps a run of it trains, the
    time of a run and of its seeds' runs on one core; then all of them together. [] where none gives it."""
    lines, total = [], 0.0
    for a in (a for a in study["arms"] if "step_s" in a):
        first, last = arm_steps(a)
        seeds = len(a.get("seeds", study["seeds"]))
        run_s = (last - first) * a["step_s"]
        total += run_s * seeds
        files = ", ".join(a.get("gguf", ()))
        lines.append(f"  {a.get('kind', arm_label(a))}{f' ({files})' if files else ''}: {last - first:,} steps x "
                     f"{a['step_s']:.2f} s = {run_s / 60:.0f} min a run, x {seeds} seeds = "
                     f"{run_s * seeds / 3600:.1f} h")
        if a.get("llama_cpp"):
            lines.append(f"    then, in the report, llama-quantize of its last checkpoint: {', '.join(a['llama_cpp'])}")
    if lines:
        lines = ["arms (steps a run trains x seconds a step on one core):", *lines,
                 f"  in all {total / 3600:.1f} h on one core (two runners side by side: about half the wall time)"]
    return lines


def dry_run(name, study, root, nproc, only):
    """The runs (those `only` keeps), each with its state and command, then the arms' costs (arm_costs)
    and time_left's estimate."""
    todo = [r for r in runs_of(study) if re.search(only, r[0])]
    print(f"{name}: {study['about']}\n{len(todo)} runs:")
    for k, (run, a, seed) in enumerate(todo, 1):
        run_dir = os.path.join(root, "runs", run)
        done = read_json(os.path.join(run_dir, "done.json"))
        state = done["status"] if done else "resume" if os.path.exists(os.path.join(run_dir, "ckpt.pt")) else "to run"
        print(f"{k:3d}. [{state}] {shlex.join(['python', *launcher(nproc)[1:], *train_args(a, seed, run_dir)])}")
    for line in arm_costs(study):
        print(line)
    print(time_left(study, todo, root))
    return 0


def check_root(root, made):
    """The directory the runs (root/runs) and the reports (root/NAME) go: root must be a directory, or a
    path where one can be made (made: make it, with runs/, now)."""
    parent = root
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise StudyError(f"--root={root}: {parent} is a file; expected a directory (or a path where one can be made)")
    if not made:
        return
    runs = os.path.join(root, "runs")
    try:
        os.makedirs(runs, exist_ok=True)
    except OSError as e:
        raise StudyError(f"--root={root}: cannot make {runs} ({e.strerror}); choose a writable directory") from None
    if not os.access(runs, os.W_OK | os.X_OK):
        raise StudyError(f"--root={root}: {runs} is not writable; choose a writable directory")
