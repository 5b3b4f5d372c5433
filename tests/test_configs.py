"""Every file in config/ is a run a user can launch: it passes train.py's dry run, and its model size,
method, optimizer, learning rate and token budget are what its name and the paper say. A run's file
holds only what differs from its family's base in config/base/ (`base = "..."`, configurator.py),
and resolves to the settings it had when every run's file still spelled out its whole recipe.

The expected sizes come from the published models, not from model.py: a preset that drifts from the
model its config names fails here.
"""
import contextlib
import glob
import io
import json
import os
import re
import subprocess
import sys
from dataclasses import fields

import pytest

import gaussws
import train
from configurator import ConfigError, configure
from model import PRESETS, ROLES, ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# config/mini_*.py are the laptop-scale bases of the studies (studies/), tested in test_study.py
CONFIGS = sorted(p for p in glob.glob(os.path.join(ROOT, "config", "*.py"))
                 if not os.path.basename(p).startswith("mini_"))
NAMES = [os.path.basename(p)[:-3] for p in CONFIGS]


def llama2_params(dim, n_layer, n_head, n_kv_head, ffn, vocab):
    """Naive count of a Llama 2: untied embedding and head, q/k/v/out, SwiGLU, two RMSNorms a block."""
    kv_dim = dim // n_head * n_kv_head
    block = 2 * dim * dim + 2 * dim * kv_dim + 3 * dim * ffn + 2 * dim
    return 2 * vocab * dim + n_layer * block + dim


# The model a config's name promises, and its published size.
EXPECTED_PARAMS = {
    "gpt2": 124e6,  # GPT-2 small, "124M" (Radford et al. 2019; nanoGPT)
    "llama2_134m": 134e6,  # the paper's Llama2-134M
    # "1b" is TinyLlama-1.1B's shape (the paper prints none): 1.10B published, 10% above 1.0B, so the
    # test holds it to the model it is, not to its round name.
    "llama2_1b": 1.10e9,
    "llama2_3b": 3.43e9,  # OpenLLaMA-3B's shape, 3.43B published
    # Llama-2-70B's published shape with 4 of its 80 layers (the paper's 70B†).
    "llama2_70b": llama2_params(dim=8192, n_layer=4, n_head=64, n_kv_head=8, ffn=28672, vocab=32000),
}
# Token budgets of the paper's runs (docs/METHOD.md section 6); bench_ configs have none.
TOKEN_BUDGET = {"gpt2": 300e9, "llama2_134m": 300e9, "llama2_1b": 275e9}


def model_of(name):
    m = re.match(r"(?:bench_)?(gpt2|llama2_(?:134m|1b|3b|70b))(?:_|$)", name)
    assert m, f"config/{name}.py: the name must start with the model (gpt2_, llama2_134m_, ..., bench_llama2_70b)"
    return m.group(1)


def settings(path):
    """The settings a config file makes, its bases' included, as train.py's configurator reads them."""
    c = dict(train.DEFAULTS)
    return {k: c[k] for k in configure(c, [path])}


@pytest.fixture(scope="module")
def dry_runs():
    """`train.main([config, "--dry_run=True"])` for every config, in this one process: the models are
    built on the meta device, so all of them take a few seconds together. Output and error per name."""
    results = {}
    for path, name in zip(CONFIGS, NAMES):
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                train.main([path, "--dry_run=True"])
            results[name] = (out.getvalue(), None)
        except Exception as e:  # reported by the test of this config, not here
            results[name] = (out.getvalue(), f"{type(e).__name__}: {e}")
    return results


def printed(output, label):
    m = re.search(rf"^{label}: ([\d,]+)", output, re.M)
    assert m, f"no '{label}: N' line in the dry run's output:\n{output[-2000:]}"
    return int(m.group(1).replace(",", ""))


def test_there_is_a_config_for_every_run_of_the_paper():
    expected = {"gpt2_gaussws_od"}  # the README's example
    expected |= {f"gpt2_{m}_lr{lr}" for m in ("bf16", "gaussws_all", "diffq_all") for lr in ("6e-4", "6e-5")}
    expected |= {f"gpt2_gaussws_{p}" for p in ("qkv", "out", "up", "down", "od")}
    expected |= {f"gpt2_adam_mini_{m}" for m in ("bf16", "gaussws_all", "diffq_all")}
    expected |= {f"llama2_{s}_{m}_{o}" for s in ("134m", "1b") for m in ("bf16", "diffq_all", "gaussws_all")
                 for o in ("adamw", "adam_mini")}
    expected |= {f"bench_llama2_{s}" for s in ("134m", "1b", "3b", "70b")}
    assert expected <= set(NAMES), f"missing: {sorted(expected - set(NAMES))}"


