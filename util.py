"""What several scripts share: files written atomically, the one-line form of an exception, and the
error every script reports as one line instead of a traceback.

    with util.atomic_open(path) as f: ...     # readers see the old file or the new one, never a part
    util.write_atomic(path, data)             # bytes or str, the same way
    util.read_record(path, form, ok, E, fix)  # a JSON record a program keeps (None where none; else E, one line)
    class ExportError(util.UserError): ...    # a script's bad input: what util.cli reports
    sys.exit(util.cli(main))                  # the script's last line: `error: <message>`, exit status 1
"""
import ctypes
import json
import os
import platform
import re
import secrets
import shutil
import sys
import tempfile
from contextlib import contextmanager


class UserError(Exception):
    """Bad input, or a state the user can fix: the message is one line saying what is wrong (the value
    seen) and what would be accepted. Every script's own errors derive from it (ConfigError,
    CheckpointError, DataError, ExportError, ...), and cli() reports any of them the same way, with
    exit status exit_status (a subclass may name another, as train.py's Diverged does)."""

    exit_status = 1


def cli(main, argv=None):
    """Run main(argv) as a command (argv: sys.argv[1:] when None) and return its exit status: the
    error's exit_status (1) after printing a UserError as `error: <message>` on stderr (one line, no
    traceback), else main's own status where it returns an int, else 0."""
    try:
        status = main(sys.argv[1:] if argv is None else argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_status
    return status if isinstance(status, int) else 0


def machine():
    """The CPU's model name and logical core count (from /proc/cpuinfo where there is one): what a
    run's record says it ran on, beside the GPU's name where it had one."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical cores"


def cpu_id():
    """The CPU's x86 family, model and stepping (/proc/cpuinfo), e.g. "family 25 model 1 stepping 1" (AMD's
    Zen 3): it tells apart two CPUs of one model name ("AMD EPYC" under a hypervisor) whose sums may round
    otherwise; None where the platform does not say."""
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n")[0]  # the first logical CPU's fields
    except OSError:
        return None
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first.splitlines())}
    parts = [f"{word} {fields[key]}" for word, key in (("family", "cpu family"), ("model", "model"),
                                                       ("stepping", "stepping")) if fields.get(key)]
    return " ".join(parts) or None


def git_commit(repo=None):
    """The repository's commit (short hash), with "+uncommitted changes" where tracked files differ
    from it; "unknown" outside a git checkout. What a run, a benchmark or a study record says its
    numbers came from."""
    import subprocess
    repo = repo or os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                             timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha or "unknown") + ("+uncommitted changes" if sha and dirty else "")


def first_line(e):
    """The first line of an exception's message: an OSError's strerror (without the errno and the
    path, which the caller's message names), else str(e), else the exception's type."""
    text = getattr(e, "strerror", None) or str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def load_error(e):
    """The telling line of a load_state_dict error (its first line only says that loading failed)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
    return lines[1 if len(lines) > 1 and lines[0].startswith("Error(s) in loading") else 0][:300]


def reason(e):
    """'Type: first line' of the innermost cause, the part a user can act on."""
    while e.__cause__ is not None:
        e = e.__cause__
    line = (str(e).strip().splitlines() or [""])[0]
    line = line if len(line) <= 160 else line[:160] + "..."
    return f"{type(e).__name__}: {line}" if line else type(e).__name__


def read_record(path, form, ok, error, fix):
    """The JSON object a program keeps at path (a run's record), or None where there is none. One that
    cannot be read, is not JSON, or is not of its form (ok(record) is false: hand-edited, damaged) is
    an `error` (a UserError) of one line naming the file, the form expected (form) and what to do (fix)."""
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise error(f"cannot read {path}: {first_line(e)}; {fix}") from None
    if not isinstance(record, dict) or not ok(record):
        raise error(f"{path} is not {form}; {fix}")
    return record


# --- atomic writes ---------------------------------------------------------------------------------

def temp_path(path):
    """A temporary name beside path that no other process uses (pid and a random token), hidden from
    globs, so two writers of the same file never write into each other's temporary files."""
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


# temp_path's names, .<name>.<pid>.<8 hex>.tmp, and with a suffix a tool insists on (.tmp.gguf)
_TEMP = re.compile(r"\.(.+)\.(\d{1,9})\.[0-9a-f]{8}\.tmp(?:\.[a-z]+)?")


def _alive(pid):
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        pass
    return True


def remove_stale_temporaries(directory, names=None):
    """Remove the temporary files of temp_path in directory (of the files `names` only, where given)
    whose writer no longer runs on the local host: what a writer killed mid-write (kill -9, a power cut)
    left. A live writer's are kept. Returns the names removed."""
    try:
        entries = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for entry in entries:
        temp = _TEMP.fullmatch(entry)
        if not temp or names is not None and temp.group(1) not in names or _alive(int(temp.group(2))):
            continue
        path = os.path.join(directory, entry)
        try:
            if os.path.isdir(path):
                continue
            os.unlink(path)
        except OSError:  # gone already, or not ours to remove: left as it is
            continue
        removed.append(entry)
    return removed


def unusable_dir(path):
    """Why no file can be written in the directory path (made where missing), or None. Tried rather
    than read off the permission bits, which do not bind root: a temporary directory is made and
    removed in path's first existing ancestor."""
    probe = os.path.abspath(path)
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return f"{probe} is not a directory"
    try:
        os.rmdir(tempfile.mkdtemp(dir=probe, prefix=".probe-"))
    except OSError as e:
        return f"cannot write in {probe} ({e.strerror})"
    return None


def fsync_dir(directory):
    """Make the renames in directory durable: without it a power cut can undo them."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp, path):
    """Rename the finished file tmp to path: its data on disk first (fsync), then the rename, then
    the directory's entry (fsync)."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


@contextmanager
def atomic_open(path, mode="wb"):
    """A file object for writing path atomically: a fresh temporary file beside it (O_EXCL; mode
    0o666, so the umask decides, as for any file open() creates), fsynced, renamed over path, the
    directory fsynced. An exception inside the block (a full disk, a crash of the writer) leaves path
    as it was and no temporary file behind."""
    path = os.path.abspath(path)
    tmp = temp_path(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the name points at it
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path))  # and the rename is on disk before we report success
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def check_json_path(path, example="out.json"):
    """A --json option names a file to write: not a bool, not a directory, in a folder that exists and can
    be written; else UserError, one line (example: the file name its advice shows)."""
    if path in ("True", "False"):
        raise UserError(f"--json={path}: --json takes the path of the JSON file to write, e.g. --json={example}")
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UserError(f"--json={path} is a directory; give the path of the JSON file to write, e.g. "
                        f"--json={os.path.join(path, example)}")
    if not os.path.isdir(folder):
        raise UserError(f"--json={path}: its folder {folder} does not exist; make it, or choose another path")
    why = unusable_dir(folder)
    if why:
        raise UserError(f"--json={path} cannot be written: {why}; choose another path")
    if os.path.basename(path) in RECORD_NAMES:  # a run's, a dataset's or a Hugging Face folder's own file
        raise UserError(f"--json={path} would replace a record of its folder ({os.path.basename(path)}); it is "
                        f"kept: choose another path, e.g. --json={os.path.join(os.path.dirname(path), example)}")
    if os.path.isfile(path) and not _holds_json(path):
        raise UserError(f"--json={path} exists and is not a JSON file (a checkpoint, a log?); it is kept: choose "
                        f"another path, e.g. --json={os.path.join(os.path.dirname(path), example)}")


