"""A GGUF file of export.py is checked as its .safetensors file is: the checksums it carries (recomputed
here by hand), damaged, foreign and mismatched files refused in one line before llama.cpp runs, a full
disk during the write, and the temporary file of a writer killed inside gguf's writer."""
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

import export as E
import export_gguf
import util
from conftest import ROOT
from data import tokenizer
from files import gguf_file
from llamacpp import runtime
from test_gguf import make_checkpoint, write_data


ARCHS = {"gpt2": dict(arch="gpt2", vocab_size=256), "llama2": dict(arch="llama2", n_kv_head=2, vocab_size=256)}


def export(run, *argv):
    """export.py --format=mxfp4 --gguf=True of a run, in this process: (exit status, stderr)."""
    import contextlib
    import io
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = util.cli(E.main, [f"--out_dir={run}", "--format=mxfp4", "--gguf=True", "--evaluate=False",
                               "--plot=False", *argv])
    return rc, err.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: run directory} of exports to mxfp4 with --gguf=True: a GPT2 and a Llama2 on the same bytes,
    and "other", the GPT2 with one weight changed."""
    d = tmp_path_factory.mktemp("runs")
    write_data(str(d / "data"), tokenizer.Tokenizer("bytes", "bytes"))
    out = {}
    for name, args in [*ARCHS.items(), ("other", ARCHS["gpt2"])]:
        make_checkpoint(str(d / name), str(d / "data"), **args)
        if name == "other":
            ckpt = torch.load(d / name / "ckpt.pt", weights_only=True)
            ckpt["model"]["transformer.h.1.mlp.c_fc.weight"][3, 4] += 0.25
            torch.save(ckpt, d / name / "ckpt.pt")
        assert export(d / name) == (0, "")
        out[name] = d / name
    return out


def raw_header(data):
    """(tensor entries, metadata, where the tensor bytes start) of safetensors bytes, read by hand."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    return header, header.pop("__metadata__"), 8 + n


# --- what the file carries -------------------------------------------------------------------------

def test_the_file_carries_the_sha256_of_its_tensors_its_header_and_its_source(runs):
    """By hand: pqt.sha256.<name> is the SHA-256 of each tensor's bytes as gguf's reader locates them;
    pqt.header_sha256 that of every byte before the tensor data with its own 64 digits as zeros; the
    pqt.source.* keys are the architecture, the format and the checksums of the .safetensors beside it."""
    for name, arch in (("gpt2", "gpt2"), ("llama2", "llama2")):
        path = runs[name] / "model-mxfp4.gguf"
        data = path.read_bytes()
        reader = gguf.GGUFReader(str(path))
        fields = {k: f.contents() for k, f in reader.fields.items()}
        assert fields["pqt.gguf_export"] == 1
        for t in reader.tensors:
            start = int(t.data_offset)
            assert fields[f"pqt.sha256.{t.name}"] == hashlib.sha256(data[start:start + int(t.n_bytes)]).hexdigest()
        assert {k for k in fields if k.startswith("pqt.sha256.")} == {f"pqt.sha256.{t.name}" for t in reader.tensors}
        digest = fields["pqt.header_sha256"]
        header = data[:reader.data_offset]
        assert header.count(digest.encode()) == 1
        assert digest == hashlib.sha256(header.replace(digest.encode(), b"0" * 64)).hexdigest()
        _, metadata, _ = raw_header((runs[name] / "model-mxfp4.safetensors").read_bytes())
        sums = json.loads(metadata["sha256"])
        assert {k: v for k, v in fields.items() if k.startswith("pqt.source.")} == {
            "pqt.source.arch": arch, "pqt.source.format": "mxfp4", "pqt.source.metadata_sha256": sums["metadata"],
            "pqt.source.tensors_sha256": hashlib.sha256(json.dumps(sums["tensors"], sort_keys=True).encode())
            .hexdigest()}


def test_every_byte_llama_cpp_reads_is_checked(runs):
    """Bits flipped at random in the header (metadata, tensor list) and in the tensors' bytes, and cuts
    at random lengths: gguf_file.read refuses each in one line (only the zero padding between tensors,
    which nothing reads, is not covered)."""
    path = runs["gpt2"] / "model-mxfp4.gguf"
    data = path.read_bytes()
    reader = gguf.GGUFReader(str(path))
    read = np.zeros(len(data), dtype=bool)
    read[:reader.data_offset] = True
    for t in reader.tensors:
        read[int(t.data_offset):int(t.data_offset) + int(t.n_bytes)] = True
    rng = np.random.default_rng(0)
    places = rng.choice(np.flatnonzero(read), 150, replace=False).tolist()
    damaged = [data[:int(n)] for n in rng.integers(0, len(data), 20)]
    damaged += [data[:i] + bytes([data[i] ^ (1 << int(rng.integers(8)))]) + data[i + 1:] for i in places]
    bad = path.parent / "bad.gguf"
    for d in damaged:
        bad.write_bytes(d)
        with pytest.raises(gguf_file.GGUFError) as e:
            gguf_file.read(str(bad))
        assert "\n" not in str(e.value)
    bad.unlink()