@pytest.mark.parametrize("name", NAMES)
def test_dry_run_passes_and_the_parameter_count_matches_the_name(name, dry_runs):
    output, error = dry_runs[name]
    assert error is None, f"python train.py config/{name}.py --dry_run=True failed: {error}"
    n = printed(output, "parameters")
    expected = EXPECTED_PARAMS[model_of(name)]
    assert abs(n - expected) <= 0.02 * expected, f"{n:,} parameters, expected {expected:,.0f} within 2%"


@pytest.mark.parametrize("name", [n for n in NAMES if not n.startswith("bench_")])
def test_paper_run_spends_the_papers_token_budget_on_a_full_schedule(name, dry_runs):
    output, error = dry_runs[name]
    assert error is None, error
    s = settings(os.path.join(ROOT, "config", name + ".py"))
    tokens = printed(output, "tokens per optimizer step") * s["max_iters"]
    budget = TOKEN_BUDGET[model_of(name)]
    # nanoGPT's GPT2 recipe, 600,000 x 491,520 = 294.9B, is the paper's "300B" within 2%
    assert abs(tokens - budget) <= 0.02 * budget, \
        f"{tokens / 1e9:.1f}B tokens, the paper's budget is {budget / 1e9:.0f}B"
    assert s["lr_decay_iters"] == s["max_iters"], "the cosine schedule must end with the run"
    assert s["warmup_iters"] < s["max_iters"]
    # accumulation counts the micro-steps of all processes: a multiple of 8 runs on 1, 2, 4 or 8 GPUs
    assert s["gradient_accumulation_steps"] % 8 == 0, "gradient_accumulation_steps must divide over 8 GPUs"


@pytest.mark.parametrize("name", NAMES)
def test_config_says_what_it_reproduces_and_sets_what_its_name_says(name):
    path = os.path.join(ROOT, "config", name + ".py")
    with open(path) as f:
        first = f.readline()
    assert re.match(r"# (Fig\. \d+[ab]?|Table \d+)\b", first), f"first line must name the figure or table: {first!r}"
    s = settings(path)
    assert s["model"] in PRESETS, f"model={s['model']!r} is not a preset of model.py"
    arch = PRESETS[s["model"]]["arch"]
    assert model_of(name).split("_")[0] == arch, f"model={s['model']!r} is not the {model_of(name)} of the name"
    method, layers = gaussws.parse_method(s["method"], ROLES[arch].values())  # raises on a bad spec
    assert s["out_dir"] == f"out/{name}", "each run writes to out/<its name>"
    if "wandb_run_name" in s:
        assert s["wandb_run_name"] == name

    if name.startswith("bench_"):
        return  # one file per model; the method and optimizer are chosen on the command line
    parts = name.split("_")
    word = next(p for p in parts if p in ("bf16", "gaussws", "diffq"))
    spec = parts[parts.index(word) + 1] if word != "bf16" else None
    assert s["method"] == (f"{word}[{spec}]" if spec else "bf16"), f"method={s['method']!r} does not match the name"
    assert s.get("optimizer", "adamw") == ("adam_mini" if "adam_mini" in name else "adamw")
    lr = re.search(r"_lr(\d+e-\d+)", name)
    if lr:
        assert s["learning_rate"] == float(lr.group(1))
    if method != "bf16":
        # Fig. 3a is the study with b_target = 0; every other run uses the paper's b_init 6, b_target 4
        assert (s["b_init"], s["b_target"]) == (6.0, 0.0 if first.startswith("# Fig. 3a") else 4.0)
    assert s["dataset"] == ("openwebtext" if name.startswith("gpt2") else "c4")


