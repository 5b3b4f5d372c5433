"""What the docs can get wrong mechanically: every file, module attribute and test they name exists,
every exit status they state is the one the code returns, and the README's table of the gguf studies is
their committed records'.

The docs are README.md, docs/*.md and studies/README.md. A name in backticks that looks like a file
(`checkpoint.py`, `data/common.py`, `studies/runner.py`) is a file of the repository; `module.name`
(`gaussws.convert`, `lowbit.load`, `data.loader.get_batch`) is defined at the top level of that module
of the repository (read from its source, nothing imported); every `test_...` name is a test of tests/,
of the file named with it where one is (`tests/test_x.py::name`). Every sentence that states an exit
status is one of EXIT_CLAIMS, which knows how to get the status the code returns.
"""
import ast
import functools
import glob
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

DOCS = sorted([os.path.join(ROOT, "README.md"), os.path.join(ROOT, "studies", "README.md"),
               *glob.glob(os.path.join(ROOT, "docs", "*.md"))])
TICKED = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?:\(.*\))?$")
TEST_NAME = re.compile(r"(?:(tests/test_\w+\.py)::)?\b(test_[a-z0-9_]+)\b(?!\.py)")
FILE_NAME = re.compile(r"\.(py|md|json|jsonl|log|txt|bin|png|pt|safetensors|gguf|dcp|lock|model|tmp)$")
EXIT = re.compile(r"\bexit(?:s|ing)?(?: with)?(?: status| code)? (\d+)|\bstatus (\d+)")


