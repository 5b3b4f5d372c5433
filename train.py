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
and its optimizers (build: the model built plain, converted, sharded, the optimizers, the state it
continues), logging, and the loop with its decisions (evaluate, check, save, stop). The functions
above _main are its named steps, in the order it takes them; the method's phases and the format it
trains toward are phases.py's, the optimizer step and the checks of the model step.py's, the run
directory's rules (resume, fork, records) checkpoint.py's.

Every run is reproducible from its seed: the initial weights do not depend on the method (the model
is built plain, then gaussws.convert swaps Linears without drawing random numbers), the batches of
step i are a function of (seed, i) and the noise of step i a function of (seed, layer, i), so a
resumed run repeats an uninterrupted one exactly. The global batch, gradient_accumulation_steps
micro-batches of batch_size sequences, is the same on any number of processes (share_out), and so
is the loss.

`python train.py --help` lists every key below with its default and comment. What the run prints,
and what it records in metrics.jsonl, is progress.py's.
"""
import json
import os
import shlex
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict
from types import SimpleNamespace

import torch

import checkpoint as ckpt_io
import configurator
import gaussws
import phases
import progress
from configurator import ConfigError, configure
from data import loader
from files import pretrained
from model import GPT, PRESETS, ROLES, ModelConfig, shape_args
from step import Diverging, NonFinite, check_sane, get_lr, schedule_notes, share_out, train_step
from util import cli, cpu_id, git_commit, keep_freed_cpu_memory, machine

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
gradient_accumulation_steps = 1  # micro-steps per optimizer step, shared out over torchrun's processes
batch_size = 32  # sequences per micro-step (split over processes where the micro-steps cannot be)
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
target_format = ""  # format trained toward (int3, mxfp4, q4_k, ...): ste's grid, or b_t's level for gaussws/diffq
bits_per_weight = 0.0  # budget: auto-int/error-int mix int2-4 per block, auto-gguf/error-gguf GGML types per tensor
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
lr_decay_iters = 0  # the step where the cosine ends; 0: max_iters
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


def fail(msg):
    raise ConfigError(msg)


EXIT_DIVERGED = 3


class Diverged(ConfigError):
    """The run stopped because it diverged (a result of its settings, not bad input): one line,
    exit status EXIT_DIVERGED, and out_dir/diverged.json names the step and what went wrong."""

    exit_status = EXIT_DIVERGED


# --- config ------------------------------------------------------------------------------------------

def validate(c, explicit):
    """Refuse a bad config before anything is built or written: one line naming the key, the value
    and what is accepted (configurator's checks)."""
    configurator.check_set(c, DEFAULTS)
    configurator.check_choices(c, dict(dtype=("bfloat16", "float32"), optimizer=("adamw", "adam_mini"),
                                       parallel=("ddp", "fsdp"), wandb_mode=("online", "offline", "disabled"),
                                       arch=("gpt2", "llama2")))
    if c["init_from"] == "":
        fail("init_from='': expected 'scratch', 'resume', or a ckpt.pt or an out_dir holding one")
    if not c["out_dir"]:
        fail("out_dir='': give the directory the run's checkpoint and records go to, e.g. --out_dir=out")
    if c["fork_from"] and c["init_from"] not in ("scratch", "resume"):  # resume: the fork's own checkpoint
        fail(f"fork_from starts a new run from {c['fork_from']}: it goes with --init_from=scratch, not "
             f"{c['init_from']!r}")
    if c["model"] and c["model"] not in PRESETS:
        fail(f"model={c['model']!r} is not a preset; expected one of {', '.join(PRESETS)} or '' (set the shape by "
             f"hand)")
    at_least = dict(batch_size=1, gradient_accumulation_steps=1, eval_iters=1, eval_interval=1, log_interval=1,
                    max_iters=0, warmup_iters=0, lr_decay_iters=0, n_kv_head=0, ffn_hidden=0, vocab_size=0)
    if not c["model"] or any(k in explicit for k in ("n_layer", "n_head", "n_embd")):
        at_least.update(n_layer=1, n_head=1, n_embd=1)  # with a preset, only the keys the user sets
    configurator.check_at_least(c, at_least)
    if c["block_size"] < 0 or c["block_size"] == 0 and not c["model"]:
        fail(f"block_size={c['block_size']}: expected an integer >= 1 (0 takes the --model preset's, and none is set)")
    configurator.check_numbers(c, ("learning_rate", "min_lr", "weight_decay", "bitwidth_weight_decay",
                                   "bitwidth_lambda"))
    if not c["grad_clip"] >= 0:
        fail(f"grad_clip={c['grad_clip']}: expected a number >= 0 (the largest gradient norm; 0 disables clipping)")
    configurator.check_numbers(c, ("beta1", "beta2", "dropout"), below=1)
    if not 0 <= c["seed"] < 2**63:
        fail(f"seed={c['seed']}: expected an integer in [0, 2^63)")
    configurator.check_device(c)
    if not c["dry_run"]:
        ckpt_io.check_out_dir(c["out_dir"])


def read_config(argv):
    """(config, the keys set, model_args, notes to say at the start) of the command line, checked
    before anything is built or written (validate, share_out), lr_decay_iters resolved. Under
    torchrun only rank 0 says what is wrong; the others leave quietly (status 0), since torchrun
    stops every process once one fails, maybe before rank 0 has said why."""
    c = dict(DEFAULTS)
    try:
        explicit = configure(c, argv)
        validate(c, explicit)
        share_out(c["gradient_accumulation_steps"], c["batch_size"], int(os.environ.get("WORLD_SIZE", 1)), 0)
        model_args = shape_args(c, explicit)
        notes = phases.resolve(c, explicit, model_args)  # the switches as steps, b_t's level, lr_decay_iters
    except ConfigError:
        if int(os.environ.get("RANK", 0)):
            raise SystemExit(0) from None
        raise
    return c, explicit, model_args, schedule_notes(c) + notes


# --- set-up ----------------------------------------------------------------------------------------

def setup_distributed(c):
    """This process among those torchrun started (RANK set), or alone: a namespace of ddp, fsdp, rank,
    world_size, local_rank, master (rank 0), dev, device_type, first_micro, local_accum and rows
    (this process's micro-steps of each optimizer step and rows of each micro-batch: share_out) and
    say (print on rank 0)."""
    ddp = int(os.environ.get("RANK", -1)) != -1
    if ddp:
        torch.distributed.init_process_group(backend="nccl" if c["device"].startswith("cuda") else "gloo")
        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        local_rank = int(os.environ["LOCAL_RANK"])
        dev = f"cuda:{local_rank}" if c["device"].startswith("cuda") else c["device"]
        if dev.startswith("cuda"):
            torch.cuda.set_device(dev)
    else:
        rank, world_size, local_rank, dev = 0, 1, 0, c["device"]
    device_type = "cuda" if dev.startswith("cuda") else "cpu"
    if device_type == "cpu":
        keep_freed_cpu_memory()
    first_micro, local_accum, rows = share_out(c["gradient_accumulation_steps"], c["batch_size"], world_size, rank)
    return SimpleNamespace(ddp=ddp, fsdp=ddp and c["parallel"] == "fsdp", rank=rank, world_size=world_size,
                           local_rank=local_rank, master=rank == 0, dev=dev, device_type=device_type,
                           first_micro=first_micro, local_accum=local_accum, rows=rows,
                           say=print if rank == 0 else lambda *args, **kwargs: None)  # print on rank 0


def show_dry_run(c, model_args, notes):
    """Print the resolved config, the model's keys as built (a preset's, not the defaults'), its
    size (built on the meta device: no memory), the notes, and whether the dataset is prepared."""
    data_dir = loader.data_dir(c["dataset"])
    prepared = os.path.exists(os.path.join(data_dir, "meta.json"))
    guessed = not model_args.get("vocab_size") and not prepared
    if not model_args.get("vocab_size"):  # the dataset's where it is prepared, else GPT-2's or Llama 2's
        model_args["vocab_size"] = (loader.read_meta(data_dir)["vocab_size"] if prepared else
                                    50304 if model_args.get("arch", "gpt2") == "gpt2" else 32000)
    with torch.device("meta"):
        m = gaussws.convert(GPT(ModelConfig(**model_args)), c["method"], ROLES[model_args.get("arch", "gpt2")],
                            **phases.method_args(c))
    built = asdict(m.config)
    print(json.dumps({**c, **{k: v for k, v in built.items() if k in c}, "model_args": built}, indent=1))
    print(f"parameters: {m.get_num_params(non_embedding=False):,} ({m.get_num_params(non_embedding=False) / 1e6:.1f}M)"
          f" + {m.get_num_bitwidth_params():,} b_i")
    print(f"tokens per optimizer step: {c['gradient_accumulation_steps'] * c['batch_size'] * m.config.block_size:,}")
    for line in notes:
        print(line)
    if not prepared:
        print(f"dataset {c['dataset']!r} is not prepared yet ({data_dir} has no meta.json): "
              f"{loader.prepare_hint(data_dir)}" + ("; a run prepares it itself" if c["dataset"] == "default" else "")
              + (f"; vocab_size={built['vocab_size']} assumed until then" if guessed else ""))


# --- the starting point: scratch, resume, a fork, or another run's (or a pretrained model's) weights --

def starting_point(c, explicit, model_args, meta):
    """(model_args, checkpoint, init_state) for init_from: the checkpoint to continue (this run's, to
    resume; a bf16 run's, to fork from), or the state dict a new run starts from (a path), with the
    architecture each implies. The run directory's rules are checkpoint.py's (resume, check_new,
    read_fork)."""
    if c["init_from"] == "resume":
        checkpoint = ckpt_io.resume(c["out_dir"], {**model_args, "vocab_size": model_args.get("vocab_size")
                                                   or meta["vocab_size"]}, c)
        return checkpoint["model_args"], checkpoint, None
    ckpt_io.check_new(c["out_dir"], c["overwrite"])
    if c["fork_from"]:
        checkpoint = ckpt_io.read_fork(c["fork_from"], c)
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
    ckpt.dcp, or an out_dir holding one), a Hugging Face model directory, or a GPT-2 of the hub
    (nanoGPT's init_from names). requested: the shape keys the user set (a pretrained GPT-2's
    block_size may shrink, pretrained.fit_pretrained)."""
    path = ckpt_io.find(init_from)
    if os.path.isfile(os.path.join(init_from, "config.json")) and not path or (
            not os.path.exists(init_from) and init_from in pretrained.GPT2_HUB):
        source = f"init_from={init_from}"
        return pretrained.fit_pretrained(*pretrained.load_pretrained(init_from), requested, source=source)
    if not path or not os.path.exists(path):
        missing = "" if os.path.exists(init_from) else " (no such file or directory)"
        fail(f"init_from={init_from!r}{missing}: expected 'scratch', 'resume', a ckpt.pt or an out_dir holding one, "
             f"a Hugging Face model directory, or one of {', '.join(pretrained.GPT2_HUB)}")
    if os.path.realpath(path) in map(os.path.realpath, ckpt_io.paths(out_dir)):
        fail(f"init_from={init_from!r} is this run's own checkpoint: continue it with --init_from=resume, "
             f"or write the new run to another --out_dir")
    checkpoint = ckpt_io.read(path)
    return checkpoint["model_args"], checkpoint["model"]


def build(c, explicit, proc, model_args, data_dir, meta):
    """The model and its optimizers at the run's starting point (starting_point): the model built
    plain from the seed, then converted (the same initial weights whatever the method), sharded under
    FSDP, the optimizers, the state of the checkpoint it continues. Returns (model, optimizers,
    (iter_num, best_val_loss, saved_step), forked): saved_step, the step of the checkpoint it
    continues (None for a new run); forked, the path of the one it forks from (or None)."""
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
    try:
        raw_model = gaussws.convert(GPT(mconf), c["method"], roles, recompute=c["recompute_w_hat"],
                                    **phases.method_args(c))
    except ValueError as e:  # another run's (or a pretrained model's) shape: a width the format cannot hold
        fail(str(e))
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

def exported_hint(c):
    """For a run of a PQT or STE method: the line saying that its val losses are its master weights' (noise
    off, no rounding; an STE run's w moves off its grid, so they can lie above the rounded model's) and how to
    measure the model export writes; none for bf16."""
    if c["method"] == "bf16":
        return []
    fmt = c["target_format"] or "auto"
    # repr: export takes the run's own budget only exactly (quant/budget.trained_ggml_types)
    budget = f" --bits_per_weight={c['bits_per_weight']!r}" if c["bits_per_weight"] else ""
    return [f"val losses: of the master weights; the {fmt} model export writes: "
            f"python export.py --out_dir={shlex.quote(c['out_dir'])} --format={fmt}{budget}"]


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


def main(argv):
    """Train as the config says. Whatever ends it (a return, ConfigError, any exception), the out_dir
    lock is released here: an exception's traceback would keep this frame, and the lock, alive."""
    with ExitStack() as resources:
        return _main(argv, resources)


