"""Checkpoints that survive crashes, full disks, concurrent runs and flipped bits.

Single file (one process, or DDP where rank 0 holds everything):
    save(state, path)            atomic: unique temporary file, fsync, rename, fsync of the directory
    load(path, map_location)     verifies every zip CRC32 first, then torch.load(weights_only=True)

Sharded (FSDP: each rank writes its own part, loadable at any other world size): sharded.py's
save_sharded and load_sharded, a directory of torch.distributed.checkpoint's files behind a symlink.

The run directory (out_dir) holds one checkpoint, ckpt.pt or ckpt.dcp: find(out_dir) says which,
read(out_dir) gives every reader (train.py's resume and init_from, sample.py, export.py, hf.py) its
model_args, pqt settings, config, step and state from either layout; load_state(model, optimizers,
read(...)) resumes. One writer per out_dir: lock(out_dir), an fcntl lock on <out_dir>/.lock; a second
run on the same out_dir is refused in one line naming the holder's pid, and the kernel drops the lock
when the process ends, however it ends.

What a run's checkpoint holds (train.py writes it: out_dir/ckpt.pt, or out_dir/ckpt.dcp under FSDP,
where model and optimizer are DCP's files and the rest is header.pt):
    model           the model's state dict, b_i included
    optimizer       a list of optimizer state dicts, one per optimizer
    model_args      the architecture: model.ModelConfig's fields
    pqt             PQT_KEYS: {"method", "b_init", "b_target", "pqt_start", "target_format",
                    "ste_start", "bits_per_weight"}; older checkpoints kept the first three inside
                    model_args, and read() gives both layouts (PQT_DEFAULTS for what they lack)
    iter_num, best_val_loss
    config          every key of train.py's config
    rng_state       torch's CPU generator (dropout draws from it), and cuda_rng_state on GPUs
The data order and the noise are functions of (seed, step) and seed is in config, so these continue
a run exactly.

Failures: a missing file, flipped bytes anywhere in the tensors, a truncated copy, a file that is not
a checkpoint, a full disk or an unwritable directory are one line each (CheckpointError), and a
failed save leaves the previous checkpoint whole; what a kill -9 mid-write leaves, the next run
removes (clean_stale). Out of memory and other failures are raised as they are, never reported as
a bad file. CheckpointError is sharded.py's, the one error of both layouts.

The run directory besides its checkpoint:
    lock(out_dir)                one writer per out_dir (an flock the kernel drops when its holder dies)
    clean_stale(out_dir)         removes what writers killed mid-write left there (call it holding the lock)
    write_text(path, text)       atomic, as save(): a reader sees the old file or the new one, whole
    write_divergence / read_divergence   out_dir/diverged.json, train.py's record of a run that diverged
How a training run starts in it, and what it writes there (train.py calls these):
    resume(out_dir, model_args, config)   the checkpoint a resumed run continues, refused for another model
    check_new(out_dir, overwrite)         a new run refused where another run's checkpoint is
    read_fork(path, config)               a bf16 run's checkpoint a phase run forks from (FORK_FREE)
    Run(out_dir, saved_step, ...)         its saves (save), its config.json and metrics.jsonl
                                          (start, log), its divergence record (diverged), and the
                                          checkpoint a stopped run keeps, named in every message (str)

Why the zip CRCs rather than a hash written beside the file: torch.save already writes a CRC32 of
every record in its zip archive (torch.load never checks them), so verifying costs one read and
no second file that would have to be renamed together with the first; it also verifies checkpoints
written before this module existed. CRC32 catches every burst of up to 32 flipped bits and all
but 2^-32 of other corruptions, which is what is to be caught here: bad disks, truncated copies,
not an adversary (a weights_only load is what stops malicious pickles).
"""
import dataclasses
import errno
import fcntl
import json
import math
import os
import pickle
import re
import shutil
import zipfile
import zlib

import torch

