"""util.py: a file or a directory is written whole or not at all, and every script reports bad input
the same way: `error: <one line>` on stderr, exit status 1, no traceback."""
import os
import platform
import shutil
import subprocess
import sys

import pytest

import util
from conftest import ROOT


def test_atomic_open_writes_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "f.json"
    path.write_text("old")
    with util.atomic_open(path, "w") as f:
        f.write("new")
        assert path.read_text() == "old"  # not yet: the new text is in a temporary file beside it
        (tmp,) = [p for p in os.listdir(tmp_path) if p != "f.json"]
        assert tmp.startswith(".f.json.") and tmp.endswith(".tmp")
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["f.json"]


@pytest.mark.parametrize("where", ["write", "rename"])
def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch, where):
    path = tmp_path / "f.bin"
    path.write_bytes(b"old")
    if where == "rename":
        monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
        with pytest.raises(OSError, match="No space left"):
            util.write_atomic(path, b"new data")
    else:
        with pytest.raises(KeyboardInterrupt):
            with util.atomic_open(path) as f:
                f.write(b"half of it")
                raise KeyboardInterrupt  # the writer stops in the middle
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["f.bin"]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="tells a directory's descriptor by /proc (Linux)")
def test_the_file_is_on_disk_before_its_name_and_the_name_before_success(tmp_path, monkeypatch):
    """The order that survives a power cut: fsync of the data, the rename, fsync of the directory."""
    events, fsync, replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.path.isdir(f"/proc/self/fd/{fd}")))
                        or fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("rename", False)) or replace(a, b))
    util.write_atomic(tmp_path / "f", "text")
    assert events == [("fsync", False), ("rename", False), ("fsync", True)]
    assert (tmp_path / "f").read_text() == "text"


def test_atomic_dir_appears_whole_or_not_at_all(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError):
        with util.atomic_dir(out) as d:
            with open(os.path.join(d, "a"), "w") as f:
                f.write("1")
            raise ValueError("the writer failed")
    assert os.listdir(tmp_path) == []
    out.mkdir()  # an empty directory is taken
    with util.atomic_dir(out) as d:
        with open(os.path.join(d, "a"), "w") as f:
            f.write("1")
        assert os.listdir(out) == []
    assert os.listdir(out) == ["a"] and os.listdir(tmp_path) == ["out"]


def test_first_line_and_reason():
    assert util.first_line(OSError(28, "No space left on device")) == "No space left on device"
    assert util.first_line(ValueError("bad\nsecond line")) == "bad"
    assert util.first_line(KeyError()) == "KeyError"
    try:
        try:
            raise OSError(2, "No such file or directory")
        except OSError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as e:
        assert util.reason(e) == "FileNotFoundError: [Errno 2] No such file or directory"
    assert util.reason(ValueError("x" * 200)) == "ValueError: " + "x" * 160 + "..."


def test_cli_reports_a_user_error_in_one_line_and_other_errors_as_they_are(capsys):
    class MyError(util.UserError):
        pass

    class Stopped(util.UserError):  # as train.py's Diverged: a status of its own
        exit_status = 3

    def main(argv):
        if argv == ["bad"]:
            raise MyError("--x=3: expected 1 or 2")
        if argv == ["stopped"]:
            raise Stopped("it diverged")
        if argv == ["bug"]:
            raise ZeroDivisionError
        return 7 if argv == ["seven"] else None
    assert util.cli(main, ["bad"]) == 1
    assert capsys.readouterr().err == "error: --x=3: expected 1 or 2\n"
    assert util.cli(main, ["stopped"]) == 3 and capsys.readouterr().err == "error: it diverged\n"
    assert util.cli(main, ["seven"]) == 7 and util.cli(main, []) == 0
    with pytest.raises(ZeroDivisionError):  # a bug keeps its traceback
        util.cli(main, ["bug"])


@pytest.mark.parametrize("argv", [
    ["train.py", "--n_layr=3"], ["sample.py", "--temprature=1"], ["export.py", "--format=fp5"],
    ["hf.py", "--ckpt=/nonexistent/ckpt.pt", "--out=/nonexistent/out"], ["-m", "studies", "nostudy"],
    ["plot.py", "--bad"], ["bench.py", "bench"], ["export_gguf.py", "--ggfu=x.gguf"]])
def test_every_script_says_error_in_one_line_with_exit_status_1(argv, tmp_path):
    script = argv[:2] if argv[0] == "-m" else [os.path.join(ROOT, argv[0])]  # a package runs as `python -m`
    r = subprocess.run([sys.executable, *script, *argv[len(script):]], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 1, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error: ") and "Traceback" not in r.stderr


_MALLOC_CHECK = """
import ctypes, torch, util
class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]
mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = Mallinfo2
def mmapped_by_a_large_tensor():
    before = mallinfo2().hblkhd
    t = torch.empty(64 * 2**20, dtype=torch.uint8)  # above glibc's largest mmap threshold (32 MB)
    return mallinfo2().hblkhd - before
print(mmapped_by_a_large_tensor(), util.keep_freed_cpu_memory(), mmapped_by_a_large_tensor())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt and mallinfo2 are glibc's")
def test_keep_freed_cpu_memory_puts_large_tensors_in_the_heap():
    # A fresh process: bench.main (tests/test_bench.py) already changed this one's malloc.
    out = subprocess.run([sys.executable, "-c", _MALLOC_CHECK], cwd=ROOT, capture_output=True, text=True, check=True)
    default, changed, after = out.stdout.split()
    assert int(default) >= 64 * 2**20  # by default its own mmap, given back at free (and faulted in again)
    assert changed == "True" and int(after) == 0  # now in the heap, where a freed block is reused


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo") or shutil.which("lscpu") is None,
                    reason="no /proc/cpuinfo, or no lscpu to compare with (not Linux)")
def test_the_cpu_id_is_lscpus_family_model_and_stepping():
    """What a run records to tell two CPUs of one name apart, against util-linux's own reading."""
    out = subprocess.run(["lscpu"], env={**os.environ, "LC_ALL": "C"}, capture_output=True, text=True).stdout
    f = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines())}
    if "CPU family" not in f:
        pytest.skip("lscpu names no CPU family here (not an x86 CPU)")
    assert util.cpu_id() == f"family {f['CPU family']} model {f['Model']} stepping {f['Stepping']}"


def test_a_json_output_never_replaces_a_checkpoint_a_log_or_a_record(tmp_path):
    """--json=PATH: an earlier JSON summary is written again; a file that is not one JSON document (a
    checkpoint, a log) and a folder's own record (config.json, metrics.jsonl, ...) are kept, in one line."""
    (tmp_path / "ckpt.pt").write_bytes(b"PK\x03\x04\x80 a zip")
    (tmp_path / "log.txt").write_text('{"iter": 1}\n{"iter": 2}\n')
    (tmp_path / "config.json").write_text('{"n_layer": 2}')
    (tmp_path / "out.json").write_text('{"exports": []}')
    for name, why in (("ckpt.pt", "is not a JSON file"), ("log.txt", "is not a JSON file"),
                      ("config.json", "would replace a record"), ("metrics.jsonl", "would replace a record")):
        with pytest.raises(util.UserError, match=why) as e:
            util.check_json_path(str(tmp_path / name), "export.json")
        assert "\n" not in str(e.value) and "choose another path" in str(e.value)
    util.check_json_path(str(tmp_path / "out.json"), "export.json")  # its own earlier summary
    util.check_json_path(str(tmp_path / "new.json"), "export.json")
    assert (tmp_path / "ckpt.pt").read_bytes() == b"PK\x03\x04\x80 a zip"
