"""sample.py: it decodes what the model generates with the data's own tokenizer, from a checkpoint of
either layout, and says in one line what is wrong with a bad option, prompt or checkpoint."""
import json
import os
import struct
import subprocess
import sys
import zipfile

import pytest
import torch

import checkpoint
import gaussws
import sample
from checkpoint import CheckpointError
from configurator import ConfigError
from data import loader
from model import GPT, ROLES
from conftest import ROOT, greedy_text, tiny_model


def flip_a_byte_of_the_largest_tensor(path, mask=0x04):
    """Flip one bit in the middle of the largest record of a torch.save zip, found from the zip
    format's own local header (not checkpoint.py)."""
    with zipfile.ZipFile(path) as z:
        info = max(z.infolist(), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset)
        name_len, extra_len = struct.unpack("<HH", f.read(30)[26:30])
        offset = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


def write_checkpoint(out_dir, config, dataset="default", method="bf16", old_layout=False):
    """A checkpoint as train.py writes it; old_layout: the method inside model_args, as older runs kept it."""
    model = gaussws.convert(GPT(config), method, ROLES[config.arch], b_init=6.0, b_target=4.0)
    from dataclasses import asdict
    os.makedirs(out_dir, exist_ok=True)
    pqt = {"method": method, "b_init": 6.0, "b_target": 4.0}
    layout = {"model_args": {**asdict(config), **pqt}} if old_layout else {"model_args": asdict(config), "pqt": pqt}
    torch.save({"model": model.state_dict(), **layout, "config": {"dataset": dataset}, "iter_num": 0},
               os.path.join(out_dir, "ckpt.pt"))
    return model


@pytest.fixture(params=[False, True], ids=["layout", "old_layout"])
def byte_run(tmp_path, monkeypatch, request):
    """A checkpoint of a tiny byte-level model and a data/default/meta.json beside a fake repo root."""
    meta_dir = tmp_path / "repo" / "data" / "default"
    meta_dir.mkdir(parents=True)
    (meta_dir / "meta.json").write_text(json.dumps({"vocab_size": 256, "tokenizer": "bytes"}))
    monkeypatch.setattr(loader, "ROOT", str(tmp_path / "repo"))  # where sample.py finds data/<dataset>
    out_dir = str(tmp_path / "out")
    torch.manual_seed(0)
    model = write_checkpoint(out_dir, tiny_model("llama2", vocab_size=256), method="gaussws[od]",
                             old_layout=request.param)
    return out_dir, model


def test_sample_prints_prompt_and_continuation(byte_run, capsys, tmp_path):
    out_dir, model = byte_run
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("def f(x):")
    sample.main([f"--out_dir={out_dir}", f"--start=FILE:{prompt}", "--num_samples=2", "--max_new_tokens=6",
                 "--temperature=0", "--device=cpu"])
    printed = capsys.readouterr().out
    want = greedy_text(model.eval(), "def f(x):", 6)  # greedy decoding by hand, not the model's generate
    assert printed == (want + "\n---------------\n") * 2


@pytest.mark.parametrize("args, message", [
    (["--temprature=0.5"], "did you mean --temperature"),
    (["--top_k=many"], "top_k"),
    (["--start="], "prompt is empty"),
    (["--temperature=-1"], "temperature must be >= 0"),
    (["--num_samples=0"], "--num_samples=0: expected an integer >= 1"),
    (["--max_new_tokens=-3"], "--max_new_tokens=-3: expected an integer >= 1"),
])
def test_sample_bad_options_say_what_is_wrong(byte_run, args, message):
    out_dir, _ = byte_run
    with pytest.raises((sample.UsageError, ConfigError), match=message):
        sample.main([f"--out_dir={out_dir}", "--device=cpu"] + args)


def test_sample_a_prompt_file_that_is_not_utf8_is_one_line(byte_run, tmp_path):
    out_dir, _ = byte_run
    prompt = tmp_path / "latin1.txt"
    prompt.write_bytes("café".encode("latin-1"))
    with pytest.raises(sample.UsageError, match="is not UTF-8 text"):
        sample.main([f"--out_dir={out_dir}", f"--start=FILE:{prompt}", "--device=cpu"])


def test_sample_refuses_a_damaged_or_foreign_checkpoint(byte_run):
    out_dir, _ = byte_run
    path = os.path.join(out_dir, "ckpt.pt")
    with open(path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match="is corrupt"):
        sample.main([f"--out_dir={out_dir}", "--device=cpu"])
    write_checkpoint(out_dir, tiny_model("gpt2", vocab_size=256))
    ckpt = torch.load(path, weights_only=True)
    ckpt["model_args"]["n_layer"] = 3  # another model's shape
    torch.save(ckpt, path)
    with pytest.raises(sample.UsageError, match="not a checkpoint of this project's model") as e:
        sample.main([f"--out_dir={out_dir}", "--device=cpu"])
    assert "Missing key(s)" in str(e.value) and "transformer.h.2" in str(e.value)  # what does not fit, not torch's
    assert "\n" not in str(e.value)  # first line only ("Error(s) in loading state_dict")


