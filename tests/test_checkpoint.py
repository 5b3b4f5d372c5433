"""checkpoint.py against a hostile environment: flipped bytes, full disks, unwritable and
concurrent out_dirs, and sharded FSDP checkpoints read back at another world size."""
import json
import os
import signal
import struct
import subprocess
import sys
import zipfile

import pytest
import torch

import checkpoint
import sharded
from checkpoint import CheckpointError
from conftest import ROOT, end_spawned_rank


def a_state():
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(64, generator=g)},
            "iter_num": 7, "config": {"seed": 1}}


def data_offset(path, member_suffix):
    """Where the bytes of the zip record ending in member_suffix start, read from its local header
    (the zip format itself, not checkpoint.py)."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(member_suffix))
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len, info.file_size


def flip(path, offset, mask=0x01):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


def one_line(e):
    text = str(e)
    assert text and "\n" not in text, text
    return text


def test_save_then_load_is_exact(tmp_path):
    path = tmp_path / "ckpt.pt"
    state = a_state()
    checkpoint.save(state, path)
    back = checkpoint.load(path)
    assert back["iter_num"] == 7 and back["config"] == {"seed": 1}
    for k in state["model"]:
        assert torch.equal(back["model"][k], state["model"][k])
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # no temporary file left


@pytest.mark.parametrize("where", ["tensor", "pickle"])
def test_flipped_bytes_are_refused_in_one_line(tmp_path, where):
    path = tmp_path / "ckpt.pt"
    checkpoint.save(a_state(), path)
    start, size = data_offset(path, "data/0" if where == "tensor" else "data.pkl")
    flip(path, start + size // 2, 0x10)
    # torch.load itself does not notice (this is what the check is for) ...
    if where == "tensor":
        torch.load(path, weights_only=True)
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(path)
    assert "corrupt" in one_line(e.value) and "CRC32" in str(e.value)


def test_truncated_missing_and_foreign_files(tmp_path):
    path = tmp_path / "ckpt.pt"
    checkpoint.save(a_state(), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt") as e:
        checkpoint.load(path)
    one_line(e.value)
    with pytest.raises(CheckpointError, match="no checkpoint at") as e:
        checkpoint.load(tmp_path / "nothing.pt")
    path.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="not a checkpoint") as e:
        checkpoint.load(path)
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as z:
        z.writestr("readme.txt", "hello")
    with pytest.raises(CheckpointError, match="not a checkpoint") as e:
        checkpoint.load(tmp_path / "other.zip")


class Foreign:  # a class weights_only refuses to build
    pass


def test_objects_that_weights_only_refuses_are_not_a_checkpoint(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"model": Foreign()}, path)
    with pytest.raises(CheckpointError, match="not a checkpoint this code can read") as e:
        checkpoint.load(path)
    one_line(e.value)


def test_out_of_memory_is_not_called_a_bad_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    checkpoint.save(a_state(), path)

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(torch, "load", oom)
    with pytest.raises(torch.OutOfMemoryError):
        checkpoint.load(path)


def test_full_disk_keeps_the_old_checkpoint_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    checkpoint.save(a_state(), path)
    before = path.read_bytes()
    real_save = torch.save

    def save_until_full(obj, f, *args, **kwargs):  # writes part of the file, then the disk is full
        f.write(b"PK\x03\x04 partial")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(torch, "save", save_until_full)
    with pytest.raises(CheckpointError, match="No space left on device") as e:
        checkpoint.save({"model": {}}, path)
    assert "unchanged" in one_line(e.value)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["ckpt.pt"]
    # torch's own writer reports a failed write as a RuntimeError: the same outcome
    message = ("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file data/0: file "
               "write failed")
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(RuntimeError(message)))
    with pytest.raises(CheckpointError, match="file write failed"):
        checkpoint.save({"model": {}}, path)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["ckpt.pt"]
    monkeypatch.setattr(torch, "save", real_save)
    checkpoint.load(path)


def test_an_out_dir_that_is_a_file_is_one_line(tmp_path):
    blocker = tmp_path / "out"
    blocker.write_text("a file where the out_dir should be")
    with pytest.raises(CheckpointError, match="not a directory") as e:
        checkpoint.save(a_state(), blocker / "ckpt.pt")
    one_line(e.value)
    with pytest.raises(CheckpointError, match="cannot lock") as e:
        checkpoint.lock(blocker)
    one_line(e.value)


def test_failed_rename_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    checkpoint.save(a_state(), path)
    before = path.read_bytes()
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    with pytest.raises(CheckpointError, match="Permission denied"):
        checkpoint.save({"model": {}}, path)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["ckpt.pt"]


HOLD = """
import sys, time
sys.path.insert(0, {root!r})
import checkpoint
held = checkpoint.lock(sys.argv[1])
print("locked", flush=True)
time.sleep(60)
"""


def test_a_second_writer_is_refused_until_the_first_dies(tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLD.format(root=ROOT), str(out)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(CheckpointError) as e:
            checkpoint.lock(out)
        assert f"pid {holder.pid}" in one_line(e.value) and "another run" in str(e.value)
        holder.send_signal(signal.SIGKILL)  # the kernel releases a dead process's lock
        holder.wait(timeout=10)
        with checkpoint.lock(out):
            with pytest.raises(CheckpointError):  # one lock per out_dir, in one process too
                checkpoint.lock(out)
        checkpoint.lock(out).release()  # and released on exit from the with block
    finally:
        holder.kill()
        holder.wait()


# ---------------------------------------------------------------------------------------------
# sharded: FSDP2 on 2 processes (gloo, CPU) saves; 1 and 2 processes load


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.GELU(),
                                                              torch.nn.Linear(24, 16)) for _ in range(2))
        self.head = torch.nn.Linear(16, 5)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def build(seed, fsdp):
    torch.manual_seed(seed)
    model = Tiny()
    if fsdp:
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)


def train_step(model, opt, step):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def full_state(model, opt):
    """The whole model and optimizer state, gathered by torch's own FSDP state-dict API."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {"model": get_model_state_dict(model, options=options),
            "optimizer": get_optimizer_state_dict(model, opt, options=options)}