def _main(argv, resources):
    # config, and the distributed set-up
    c, explicit, model_args, notes = read_config(argv)
    proc = setup_distributed(c)
    if c["dry_run"]:
        return show_dry_run(c, model_args, notes)
    # one run per out_dir: a second one is refused before it reads or writes anything there
    if proc.master:
        resources.enter_context(ckpt_io.lock(c["out_dir"]))  # until main ends; the kernel drops it if we die
        ckpt_io.clean_stale(c["out_dir"])  # the temporary files of a run killed while it wrote them

    # data, and the model at its starting point
    data_dir, meta = loader.open_data(c["dataset"], proc.master, torch.distributed.barrier if proc.ddp else None)
    raw_model, optimizers, (iter_num, best_val_loss, saved_step), forked = build(c, explicit, proc, model_args,
                                                                                 data_dir, meta)
    mconf = raw_model.config
    run = ckpt_io.Run(c["out_dir"], saved_step, sharded=proc.fsdp, writer=proc.master)  # where this run saves
    if saved_step is not None and saved_step >= c["max_iters"] and not c["eval_only"]:
        proc.say(f"{run.path} is at step {saved_step}, max_iters={c['max_iters']}: the run is complete, nothing "
                 f"to train (raise --max_iters to continue it)")
        if proc.ddp:
            torch.distributed.destroy_process_group()
        return
    train_model = for_training(c, proc, raw_model)
    splits = {s: loader.open_split(data_dir, s, meta, mconf.block_size) for s in ("train", "val")}
    batch_args = dict(batch_size=c["batch_size"], block_size=mconf.block_size, device=proc.dev)
    autocast = loader.autocast_for(c["dtype"], proc.dev)
    tokens_per_iter = c["gradient_accumulation_steps"] * c["batch_size"] * mconf.block_size
    report = progress.Progress(iter_num, c["max_iters"], tokens_per_iter, progress.flops_per_token(raw_model),
                               progress.device_peak(proc.dev, c["dtype"], proc.world_size))

    # logging
    cuda = proc.device_type == "cuda"
    # the threads, the CPU's family/model and the SIMD level torch's CPU kernels dispatch to too: a CPU run
    # repeats bit for bit on the same code, CPU and thread count (reduction order), and another CPU of the
    # same name (another microarchitecture, another SIMD level) may round otherwise
    versions = {"torch": torch.__version__, "python": sys.version.split()[0], "commit": git_commit(),
                "machine": machine() + (f", {torch.cuda.get_device_name(proc.dev)}" if cuda else ""),
                "threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                "cpu_id": cpu_id()}
    run_info = {**c, "model_args": asdict(mconf), "world_size": proc.world_size, "versions": versions}
    if proc.master and not c["eval_only"]:  # an evaluation leaves the run's record as it is
        run.start(run_info, new=c["init_from"] != "resume", forked=forked)
    metrics = progress.Metrics(c, proc, run, run_info)
    proc.say(f"{raw_model.get_num_params(non_embedding=False) / 1e6:.2f}M parameters "
             f"({mconf.arch}, {c['method']}, {len(gaussws.method_layers(raw_model))} converted Linears"
             + (f" from step {c['pqt_start']:.0f}" if c["pqt_start"] else "") + "), "
             f"{tokens_per_iter:,} tokens per step, {proc.world_size} process(es) on {proc.dev}, each taking "
             f"{proc.local_accum} micro-step(s) of {proc.rows.stop - proc.rows.start} sequences a step")
    if "unigram_entropy_nats" in meta:
        proc.say(f"unigram entropy of the corpus: {meta['unigram_entropy_nats']:.4f} nats/token "
                 f"(the loss of a model that ignores context)")
    for line in [progress.start_line(c["init_from"], c["seed"], saved_step, run.path, forked),
                 progress.dtype_line(c["dtype"], "dtype" in explicit, proc.device_type), *notes]:
        proc.say(line)
    if c["compile"]:
        proc.say("compiling the model (the first steps are slow)")

    # the loop
    micro_batch = lambda it, micro: loader.get_batch(  # noqa: E731
        splits["train"], (c["seed"], "train", it, proc.first_micro + micro), rows=proc.rows, **batch_args)
    batch = micro_batch(iter_num, 0)
    t0, timed_steps = time.time(), 0
    while True:
        lr = get_lr(iter_num, c)
        for group in (g for o in optimizers for g in o.param_groups):
            group["lr"] = lr
        evaluate_now = iter_num % c["eval_interval"] == 0 or iter_num == c["max_iters"]
        # (the step a run resumes from was evaluated and saved before)
        if c["eval_only"] or evaluate_now and iter_num != run.saved_step:
            losses = evaluate(c, proc, raw_model, splits, iter_num, metrics, autocast=autocast, **batch_args)
            report.val[iter_num] = losses["val"]
            if c["eval_only"]:
                break
            try:  # at every evaluation, before any save: a model that is not sane is never kept
                check_sane(raw_model, losses, iter_num, min(c["b_init"], c["b_target"]), proc.ddp, kept=run)
            except Diverging as e:
                raise Diverged(run.diverged(iter_num, e.what, e.value, str(e), e.limit))
            better = losses["val"] < best_val_loss
            if c["save_checkpoints"] and iter_num > 0 and (better or c["always_save_checkpoint"]):
                best_val_loss = min(best_val_loss, losses["val"])
                run.save(raw_model, optimizers, c, iter_num, best_val_loss, proc.dev if cuda else None)
                proc.say(f"saved checkpoint to {run.path}")
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
            raise Diverged(run.diverged(iter_num, e.what, e.value, f"{e} at step {iter_num}; stopping before the "
                                        f"update ({run}). Try a lower --learning_rate or --grad_clip"))
        iter_num += 1
        timed_steps += 1
        report.stepped(iter_num)
        if iter_num % c["log_interval"] == 0 or iter_num == c["max_iters"]:
            dt = (time.time() - t0) / timed_steps
            t0, timed_steps = time.time(), 0
            record = report.record(iter_num, step_loss, lr, dt, gaussws.bitwidth_stats(raw_model))
            metrics.log(record)
            proc.say(report.line(record), flush=True)
    if not c["eval_only"]:
        for line in [*report.summary(iter_num, best_val_loss, proc.dev), *exported_hint(c)]:
            proc.say(line)
    if proc.ddp:
        # DDP's reducer and fully_shard keep the gloo process group referenced from C++, so
        # destroy_process_group cannot free it. Freed in the interpreter's teardown, it joins gloo's
        # threads while holding the GIL that one of them may wait for (to release a finished
        # collective's tensors: a hang, seen under DDP), or they outlive it and abort in a noexcept
        # destructor (the random SIGABRT of FSDP). Everything is written: the process ends without it.
        torch.distributed.destroy_process_group()
        metrics.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    sys.exit(cli(main))