import gaussws
from model import ModelConfig
from quant.ste import IMATRIX_STEPS
from sharded import CRCS, HEADER, CheckpointError, load_sharded, save_sharded
from sharded import load_model as load_sharded_model
from util import (atomic_open, first_line, fsync_dir, load_error, read_json_or_none, read_record,
                  remove_stale_temporaries, unusable_dir, write_atomic)


class Busy(CheckpointError):
    """lock(out_dir) without wait found the directory held by another process (pid in .holder)."""

    def __init__(self, message, holder):
        super().__init__(message)
        self.holder = holder


def save(state, path):
    """torch.save(state) to path atomically: a crash, a full disk or a second writer leaves the
    previous file whole and no temporary file behind. Raises CheckpointError (one line)."""
    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        raise CheckpointError(f"cannot save {path}: {directory} is not a directory")
    try:
        with atomic_open(path) as f:  # a unique temporary file, fsync, rename, fsync of the directory
            torch.save(state, f)
    except BaseException as e:
        # torch.save reports a full disk as RuntimeError: "... file write failed", or "unexpected pos
        # N vs M" with the file's own OSError as its context
        cause = e.__context__ if isinstance(e, RuntimeError) and isinstance(e.__context__, OSError) else e
        if isinstance(cause, OSError) or (isinstance(e, RuntimeError) and "write" in str(e).lower()):
            raise CheckpointError(f"cannot save {path}: {first_line(cause)}; the previous checkpoint there, "
                                  f"if any, is unchanged") from None
        raise


def write_text(path, text):
    """text to path atomically, as save(): a crash or a full disk leaves the previous file whole (and
    no temporary file, but for a kill: clean_stale). Raises CheckpointError (one line)."""
    try:
        write_atomic(path, text.encode("utf-8"))
    except OSError as e:
        raise CheckpointError(f"cannot write {os.path.abspath(path)}: {first_line(e)}; the previous file there, "
                              f"if any, is unchanged") from None


def copy(src, dst):
    """A verified copy of the checkpoint file src at dst, written atomically as save() writes (a
    study keeps a run's checkpoint of one step this way, for the runs that fork there)."""
    verify(src)
    dst = os.path.abspath(dst)
    try:
        with open(src, "rb") as f, atomic_open(dst) as g:
            shutil.copyfileobj(f, g)
    except OSError as e:
        raise CheckpointError(f"cannot copy {src} to {dst}: {first_line(e)}") from None


