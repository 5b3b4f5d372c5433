"""Train GPT2 or Llama2 with pseudo-quantization training of chosen Linear layers.

Single process (CPU or one GPU):
    python train.py                                   # small gaussws[all] GPT2 on the default corpus
    python train.py config/gpt2_gaussws_od.py --batch_size=8
    python train.py --init_from=out/bf16_run --method="gaussws[od]" --out_dir=out/pqt   # PQT from trained weights
Data parallel, one node of 8 GPUs (gloo on CPU, nccl on CUDA):
    torchrun --standalone --nproc_per_node=8 train.py config/gpt2_gaussws_od.py
Several nodes, e.g. 2 x 8 GPUs (run on each node, --node_rank=0 on the master):
    torchrun --nproc_per_node=8 --nnodes=2 --node_rank=0 --master_addr=10.0.0.1 --master_port=29500 train.py ...

_main reads top to bottom as nanoGPT's train.py does: config, distributed set-up, data, the model
and its optimizers (build: the model built plain, converted, sharded, the optimizers, the resumed
state), logging, and the loop with its decisions (evaluate, save, stop); the optimizer step itself
is step.py's. The functions above _main are its named steps, in the order it takes them.

Every run is reproducible from its seed: the initial weights do not depend on the method (the model
is built plain, then gaussws.convert swaps Linears without drawing random numbers), the batches of
step i are a function of (seed, i) and the noise of step i a function of (seed, layer, i), so a
resumed run repeats an uninterrupted one exactly, and the global batch (and so the loss) does not
depend on the number of processes.
"""
import json
import math
import os
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, fields
from types import SimpleNamespace

import torch

import checkpoint as ckpt_io
import gaussws
import hf
from configurator import ConfigError, configure
from data import loader
from model import GPT, PRESETS, ROLES, ModelConfig
from step import NonFinite, all_finite, train_step
from util import cli, keep_freed_cpu_memory

# -----------------------------------------------------------------------------------------------
# default config values: a small gaussws[all] GPT2 on the offline default corpus
# I/O
out_dir = "out"  # checkpoint, metrics.jsonl and config.json go here
eval_interval = 200  # iterations between evaluations (and checkpoints)
log_interval = 20  # iterations between log lines
eval_iters = 20  # batches per evaluation of train and val loss
eval_only = False  # evaluate once and exit
always_save_checkpoint = True  # save at every eval; False: only when val loss improves
save_checkpoints = True  # False: never write a checkpoint (throughput runs)
init_from = "scratch"  # "scratch", "resume" (from out_dir/ckpt.pt), or a ckpt.pt / out_dir whose weights start this run
overwrite = False  # allow a new run to replace the checkpoint of another run in out_dir
dry_run = False  # build the model on the meta device, print the resolved config and exit
# wandb logging (imported only when on)
wandb_log = False  # log metrics to Weights & Biases
wandb_project = "gaussws"  # wandb project
wandb_run_name = "run"  # wandb run name
wandb_mode = "online"  # "online", "offline" (sync later with `wandb sync`) or "disabled"
# data
dataset = "default"  # a folder under data/ (or a path to one) holding train.bin, val.bin, meta.json
gradient_accumulation_steps = 1  # micro-steps per optimizer step, summed over all processes
batch_size = 32  # sequences per micro-step per process
block_size = 128  # tokens per sequence (the model's context); a preset's when 0
# model
model = ""  # a preset of model.PRESETS ("gpt2-124m", "llama2-134m", ...); fields set below win
arch = "gpt2"  # "gpt2" or "llama2"
n_layer = 4  # transformer blocks
n_head = 4  # attention heads
n_kv_head = 0  # llama2 key/value heads (grouped-query attention); 0: n_head
n_embd = 128  # model width
ffn_hidden = 0  # MLP hidden width; 0: 4 * n_embd (gpt2) or Llama 2's rule
vocab_size = 0  # 0: the dataset's (meta.json)
dropout = 0.0  # 0 for pre-training, as the paper's runs
bias = True  # gpt2 biases in Linears and LayerNorms (llama2 has none)
# pseudo-quantization training (gaussws.convert)
method = "gaussws[all]"  # PQT method and layers: bf16, gaussws[all], gaussws[od], diffq[all], ...
b_init = 6.0  # b_t at initialisation (Eq. 11)
b_target = 4.0  # b_t that weight decay on b_i pulls toward (Eq. 11)
recompute_w_hat = False  # keep no w_hat for the backward, make it again there: less memory, more time
pqt_start = 0.0  # first step of the method (a fraction of max_iters if < 1); plain Linears before it; 0: every step
fork_from = ""  # a bf16 run's ckpt.pt at a step <= pqt_start, same settings but the method: this phase run continues it
target_format = ""  # format trained toward: ste's grid, or b_t's level for gaussws/diffq (gaussws.phase_settings)
bits_per_weight = 0.0  # with target_format auto-int / error-int: int2/int3/int4 per block at this mean; 0: no budget
ste_start = 0.0  # gaussws/diffq at a budget: first step of STE on the formats chosen then (as pqt_start); 0: none
# optimizer
optimizer = "adamw"  # "adamw" or "adam_mini"
learning_rate = 2e-3  # peak learning rate
max_iters = 400  # optimizer steps
weight_decay = 0.1  # AdamW decoupled decay of the model's matrices
bitwidth_weight_decay = 0.1  # AdamW decay of b_i, pulling b_t toward b_target (its own, never weight_decay)
bitwidth_lambda = 0.0  # lambda of Eq. 12: mean |b_t - b_target| per layer added to the loss
beta1 = 0.9  # AdamW beta1
beta2 = 0.99  # AdamW beta2
grad_clip = 1.0  # clip the global gradient norm at this value; 0 disables
# learning rate schedule: linear warmup, cosine decay to min_lr
decay_lr = True  # False: constant learning_rate
warmup_iters = 50  # linear warmup steps
lr_decay_iters = 400  # cosine ends here (usually max_iters)
min_lr = 2e-4  # final learning rate (learning_rate / 10 as Chinchilla)
# system
device = "cuda" if torch.cuda.is_available() else "cpu"  # "cpu", "cuda", "cuda:1", ...
# autocast dtype of matmuls: "bfloat16", or "float32" (no autocast). BF16 where the hardware has it
# (GPUs, CPUs with AVX512-BF16 or AMX); elsewhere the CPU emulates BF16 matmuls several times slower
# than FP32 ones. w_hat is BF16 either way.
dtype = "bfloat16" if torch.cuda.is_available() or torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"
compile = False  # torch.compile the model
seed = 1337  # one seed for init, data order and noise; shared by all processes
parallel = "ddp"  # how torchrun processes share the work: "ddp" (replicated) or "fsdp" (FSDP2, sharded)
# -----------------------------------------------------------------------------------------------
DEFAULTS = {k: v for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, bool, str))}
MODEL_KEYS = [f.name for f in fields(ModelConfig)]