def text(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


@functools.lru_cache(maxsize=None)
def repo_files():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return set(out.split())


@functools.lru_cache(maxsize=None)
def top_level_names(path):
    """The names a module defines at its top level: functions, classes, assignments, and the names it takes
    from another module of its API (`from kernels.ops import pseudo_quantize` in gaussws.py); not the modules
    it imports."""
    tree = ast.parse(text(path))
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def module_file(dotted):
    """(the repository file of the longest module prefix of `dotted`, the attribute path after it), or None."""
    parts = dotted.split(".")
    for k in range(len(parts) - 1, 0, -1):
        path = "/".join(parts[:k]) + ".py"
        if path in repo_files():
            return path, parts[k:]
    return None


@functools.lru_cache(maxsize=None)
def defined_tests():
    found = {}
    for path in glob.glob(os.path.join(ROOT, "tests", "test_*.py")):
        tree = ast.parse(text(path))
        found[os.path.relpath(path, ROOT)] = {n.name for n in ast.walk(tree)
                                             if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    return found


def claims(pattern_of, kind):
    """(doc, line number, match) of every occurrence in the docs."""
    for doc in DOCS:
        for i, line in enumerate(text(doc).splitlines(), 1):
            for m in pattern_of.finditer(line):
                yield os.path.relpath(doc, ROOT), i, m


def test_every_file_the_docs_name_exists():
    files, missing = repo_files(), []
    for doc, line, m in claims(TICKED, "file"):
        token = m.group(1).split()[0]
        if not re.fullmatch(r"[\w./-]+\.(py|md|sh|txt)", token) or token.startswith(("out/", "/")):
            continue
        here = os.path.relpath(os.path.join(os.path.dirname(os.path.join(ROOT, doc)), token), ROOT)
        if token in files or here in files or any(f.endswith("/" + token) for f in files):
            continue
        missing.append(f"{doc}:{line}: {token}")
    assert not missing, "files the docs name that the repository does not have:\n" + "\n".join(missing)


def test_every_module_attribute_the_docs_name_is_defined():
    missing = []
    for doc, line, m in claims(TICKED, "attribute"):
        dotted = DOTTED.match(m.group(1).strip())
        if not dotted or FILE_NAME.search(dotted.group(1)):
            continue
        found = module_file(dotted.group(1))
        if not found:
            continue  # not a module of the repository (torch.save, nn.Linear, file names)
        path, attrs = found
        if attrs[0] not in top_level_names(os.path.join(ROOT, path)):
            missing.append(f"{doc}:{line}: {dotted.group(1)} ({path} defines no {attrs[0]})")
    assert not missing, "module attributes the docs name that the code does not define:\n" + "\n".join(missing)


def test_every_test_the_docs_name_exists():
    tests, missing = defined_tests(), []
    everywhere = set().union(*tests.values())
    for doc, line, m in claims(TEST_NAME, "test"):
        file, name = m.groups()
        if file and name not in tests.get(file, ()):
            missing.append(f"{doc}:{line}: {file}::{name}")
        elif not file and name not in everywhere and not os.path.exists(os.path.join(ROOT, "tests", name + ".py")):
            missing.append(f"{doc}:{line}: {name}")
    assert not missing, "tests the docs name that tests/ does not have:\n" + "\n".join(missing)


def run_status(*args):
    r = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    return r.returncode


def diverged_status():
    import train
    return train.Diverged.exit_status


def bad_input_status():
    """A refused input of every script goes through util.cli: a missing file for export_gguf.py."""
    return run_status("export_gguf.py", "--gguf=/nonexistent/model.gguf")


def gpu_check_status():
    import torch
    if torch.cuda.is_available():
        pytest.skip("the claim is about a machine without CUDA, and this one has a GPU")
    return run_status("bench.py", "gpu-check")


# (doc, a phrase of the sentence that states the status, how to get the status the code returns; None: not ours)
EXIT_CLAIMS = [
    ("README.md", "stops as *diverged*", diverged_status),
    ("docs/RELIABILITY.md", "A diverged run exits with", diverged_status),
    ("docs/GGUF.md", "or a non-finite model are one line", bad_input_status),
    ("docs/GGUF.md", "reports both terms and exits", bad_input_status),
    ("docs/RELIABILITY.md", "refused in one", bad_input_status),
    ("docs/RELIABILITY.md", "are each refused in one line", bad_input_status),
    ("docs/RELIABILITY.md", "refuses, in one line with", bad_input_status),
    ("docs/GPU.md", "Without CUDA it says so", gpu_check_status),
    ("docs/GGUF.md", "`ldtilecfg`", None),  # llama.cpp's own crash (SIGSEGV), reported, not ours
    ("studies/README.md", "runner writes it only after", lambda: 0),  # success
]


def test_every_exit_status_the_docs_state_is_the_codes():
    found = []
    for doc, line, m in claims(EXIT, "exit"):
        lines = text(os.path.join(ROOT, doc)).splitlines()
        context = " ".join(lines[max(line - 3, 0):line])
        known = [c for c in EXIT_CLAIMS if c[0] == doc and c[1] in context]
        assert known, (f"{doc}:{line} states an exit status ({m.group(0)!r}) that EXIT_CLAIMS does not know: "
                       "add how to check it")
        found.append((doc, line, int(m.group(1) or m.group(2)), known[-1][2]))
    for doc, line, stated, status in found:
        if status is not None:
            assert status() == stated, f"{doc}:{line} states exit status {stated}, the code returns {status()}"


def test_every_test_reliability_md_names_is_a_test_of_the_file_it_names():
    """docs/RELIABILITY.md names the tests that hold each promise as *(test_x.py: test_a, test_b;
    test_y.py: test_c)*: each name is a test of the file named before it in its group."""
    tests, wrong = defined_tests(), []
    for group in re.findall(r"\*\(([^*]*)\)\*", text(os.path.join(ROOT, "docs", "RELIABILITY.md"))):
        file = None
        for token in re.findall(r"\btest_\w+\.py:|\btest_[a-z0-9_]+\b(?!\.py)", group):
            if token.endswith(".py:"):
                file = "tests/" + token[:-1]
            elif token not in tests.get(file, ()):
                wrong.append(f"{file or 'no file named'}::{token}")
    assert not wrong, "tests RELIABILITY.md names that are not tests of the file it names:\n" + "\n".join(wrong)


def requirements(path):
    """{normalized package name: its version specifier} of a pip requirements file, and the files it
    reads (-r, -c)."""
    names, reads = {}, []
    for line in text(os.path.join(ROOT, path)).splitlines():
        line = line.split("#")[0].strip()
        if line.startswith(("-r ", "-c ")):
            reads.append(line.split()[1])
        elif line:
            name, spec = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*(.*)", line).groups()
            names[re.sub(r"[-_.]+", "-", name).lower()] = spec
    return names, reads


def test_the_install_pins_every_package_at_the_version_the_suite_passed_on():
    """The README's install (pip install -r requirements-test.txt) goes through constraints.txt, which
    pins every package either requirements file names (==) at a version its own specifier admits: a
    new machine gets the versions CI ran, not the newest ones."""
    from packaging.specifiers import SpecifierSet
    pins, _ = requirements("constraints.txt")
    main, main_reads = requirements("requirements.txt")
    test, test_reads = requirements("requirements-test.txt")
    assert "constraints.txt" in main_reads and "requirements.txt" in test_reads
    assert all(spec.startswith("==") for spec in pins.values())
    for name, spec in {**main, **test}.items():
        assert name in pins, f"constraints.txt pins no version of {name}"
        assert pins[name][2:] in SpecifierSet(spec), f"{name}{pins[name]} is not {name}{spec}"


def test_the_readme_table_of_the_gguf_studies_is_their_committed_records():
    """The README's table of trained GGUF files against llama-quantize is the one the committed results of
    the studies it names give, so that no figure of it outlives a report written again."""
    from studies.gguf_report import committed_readme_table
    assert "\n".join(committed_readme_table()) in text(os.path.join(ROOT, "README.md")), \
        "README.md's table of the gguf studies is not their committed records': `python -m studies --readme_table`"