def verify(path):
    """Raise CheckpointError unless path is a torch zip archive whose every record passes its CRC32."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {path}") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path} is a directory, not a checkpoint file") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {first_line(e)}") from None
    if magic != b"PK\x03\x04":
        raise CheckpointError(f"{path} is not a checkpoint (not a torch.save zip archive)")
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
            if not any(n.endswith("/data.pkl") or n == "data.pkl" for n in names):
                raise CheckpointError(f"{path} is a zip archive but not a checkpoint (no data.pkl)")
            bad = z.testzip()  # reads every record and checks its CRC32
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, zlib.error, EOFError, ValueError) as e:  # truncated, or its directory damaged
        raise CheckpointError(f"{path} is corrupt ({first_line(e)}); use an earlier copy or start a new run") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {first_line(e)}") from None
    if bad is not None:
        raise CheckpointError(f"{path} is corrupt: record {bad} fails its CRC32 check; "
                              f"use an earlier copy or start a new run")


def load(path, map_location="cpu"):
    """The object saved at path, after verify(path), with torch.load(weights_only=True).

    CheckpointError (one line) for a missing, corrupt or unreadable file or one that is not a
    checkpoint; anything else (out of memory, a map_location that does not exist) is raised as is."""
    path = os.fspath(path)
    verify(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:  # weights_only refused an object: not a checkpoint of ours
        raise CheckpointError(f"{path} is not a checkpoint this code can read: it holds objects that "
                              f"weights_only loading refuses ({first_line(e)[:200]})") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {first_line(e)}") from None


class Lock:
    """An exclusive fcntl.flock on <out_dir>/<name>, held while this object lives (or until
    release()). The kernel drops it when the process dies, however it dies, so a crash leaves no
    stale lock to clean up by hand. wait: block until the holder lets go, instead of raising Busy.
    A lock that made out_dir and finds nothing else there when it lets go (a run that failed before
    writing) removes its file and the directory: a failed start leaves no folder behind."""

    def __init__(self, out_dir, wait=False, name=".lock"):
        self.out_dir, self.path, self._fd, self._made = out_dir, os.path.join(out_dir, name), None, False
        while not self._acquire(wait):  # the file we locked was removed by its last holder: lock the new one
            pass

    def _acquire(self, wait):
        try:
            self._made = not os.path.isdir(self.out_dir)
            os.makedirs(self.out_dir, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:
            raise CheckpointError(f"cannot lock {self.out_dir}: {first_line(e)}") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except OSError as e:
            holder = os.pread(self._fd, 64, 0).decode(errors="replace").strip() or "unknown"
            self._close()
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise Busy(f"{self.out_dir} is in use by another run (pid {holder}); wait for it to end, "
                           f"stop it, or choose another --out_dir", holder) from None
            raise CheckpointError(f"cannot lock {self.out_dir}: {first_line(e)}") from None
        try:  # a waiter may get the lock of a file its holder removed on release: that file locks nothing
            current = os.stat(self.path).st_ino == os.fstat(self._fd).st_ino
        except FileNotFoundError:
            current = False
        if not current:
            self._close()
            return False
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)  # the holder, for the message above
        except OSError as e:  # a full disk: nothing is written yet, so stop here
            self.release()
            raise CheckpointError(f"cannot write {self.path}: {first_line(e)}; free some space") from None
        return True

    def release(self):
        if self._fd is None:
            return
        if self._made:  # removed while still held, so no one locks the file between
            try:
                if os.listdir(self.out_dir) == [os.path.basename(self.path)]:
                    os.unlink(self.path)
                    os.rmdir(self.out_dir)
            except OSError:
                pass  # a file written meanwhile, or no permission: the directory stays, as it would have
        self._close()

    def _close(self):
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor releases the flock
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def __del__(self):
        self.release()


def lock(out_dir, wait=False, name=".lock"):
    """Lock out_dir for this process (call it on the one rank that owns out_dir, rank 0): a second
    run on the same out_dir gets Busy naming the holder's pid (or, with wait, waits for it). Keep
    the returned Lock. Another name is another lock of the same directory (the study runner's own:
    python -m studies)."""
    return Lock(out_dir, wait, name)


_SHARDED = re.compile(r"(.+)\.[0-9a-f]{8}")  # save_sharded's directory beside its symlink: <name>.<8 hex>


def clean_stale(out_dir):
    """Remove what writers killed mid-write (kill -9, a power cut) left in out_dir: temporary files
    named by util.temp_path (save, write_text, the data tools) whose process no longer runs on this
    machine, and sharded-checkpoint directories that no symlink points to. A live writer's temporary
    file is kept. Call it holding lock(out_dir): only the lock's holder writes sharded directories.
    Returns the names removed."""
    removed = remove_stale_temporaries(out_dir)
    try:
        names = os.listdir(out_dir)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(out_dir, name)
        dcp_dir = _SHARDED.fullmatch(name)
        try:
            if (dcp_dir and os.path.isdir(path) and not os.path.islink(path)
                    and os.path.realpath(os.path.join(out_dir, dcp_dir.group(1))) != os.path.realpath(path)
                    and any(f in (".metadata", HEADER, CRCS) or f.endswith(".distcp") for f in os.listdir(path))):
                shutil.rmtree(path)
                removed.append(name)
        except OSError:  # gone already, or not ours to remove: left as it is
            continue
    return removed


DIVERGED = "diverged.json"  # train.py's record of a run it stopped because it diverged


def write_divergence(out_dir, record):
    """out_dir/diverged.json: {"step", "what", "value", ...} of a run that diverged (train.py).
    Non-finite floats are written as the strings "nan", "inf", "-inf" (JSON has no such numbers)."""
    def plain(v):
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        return {k: plain(x) for k, x in v.items()} if isinstance(v, dict) else v
    write_text(os.path.join(out_dir, DIVERGED), json.dumps(plain(record), indent=1, allow_nan=False) + "\n")


def read_divergence(out_dir):
    """The divergence record of out_dir, or None where it has none; CheckpointError for one that is
    not a record of train.py (hand-edited, damaged)."""
    return read_record(os.path.join(out_dir, DIVERGED),
                       "a divergence record of train.py (expected an object with an integer 'step' and a string "
                       "'what')", lambda r: isinstance(r.get("step"), int) and isinstance(r.get("what"), str),
                       CheckpointError, "delete it to run the run again")


def load_header(path):
    """Of a sharded checkpoint: the header (everything but the model's and optimizers' tensors),
    verified; load_sharded verifies the rest when it loads them."""
    if not os.path.lexists(path):
        raise CheckpointError(f"no checkpoint at {path}")
    return load(os.path.join(os.path.realpath(path), HEADER))


def remove(path):
    """Delete a checkpoint: a single file, or a sharded one (its symlink and the directory behind it),
    durably (the directory is synced, so a power cut cannot bring it back)."""
    if os.path.islink(path) or os.path.isdir(path):
        directory = os.path.realpath(path)
        if os.path.islink(path):
            os.unlink(path)
        shutil.rmtree(directory, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)
    else:
        return
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def load_model(path, map_location="cpu"):
    """{"model": full state dict, **the rest} from a single-file checkpoint or a sharded one, in one
    process, without the optimizer state of a sharded one (what read() gives the readers)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return load_sharded_model(path, map_location)
    ckpt = load(path, map_location)
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise CheckpointError(f"{path} is not a checkpoint of train.py: it has no 'model'")
    return ckpt


