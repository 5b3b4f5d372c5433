"""nanoGPT's configurator as a function: config files and --key=value overrides, checked.

    python train.py config/gpt2_gaussws_od.py --batch_size=32 --method="gaussws[od]"

A config file is plain Python that reassigns some of the defaults. An override must name an
existing key (a typo lists close matches) and keep the default's type (an int default takes
"3", a float default "3e-4" or "3", a bool "True"/"False", a string anything).
"""
import ast
import difflib
import os

from util import UserError


class ConfigError(UserError):
    """Bad user input; the message is one line that says what to do."""


def _unknown(key, config):
    close = difflib.get_close_matches(key, config, n=3)
    hint = f"; did you mean {', '.join('--' + c for c in close)}?" if close else "; see the defaults at the top of the script"
    return ConfigError(f"unknown config key {key!r}{hint}")


def _coerce(key, value, default):
    """`value` (a string from the command line, or a Python value from a file) as the default's type."""
    if isinstance(value, str) and not isinstance(default, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ConfigError(f"--{key}={value}: expected a {type(default).__name__} like {default!r}") from None
    if default is None or value is None or isinstance(value, type(default)):
        pass
    elif isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    else:
        raise ConfigError(f"{key}={value!r} is a {type(value).__name__}, but {key} takes a "
                          f"{type(default).__name__} (default {default!r})")
    return value


def configure(config, argv):
    """Apply config files and --key=value overrides in `argv` to the dict `config`, in order.

    Returns the set of keys that were set, so a caller can tell a user's choice from a default.
    """
    explicit = set()
    for arg in argv:
        if not arg.startswith("--"):
            if not os.path.isfile(arg):
                raise ConfigError(f"config file {arg!r} not found (arguments are config files and --key=value)")
            scope = {}
            try:
                exec(compile(open(arg).read(), arg, "exec"), scope)
            except Exception as e:
                raise ConfigError(f"config file {arg} failed: {type(e).__name__}: {e}") from None
            for key, value in scope.items():
                if key.startswith("_") or key == "__builtins__" or callable(value) or type(value).__name__ == "module":
                    continue
                if key not in config:
                    raise ConfigError(f"{arg}: {_unknown(key, config)}")
                config[key] = _coerce(key, value, config[key])
                explicit.add(key)
        else:
            key, sep, value = arg[2:].partition("=")
            if not sep:
                raise ConfigError(f"{arg}: overrides are written --key=value")
            if key not in config:
                raise _unknown(key, config)
            config[key] = _coerce(key, value, config[key])
            explicit.add(key)
    return explicit
