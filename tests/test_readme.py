"""The README's examples, run top to bottom in a fresh copy of the repository, as a newcomer would.

Each code block of the README is run as a bash script, in the README's order, in one fresh copy
of the repository; a line that cannot run on a CPU without network in a test's time is named in
NOT_RUN with the reason, and every other line runs. `python` (and `torchrun`) is a shim that runs this interpreter
and, for train.py, appends settings that make each run a few steps long; the out_dirs, checkpoints
and exported files are those the README's sequence makes, so a refusal (a run that already holds
an out_dir, an export that would overwrite another's file) fails the test as it stops a newcomer.
"""
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import pytest

from conftest import ROOT

REPO = pathlib.Path(ROOT)

# What makes a train.py example short enough for a test; every other setting is the example's.
SHORT = ["--max_iters=4", "--eval_interval=2", "--eval_iters=1"]

# README lines not run here, each with why: a pattern that must match some line of the README.
NOT_RUN = {
    r"python -m pytest": "the test suite itself",
    r"^pip install": "the packages are installed; what follows `&&` runs",
    r"data/openwebtext/prepare\.py|data/c4/prepare\.py": "downloads from the Hugging Face hub, or needs its files",
    r"^python train\.py config/gpt2_gaussws_od\.py": "OpenWebText (a hub download) at GPT-2 124M scale",
    r"^python train\.py config/llama2_134m_gaussws_all_adamw\.py$": "C4 with Llama 2's tokenizer (a download)",
    r"^torchrun .*--nproc_per_node=8|^torchrun --nnodes": "8 GPUs, or two nodes of them",
    r"^llama-cli": "llama.cpp's own program, not a Python package",
    r"^python export_gguf\.py": "llama-cpp-python, built from source (tests/test_gguf.py runs it where present)",
    r"^python -m studies fig1b\s*(#|$)": "hours of training",
    r"out/gguf_": "the gguf study's 6,400-step schedule, 2 h on a CPU; shortened to 4 steps its fork has nothing to "
                  "train (test_the_trained_gguf_commands_run_as_written_at_8_steps)",
}

SHIM = f"""#!/bin/sh
if [ "$1" = train.py ]; then exec {sys.executable} "$@" {' '.join(SHORT)}; fi
exec {sys.executable} "$@"
"""
# torchrun's arguments end with train.py's, so the short settings go last.
TORCHRUN_SHIM = f"""#!/bin/sh
exec {sys.executable} -m torch.distributed.run "$@" {' '.join(SHORT)}
"""


def blocks(readme):
    """The README's code blocks (4-space-indented lines after a blank line), each a list of its
    command lines with `\\` continuations joined."""
    out, block, prev_blank = [], None, True
    for line in readme.splitlines() + [""]:
        if line.startswith("    ") and (block is not None or prev_blank):
            block = [] if block is None else block
            if block and block[-1].endswith("\\"):
                block[-1] = block[-1][:-1].rstrip() + " " + line.strip()
            else:
                block.append(line.strip())
        elif block is not None:
            out.append(block)
            block = None
        prev_blank = not line.strip()
    return out


def runnable(line, used):
    for pattern in NOT_RUN:
        if re.search(pattern, line):
            used.add(pattern)
            return re.sub(r"^pip install [^&]*&&\s*", "", line) if pattern == r"^pip install" else None
    return line


def test_readme_examples_run_in_order_in_a_fresh_clone(tmp_path):
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split("\n")
    clone = tmp_path / "clone"
    for f in filter(None, files):
        if os.path.isfile(REPO / f):
            (clone / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, clone / f)
    # A repository of its own, so that what the examples write can be checked against .gitignore.
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(git[:1] + ["init", "-q"], cwd=clone, check=True)
    subprocess.run(git[:1] + ["add", "-A"], cwd=clone, check=True)
    subprocess.run(git + ["commit", "-qm", "clone"], cwd=clone, check=True)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in (("python", SHIM), ("torchrun", TORCHRUN_SHIM)):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    used, ran = set(), []
    for i, block in enumerate(blocks((clone / "README.md").read_text())):
        lines = [r for r in (runnable(line, used) for line in block) if r]
        if not any(line and not line.startswith("#") for line in lines):
            continue
        script = "set -e\n" + "\n".join(lines) + "\n"
        t0 = time.time()
        p = subprocess.run(["bash", "-c", script], cwd=clone, env=env, capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, f"README block {i} failed:\n{script}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        ran += lines
        print(f"block {i}: {time.time() - t0:.0f} s: {lines}")
    assert used == set(NOT_RUN), f"NOT_RUN entries that match no README line: {set(NOT_RUN) - used}"
    assert any(line.startswith("python train.py") for line in ran) and any("export.py" in line for line in ran)
    # Everything the examples wrote is ignored by git: a newcomer's `git status` stays clean.
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=clone, check=True,
                            capture_output=True, text=True).stdout
    assert status == "", f"the README's examples leave files git does not ignore:\n{status}"


# The README's commands to a trained GGUF: the bf16 run's checkpoint they fork from, the file they end with
GGUF_RECIPES = {"q4_0": ("out/gguf_bf16/ckpt.pt", "gguf_q4_0/model-q4_0.gguf"),
                "auto-gguf": ("out/gguf_bf16_70/ckpt.pt", "gguf_mix/model-auto-gguf.gguf")}
K_MIX = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0"}  # the types a mix in a budget chooses from


@pytest.mark.parametrize("recipe", sorted(GGUF_RECIPES))
def test_the_trained_gguf_commands_run_as_written_at_8_steps(tmp_path, recipe):
    """The README's bf16 run and its commands to a trained GGUF, as written but for the schedule (steps
    4480, 5440 and 6400 become 4, 6 and 8) and the out_dirs (under tmp_path): the bf16 run stops at its
    switch, the phase forks from its checkpoint, and the export writes the type trained on. Read back by
    gguf's reader: q4_0 writes every block Linear as Q4_0; the mix one K-quant or Q8_0 per tensor whose
    bytes, counted from the file, stay within the commands' --bits_per_weight."""
    import gguf
    fork, path = GGUF_RECIPES[recipe]
    block, = [b for b in blocks((REPO / "README.md").read_text()) if any(f"--fork_from={fork}" in x for x in b)]
    for line in block:
        cmd = line.split("#")[0].replace("4480", "4").replace("5440", "6").replace("6400", "8")
        cmd = cmd.replace("out/", f"{tmp_path}/out/")
        cmd += " --eval_interval=2 --eval_iters=1" if "train.py" in cmd else " --eval_iters=1"
        assert cmd.startswith("python ")
        p = subprocess.run(["bash", "-c", sys.executable + cmd[len("python"):]], cwd=REPO, capture_output=True,
                           text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, f"{cmd}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    reader = gguf.GGUFReader(tmp_path / "out" / path)
    linears = [t for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    types = {t.tensor_type.name for t in linears}
    if recipe == "q4_0":
        assert linears and types == {"Q4_0"}
    else:
        assert linears and types <= K_MIX, types
        budget, = {float(m) for line in block for m in re.findall(r"--bits_per_weight=([0-9.]+)", line)}
        bits = 8 * sum(int(t.n_bytes) for t in linears) / sum(int(t.n_elements) for t in linears)
        assert bits <= budget, (bits, budget)