# ---------------------------------------------------------------------------------------------
# the run directory: where a run's checkpoint is, and what its readers need from it

# the checkpoint's "pqt" entry: the method's settings, and their values in a checkpoint that lacks them
# (older ones kept the first three in model_args, and had no phase, target format or bit budget)
PQT_DEFAULTS = {"method": "bf16", "b_init": 6.0, "b_target": 4.0, "pqt_start": 0.0, "target_format": "",
                "ste_start": 0.0, "bits_per_weight": 0.0}
PQT_KEYS = tuple(PQT_DEFAULTS)
# the settings only a method reads, which a bf16 run ignores: PQT_KEYS, b_i's decay, Eq. 12's lambda,
# how w_hat is kept
METHOD_ONLY = PQT_KEYS + ("bitwidth_weight_decay", "bitwidth_lambda", "recompute_w_hat")
# the settings that are not training: the run's length, evaluation, logging, files, where it starts
NOT_TRAINING = ("max_iters", "eval_interval", "log_interval", "eval_iters", "always_save_checkpoint",
                "save_checkpoints", "out_dir", "init_from", "fork_from", "overwrite", "dry_run", "eval_only",
                "wandb_log", "wandb_project", "wandb_run_name", "wandb_mode")


def check_out_dir(out_dir):
    """Refuse, before anything is written, an out_dir that is a file or cannot be made or written."""
    out = os.path.abspath(out_dir)
    if os.path.exists(out) and not os.path.isdir(out):
        raise CheckpointError(f"out_dir={out_dir!r} is a file; expected a directory (or a path where one can be made)")
    why = unusable_dir(out)
    if why:
        raise CheckpointError(f"out_dir={out_dir!r} is not a writable directory ({why}); choose another --out_dir")


def paths(out_dir):
    """A run's checkpoint: ckpt.pt (one file, written by rank 0) or, under FSDP, ckpt.dcp (sharded:
    each process writes its own part, sharded.save_sharded)."""
    return os.path.join(out_dir, "ckpt.pt"), os.path.join(out_dir, "ckpt.dcp")


def is_checkpoint_dir(path):
    """A sharded checkpoint (ckpt.dcp) rather than an out_dir or a model directory."""
    return os.path.isfile(os.path.join(path, HEADER))