# the files a run directory, a prepared dataset or a Hugging Face folder keeps about itself: never a --json
RECORD_NAMES = {"config.json", "run.json", "done.json", "meta.json", "diverged.json", "manifest.json",
                "metrics.jsonl", "tokenizer.json", "generation_config.json"}


def _holds_json(path):
    """Whether the file is one JSON document (what a --json wrote before, to be written again)."""
    return read_json_or_none(path) is not None


def read_json_or_none(path):
    """The JSON document at path, or None where it cannot be read or is not JSON: for a caller that only
    asks whether a file is of a kind it knows (read_record is the reader of a program's own records)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def write_atomic(path, data):
    """bytes or str to path through atomic_open: a reader sees the old file or the new one."""
    with atomic_open(path, "wb" if isinstance(data, (bytes, bytearray, memoryview)) else "w") as f:
        f.write(data)


@contextmanager
def atomic_dir(path):
    """A directory to fill for path, written whole or not at all: a fresh temporary directory beside
    path whose files are fsynced and which is renamed to path (an empty directory there is replaced)
    when the block ends; an exception inside it removes the temporary directory and leaves path as
    it was."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(path)}.")
    try:
        yield tmp
        for name in os.listdir(tmp):
            with open(os.path.join(tmp, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(tmp)
        if os.path.isdir(path):
            os.rmdir(path)  # empty (a non-empty one fails here, as the rename would)
        os.replace(tmp, path)
        fsync_dir(parent)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)


# --- the process ---------------------------------------------------------------------------------

def keep_freed_cpu_memory():
    """Make glibc keep freed memory for reuse instead of returning it to the OS.

    By default every tensor over 32 MB is a fresh mmap, so each CPU step page-faults (and the kernel
    zeroes) its activations and logits again: a large part of a GPT2-124M step on a CPU, and of its
    step-to-step jitter. The process then keeps its peak memory, as the CUDA caching allocator does
    on GPUs. Returns False (and changes nothing) where libc has no mallopt.
    """
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's malloc.h
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS, Windows, ...)
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