def fail(msg):
    raise ConfigError(msg)


EXIT_DIVERGED = 3


class Diverged(ConfigError):
    """The run stopped because it diverged (a result of its settings, not bad input): one line,
    exit status EXIT_DIVERGED, and out_dir/diverged.json names the step and what went wrong."""

    exit_status = EXIT_DIVERGED


# A model is kept (trained on, saved) only while every evaluation finds it sane: its eval losses
# and weights finite; after its first step its val loss at most ln(vocab_size) + VAL_LOSS_MARGIN
# nats, where a model that predicts every token uniformly scores ln(vocab_size) and an untrained one
# about that: one a nat worse has not learned but lost its way (seen: 1.6e13); and no b_t more than
# B_T_MARGIN bits below min(b_init, b_target): b_t starts at b_init, weight decay on b_i pulls it to
# b_target and the loss pulls it up, so only a blown-up optimizer puts it there, where Eq. 3's noise,
# 2^(1 - b_t) times the block max, drowns the weights (at b_t of about -1e6 it overflows: the next
# step is NaN).
VAL_LOSS_MARGIN, B_T_MARGIN = 1.0, 8.0


def insanity(losses, b_t, vocab_size, b_floor, trained):
    """(what, value, limit) of the first rule above the evaluated model breaks, or None.
    losses: estimate_loss's; b_t: gaussws.bitwidth_stats' (None without PQT); trained: it took a step."""
    if not all(map(math.isfinite, losses.values())):
        return "eval_loss", losses, None
    if trained and losses["val"] > math.log(vocab_size) + VAL_LOSS_MARGIN:
        return "val_loss", losses["val"], math.log(vocab_size) + VAL_LOSS_MARGIN
    if b_t is not None and not b_t["min"] >= b_floor - B_T_MARGIN:  # NaN too
        return "b_t", b_t["min"], b_floor - B_T_MARGIN
    return None


# --- config ------------------------------------------------------------------------------------------