def find(path):
    """The checkpoint that path names, or None: path itself where it is one (a ckpt.pt, a sharded
    ckpt.dcp), else the one in the run directory path (ckpt.pt before ckpt.dcp)."""
    if os.path.isdir(path) and not is_checkpoint_dir(path):
        return next((p for p in paths(path) if os.path.lexists(p)), None)
    return path if os.path.lexists(path) else None


def read(path, header_only=False):
    """What every reader of a run needs from its checkpoint (find(path): a ckpt.pt, a ckpt.dcp or a
    run directory holding one), verified and loaded to CPU with weights_only=True, as a dict:
        path        the checkpoint read
        model_args  the architecture: model.ModelConfig's fields
        pqt         {PQT_KEYS: value}: its "pqt" entry, or (older checkpoints) these keys of its
                    model_args; PQT_DEFAULTS' values for what it has in neither
        config      train.py's resolved config of the run ({} if none), iter_num its step (None if none)
        model       the full state dict; absent with header_only from a sharded checkpoint, whose
                    "sharded" (its path) load_state then loads in place
    and everything else the checkpoint holds (optimizer, best_val_loss, rng_state, ...).
    CheckpointError, one line, for a missing, corrupt or foreign checkpoint."""
    found = find(path)
    if found is None:
        run_dir = os.path.dirname(path) if str(path).endswith((".pt", ".dcp")) else path
        raise CheckpointError(f"no checkpoint at {path}: train one (python train.py --out_dir={run_dir or '.'}) "
                              f"or point at a run directory that holds ckpt.pt (or ckpt.dcp)")
    if header_only and os.path.isdir(found):
        checkpoint = {**load_header(found), "sharded": found}
    else:
        checkpoint = load_model(found)
    if not isinstance(checkpoint, dict) or "model_args" not in checkpoint:
        raise CheckpointError(f"{found} is not a checkpoint of train.py: it lacks 'model_args'")
    model_args = dict(checkpoint["model_args"])
    pqt = {k: model_args.pop(k) for k in PQT_KEYS if k in model_args}
    model_keys = [f.name for f in dataclasses.fields(ModelConfig)]
    unknown = sorted(set(model_args) - set(model_keys))
    if unknown:
        raise CheckpointError(f"the checkpoint's model_args hold {', '.join(map(repr, unknown))}, which this code's "
                              f"model does not have (expected fields of model.ModelConfig: {', '.join(model_keys)})")
    pqt = {**PQT_DEFAULTS, **pqt, **(checkpoint.get("pqt") or {})}
    return {**checkpoint, "path": found, "model_args": model_args, "pqt": pqt,
            "config": dict(checkpoint.get("config") or {}), "iter_num": checkpoint.get("iter_num")}


def save_run(out_dir, state, model, optimizers, sharded=False):
    """Save a run's checkpoint into out_dir as the one checkpoint there, which find() and resume then
    take: ckpt.pt (state and the model's and optimizers' state dicts; rank 0 calls it) or, sharded
    (FSDP: every rank calls it), ckpt.dcp; the other one is removed. Returns the path written."""
    import torch.distributed as dist
    path = paths(out_dir)[1 if sharded else 0]
    if sharded:
        save_sharded(path, model, optimizers, state)
    else:
        save({"model": model.state_dict(), "optimizer": [o.state_dict() for o in optimizers], **state}, path)
    if not sharded or not dist.is_initialized() or dist.get_rank() == 0:
        for other in paths(out_dir):
            if other != path:
                remove(other)
    return path