def test_the_command_line_dry_run_exits_0():
    """The same through the real command line, for the README's example config."""
    r = subprocess.run([sys.executable, "train.py", "config/gpt2_gaussws_od.py", "--dry_run=True"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert printed(r.stdout, "parameters") > 0


# --- bases: each run holds only what differs, and resolves as before ---------------------------------

# Every config file's resolution at commit e87f73e, when each file still spelled out its whole recipe
# (no bases): record() below run on that commit's configurator, train.DEFAULTS and files.
RESOLVED_BEFORE = os.path.join(ROOT, "tests", "configs_e87f73e.json")
MACHINE_DEFAULTS = ("device", "dtype")  # train.py picks these by the hardware; no config sets them
MODEL_KEYS = {f.name for f in fields(ModelConfig)} | {"model"}


def record(path):
    """A config's resolved settings, and the model keys it sets (they decide which of a preset's and
    an init_from checkpoint's shape wins, train.config_model_args). Resolved as train.py resolves
    them (read_config, of its dry run, which writes nothing), not only as the file sets them:
    lr_decay_iters' default is now 0, the run's max_iters, where e87f73e's was 400, so a file that
    leaves it unset (config/cpu/*.py, 400 steps) must still resolve to the 400 it had."""
    c, explicit, _, _ = train.read_config([path, "--dry_run=True"])
    c["dry_run"], explicit = False, explicit - {"dry_run"}  # the dry run's own flag, not the file's
    assert not explicit & set(MACHINE_DEFAULTS), path
    return {"settings": {k: v for k, v in sorted(c.items()) if k not in MACHINE_DEFAULTS},
            "model_keys_set": sorted(explicit & MODEL_KEYS), "explicit": explicit}


with open(RESOLVED_BEFORE) as f:
    BEFORE = json.load(f)


@pytest.mark.parametrize("rel", sorted(BEFORE))
def test_config_resolves_to_the_settings_it_had_before_it_had_a_base(rel):
    path = os.path.join(ROOT, rel)
    assert os.path.isfile(path), f"{rel} is gone"
    now, before = record(path), BEFORE[rel]
    changed = [f"{k}: {before['settings'][k]!r} before, {now['settings'].get(k, '<no such key>')!r} now"
               for k in before["settings"]
               if k not in now["settings"] or (type(now["settings"][k]), now["settings"][k])
               != (type(before["settings"][k]), before["settings"][k])]
    assert not changed, f"{rel}: " + "; ".join(changed)
    # a key train.py gained since is its default here, unless the file sets it
    assert not {k for k in now["settings"] if k not in before["settings"]} & now["explicit"]
    assert now["model_keys_set"] == before["model_keys_set"]


def test_every_base_is_the_base_of_a_run_and_not_a_run():
    bases = {os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "config", "base", "*.py"))}
    named = set()
    for p in glob.glob(os.path.join(ROOT, "config", "*.py")) + glob.glob(os.path.join(ROOT, "config", "base", "*.py")):
        m = re.search(r'^base = "(.+)"', open(p).read(), re.M)
        if m:
            named.add(os.path.relpath(os.path.normpath(os.path.join(os.path.dirname(p), m.group(1))), ROOT))
    assert bases and bases == named & bases, f"bases no file names: {sorted(bases - named)}"
    for b in bases:
        assert "out_dir" not in settings(os.path.join(ROOT, b)), f"{b} is a base: its runs name their out_dir"


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def test_a_base_applies_first_its_own_base_before_it_relative_to_its_folder(tmp_path, monkeypatch):
    write(tmp_path / "config" / "base" / "family.py", 'base = "recipe.py"\nbatch_size = 8\nmax_iters = 100\n')
    write(tmp_path / "config" / "base" / "recipe.py", 'batch_size = 2\nlearning_rate = 1e-3\nmin_lr = 3\n')
    run = write(tmp_path / "config" / "run.py", 'max_iters = 7\nbase = "base/family.py"\n')
    monkeypatch.chdir(tmp_path / "config" / "base")  # bases are found from the naming file, not the cwd
    c = dict(train.DEFAULTS)
    explicit = configure(c, [run, "--max_iters=9"])
    assert (c["batch_size"], c["learning_rate"], c["max_iters"]) == (8, 1e-3, 9)  # the later wins
    assert type(c["min_lr"]) is float and c["min_lr"] == 3.0  # a base's values are coerced as the file's
    assert explicit == {"batch_size", "learning_rate", "min_lr", "max_iters"}
    assert c["eval_iters"] == train.DEFAULTS["eval_iters"]


@pytest.mark.parametrize("files, message", [
    ({"run.py": 'base = "nowhere.py"\n'}, r"run.py: base file '.*nowhere.py' not found"),
    ({"run.py": 'base = "a.py"\n', "a.py": 'base = "run.py"\n'},
     r"its bases form a cycle \(.*run.py -> .*a.py -> .*run.py\)"),
    ({"run.py": 'base = "run.py"\n'}, r"its bases form a cycle"),
    ({"run.py": "base = 3\n"}, r"run.py: base=3: expected the path of a config file"),
    ({"run.py": 'base = "a.py"\n', "a.py": "batch_size = 2.5\n"},
     r"a.py: batch_size=2.5 is a float, but batch_size takes a int"),
    ({"run.py": 'base = "a.py"\n', "a.py": "bach_size = 8\n"},
     r"a.py: unknown config key 'bach_size'; did you mean --batch_size"),
    ({"run.py": 'base = "a.py"\n', "a.py": "x = 1 / 0\n"}, r"config file .*a.py failed: ZeroDivisionError"),
])
def test_a_bad_base_is_one_error_naming_the_file(tmp_path, files, message):
    for name, text in files.items():
        write(tmp_path / name, text)
    with pytest.raises(ConfigError, match=message):
        configure(dict(train.DEFAULTS), [str(tmp_path / "run.py")])


def test_a_missing_base_on_the_command_line_is_one_line_and_exit_1(tmp_path):
    run = write(tmp_path / "run.py", 'base = "base/gone.py"\n')
    r = subprocess.run([sys.executable, "train.py", run, "--dry_run=True"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: ") and "gone.py' not found" in r.stderr