def sharded_worker(rank, world_size, init_file, path, tmp):
    """Save a trained FSDP model twice, then load it into a fresh one with other weights."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        model, opt = build(0, fsdp=True)
        train_step(model, opt, 0)
        sharded.save_sharded(path, model, [opt], {"iter_num": 1})
        first = os.path.realpath(path)
        train_step(model, opt, 1)
        sharded.save_sharded(path, model, [opt], {"iter_num": 2, "rng_state": torch.get_rng_state()})
        assert os.path.realpath(path) != first and not os.path.exists(first)  # swapped, the old one gone
        saved = full_state(model, opt)

        model, opt = build(1, fsdp=True)  # other weights ...
        train_step(model, opt, 5)  # ... and other optimizer state, all to be overwritten
        header = sharded.load_sharded(path, model, [opt])
        assert header["iter_num"] == 2
        loaded = full_state(model, opt)
        if rank == 0:
            torch.save(saved, os.path.join(tmp, "saved.pt"))
            torch.save(loaded, os.path.join(tmp, "loaded2.pt"))
    except BaseException:
        dist.destroy_process_group()
        raise
    end_spawned_rank()


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), (a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (a.keys(), b.keys())
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b, (a, b)


def test_sharded_checkpoint_saved_by_2_loads_in_1_and_2(tmp_path):
    import torch.multiprocessing as mp
    path = tmp_path / "ckpt.dcp"
    mp.spawn(sharded_worker, args=(2, str(tmp_path / "init"), str(path), str(tmp_path)), nprocs=2, join=True)
    saved = torch.load(tmp_path / "saved.pt", weights_only=True)
    assert_same(saved, torch.load(tmp_path / "loaded2.pt", weights_only=True))  # 2 processes, FSDP
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt.dcp", os.path.basename(os.path.realpath(path)),
                                                  "saved.pt", "loaded2.pt", "init"])

    model, opt = build(2, fsdp=False)  # 1 process, no process group
    train_step(model, opt, 5)
    header = sharded.load_sharded(path, model, [opt])
    assert header["iter_num"] == 2 and header["rng_state"].dtype == torch.uint8
    assert_same(saved, full_state(model, opt))

    other = torch.nn.Linear(3, 3)  # another model: one line, not DCP's traceback
    with pytest.raises(CheckpointError, match="cannot load") as e:
        sharded.load_sharded(path, other, [torch.optim.AdamW(other.parameters())])
    one_line(e.value)

    ckpt = checkpoint.load_model(path)  # what sample.py reads
    assert ckpt["iter_num"] == 2 and "optimizer" not in ckpt
    assert_same(saved["model"], ckpt["model"])

    shard = os.path.join(os.path.realpath(path), "__1_0.distcp")
    flip(shard, os.path.getsize(shard) // 2)
    with pytest.raises(CheckpointError, match="corrupt") as e:
        checkpoint.load_model(path)
    assert "__1_0.distcp" in one_line(e.value)
    with pytest.raises(CheckpointError, match="corrupt"):
        sharded.load_sharded(path, model, [opt])


# ---------------------------------------------------------------------------------------------
# the run directory: find and read


def test_read_gives_every_reader_the_same_from_either_layout_and_any_path(tmp_path):
    from dataclasses import asdict

    from model import ModelConfig
    args = asdict(ModelConfig(n_layer=1, n_head=2, n_embd=64, block_size=16, vocab_size=256))
    pqt = {"method": "gaussws[od]", "b_init": 7.0, "b_target": 3.0}
    layouts = {"new": {"model_args": args, "pqt": pqt}, "old": {"model_args": {**args, **pqt}},
               "none": {"model_args": args}}  # no pqt at all: train.py's defaults
    for name, layout in layouts.items():
        (tmp_path / name).mkdir()
        checkpoint.save({"model": a_state()["model"], "iter_num": 3, "config": {"seed": 5}, **layout},
                        tmp_path / name / "ckpt.pt")
    for name in layouts:
        for path in (tmp_path / name, tmp_path / name / "ckpt.pt"):  # a run directory, or the file itself
            ckpt = checkpoint.read(str(path))
            assert ckpt["path"] == str(tmp_path / name / "ckpt.pt") and ckpt["model_args"] == args
            unset = {"pqt_start": 0.0, "target_format": "", "ste_start": 0.0, "bits_per_weight": 0.0}  # no phase
            assert ckpt["pqt"] == {**unset, **(pqt if name != "none" else {"method": "bf16", "b_init": 6.0,
                                                                            "b_target": 4.0})}
            assert ckpt["config"] == {"seed": 5} and ckpt["iter_num"] == 3
            assert_same(ckpt["model"], a_state()["model"])


def test_find_prefers_ckpt_pt_and_reads_a_sharded_header(tmp_path):
    run = tmp_path / "run"
    target = run / "ckpt.dcp.1234"
    target.mkdir(parents=True)
    checkpoint.save({"model_args": {"n_layer": 1}, "iter_num": 4}, target / sharded.HEADER)
    os.symlink("ckpt.dcp.1234", run / "ckpt.dcp")
    assert checkpoint.find(str(run)) == str(run / "ckpt.dcp")
    assert checkpoint.find(str(run / "ckpt.dcp")) == str(run / "ckpt.dcp")  # a sharded checkpoint names itself
    header = checkpoint.read(str(run), header_only=True)
    assert header["sharded"] == str(run / "ckpt.dcp") and header["iter_num"] == 4 and "model" not in header
    checkpoint.save({"model": {}, "model_args": {}}, run / "ckpt.pt")
    assert checkpoint.find(str(run)) == str(run / "ckpt.pt")
    assert checkpoint.find(str(tmp_path / "nothing")) is None and checkpoint.find(str(tmp_path)) is None


def test_read_refuses_what_is_not_a_checkpoint_of_this_code_in_one_line(tmp_path):
    with pytest.raises(CheckpointError, match=r"no checkpoint at .*: train one \(python train.py --out_dir=") as e:
        checkpoint.read(str(tmp_path / "none"))
    one_line(e.value)
    checkpoint.save({"model": {}}, tmp_path / "ckpt.pt")
    with pytest.raises(CheckpointError, match="lacks 'model_args'"):
        checkpoint.read(str(tmp_path))
    checkpoint.save({"model": {}, "model_args": {"n_layer": 1, "n_expert": 4}}, tmp_path / "ckpt.pt")
    with pytest.raises(CheckpointError, match="'n_expert', which this code's model does not have") as e:
        checkpoint.read(str(tmp_path))
    one_line(e.value)


class RunsCode:
    """Pickled, calls os.system: what a crafted .metadata would run if it were unpickled unchecked."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def sharded_with_metadata(d, data):
    """A sharded checkpoint in d whose .metadata is replaced by data, crc32.json made to match."""
    import zlib
    model = torch.nn.Linear(4, 4)
    sharded.save_sharded(d / "ckpt.dcp", model, [torch.optim.AdamW(model.parameters())],
                         {"model_args": {"n_layer": 1}, "iter_num": 1})
    directory = os.path.realpath(d / "ckpt.dcp")
    with open(os.path.join(directory, ".metadata"), "wb") as f:
        f.write(data)
    crcs = {n: zlib.crc32(open(os.path.join(directory, n), "rb").read()) for n in sorted(os.listdir(directory))
            if n != sharded.CRCS}
    with open(os.path.join(directory, sharded.CRCS), "w") as f:
        f.write(json.dumps(crcs))
    return d / "ckpt.dcp"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP saving in one process