def load_state(model, optimizers, checkpoint, fsdp=False):
    """Resume: load what read(path, header_only=True) gave into the model and its optimizers, in
    place: a sharded checkpoint's parts (load_sharded, at any world size), a single file's state
    dicts (under FSDP each process takes its shards of them), or a forked run's (read_fork)."""
    if "sharded" in checkpoint:  # ckpt.dcp: each process loads its part, at any world size
        load_sharded(checkpoint["sharded"], model, optimizers)
        return
    if "forked" in checkpoint:
        if fsdp:
            raise CheckpointError("fork_from is for one process or DDP; an FSDP phase run starts from scratch")
        return _load_fork(model, optimizers, checkpoint)
    if len(checkpoint["optimizer"]) != len(optimizers):
        raise CheckpointError(f"the checkpoint has {len(checkpoint['optimizer'])} optimizer state(s), this run "
                              f"{len(optimizers)}: resume with the optimizer it was trained with")
    try:
        if not fsdp:
            model.load_state_dict(checkpoint["model"])
            for o, state in zip(optimizers, checkpoint["optimizer"]):
                o.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, checkpoint["model"], options=options)
        for o, state in zip(optimizers, checkpoint["optimizer"]):
            set_optimizer_state_dict(model, o, state, options=options)
    except (RuntimeError, ValueError, KeyError) as e:
        if isinstance(e, torch.OutOfMemoryError):
            raise
        raise CheckpointError(f"the checkpoint's weights do not fit the model its model_args describe "
                              f"({load_error(e)}): it cannot be resumed; start a new run with --overwrite=True or "
                              f"use another --out_dir") from None


# ---------------------------------------------------------------------------------------------
# a run's start in its directory (resume, a new run, a fork) and its records there

def resume(out_dir, model_args, config):
    """The checkpoint a resumed run continues, read(header_only=True): refused where out_dir holds
    none, where it lacks what resuming needs, or where its model or method is not this run's (its
    model_args, the PQT keys of its train.py config)."""
    path = find(out_dir)
    if path is None:
        raise CheckpointError(f"init_from=resume but {out_dir} holds no checkpoint (ckpt.pt or ckpt.dcp); start with "
                              f"--init_from=scratch")
    checkpoint = read(path, header_only=True)
    needed = {"iter_num", "best_val_loss", "rng_state"} | ({"optimizer"} if "sharded" not in checkpoint else set())
    missing = sorted(needed - set(checkpoint))
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(missing)}: it cannot be resumed; start a new run from its "
                              f"weights with --init_from={path} --out_dir=<new dir>")
    try:
        wanted = {**dataclasses.asdict(ModelConfig(**model_args)), **{k: config[k] for k in PQT_KEYS}}
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path} cannot be resumed with this model: {e}") from None
    saved = {**checkpoint["model_args"], **checkpoint["pqt"]}
    diff = [f"{k}: checkpoint {saved.get(k)!r}, config {v!r}" for k, v in wanted.items() if saved.get(k) != v]
    if diff:
        raise CheckpointError(f"{path} holds another model ({'; '.join(diff)}); resume with the settings it was "
                              f"trained with, or use another --out_dir")
    return checkpoint


def check_new(out_dir, overwrite):
    """A new run in out_dir: refused where another run's checkpoint is there, or another tool's config.json
    (a Hugging Face folder: the run would write its own over it), unless overwrite."""
    path = find(out_dir)
    if path is not None and not overwrite:
        raise CheckpointError(f"{path} holds another run; resume it with --init_from=resume, choose another --out_dir, "
                              f"or pass --overwrite=True to replace it")
    config = os.path.join(out_dir, "config.json")
    if os.path.isfile(config) and not overwrite and not _a_run_record(config):
        raise CheckpointError(f"{config} is not a record of a run of train.py (another tool's folder?): choose "
                              f"another --out_dir, or pass --overwrite=True to replace it")


def _a_run_record(path):
    """Whether config.json is train.py's record of a run (its settings with model_args)."""
    record = read_json_or_none(path)
    return isinstance(record, dict) and "model_args" in record


# What a phase run may set otherwise than the bf16 run it forks from: the method and its settings,
# which change nothing before the switch (the layers are plain Linears, b_i get no gradient), and
# what is not training (the run's length beyond the fork step, evaluation, logging, files).
FORK_FREE = frozenset(METHOD_ONLY + NOT_TRAINING)