# --- damaged, foreign and mismatched files: one line, and llama.cpp never runs ------------------------

def flip(data, at, n):
    return data[:at] + bytes(b ^ 0xFF for b in data[at:at + n]) + data[at + n:]


def other_tools_gguf(path):
    """A GGUF file without our checksums (as llama.cpp's converters write them)."""
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.ones((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def metadata_flip(data):
    """4 bytes flipped inside a token of the vocabulary: a file gguf's reader reads, whose text differs."""
    at = data.index(b"<0x41>")  # the byte "A"
    return data[:at] + bytes(b ^ 0x01 for b in data[at:at + 4]) + data[at + 4:]


BAD = {  # name -> (what is done to the GPT2's model-mxfp4.gguf, what the line says)
    "64 bytes flipped at 80 %": (lambda d: flip(d, int(0.8 * len(d)), 64), "does not match its checksum"),
    "the last 3000 bytes cut": (lambda d: d[:-3000], "not a readable GGUF file"),
    "200,000 random bytes": (lambda d: np.random.default_rng(0).bytes(200_000), "not a readable GGUF file"),
    "4 bytes flipped in the fixed header": (lambda d: flip(d, 20, 4), "not a readable GGUF file"),
    "4 bytes flipped in the metadata": (metadata_flip, "metadata and tensor list do not match their checksum"),
    "an empty file": (lambda d: b"", "not a readable GGUF file"),
    "a missing file": (None, "no file"),
    "a directory": (None, "is a directory"),
    "another tool's GGUF": (None, "carries no checksums (pqt.gguf_export)"),
    "a GPT2 GGUF beside a Llama2 export": (None, "holds a gpt2 model in format mxfp4, and"),
    "another export of the same model": (None, "was written from another export than"),
}


def bad_file(case, runs, tmp_path):
    """The path of the GGUF of case, a .safetensors export beside it of the same stem."""
    path = tmp_path / "model-mxfp4.gguf"
    change = BAD[case][0]
    beside = {"a GPT2 GGUF beside a Llama2 export": "llama2", "another export of the same model": "other"}
    shutil.copy(runs[beside.get(case, "gpt2")] / "model-mxfp4.safetensors", tmp_path / "model-mxfp4.safetensors")
    if change is not None:
        path.write_bytes(change((runs["gpt2"] / "model-mxfp4.gguf").read_bytes()))
    elif case == "a directory":
        path.mkdir()
    elif case == "another tool's GGUF":
        other_tools_gguf(path)
    elif case != "a missing file":
        shutil.copy(runs["gpt2"] / "model-mxfp4.gguf", path)
    return path


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_gguf_is_one_line_and_llama_cpp_never_runs(case, runs, tmp_path, capsys, monkeypatch):
    """python export_gguf.py --gguf=F: exit status 1, one line naming what is wrong, no traceback, and
    llama.cpp is never started (whether llama-cpp-python is installed or not)."""
    def never(*args, **kwargs):
        raise AssertionError("llama.cpp ran on a file that should have been refused")
    monkeypatch.setattr(runtime, "llama_cpp_model", never)
    path = bad_file(case, runs, tmp_path)
    rc = util.cli(export_gguf.main, [f"--gguf={path}"])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("error: ") and err.strip().count("\n") == 0, err
    assert BAD[case][1] in err and str(path) in err, err


def test_the_command_refuses_a_damaged_file_in_one_line(runs, tmp_path):
    """The command itself, in a process of its own: 64 bytes flipped at 80 % of the file."""
    path = bad_file("64 bytes flipped at 80 %", runs, tmp_path)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "export_gguf.py"), f"--gguf={path}"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 1 and p.stdout == "" and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().count("\n") == 0 and "does not match its checksum" in p.stderr, p.stderr


def test_our_reader_refuses_a_damaged_file_before_using_it(runs, tmp_path):
    """model_from_gguf, the model export.py measures the file's logits with, reads through the check."""
    path = bad_file("64 bytes flipped at 80 %", runs, tmp_path)
    model_args = json.loads(raw_header((tmp_path / "model-mxfp4.safetensors").read_bytes())[1]["model_args"])
    with pytest.raises(gguf_file.GGUFError, match="does not match its checksum"):
        gguf_file.model_from_gguf(str(path), model_args)


# --- a full disk, a writer killed ---------------------------------------------------------------------

def test_a_full_disk_during_the_gguf_write_is_one_line_and_leaves_no_temporary(runs, tmp_path):
    """A tmpfs with room for bitwidths.json and the .safetensors but not the .gguf as --export_dir: the
    line every full disk gets, no traceback, the .safetensors kept and no temporary file left."""
    from disk_faults import tiny_tmpfs
    sizes = [os.path.getsize(runs["gpt2"] / name) for name in ("bitwidths.json", "model-mxfp4.safetensors")]
    pages = lambda n: -(-n // 4096) * 4096  # noqa: E731 (tmpfs allocates whole pages)
    room = sum(pages(n) for n in sizes) + pages(os.path.getsize(runs["gpt2"] / "model-mxfp4.gguf") // 2)
    mnt = tmp_path / "disk"
    script = (f'{sys.executable} export.py --out_dir={runs["gpt2"]} --export_dir={mnt} --format=mxfp4 --gguf=True '
              f'--evaluate=False --plot=False 2>{tmp_path / "err"}; echo $? > {tmp_path / "rc"}; '
              f'ls -A {mnt} > {tmp_path / "left"}')
    subprocess.run([*tiny_tmpfs(mnt, size=str(room)), "sh", "-c", script], cwd=ROOT, timeout=300, check=True)
    err = (tmp_path / "err").read_text()
    assert (tmp_path / "rc").read_text().strip() == "1" and err.strip().count("\n") == 0, err
    assert f"cannot write {mnt / 'model-mxfp4.gguf'} (No space left on device)" in err, err
    assert (tmp_path / "left").read_text().split() == ["bitwidths.json", "model-mxfp4.safetensors"]


def test_a_full_disk_inside_ggufs_writer_is_one_line(runs, tmp_path, capsys, monkeypatch):
    """The same where no tmpfs can be mounted: the files gguf's writer opens fill after half a write."""
    from disk_faults import full_disk_open
    monkeypatch.setattr(gguf.gguf_writer, "open", full_disk_open(), raising=False)
    rc, err = export(runs["gpt2"], f"--export_dir={tmp_path}")
    assert rc == 1 and err.strip().count("\n") == 0, err
    assert f"cannot write {tmp_path / 'model-mxfp4.gguf'} (No space left on device)" in err, err
    assert sorted(os.listdir(tmp_path)) == ["bitwidths.json", "model-mxfp4.safetensors"]


CRASH = """import os, signal, sys
sys.path.insert(0, {root!r})
import gguf, export, util
def killed(self, *args, **kwargs):  # kill -9 inside gguf's writer, half of the file written
    self.fout[0].write(b"x" * 1000)
    self.fout[0].flush()
    os.kill(os.getpid(), signal.SIGKILL)
gguf.GGUFWriter.write_tensors_to_file = killed
sys.exit(util.cli(export.main, {argv!r}))
"""


def test_a_writer_killed_inside_the_gguf_write_leaves_a_temporary_the_next_export_removes(runs, tmp_path):
    """kill -9 inside gguf's writer leaves .model-mxfp4.gguf.<pid>.<token>.tmp and no model-mxfp4.gguf;
    the next export removes it (as train.py removes its dead writers' temporaries), keeps a live
    writer's, and writes the file."""
    argv = [f"--out_dir={runs['gpt2']}", f"--export_dir={tmp_path}", "--format=mxfp4", "--gguf=True",
            "--evaluate=False", "--plot=False"]
    p = subprocess.run([sys.executable, "-c", CRASH.format(root=ROOT, argv=argv)], cwd=ROOT, timeout=300)
    assert p.returncode == -9
    stale = [n for n in os.listdir(tmp_path) if n.startswith(".model-mxfp4.gguf.") and n.endswith(".tmp")]
    assert len(stale) == 1 and not (tmp_path / "model-mxfp4.gguf").exists()
    live = f".model-mxfp4.gguf.{os.getpid()}.0123abcd.tmp"
    (tmp_path / live).write_bytes(b"a writer still at work")
    assert export(runs["gpt2"], f"--export_dir={tmp_path}", "--overwrite=True") == (0, "")
    assert sorted(os.listdir(tmp_path)) == sorted([live, "bitwidths.json", "model-mxfp4.gguf",
                                                   "model-mxfp4.safetensors"])
    gguf_file.read(str(tmp_path / "model-mxfp4.gguf"))  # whole, and verified