@pytest.mark.parametrize("payload", ["code", "an allowed class that is not DCP's metadata", "not a pickle"])
def test_a_sharded_checkpoint_whose_metadata_is_not_dcps_is_one_line_and_runs_nothing(tmp_path, payload, caplog):
    """DCP's .metadata is a pickle. One that would run code, one that unpickles to something else (as one of
    another torch version may), and bytes that are no pickle, each with a valid crc32.json: every reader
    (checkpoint.read) refuses it in one line, nothing runs, and DCP logs nothing (it logged a traceback for each
    of its two reads); sample.py says so in one line, exit status 1, no traceback on its stderr."""
    import pickle
    marker = tmp_path / "ran"
    data = {"code": pickle.dumps(RunsCode(marker)), "not a pickle": os.urandom(300),
            "an allowed class that is not DCP's metadata": pickle.dumps(torch.Size([1, 2]))}[payload]
    path = sharded_with_metadata(tmp_path, data)
    caplog.clear()
    with pytest.raises(CheckpointError) as e:
        checkpoint.read(str(tmp_path))
    assert one_line(e.value).startswith(f"{path} is not a sharded checkpoint this code can read: its .metadata ")
    assert not caplog.records and not marker.exists()
    if payload == "code":
        r = subprocess.run([sys.executable, "sample.py", f"--out_dir={tmp_path}", "--device=cpu"], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 1 and r.stderr == f"error: {e.value}\n" and not marker.exists(), r.stderr


# ---------------------------------------------------------------------------------------------
# the run directory: full disks, stale temporaries, the divergence record, waiting for the lock


def test_a_disk_that_fills_inside_torch_save_is_one_line(tmp_path, monkeypatch):
    """torch's writer turns the file's ENOSPC into RuntimeError "unexpected pos N vs M"."""
    import errno
    import io
    path = tmp_path / "ckpt.pt"
    checkpoint.save(a_state(), path)
    before = path.read_bytes()

    class FillsUp(io.FileIO):
        def write(self, b):
            if self.tell() + len(b) > 300:
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().write(b)
    monkeypatch.setattr(checkpoint.os, "fdopen", lambda fd, mode: FillsUp(fd, "wb"))
    with pytest.raises(CheckpointError, match="No space left on device") as e:
        checkpoint.save(a_state(), path)
    assert "unexpected pos" not in one_line(e.value)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["ckpt.pt"]


def test_write_text_on_a_full_disk_keeps_the_old_file(tmp_path, monkeypatch):
    import errno
    path = tmp_path / "config.json"
    path.write_text("old")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(CheckpointError, match="No space left on device") as e:
        checkpoint.write_text(path, "new")
    one_line(e.value)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["config.json"]


def test_clean_stale_removes_dead_writers_temporaries_and_unlinked_sharded_directories(tmp_path):
    dead, live = 999_999_999, os.getpid()  # above any pid_max (2^22 at most): no process has it
    stale = [f".ckpt.pt.{dead}.0123abcd.tmp", f".ckpt.dcp.{dead}.89abcdef.tmp"]
    kept = [f".ckpt.pt.{live}.0123abcd.tmp", f".ckpt.pt.{dead}.tmp", "x.tmp", ".lock"]
    for name in stale + kept:
        (tmp_path / name).write_bytes(b"x")
    for name, content in (("ckpt.dcp.00000001", ".metadata"), ("ckpt.dcp.00000002", "__0_0.distcp"),
                          ("ckpt.dcp.00000003", sharded.CRCS), ("other.0000000a", "notes.txt")):
        (tmp_path / name).mkdir()
        (tmp_path / name / content).write_bytes(b"x")
    os.symlink("ckpt.dcp.00000003", tmp_path / "ckpt.dcp")  # the current sharded checkpoint
    removed = checkpoint.clean_stale(tmp_path)
    assert sorted(removed) == sorted(stale + ["ckpt.dcp.00000001", "ckpt.dcp.00000002"])
    assert sorted(os.listdir(tmp_path)) == sorted(kept + ["ckpt.dcp", "ckpt.dcp.00000003", "other.0000000a"])


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"step": "11", "what": "loss"}', '{"step": 11}'])
def test_a_hand_edited_divergence_record_is_one_line(tmp_path, text):
    (tmp_path / "diverged.json").write_text(text)
    with pytest.raises(CheckpointError, match="diverged.json") as e:
        checkpoint.read_divergence(tmp_path)
    one_line(e.value)
    assert checkpoint.read_divergence(tmp_path / "nowhere") is None


