"""bench.py's options: each command's defaults, overridden by `--key=value` and type-checked by the
configurator train.py uses; lists are strings parsed here ("1,8", "512x2048,4096x4096")."""
import dataclasses
import re
import types

import torch

import model as model_lib
from benchmarks.common import BenchError
from configurator import check_device, configure
from util import check_json_path

def parse_shapes(text):
    shapes = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", part)
        if not match or 0 in (int(match.group(1)), int(match.group(2))):
            raise BenchError(f"--shapes={text}: bad shape {part!r}; expected MxN with positive M and N, e.g. 512x2048")
        shapes.append((int(match.group(1)), int(match.group(2))))
    return shapes


def check_positive(key, value):
    """An option that is one count (configurator has made it an int)."""
    if value < 1:
        raise BenchError(f"--{key}={value}: expected a positive integer")


def parse_ints(key, text):
    try:
        values = [int(v) for v in str(text).split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise BenchError(f"--{key}={text}: expected positive integers separated by commas, e.g. 1,8")
    return values


def _common():
    return dict(
        device="cuda" if torch.cuda.is_available() else "cpu",  # "cpu" or "cuda"
        threads=0,  # CPU threads for torch; 0: torch's default (one per core). Fewer when others share the cores
        json="",  # also write the records to this path as JSON
    )


KERNEL_CONFIG = dict(
    shapes="",  # MxN,... of w; "": a default list for the device
    repeats=5,  # timed blocks per impl; the median is reported
    **_common(),
)
TRAIN_CONFIG = dict(
    model="gpt2-124m",  # a name of model.PRESETS
    methods="bf16,gaussws[all],diffq[all]",  # method strings; bf16 (the baseline) is always added
    batch_size=1,  # sequences per micro-step
    block_size=1024,  # tokens per sequence
    grad_accum="1",  # micro-steps per optimizer step; a list such as "1,8" measures each
    rounds=3,  # timed optimizer steps per method
    warmup=1,  # untimed steps per method first (the noise kernels compile at the first)
    compile=False,  # torch.compile the model
    recompute_w_hat=False,  # as train.py: keep no w_hat for the backward, make it again there (less memory)
    seed=1337,  # initial weights, tokens and noise
    **_common(),
)
HOST_CONFIG = dict(
    layers="2,24,84,154",  # numbers of PQT Linears (Llama2-134M has 84, Llama2-1B 154)
    width=64,  # each weight is width x width: tiny, so that what is timed is the host's calls
    repeats=50,  # timed steps per case; the median is reported
    threads=0,  # CPU threads for torch; 0: torch's default. One is steadier where others share the cores
    json="",  # also write the records to this path as JSON
)
COMMANDS = {"kernel": KERNEL_CONFIG, "train": TRAIN_CONFIG, "host": HOST_CONFIG}
# Any model.ModelConfig field overrides the preset, e.g. a tiny model: --n_layer=1 --n_embd=64.
MODEL_KEYS = [f.name for f in dataclasses.fields(model_lib.ModelConfig) if f.name != "block_size"]


def parse_args(argv):
    """(command, namespace of settings) from the command line; a UserError for bad input."""
    if not argv or argv[0] not in COMMANDS:
        got = f"got {argv[0]!r}" if argv else "got nothing"
        raise BenchError(f"expected 'kernel', 'train' or 'host' as the first argument, or 'gpu-check' ({got}); "
                         "see python bench.py --help")
    command = argv[0]
    config = dict(COMMANDS[command])
    defaults = dataclasses.asdict(model_lib.ModelConfig()) if command == "train" else {}
    config.update({k: defaults[k] for k in MODEL_KEYS if command == "train"})
    explicit = configure(config, argv[1:])
    args = types.SimpleNamespace(command=command, **{k: v for k, v in config.items() if k not in MODEL_KEYS})
    args.model_overrides = {k: config[k] for k in MODEL_KEYS if k in explicit}
    for key in ("vocab_size", "n_layer", "n_head", "n_embd"):
        if args.model_overrides.get(key, 1) < 1:
            raise BenchError(f"--{key}={args.model_overrides[key]}: expected a positive integer")
    positive = {"kernel": ["repeats"], "train": ["batch_size", "block_size", "rounds", "warmup"],
                "host": ["repeats", "width"]}[command]
    for key in positive:
        check_positive(key, getattr(args, key))
    if args.threads < 0:
        raise BenchError(f"--threads={args.threads}: expected 0 (torch's default) or a positive number")
    check_json_path(args.json)  # before the run, not after it
    if command == "kernel":
        args.shapes = parse_shapes(args.shapes) if args.shapes else None
    elif command == "host":
        args.layers = parse_ints("layers", args.layers)
        return command, args  # on the CPU, whatever the machine has
    else:
        args.grad_accum = parse_ints("grad_accum", args.grad_accum)
        if args.model not in model_lib.PRESETS:
            raise BenchError(f"--model={args.model}: unknown; expected one of {', '.join(model_lib.PRESETS)}")
    check_device(config)
    return command, args