def read_fork(path, config):
    """The checkpoint a phase run forks from (train.py --fork_from): a bf16 run's ckpt.pt at a step
    from 1 to this run's pqt_start, whose config equals this run's `config` but for FORK_FREE's keys.
    Until its switch a phase run is that run bit for bit, so continuing it gives the losses the whole
    phase run would have had, without training the shared steps again (the studies' deploy study).
    An error-gguf run forks IMATRIX_STEPS or more before its switch: its imatrix sums those steps.
    load_state then loads it."""
    if not os.path.isfile(path):
        raise CheckpointError(f"fork_from={path!r}: expected the ckpt.pt file of a bf16 run (not a directory or a "
                              f"sharded checkpoint)")
    checkpoint = read(path)
    theirs, step = checkpoint["config"], checkpoint["iter_num"]
    if checkpoint["pqt"]["method"] != "bf16":
        raise CheckpointError(f"fork_from={path!r} is a {checkpoint['pqt']['method']} run; a phase run forks from a "
                              f"bf16 run")
    if not isinstance(step, int) or not 0 < step <= config["pqt_start"]:
        raise CheckpointError(f"fork_from={path!r} is at step {step}, pqt_start={config['pqt_start']:g}: a phase run "
                              f"forks from the bf16 run at a step from 1 to its switch")
    switch = config["ste_start"] or config["method"].startswith("ste") and config["pqt_start"]
    latest = max(0, int(switch) - IMATRIX_STEPS)  # error-gguf sums the activations of the steps from there
    if config["target_format"] == "error-gguf" and switch and step > latest:
        raise CheckpointError(f"fork_from={path!r} is at step {step}, and error-gguf sums the input activations of "
                              f"the {IMATRIX_STEPS} steps before its switch at step {switch:g}, which a fork trains "
                              f"only from there: " + (f"fork from a checkpoint at step {latest} or earlier" if latest
                                                      else "train the run whole (without fork_from)"))
    diff = [f"{k}: {theirs.get(k)!r} there, {v!r} here" for k, v in config.items()
            if k not in FORK_FREE and theirs.get(k) != v]
    if diff:
        raise CheckpointError(f"fork_from={path!r} was trained with other settings ({'; '.join(diff[:3])}): a phase "
                              f"run forks only from the bf16 run it equals until its switch")
    return {**checkpoint, "forked": path}


def _load_fork(model, optimizers, checkpoint):
    """The bf16 run's state in this phase run: its weights (b_i keep their fresh init, b_t = b_init)
    and each optimizer's state; the groups this run has beyond the bf16 run's (b_i's) start empty, as
    in the whole phase run, where they get no gradient before the switch."""
    try:
        gaussws.load_weights(model, checkpoint["model"])
    except ValueError as e:
        raise CheckpointError(f"{checkpoint['forked']} does not fit this run's model: {e}") from None
    if len(checkpoint["optimizer"]) > len(optimizers):
        raise CheckpointError(f"{checkpoint['forked']} has {len(checkpoint['optimizer'])} optimizers, this run "
                              f"{len(optimizers)}")
    for o, state in zip(optimizers, checkpoint["optimizer"]):
        groups = state["param_groups"]
        own = o.state_dict()["param_groups"][len(groups):]
        try:
            o.load_state_dict({"state": state["state"], "param_groups": groups + own})
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"the optimizer state of {checkpoint['forked']} does not fit this run's: "
                                  f"{e}") from None


def open_metrics(path, resumed_step, source=None):
    """metrics.jsonl for appending, holding this run's records only: a new run starts it afresh; a
    resumed one keeps the records up to its checkpoint's step (what came later is redone), and a forked
    one those of the run it forks from (source). The kept lines are written to a temporary file renamed
    over the old one: a crash keeps one or the other."""
    keep, source = [], source or path
    if resumed_step is not None and os.path.exists(source):
        with open(source) as f:
            for line in f:
                try:
                    if json.loads(line)["iter"] <= resumed_step:
                        keep.append(line if line.endswith("\n") else line + "\n")
                except (ValueError, KeyError, TypeError):  # a line cut short by a crash
                    pass
    write_text(path, "".join(keep))
    try:
        return open(path, "a")
    except OSError as e:
        raise CheckpointError(f"cannot open {path}: {e.strerror}") from None