def test_a_divergence_record_writes_non_finite_values_as_strings(tmp_path):
    checkpoint.write_divergence(tmp_path, {"step": 3, "what": "eval_loss", "value": {"train": float("nan"),
                                                                                     "val": float("inf")}})
    import json
    assert json.loads((tmp_path / "diverged.json").read_text()) == {"step": 3, "what": "eval_loss",
                                                                    "value": {"train": "nan", "val": "inf"}}
    assert checkpoint.read_divergence(tmp_path)["step"] == 3


def waiter_for(out_dir, monkeypatch):
    """A thread that takes lock(out_dir, wait=True) into the returned list, started and past the point where
    it asks for the lock without LOCK_NB (from there it must block while the lock is held)."""
    import fcntl
    import threading
    got, asking, real_flock = [], threading.Event(), fcntl.flock

    def flock(fd, op):
        if not op & fcntl.LOCK_NB:
            asking.set()
        return real_flock(fd, op)
    monkeypatch.setattr(fcntl, "flock", flock)
    waiter = threading.Thread(target=lambda: got.append(checkpoint.lock(out_dir, wait=True)))
    waiter.start()
    assert asking.wait(30)
    return waiter, got


def test_a_lock_with_wait_blocks_until_the_holder_lets_go(tmp_path, monkeypatch):
    held = checkpoint.lock(tmp_path)
    with pytest.raises(checkpoint.Busy) as e:
        checkpoint.lock(tmp_path)
    assert e.value.holder == str(os.getpid())
    waiter, got = waiter_for(tmp_path, monkeypatch)
    waiter.join(timeout=0.5)
    assert waiter.is_alive() and not got  # still waiting: the lock is held
    held.release()
    waiter.join(timeout=30)
    assert len(got) == 1
    got[0].release()
    with checkpoint.lock(tmp_path, name=".study.lock"):  # another name, another lock of the same directory
        checkpoint.lock(tmp_path).release()


