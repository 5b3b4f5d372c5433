"""--help (or -h) of every script configured by configurator.configure: each key with its default and
the comment its defaults block gives it, exit status 0, nothing written. The expected lines are the
scripts' own defaults, copied here by hand."""
import os
import subprocess
import sys

import pytest

from configurator import ConfigError, configure
from conftest import ROOT


def help_of(*args, cwd=ROOT):
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=cwd)
    assert r.returncode == 0 and not r.stderr.strip().count("Traceback"), r.stderr[-2000:]
    return r.stdout.splitlines()


def key_line(lines, key):
    """The line of `key`, split into its assignment and its comment."""
    (line,) = [line for line in lines if line.lstrip().startswith(f"{key} = ")]
    assignment, _, comment = line.strip().partition("  # ")
    return " ".join(assignment.split()), comment


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_train_help_lists_every_key_with_its_default_and_comment(flag, tmp_path):
    lines = help_of(os.path.join(ROOT, "train.py"), flag, cwd=tmp_path)
    assert lines[0] == "usage: python train.py [config.py ...] [--key=value ...]"
    assert key_line(lines, "max_iters") == ("max_iters = 400", "optimizer steps")
    assert key_line(lines, "lr_decay_iters") == ("lr_decay_iters = 0", "the step where the cosine ends; 0: max_iters")
    assert key_line(lines, "method") == ("method = 'gaussws[all]'", "PQT method and layers: bf16, gaussws[all], "
                                         "gaussws[od], diffq[all], ...")
    # a key whose comment is the block above its line
    assert key_line(lines, "dtype")[1].startswith('autocast dtype of matmuls: "bfloat16", or "float32" (no autocast).')
    import train
    assert {key_line(lines, k)[0].split(" = ")[0] for k in train.DEFAULTS} == set(train.DEFAULTS)
    assert not os.listdir(tmp_path)  # no out/, no data prepared


def test_help_after_a_config_file_shows_its_values_beside_the_defaults():
    lines = help_of("train.py", "config/mini_gpt2.py", "--max_iters=300", "--help")
    assert key_line(lines, "max_iters") == ("max_iters = 300", "optimizer steps (default 400)")
    assert key_line(lines, "warmup_iters") == ("warmup_iters = 25", "linear warmup steps (default 50)")


def test_sample_help():
    lines = help_of("sample.py", "--help")
    assert key_line(lines, "max_new_tokens") == ("max_new_tokens = 200", "tokens generated per sample")
    assert key_line(lines, "seed") == ("seed = 1337", "")  # a default without a comment has none


def test_export_help_reads_the_comments_of_its_defaults_dict():
    lines = help_of("export.py", "--help")
    assert key_line(lines, "out_dir") == ("out_dir = 'out'", "the run directory holding ckpt.pt")
    assert key_line(lines, "other_dtype") == ("other_dtype = 'bfloat16'",
                                              'every tensor that is not quantized: "bfloat16" or "float32"')


def test_help_is_a_flag_not_a_config_file_and_other_arguments_still_fail():
    with pytest.raises(SystemExit) as done:
        configure({"a": 1}, ["-h"])
    assert done.value.code == 0
    with pytest.raises(ConfigError, match="config file '-x' not found"):
        configure({"a": 1}, ["-x"])


def test_a_bare_flag_is_true_for_a_bool_key_and_refused_for_any_other():
    c = {"dry_run": False, "steps": 3}
    assert configure(c, ["--dry_run"]) == {"dry_run"} and c["dry_run"] is True
    with pytest.raises(ConfigError, match="--steps: overrides are written --key=value"):
        configure(c, ["--steps"])
    with pytest.raises(ConfigError, match="unknown config key 'dry_rn'; did you mean --dry_run"):
        configure(c, ["--dry_rn"])


def test_plain_arguments_go_to_positional_where_a_script_takes_names(tmp_path):
    names, c = [], {"root": "out"}
    configure(c, ["fig1b", "--root=x", "deploy"], positional=names)
    assert names == ["fig1b", "deploy"] and c["root"] == "x"
    with pytest.raises(ConfigError, match="config file 'fig1b' not found"):  # without positional: a config file
        configure(dict(c), ["fig1b"])