def validate(c, explicit):
    """Refuse a bad config before anything is built or written: one line naming the key, the value
    and what is accepted."""
    for k, v in c.items():
        if v is None:
            fail(f"{k}=None: expected a {type(DEFAULTS[k]).__name__} like {DEFAULTS[k]!r}")
    choices = dict(dtype=("bfloat16", "float32"), optimizer=("adamw", "adam_mini"), parallel=("ddp", "fsdp"),
                   wandb_mode=("online", "offline", "disabled"), arch=("gpt2", "llama2"))
    for k, accepted in choices.items():
        if c[k] not in accepted:
            fail(f"{k}={c[k]!r}: expected one of {', '.join(accepted)}")
    if c["init_from"] == "":
        fail("init_from='': expected 'scratch', 'resume', or a ckpt.pt or an out_dir holding one")
    if c["fork_from"] and c["init_from"] != "scratch":
        fail(f"fork_from starts a new run from {c['fork_from']}: it goes with --init_from=scratch, not "
             f"{c['init_from']!r}")
    if c["model"] and c["model"] not in PRESETS:
        fail(f"model={c['model']!r} is not a preset; expected one of {', '.join(PRESETS)} or '' (set the shape by hand)")
    at_least = dict(batch_size=1, gradient_accumulation_steps=1, eval_iters=1, eval_interval=1, log_interval=1,
                    max_iters=0, warmup_iters=0, lr_decay_iters=0, n_kv_head=0, ffn_hidden=0, vocab_size=0)
    if not c["model"] or any(k in explicit for k in ("n_layer", "n_head", "n_embd")):
        at_least.update(n_layer=1, n_head=1, n_embd=1)  # with a preset, only the keys the user sets
    for k, low in at_least.items():
        if c[k] < low:
            fail(f"{k}={c[k]}: expected an integer >= {low}")
    if c["block_size"] < 0 or c["block_size"] == 0 and not c["model"]:
        fail(f"block_size={c['block_size']}: expected an integer >= 1 (0 takes the --model preset's, and none is set)")
    for k in ("learning_rate", "min_lr", "weight_decay", "bitwidth_weight_decay", "bitwidth_lambda"):
        if not c[k] >= 0:
            fail(f"{k}={c[k]}: expected a number >= 0")
    if not c["grad_clip"] >= 0:
        fail(f"grad_clip={c['grad_clip']}: expected a number >= 0 (the largest gradient norm; 0 disables clipping)")
    for k in ("beta1", "beta2", "dropout"):
        if not 0 <= c[k] < 1:
            fail(f"{k}={c[k]}: expected a number in [0, 1)")
    if not 0 <= c["seed"] < 2**63:
        fail(f"seed={c['seed']}: expected an integer in [0, 2^63)")
    try:
        dev = torch.device(c["device"])
    except (RuntimeError, ValueError):
        fail(f"device={c['device']!r}: expected cpu, cuda or cuda:N")
    if dev.type not in ("cpu", "cuda"):
        fail(f"device={c['device']!r}: expected cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        fail(f"device={c['device']!r}, but torch finds no CUDA GPU here; use --device=cpu")
    if not c["dry_run"]:
        ckpt_io.check_out_dir(c["out_dir"])


def config_model_args(c, explicit):
    """The model's shape from the config: ModelConfig's defaults < the preset < this file's defaults
    where no preset < the user's keys. 0 means "derive it" for n_kv_head, ffn_hidden, block_size."""
    model_args = dict(PRESETS[c["model"]]) if c["model"] else {}
    for k in MODEL_KEYS:
        if k in c and (k in explicit or not c["model"]):
            model_args[k] = c[k]
    for k in ("n_kv_head", "ffn_hidden"):
        if model_args.get(k) == 0:
            model_args[k] = None
    if model_args.get("block_size", 0) == 0:
        model_args.pop("block_size", None)
    return model_args


def method_args(c):
    """gaussws.convert's settings of the method from the config (resolved by gaussws.phase_settings)."""
    return dict(b_init=c["b_init"], b_target=c["b_target"], seed=c["seed"], start=int(c["pqt_start"]),
                fmt=c["target_format"], ste_start=int(c["ste_start"]), bits_per_weight=c["bits_per_weight"])


# --- set-up ----------------------------------------------------------------------------------------

def setup_distributed(c):
    """This process among those torchrun started (RANK set), or alone: a namespace of ddp, fsdp, rank,
    world_size, local_rank, master (rank 0), dev, device_type, local_accum (this process's
    micro-steps per optimizer step) and say (print on rank 0)."""
    ddp = int(os.environ.get("RANK", -1)) != -1
    if ddp:
        torch.distributed.init_process_group(backend="nccl" if c["device"].startswith("cuda") else "gloo")
        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        local_rank = int(os.environ["LOCAL_RANK"])
        dev = f"cuda:{local_rank}" if c["device"].startswith("cuda") else c["device"]
        if dev.startswith("cuda"):
            torch.cuda.set_device(dev)
        if c["gradient_accumulation_steps"] % world_size:
            fail(f"gradient_accumulation_steps={c['gradient_accumulation_steps']} must be a multiple of the "
                 f"{world_size} processes: it counts micro-steps of all processes together")
    else:
        rank, world_size, local_rank, dev = 0, 1, 0, c["device"]
    device_type = "cuda" if dev.startswith("cuda") else "cpu"
    if device_type == "cpu":
        keep_freed_cpu_memory()
    return SimpleNamespace(ddp=ddp, fsdp=ddp and c["parallel"] == "fsdp", rank=rank, world_size=world_size,
                           local_rank=local_rank, master=rank == 0, dev=dev, device_type=device_type,
                           local_accum=c["gradient_accumulation_steps"] // world_size,
                           say=print if rank == 0 else lambda *args, **kwargs: None)  # print on rank 0


def show_dry_run(c, model_args):
    """Print the resolved config and the model's size, built on the meta device (no memory)."""
    if not model_args.get("vocab_size"):
        model_args["vocab_size"] = 50304 if model_args.get("arch", "gpt2") == "gpt2" else 32000
    with torch.device("meta"):
        m = gaussws.convert(GPT(ModelConfig(**model_args)), c["method"], ROLES[model_args.get("arch", "gpt2")],
                            **method_args(c))
    print(json.dumps({**c, "model_args": asdict(m.config)}, indent=1))
    print(f"parameters: {m.get_num_params(non_embedding=False):,} ({m.get_num_params(non_embedding=False) / 1e6:.1f}M)"
          f" + {m.get_num_bitwidth_params():,} b_i")
    print(f"tokens per optimizer step: {c['gradient_accumulation_steps'] * c['batch_size'] * m.config.block_size:,}")


def open_data(c, proc):
    """(data_dir, meta) of the dataset, meta.json checked against its files (data/loader.py). The
    default corpus is prepared where it is missing, by rank 0 while the others wait."""
    data_dir = loader.data_dir(c["dataset"])
    if c["dataset"] == "default" and not os.path.exists(os.path.join(data_dir, "meta.json")):
        if proc.master:
            loader.prepare_default(data_dir)  # a full disk, an unwritable data/default: one line (DataError)
        if proc.ddp:
            torch.distributed.barrier()
    return data_dir, loader.read_meta(data_dir)


# --- the starting point: scratch, resume, a fork, or another run's (or a pretrained model's) weights --

# What a phase run may set otherwise than the bf16 run it forks from: the method and its settings,
# which change nothing before the switch (the layers are plain Linears, b_i get no gradient), and
# what is not training (the run's length beyond the fork step, evaluation, logging, files).
FORK_FREE = {"method", "b_init", "b_target", "pqt_start", "target_format", "ste_start", "bits_per_weight",
             "bitwidth_weight_decay", "bitwidth_lambda", "recompute_w_hat", "max_iters", "eval_interval",
             "log_interval", "eval_iters", "always_save_checkpoint", "save_checkpoints", "out_dir", "init_from",
             "fork_from", "overwrite", "dry_run", "eval_only", "wandb_log", "wandb_project", "wandb_run_name",
             "wandb_mode"}


def starting_point(c, explicit, model_args, meta):
    """(model_args, checkpoint, init_state) for init_from: the checkpoint to continue (this run's, to
    resume; a bf16 run's, to fork from), or the state dict a new run starts from (a path), with the
    architecture each implies. The run directory's rules are checkpoint.py's (resume, check_new,
    read_fork)."""
    if c["init_from"] == "resume":
        if not model_args.get("vocab_size"):
            model_args["vocab_size"] = meta["vocab_size"]
        try:
            wanted = {**asdict(ModelConfig(**model_args)), **{k: c[k] for k in ckpt_io.PQT_KEYS}}
        except (ValueError, TypeError) as e:
            fail(str(e))
        checkpoint = ckpt_io.resume(c["out_dir"], wanted)
        return checkpoint["model_args"], checkpoint, None
    ckpt_io.check_new(c["out_dir"], c["overwrite"])
    if c["fork_from"]:
        checkpoint = ckpt_io.read_fork(c["fork_from"], c, FORK_FREE)
        return checkpoint["model_args"], checkpoint, None
    if c["init_from"] == "scratch":
        return model_args, None, None
    requested = {k: v for k, v in model_args.items() if k in explicit}
    source_args, init_state = resolve_init(c["init_from"], c["out_dir"], requested)
    # The architecture is the source's; a shape the user set explicitly must agree with it.
    asked = {k: v for k, v in model_args.items() if (k in explicit or c["model"] and "model" in explicit)
             and k != "dropout" and v is not None}
    clash = [f"{k}: {c['init_from']} has {source_args.get(k)!r}, config {v!r}" for k, v in asked.items()
             if source_args.get(k) != v]
    if clash:
        fail(f"init_from={c['init_from']} has another shape ({'; '.join(clash)}); drop those keys")
    return {**source_args, **({"dropout": c["dropout"]} if "dropout" in explicit else {})}, None, init_state


def resolve_init(init_from, out_dir, requested):
    """(model_args, state_dict) of the weights a run starts from: a checkpoint of train.py (ckpt.pt,
    ckpt.dcp, or an out_dir holding one), a Hugging Face model directory, or a GPT-2 of the hub.
    requested: the shape keys the user set (a pretrained GPT-2's block_size may shrink)."""
    path = ckpt_io.find(init_from)
    if os.path.isdir(init_from) and os.path.isfile(os.path.join(init_from, "config.json")) and not path:
        return pretrained(init_from, requested)  # a Hugging Face model directory
    if not os.path.exists(init_from) and init_from in hf.GPT2_HUB:  # nanoGPT's init_from names
        return pretrained(init_from, requested)
    if not path or not os.path.exists(path):
        fail(f"init_from={init_from!r}: expected 'scratch', 'resume', a ckpt.pt or an out_dir holding one, a "
             f"Hugging Face model directory, or one of {', '.join(hf.GPT2_HUB)}")
    if os.path.realpath(path) in map(os.path.realpath, ckpt_io.paths(out_dir)):
        fail(f"init_from={init_from!r} is this run's own checkpoint: continue it with --init_from=resume, "
             f"or write the new run to another --out_dir")
    checkpoint = ckpt_io.read(path)
    return checkpoint["model_args"], checkpoint["model"]


def pretrained(name_or_dir, requested):
    """(model_args, state_dict) of a Hugging Face GPT2LMHeadModel / LlamaForCausalLM (hf.py)."""
    try:
        model_args, state_dict = hf.load_pretrained(name_or_dir)
        return hf.fit_pretrained(model_args, state_dict, requested, source=f"init_from={name_or_dir}")
    except hf.HFError as e:
        fail(str(e))


def build(c, explicit, proc, model_args, data_dir, meta):
    """The model and its optimizers at the run's starting point (starting_point: scratch, this run's
    checkpoint, a fork's, or another's weights): the model built plain from the seed, then converted
    (the same initial weights whatever the method), sharded under FSDP, the optimizers, the state of
    the checkpoint it continues. Returns (model, optimizers, (iter_num, best_val_loss, saved_step),
    forked), saved_step the step of the checkpoint this run continues (None for a new run), forked
    the path of the checkpoint it forks from (or None)."""
    model_args, checkpoint, init_state = starting_point(c, explicit, model_args, meta)
    if not model_args.get("vocab_size"):
        model_args["vocab_size"] = meta["vocab_size"]
    if meta["vocab_size"] > model_args["vocab_size"]:
        fail(f"the data in {data_dir} has a vocabulary of {meta['vocab_size']} tokens ({meta.get('tokenizer')}), more "
             f"than the model's vocab_size={model_args['vocab_size']}; prepare the data with a tokenizer of at most "
             f"that many tokens, or pass --vocab_size={64 * -(-meta['vocab_size'] // 64)}")

    # model: built plain, then converted (the same initial weights whatever the method)
    torch.manual_seed(c["seed"])
    mconf = ModelConfig(**model_args)
    roles = ROLES[mconf.arch]
    raw_model = gaussws.convert(GPT(mconf), c["method"], roles, recompute=c["recompute_w_hat"], **method_args(c))
    if init_state is not None:
        try:
            gaussws.load_weights(raw_model, init_state)
        except ValueError as e:
            fail(f"the init_from checkpoint does not fit the model: {e}")
        init_state = None
    raw_model.to(proc.dev)
    if proc.fsdp:
        # FSDP2: each block's parameters are gathered whole for its forward, so PQTLinear adds the
        # noise to the unsharded weight, and the block max sees every element of its block.
        from torch.distributed.fsdp import fully_shard
        for block in raw_model.transformer.h:
            fully_shard(block)
        fully_shard(raw_model)

    # optimizer
    optimizers = gaussws.build_optimizers(
        raw_model, c["optimizer"], roles, lr=c["learning_rate"], betas=(c["beta1"], c["beta2"]),
        weight_decay=c["weight_decay"], bitwidth_weight_decay=c["bitwidth_weight_decay"],
        n_embd=mconf.n_embd, n_head=mconf.n_head, n_kv_head=mconf.n_kv_head)
    if checkpoint is None:
        return raw_model, optimizers, (0, 1e9, None), None
    ckpt_io.load_state(raw_model, optimizers, checkpoint, proc.fsdp)
    torch.set_rng_state(checkpoint["rng_state"])
    if proc.device_type == "cuda" and "cuda_rng_state" in checkpoint:
        torch.cuda.set_rng_state(checkpoint["cuda_rng_state"], proc.dev)
    return (raw_model, optimizers, (checkpoint["iter_num"], checkpoint["best_val_loss"], checkpoint["iter_num"]),
            checkpoint.get("forked"))


def for_training(c, proc, model):
    """What the training forward calls: the model compiled (compile=True), and under DDP wrapped to
    all-reduce the gradients in the backward (but those of gaussws.ddp_ignored_parameters)."""
    train_model = torch.compile(model) if c["compile"] else model
    if proc.ddp and not proc.fsdp:
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, gaussws.ddp_ignored_parameters(model))
        train_model = torch.nn.parallel.DistributedDataParallel(
            train_model, device_ids=[proc.local_rank] if proc.device_type == "cuda" else None)
    return train_model


