"""nanoGPT's configurator as a function: config files and --key=value overrides, checked.

    python train.py config/gpt2_gaussws_od.py --batch_size=32 --method="gaussws[od]"

A config file is plain Python that reassigns some of the defaults. It may start from another
config file, its base, by naming it: `base = "base/gpt2_owt.py"` (relative to the naming file's
folder) applies the base's settings first and then the file's own, so a paper run holds only what
differs from its family's recipe. A base may name a base of its own. An override must name an
existing key (a typo lists close matches) and keep the default's type (an int default takes
"3", a float default "3e-4" or "3", a bool "True"/"False", a string anything); a config file's
values, its bases' included, are checked the same way. A bare `--key` sets a bool key to True
(`--dry_run` is `--dry_run=True`); any other key needs its value.

Every script reads its command line here, so all speak one dialect: `--key=value` (or a bare
`--flag`), the same one-line error for an unknown key, and `--help` from the defaults' comments. A
script whose plain arguments are not config files (a study's name, run directories) passes
`positional=[]` and gets them there in order.

`--help` (or `-h`) prints every key with its value and the one-line comment the script's defaults
block gives it (read from the script's source: `key = value  # comment`, or `key=value,  # comment`
inside a `dict(...)`), then exits 0.
"""
import ast
import difflib
import io
import os
import sys
import tokenize

from util import UserError


class ConfigError(UserError):
    """Bad user input; the message is one line that says what to do."""


def _unknown(key, config):
    close = difflib.get_close_matches(key, config, n=3)
    if close:
        hint = f"; did you mean {', '.join('--' + c for c in close)}?"
    else:
        hint = "; see the defaults at the top of the script"
    return ConfigError(f"unknown config key {key!r}{hint}")