def test_sample_needs_the_datasets_meta(byte_run):
    out_dir, _ = byte_run
    write_checkpoint(out_dir, tiny_model("gpt2", vocab_size=256), dataset="nowhere")
    with pytest.raises(sample.UsageError, match="prepare.py"):
        sample.main([f"--out_dir={out_dir}", "--device=cpu"])


def test_sample_missing_checkpoint_is_one_line_without_traceback(tmp_path):
    run = subprocess.run([sys.executable, os.path.join(ROOT, "sample.py"), f"--out_dir={tmp_path}"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 1
    assert run.stderr.count("\n") == 1 and "no checkpoint at" in run.stderr
    assert "Traceback" not in run.stderr


def test_tokenizers_from_meta(monkeypatch):
    encode, decode = sample.load_tokenizer({"tokenizer": "bytes"})
    assert encode("é x") == [0xC3, 0xA9, 0x20, 0x78]
    assert decode([0xC3, 0xA9, 0xFF]) == "é\ufffd"  # a broken byte does not stop sampling
    import tiktoken
    tiny_bpe = tiktoken.Encoding(name="tiny", pat_str=r"\s+|\S+", mergeable_ranks={bytes([i]): i for i in range(256)},
                                 special_tokens={"<|endoftext|>": 256})
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: tiny_bpe)
    encode, decode = sample.load_tokenizer({"tokenizer": "tiktoken:tiny"})
    assert encode("ab<|endoftext|>") == [97, 98, 256]
    assert decode([97, 98, 256]) == "ab<|endoftext|>"
    with pytest.raises(sample.UsageError, match="unknown tokenizer"):
        sample.load_tokenizer({"tokenizer": "sentencepiece"})


def a_model_checkpoint(out_dir):
    from dataclasses import asdict

    from model import GPT, ModelConfig
    torch.manual_seed(0)
    config = ModelConfig(n_layer=1, n_head=2, n_embd=64, block_size=16, vocab_size=256)
    model = GPT(config)
    checkpoint.save({"model": model.state_dict(), "model_args": asdict(config), "iter_num": 1,
                     "config": {"dataset": "default"}}, out_dir / "ckpt.pt")
    return model


def test_sample_refuses_a_checkpoint_with_flipped_bytes_in_one_line(tmp_path):
    import sample
    model = a_model_checkpoint(tmp_path)
    loaded, _ = sample.load_checkpoint(str(tmp_path), "cpu")  # the intact one loads, weights equal
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    flip_a_byte_of_the_largest_tensor(tmp_path / "ckpt.pt")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "sample.py"), f"--out_dir={tmp_path}", "--device=cpu",
                        "--num_samples=1", "--max_new_tokens=2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "is corrupt" in line and "CRC32" in line


def test_sample_refuses_a_non_finite_model_in_one_line(tmp_path):
    """A diverged model's logits are NaN, whose argmax is token 0: NUL bytes at temperature 0."""
    model = a_model_checkpoint(tmp_path)
    state = model.state_dict()
    state["transformer.h.0.mlp.c_fc.weight"][0, 0] = float("nan")
    ckpt = checkpoint.load(tmp_path / "ckpt.pt")
    checkpoint.save({**ckpt, "model": state}, tmp_path / "ckpt.pt")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "sample.py"), f"--out_dir={tmp_path}", "--device=cpu",
                        "--num_samples=1", "--max_new_tokens=4", "--temperature=0"], capture_output=True, timeout=120)
    assert r.returncode == 1 and b"Traceback" not in r.stderr and b"\0" not in r.stdout, r.stderr
    (line,) = r.stderr.decode().strip().splitlines()
    assert line.startswith("error: ") and "non-finite values" in line and "transformer.h.0.mlp.c_fc.weight" in line


def test_sample_refuses_a_seed_torch_cannot_take_in_one_line(tmp_path):
    a_model_checkpoint(tmp_path)
    for seed in (2**63, -1):
        r = subprocess.run([sys.executable, os.path.join(ROOT, "sample.py"), f"--out_dir={tmp_path}", "--device=cpu",
                            f"--seed={seed}"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        (line,) = r.stderr.strip().splitlines()
        assert f"--seed={seed}: expected an integer in [0, 2^63)" in line