# --- the loop's: learning rate, logging, evaluation, checkpoints, stopping --------------------------

def get_lr(it, c):
    """The learning rate of step `it` under config `c`: linear warmup to learning_rate, cosine decay to
    min_lr at lr_decay_iters (learning_rate throughout without decay_lr)."""
    if not c["decay_lr"]:
        return c["learning_rate"]
    if it < c["warmup_iters"]:
        return c["learning_rate"] * (it + 1) / (c["warmup_iters"] + 1)
    if it > c["lr_decay_iters"]:
        return c["min_lr"]
    ratio = (it - c["warmup_iters"]) / max(1, c["lr_decay_iters"] - c["warmup_iters"])
    return c["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (c["learning_rate"] - c["min_lr"])


class Saved:
    """The checkpoint a stopped run leaves behind (path, step; step None: none yet), named truthfully
    in every message that stops it."""

    def __init__(self, path, step):
        self.path, self.step = path, step

    def __str__(self):
        return "this run wrote no checkpoint" if self.step is None else \
            f"the last good checkpoint is {self.path}, step {self.step}"


class Metrics:
    """Where the run's records go: out_dir's metrics.jsonl and config.json (rank 0; none for eval_only,
    which leaves the run's record as it is; checkpoint.start_run) and, with wandb_log, Weights &
    Biases (imported only then). A full disk stops the run in one line naming what it kept (saved)."""

    def __init__(self, c, proc, run_info, saved, forked):
        self.saved, self.wandb, self.file = saved, None, None
        if proc.master and not c["eval_only"]:
            self.file = ckpt_io.start_run(c["out_dir"], run_info, saved.step, new=c["init_from"] != "resume",
                                          forked=forked)
        if c["wandb_log"] and proc.master:
            import wandb
            wandb.init(project=c["wandb_project"], name=c["wandb_run_name"], mode=c["wandb_mode"], dir=c["out_dir"],
                       config=run_info)
            self.wandb = wandb

    def log(self, record):
        if self.file:
            try:
                self.file.write(json.dumps(record) + "\n")
                self.file.flush()
            except OSError as e:  # a full disk
                try:
                    self.file.close()
                except OSError:
                    pass
                fail(f"cannot write {self.file.name}: {e.strerror or e}; the run stops here ({self.saved})")
            if self.wandb:
                self.wandb.log(record, step=record["iter"])

    def close(self):
        if self.wandb:
            self.wandb.finish()
        if self.file:
            self.file.close()


def evaluate(c, proc, model, splits, iter_num, metrics, **eval_args):
    """{split: loss} of the model at step iter_num on the fixed evaluation batches, noise off
    (data/loader.estimate_loss); printed and logged, and the b_t histograms sent to wandb."""
    losses = loader.estimate_loss(model, splits, seed=c["seed"], eval_iters=c["eval_iters"], rank=proc.rank,
                                  world_size=proc.world_size, **eval_args)
    proc.say(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
    metrics.log({"iter": iter_num, "train/loss": losses["train"], "val/loss": losses["val"]})
    if c["wandb_log"]:
        hists = gaussws.bitwidth_histograms(model)  # collective under FSDP
        if proc.master and hists:
            metrics.wandb.log({f"b_t/{k}": metrics.wandb.Histogram(v) for k, v in hists.items()}, step=iter_num)
    return losses


def diverged(c, proc, step, saved, what, value, message, limit=None):
    """Stop the run as diverged: the one line (Diverged, exit status 3), and out_dir/diverged.json
    for whoever runs it (study.py): the step, what broke, its value and limit, the checkpoint kept."""
    if proc.master:
        record = {"step": step, "what": what, "value": value, "limit": limit, "message": message,
                  "checkpoint": None if saved.step is None else saved.path, "checkpoint_step": saved.step}
        try:
            ckpt_io.write_divergence(c["out_dir"], record)
        except ckpt_io.CheckpointError as e:
            message += f" ({e})"
    raise Diverged(message)


def check_sane(c, proc, model, losses, step, saved):
    """Stop as diverged, saving nothing, unless the evaluated model is sane: finite weights (b_i,
    unseen by the eval, included) and none of insanity's rules broken."""
    if not all_finite(model, proc.ddp):
        diverged(c, proc, step, saved, "model", None, f"the model holds non-finite values at step {step}; stopping "
                                                      f"without saving ({saved})")
    broken = insanity(losses, gaussws.bitwidth_stats(model), model.config.vocab_size, min(c["b_init"], c["b_target"]),
                      trained=step > 0)
    if broken:
        what, value, limit = broken
        told = (f"eval loss is {losses}" if what == "eval_loss" else
                f"val loss is {value:.4g}, above ln(vocab_size) + {VAL_LOSS_MARGIN:g} = {limit:.4f}"
                if what == "val_loss" else f"b_t fell to {value:.4g}, below min(b_init, b_target) - {B_T_MARGIN:g} = {limit:g}")
        diverged(c, proc, step, saved, what, value, f"{told} at step {step}; stopping without saving ({saved}). Try a "
                                                    f"lower --learning_rate or --grad_clip", limit)


def save_checkpoint(c, proc, model, optimizers, iter_num, best_val_loss, ckpt_path):
    """The run's checkpoint (ckpt_path: ckpt.pt, or ckpt.dcp under FSDP), atomic and verifiable
    (checkpoint.save_run): a crash, a full disk or a second writer leaves the previous one whole."""
    state = {"model_args": asdict(model.config), "pqt": {k: c[k] for k in ckpt_io.PQT_KEYS}, "iter_num": iter_num,
             "best_val_loss": best_val_loss, "config": c,
             # What continues the run exactly besides the model and optimizers: the data
             # order and the noise are functions of (seed, step), and seed is in config;
             # dropout draws from the CPU generator, and on GPUs from the CUDA one.
             "rng_state": torch.get_rng_state()}
    if proc.device_type == "cuda":
        state["cuda_rng_state"] = torch.cuda.get_rng_state(proc.dev)
    if proc.fsdp or proc.master:  # under FSDP every process writes its own shards
        try:
            ckpt_io.save_run(c["out_dir"], state, model, optimizers, sharded=proc.fsdp)
        except ckpt_io.CheckpointError as e:
            fail(f"{e}; the run stops here")
    proc.say(f"saved checkpoint to {ckpt_path}")


def main(argv):
    """Train as the config says. Whatever ends it (a return, ConfigError, any exception), the out_dir
    lock is released here: an exception's traceback would keep this frame, and the lock, alive."""
    with ExitStack() as resources:
        return _main(argv, resources)


def _main(argv, resources):
    # config
    c = dict(DEFAULTS)
    explicit = configure(c, argv)
    validate(c, explicit)
    model_args = config_model_args(c, explicit)
    roles = ROLES.get(model_args.get("arch", "gpt2"), {})
    try:  # a bad method or shape fails now, before data or checkpoints are touched
        kind, _ = gaussws.parse_method(c["method"], roles.values())
        c.update(gaussws.phase_settings(kind, c, explicit))  # pqt_start as a step; b_t's level for target_format
        ModelConfig(**{**model_args, "vocab_size": model_args.get("vocab_size") or 1})
    except (ValueError, TypeError) as e:
        fail(str(e))

    # distributed set-up
    proc = setup_distributed(c)
    if c["dry_run"]:
        return show_dry_run(c, model_args)
    # one run per out_dir: a second one is refused before it reads or writes anything there
    if proc.master:
        resources.enter_context(ckpt_io.lock(c["out_dir"]))  # until main ends; the kernel drops it if we die
        ckpt_io.clean_stale(c["out_dir"])  # the temporary files of a run killed while it wrote them

    # data, and the model at its starting point
    data_dir, meta = open_data(c, proc)
    raw_model, optimizers, (iter_num, best_val_loss, saved_step), forked = build(c, explicit, proc, model_args,
                                                                                 data_dir, meta)
    mconf = raw_model.config
    saved = Saved(ckpt_io.paths(c["out_dir"])[1 if proc.fsdp else 0], saved_step)  # where this run saves
    if saved.step is not None and saved.step >= c["max_iters"] and not c["eval_only"]:
        proc.say(f"{saved.path} is at step {saved.step}, max_iters={c['max_iters']}: the run is complete, nothing "
                 f"to train (raise --max_iters to continue it)")
        if proc.ddp:
            torch.distributed.destroy_process_group()
        return
    train_model = for_training(c, proc, raw_model)
    splits = {s: loader.open_split(data_dir, s, meta, mconf.block_size) for s in ("train", "val")}
    batch_args = dict(batch_size=c["batch_size"], block_size=mconf.block_size, device=proc.dev)
    autocast = loader.autocast_for(c["dtype"], proc.dev)
    tokens_per_iter = c["gradient_accumulation_steps"] * c["batch_size"] * mconf.block_size

    # logging
    versions = {"torch": torch.__version__, "python": sys.version.split()[0]}
    run_info = {**c, "model_args": asdict(mconf), "world_size": proc.world_size, "versions": versions}
    metrics = Metrics(c, proc, run_info, saved, forked)
    proc.say(f"{raw_model.get_num_params(non_embedding=False) / 1e6:.2f}M parameters "
             f"({mconf.arch}, {c['method']}, {len(gaussws.method_layers(raw_model))} converted Linears"
             + (f" from step {c['pqt_start']:.0f}" if c["pqt_start"] else "") + "), "
             f"{tokens_per_iter:,} tokens per step, {proc.world_size} process(es) on {proc.dev}")
    if "unigram_entropy_nats" in meta:
        proc.say(f"unigram entropy of the corpus: {meta['unigram_entropy_nats']:.4f} nats/token "
                 f"(the loss of a model that ignores context)")

    # the loop
    micro_batch = lambda it, micro: loader.get_batch(  # noqa: E731
        splits["train"], (c["seed"], "train", it, proc.rank * proc.local_accum + micro), **batch_args)
    batch = micro_batch(iter_num, 0)
    t0, timed_steps = time.time(), 0
    while True:
        lr = get_lr(iter_num, c)
        for group in (g for o in optimizers for g in o.param_groups):
            group["lr"] = lr
        evaluate_now = iter_num % c["eval_interval"] == 0 or iter_num == c["max_iters"]
        if c["eval_only"] or evaluate_now and iter_num != saved.step:  # the resumed step was evaluated and saved before
            losses = evaluate(c, proc, raw_model, splits, iter_num, metrics, autocast=autocast, **batch_args)
            if c["eval_only"]:
                break
            check_sane(c, proc, raw_model, losses, iter_num, saved)  # at every evaluation, before any save
            if c["save_checkpoints"] and iter_num > 0 and (losses["val"] < best_val_loss or c["always_save_checkpoint"]):
                best_val_loss = min(best_val_loss, losses["val"])
                save_checkpoint(c, proc, raw_model, optimizers, iter_num, best_val_loss, saved.path)
                saved.step = iter_num
            t0, timed_steps = time.time(), 0  # evaluation is not training time
        if iter_num >= c["max_iters"]:
            break

        # one optimizer step (step.py): gaussws.TrainStep around the micro-steps, the clipped
        # gradient, the finite check, the update
        try:
            step_loss, _, batch = train_step(raw_model, optimizers, iter_num, batch, micro_batch, proc.local_accum,
                                             forward=train_model, autocast=autocast, grad_clip=c["grad_clip"],
                                             bitwidth_lambda=c["bitwidth_lambda"])
        except NonFinite as e:
            diverged(c, proc, iter_num, saved, e.what, e.value, f"{e} at step {iter_num}; stopping before the update "
                                                                f"({saved}). Try a lower --learning_rate or --grad_clip")
        iter_num += 1
        timed_steps += 1
        if iter_num % c["log_interval"] == 0 or iter_num == c["max_iters"]:
            dt = (time.time() - t0) / timed_steps
            t0, timed_steps = time.time(), 0
            record = {"iter": iter_num, "loss": step_loss, "lr": lr, "ms_per_iter": 1000 * dt,
                      "tokens_per_s": tokens_per_iter / dt}
            stats = gaussws.bitwidth_stats(raw_model)
            if stats:
                record.update({f"b_t/{k}": v for k, v in stats.items()})
            metrics.log(record)
            bits = f", b_t {stats['mean']:.2f} [{stats['min']:.2f}, {stats['max']:.2f}]" if stats else ""
            proc.say(f"iter {iter_num}: loss {step_loss:.4f}, lr {lr:.2e}, {1000 * dt:.0f} ms/iter, "
                     f"{tokens_per_iter / dt:,.0f} tokens/s{bits}", flush=True)
    if proc.ddp:
        torch.distributed.destroy_process_group()
        if proc.fsdp:
            # fully_shard keeps the gloo process group referenced from C++, so destroy_process_group
            # cannot free it: its two worker threads and its TCP loop thread stay alive through the
            # interpreter's teardown and exit()'s C++ static destructors. A native thread that needs
            # the GIL then is ended by CPython with pthread_exit, and unwinding through a noexcept
            # destructor aborts ("terminate called without an active exception"): the likely cause
            # of the random SIGABRT of 2-process FSDP runs. Everything is written and flushed by
            # now, so the process ends without that teardown.
            metrics.close()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


if __name__ == "__main__":
    sys.exit(cli(main))