class Run:
    """A training run's directory as train.py keeps it: the checkpoint it saves (path: ckpt.pt, or
    ckpt.dcp when sharded), the step of the one it can fall back on (saved_step; None before any),
    which every message of a stopped run names (str(run)), and its records: config.json and
    metrics.jsonl (start, log), diverged.json (diverged). Only the process that owns the directory
    (writer: rank 0) writes them; under FSDP every process writes its shards of the checkpoint."""

    def __init__(self, out_dir, saved_step=None, sharded=False, writer=True):
        self.out_dir, self.saved_step, self.sharded, self.writer = out_dir, saved_step, sharded, writer
        self.path, self.metrics = paths(out_dir)[1 if sharded else 0], None

    def __str__(self):
        if self.saved_step is None:
            return "this run wrote no checkpoint"
        return f"the last good checkpoint is {self.path}, step {self.saved_step}"

    def start(self, run_info, new, forked=None):
        """The records of a run that trains, before its first step (an evaluation, eval_only, writes
        none): a new run first removes the checkpoint it replaces (--overwrite), so that a kill before
        its first save cannot leave that checkpoint to be resumed as this run's; a divergence record
        goes (the run is tried again); metrics.jsonl keeps this run's records (open_metrics; forked:
        the checkpoint it forks from, whose run's records it continues); config.json is run_info."""
        if new:
            for path in paths(self.out_dir):
                remove(path)
        if os.path.exists(os.path.join(self.out_dir, DIVERGED)):
            os.remove(os.path.join(self.out_dir, DIVERGED))
        self.metrics = open_metrics(os.path.join(self.out_dir, "metrics.jsonl"), self.saved_step,
                                    source=forked and os.path.join(os.path.dirname(forked), "metrics.jsonl"))
        write_text(os.path.join(self.out_dir, "config.json"), json.dumps(run_info, indent=1))

    def log(self, record):
        """A line of metrics.jsonl, where start opened it. A full disk stops the run: CheckpointError
        naming the checkpoint it keeps."""
        if self.metrics is None:
            return
        try:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()
        except OSError as e:
            try:
                self.metrics.close()
            except OSError:
                pass
            raise CheckpointError(f"cannot write {self.metrics.name}: {e.strerror or e}; the run stops here "
                                  f"({self})") from None

    def save(self, model, optimizers, config, iter_num, best_val_loss, cuda_device=None):
        """The run's checkpoint of step iter_num (save_run): what continues the run exactly, the model,
        its optimizers, and the state that is not theirs (the module docstring's list). The data order
        and the noise are functions of (seed, step), and seed is in config; dropout draws from the CPU
        generator, and on GPUs (cuda_device) from the CUDA one."""
        state = {"model_args": dataclasses.asdict(model.config), "pqt": {k: config[k] for k in PQT_KEYS},
                 "iter_num": iter_num, "best_val_loss": best_val_loss, "config": config,
                 "rng_state": torch.get_rng_state()}
        if cuda_device is not None:
            state["cuda_rng_state"] = torch.cuda.get_rng_state(cuda_device)
        if self.sharded or self.writer:
            try:
                save_run(self.out_dir, state, model, optimizers, sharded=self.sharded)
            except CheckpointError as e:
                raise CheckpointError(f"{e}; the run stops here") from None
        self.saved_step = iter_num

    def diverged(self, step, what, value, message, limit=None):
        """Record in diverged.json that the run diverged at step (what broke, its value and limit, the
        message, the checkpoint it keeps) and return message, saying why where no record was written."""
        if self.writer:
            record = {"step": step, "what": what, "value": value, "limit": limit, "message": message,
                      "checkpoint": None if self.saved_step is None else self.path, "checkpoint_step": self.saved_step}
            try:
                write_divergence(self.out_dir, record)
            except CheckpointError as e:
                message += f" ({e})"
        return message

    def close(self):
        if self.metrics is not None:
            self.metrics.close()