def _coerce(key, value, default):
    """`value` (a string from the command line, or a Python value from a file) as the default's type."""
    if isinstance(value, str) and not isinstance(default, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ConfigError(f"--{key}={value}: expected {_a(type(default).__name__)} like {default!r}") from None
    if default is None or value is None or isinstance(value, type(default)):
        pass
    elif isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    else:
        raise ConfigError(f"{key}={value!r} is a {type(value).__name__}, but {key} takes a "
                          f"{type(default).__name__} (default {default!r})")
    return value


def file_settings(path, named_by=()):
    """[(file, its settings)] of config file `path`: its base's chain first, then its own."""
    if not os.path.isfile(path):
        where = f"{named_by[-1]}: base" if named_by else "config"
        raise ConfigError(f"{where} file {path!r} not found (arguments are config files and --key=value)")
    if os.path.realpath(path) in map(os.path.realpath, named_by):
        raise ConfigError(f"config file {path}: its bases form a cycle ({' -> '.join([*named_by, path])})")
    scope = {}
    try:
        exec(compile(open(path).read(), path, "exec"), scope)
    except Exception as e:
        raise ConfigError(f"config file {path} failed: {type(e).__name__}: {e}") from None
    own = {k: v for k, v in scope.items()
           if not (k.startswith("_") or callable(v) or type(v).__name__ == "module")}
    if "base" not in own:
        return [(path, own)]
    base = own.pop("base")
    if not isinstance(base, str) or not base.endswith(".py"):
        raise ConfigError(f"{path}: base={base!r}: expected the path of a config file, like \"base/gpt2_owt.py\"")
    return file_settings(os.path.join(os.path.dirname(path), base), (*named_by, path)) + [(path, own)]


def configure(config, argv, script=None, positional=None, usage=None):
    """Apply config files and --key=value overrides in `argv` to the dict `config`, in order.

    Returns the set of keys that were set, so a caller can tell a user's choice from a default.
    `--help` or `-h` prints the keys (help_text: their comments from `script`, by default the
    source file of the module that calls configure; `usage` its first line) and exits 0, as
    argparse does. With a list as `positional`, plain arguments are appended to it instead of
    being read as config files.
    """
    explicit, defaults = set(), dict(config)
    for arg in argv:
        if arg in ("-h", "--help"):
            caller = sys._getframe(1).f_globals  # the script whose defaults these are
            print(help_text(config, defaults, script or caller.get("__file__"), caller.get("__doc__"), usage))
            raise SystemExit(0)
        if not arg.startswith("--") and positional is not None:
            positional.append(arg)
        elif not arg.startswith("--"):
            for path, settings in file_settings(arg):
                for key, value in settings.items():
                    if key not in config:
                        raise ConfigError(f"{path}: {_unknown(key, config)}")
                    try:
                        config[key] = _coerce(key, value, config[key])
                    except ConfigError as e:
                        raise ConfigError(f"{path}: {e}") from None
                    explicit.add(key)
        else:
            key, sep, value = arg[2:].partition("=")
            if key not in config:
                raise _unknown(key, config)
            if not sep and not isinstance(config[key], bool):
                raise ConfigError(f"{arg}: overrides are written --key=value (a bare --key is for the true/false "
                                  f"keys only)")
            config[key] = _coerce(key, value, config[key]) if sep else True
            explicit.add(key)
    return explicit


def key_comments(path):
    """{key: its comment} in the source of a script's defaults: the comment after `key = value` at
    the top level, or after `key=value,` in a call there (`DEFAULTS = dict(...)`); where that line has
    none, the comment lines right above it, joined. {} where the source cannot be read."""
    try:
        with open(path) as f:
            source = f.read()
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return {}
    lines = source.splitlines()
    comments = {t.start[0]: t.string.lstrip("#").strip()
                for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT}

    def comment(node):
        if node.end_lineno in comments or node.lineno in comments:
            return comments.get(node.end_lineno) or comments[node.lineno]
        above = node.lineno - 1
        while above in comments and lines[above - 1].lstrip().startswith("#"):
            above -= 1
        return " ".join(comments[i] for i in range(above + 1, node.lineno))
    found = {}
    for stmt in (s for s in tree.body if isinstance(s, ast.Assign)):
        named = [(t.id, stmt) for t in stmt.targets if isinstance(t, ast.Name)]
        named += [(k.arg, k.value) for call in ast.walk(stmt.value) if isinstance(call, ast.Call)
                  for k in call.keywords if k.arg]
        for key, node in named:
            found.setdefault(key, comment(node))
    return found


def help_text(config, defaults, script, doc=None, usage=None):
    """What --help prints: how to call the script, its docstring's first line, and each key of
    config as a config file assigns it, with its comment (key_comments) and, where earlier arguments
    changed it, its default."""
    name = os.path.basename(script) if script else "the script"
    comments = key_comments(script) if script else {}
    rows = [(f"{k} = {v!r}", comments.get(k, "") + (f" (default {defaults[k]!r})" if v != defaults[k] else ""))
            for k, v in config.items()]
    width = min(max(len(a) for a, _ in rows), 40) if rows else 0
    head = [usage or f"usage: python {name} [config.py ...] [--key=value ...]"]
    head += [doc.strip().splitlines()[0]] if doc else []
    return "\n".join(head + ["", "keys (a config file reassigns them in Python; --key=value overrides, left to right):"]
                     + [f"  {a:<{width}}  # {c}" if c else f"  {a}" for a, c in rows])


# --- checks of a resolved config: one line naming the key, the value and what is accepted -----------

def check_set(config, defaults):
    """No key left None (a config file's `key = None`): each takes a value of its default's type."""
    for key, value in config.items():
        if value is None:
            raise ConfigError(f"{key}=None: expected {_a(type(defaults[key]).__name__)} like {defaults[key]!r}")


def check_choices(config, choices):
    """Each key of choices ({key: accepted values}) holds one of its values."""
    for key, accepted in choices.items():
        if config[key] not in accepted:
            raise ConfigError(f"{key}={config[key]!r}: expected one of {', '.join(accepted)}")


def check_at_least(config, lowest):
    """Each key of lowest ({key: the lowest integer accepted}) holds an integer at least that."""
    for key, low in lowest.items():
        if config[key] < low:
            raise ConfigError(f"{key}={config[key]}: expected an integer >= {low}")


def check_numbers(config, keys, below=None):
    """Each of keys holds a number >= 0, and < below where given (NaN never passes)."""
    for key in keys:
        if not (config[key] >= 0 and (below is None or config[key] < below)):
            accepted = ">= 0" if below is None else f"in [0, {below})"
            raise ConfigError(f"{key}={config[key]}: expected a number {accepted}")


def check_device(config, key="device"):
    """config[key] names a device torch has here: cpu, or cuda / cuda:N with a GPU."""
    import torch  # only the scripts that check a device need it
    try:
        dev = torch.device(config[key])
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"--{key}={config[key]!r}: expected cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--{key}={config[key]!r}, but torch finds no CUDA GPU here; use --{key}=cpu")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise ConfigError(f"--{key}={config[key]!r}, but torch finds {torch.cuda.device_count()} CUDA GPUs here")


def _a(noun):
    """The noun with its article: "an int", "a float"."""
    return ("an " if noun[:1] in "aeiou" else "a ") + noun
