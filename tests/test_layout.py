"""The repository's import rule, read from the source (ast, nothing imported): quant/ <- files/ <- llamacpp/ <-
the commands, each package importing only those before it; the training core (model.py, gaussws.py, step.py,
kernels/) reaching none of files/ or llamacpp/, not even through another module; no module importing a script
(a module run as `python X.py` or `python -m X`, with `if __name__ == "__main__":`); and no import cycle. Every
import counts, a function's own (imported where used) as much as a module's."""
import ast
import functools
import os
import subprocess

from conftest import ROOT

LAYERS = ("quant", "files", "llamacpp")  # each may import those before it, none after
COMMANDS = ("train", "sample", "bench", "export", "export_gguf", "hf", "plot")  # what a user types, at the root
CORE = ("model", "gaussws", "step", "kernels")  # the training core: no file format, no llama.cpp


@functools.lru_cache(maxsize=None)
def modules():
    """{module name: path} of the repository's Python modules but the tests ("quant.ste", "data.loader", "train")."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "*.py"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    found = {}
    for path in out:
        if path.startswith("tests/") or not os.path.exists(os.path.join(ROOT, path)):
            continue
        name = path[:-3].replace("/", ".")
        found[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return found


def source(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return ast.parse(f.read())


@functools.lru_cache(maxsize=None)
def graph():
    """{module: {the repository's modules it imports, anywhere in it}}."""
    known, edges = modules(), {}
    for name, path in known.items():
        found = set()
        for node in ast.walk(source(path)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            else:
                continue
            for target in targets:
                parts = target.split(".")
                hit = next((".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in known),
                           None)
                if hit and hit != name:
                    found.add(hit)
        edges[name] = found
    return edges


def layer(module):
    top = module.split(".")[0]
    return LAYERS.index(top) if top in LAYERS else None


def closure(module):
    """Every module `module` reaches through imports."""
    seen, todo = set(), [module]
    while todo:
        for m in graph()[todo.pop()] - seen:
            seen.add(m)
            todo.append(m)
    return seen


def is_script(path):
    return any(isinstance(n, ast.If) and isinstance(n.test, ast.Compare) and isinstance(n.test.left, ast.Name)
               and n.test.left.id == "__name__" for n in source(path).body)


def test_each_package_imports_only_the_packages_before_it():
    wrong = [f"{m} imports {t}" for m, targets in graph().items() if layer(m) is not None
             for t in targets if layer(t) is not None and layer(t) > layer(m)]
    assert not wrong, "quant <- files <- llamacpp: imports against the order:\n" + "\n".join(sorted(wrong))


def test_the_packages_and_the_training_core_reach_nothing_above_them():
    """Not even through a module outside the packages (checkpoint.py, data/, util.py, ...)."""
    wrong = []
    for m in graph():
        top = m.split(".")[0]
        below = LAYERS.index(top) if top in LAYERS else 0 if top in CORE else None
        if below is not None:
            wrong += [f"{m} reaches {t}" for t in sorted(closure(m)) if layer(t) is not None and layer(t) > below]
    assert not wrong, "\n".join(wrong)


def test_the_commands_are_scripts_at_the_root_and_no_module_imports_a_script():
    known = modules()
    assert all(known.get(c) == f"{c}.py" and is_script(known[c]) for c in COMMANDS)
    scripts = {m for m, path in known.items() if is_script(path)}
    wrong = [f"{m} imports the script {t}" for m, targets in graph().items() for t in targets if t in scripts]
    assert not wrong, "a script imports libraries, never another script:\n" + "\n".join(sorted(wrong))


def test_no_module_shadows_an_installed_one_nor_a_command():
    """No module or package of the repository is named gguf (it would hide gguf-py, llama.cpp's writer), and
    no package export (export.py is the command)."""
    assert "gguf" not in {m.split(".")[0] for m in modules()}
    assert not os.path.isdir(os.path.join(ROOT, "export"))


def test_no_import_cycle():
    """Depth-first search of the import graph: a module on the current path reached again is a cycle."""
    edges, state, cycles = graph(), {}, []

    def visit(m, path):
        state[m] = "open"
        for t in sorted(edges[m]):
            if state.get(t) == "open":
                cycles.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t, path + [t])
        state[m] = "done"
    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