def test_a_lock_that_made_its_directory_removes_it_when_nothing_else_was_written(tmp_path):
    out = tmp_path / "out"
    checkpoint.lock(out).release()  # a run that failed before it wrote anything leaves no folder
    assert not out.exists()
    with checkpoint.lock(out):
        (out / "ckpt.pt").write_bytes(b"x")
    assert sorted(os.listdir(out)) == [".lock", "ckpt.pt"]  # what a run wrote stays, with its lock file
    checkpoint.lock(out).release()  # a directory the lock did not make stays too
    assert out.is_dir()
    tmp_path.joinpath("kept").mkdir()
    checkpoint.lock(tmp_path / "kept").release()
    assert os.listdir(tmp_path / "kept") == [".lock"]


def test_a_waiter_whose_lock_file_was_removed_locks_the_new_one(tmp_path, monkeypatch):
    """The holder made the directory and removes it with its lock file when it lets go; a waiter that
    opened the old file then holds a lock on nothing, so it must lock the path anew: after it has
    the lock, a third run is refused."""
    out = tmp_path / "out"
    held = checkpoint.lock(out)
    waiter, got = waiter_for(out, monkeypatch)
    held.release()  # removes out/.lock and out, which the waiter's open file no longer names
    waiter.join(timeout=30)
    assert len(got) == 1 and (out / ".lock").read_text() == f"{os.getpid()}\n"
    with pytest.raises(checkpoint.Busy):
        checkpoint.lock(out)
    got[0].release()
