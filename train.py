"""Train GPT2 or Llama2 with pseudo-quantization training of chosen Linear layers.

Single process (CPU or one GPU):
    python train.py                                   # small gaussws[all] GPT2 on the default corpus
    python train.py config/gpt2_gaussws_od.py --batch_size=8
Data parallel, one node of 8 GPUs (gloo on CPU, nccl on CUDA):
    torchrun --standalone --nproc_per_node=8 train.py config/gpt2_gaussws_od.py
Several nodes, e.g. 2 x 8 GPUs (run on each node, --node_rank=0 on the master):
    torchrun --nproc_per_node=8 --nnodes=2 --node_rank=0 --master_addr=10.0.0.1 --master_port=29500 train.py ...

It reads top to bottom: config, distributed set-up, data, model, optimizer, loop. Every run is
reproducible from its seed: the batches of step i are a function of (seed, i) and the noise of
step i a function of (seed, layer, i), so a resumed run repeats an uninterrupted one exactly,
and the global batch (and so the loss) does not depend on the number of processes.
"""
import ctypes
import hashlib
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, fields

import numpy as np
import torch

import gaussws
from configurator import ConfigError, configure
from model import GPT, PRESETS, ModelConfig

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
init_from = "scratch"  # "scratch" or "resume" (from out_dir/ckpt.pt)
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
method = "gaussws[all]"  # PQT method and layers: bf16, gaussws[all], gaussws[od], diffq[all], ...
b_init = 6.0  # b_t at initialisation (Eq. 11)
b_target = 4.0  # b_t that weight decay on b_i pulls toward (Eq. 11)
recompute_w_hat = False  # keep no w_hat for the backward, make it again there: less memory, more time
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
dtype = "bfloat16"  # autocast dtype of matmuls: "bfloat16" or "float32" (no autocast)
compile = False  # torch.compile the model
seed = 1337  # one seed for init, data order and noise; shared by all processes
parallel = "ddp"  # how torchrun processes share the work: "ddp" (replicated) or "fsdp" (FSDP2, sharded)
# -----------------------------------------------------------------------------------------------
DEFAULTS = {k: v for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, bool, str))}
MODEL_KEYS = [f.name for f in fields(ModelConfig)]


def fail(msg):
    raise ConfigError(msg)


def keep_freed_cpu_memory():
    """Make glibc keep freed memory for reuse instead of returning it to the OS.

    By default every tensor over 32 MB is a fresh mmap, so each CPU step page-faults (and the kernel
    zeroes) its activations and logits again: a large part of a GPT2-124M step on our 2-core CPU,
    and of its step-to-step jitter. The process then keeps its peak memory, as the CUDA
    caching allocator does on GPUs. Returns False (and changes nothing) where libc has no mallopt.
    """
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's malloc.h
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS, Windows, ...)
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def read_meta(data_dir):
    meta_path = os.path.join(data_dir, "meta.json")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        meta["vocab_size"] = int(meta["vocab_size"])
    except FileNotFoundError:
        fail(f"{meta_path} not found; prepare the data first: python {os.path.join(data_dir, 'prepare.py')}")
    except (ValueError, KeyError, TypeError) as e:
        fail(f"{meta_path} is corrupt ({type(e).__name__}: {e}); run python {os.path.join(data_dir, 'prepare.py')} again")
    return meta


def open_split(data_dir, split, meta, block_size):
    path = os.path.join(data_dir, f"{split}.bin")
    dt = np.dtype(meta.get("dtype", "uint16"))
    if not os.path.exists(path):
        fail(f"{path} not found; prepare the data first: python {os.path.join(data_dir, 'prepare.py')}")
    size = os.path.getsize(path)
    if size % dt.itemsize or size // dt.itemsize <= block_size + 1:
        fail(f"{path} is corrupt or too short ({size} bytes of {dt.name} for block_size {block_size}); "
             f"run python {os.path.join(data_dir, 'prepare.py')} again")
    return np.memmap(path, dtype=dt, mode="r")


def batch_generator(*key):
    """A torch.Generator seeded by a tuple: the sampler's state is the step, nothing to save.

    blake2b rather than hash(): str hashes differ between processes (PYTHONHASHSEED)."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def get_state(model, optimizers, fsdp):
    """Full (unsharded) model and optimizer state dicts, on CPU under FSDP."""
    if not fsdp:
        return model.state_dict(), [o.state_dict() for o in optimizers]
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return (get_model_state_dict(model, options=options),
            [get_optimizer_state_dict(model, o, options=options) for o in optimizers])


def load_state(model, optimizers, checkpoint, fsdp):
    if len(checkpoint["optimizer"]) != len(optimizers):
        fail(f"the checkpoint has {len(checkpoint['optimizer'])} optimizer state(s), this run {len(optimizers)}: "
             f"resume with the optimizer it was trained with")
    if not fsdp:
        model.load_state_dict(checkpoint["model"])
        for o, state in zip(optimizers, checkpoint["optimizer"]):
            o.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, checkpoint["model"], options=options)
    for o, state in zip(optimizers, checkpoint["optimizer"]):
        set_optimizer_state_dict(model, o, state, options=options)


def main(argv):
    config = dict(DEFAULTS)
    explicit = configure(config, argv)
    globals().update(config)
    if init_from not in ("scratch", "resume"):
        fail(f"init_from={init_from!r}: expected 'scratch' or 'resume'")
    if dtype not in ("bfloat16", "float32"):
        fail(f"dtype={dtype!r}: expected 'bfloat16' or 'float32'")
    if optimizer not in ("adamw", "adam_mini"):
        fail(f"optimizer={optimizer!r}: expected 'adamw' or 'adam_mini'")
    if parallel not in ("ddp", "fsdp"):
        fail(f"parallel={parallel!r}: expected 'ddp' or 'fsdp'")
    if model and model not in PRESETS:
        fail(f"model={model!r} is not a preset; expected one of {', '.join(PRESETS)} or '' (set the shape by hand)")
    if min(batch_size, gradient_accumulation_steps, max_iters + 1, eval_iters) < 1:
        fail("batch_size, gradient_accumulation_steps and eval_iters must be >= 1, max_iters >= 0")

    # the model's shape: ModelConfig's defaults < the preset < this file's defaults where no preset < the user's keys
    data_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", dataset)  # a path stays a path
    model_args = dict(PRESETS[model]) if model else {}
    for k in MODEL_KEYS:
        if k in config and (k in explicit or not model):
            model_args[k] = config[k]
    for k, zero_means in (("n_kv_head", None), ("ffn_hidden", None)):
        if model_args.get(k) == 0:
            model_args[k] = zero_means
    if model_args.get("block_size", 0) == 0:
        model_args.pop("block_size", None)
    try:  # a bad method or shape fails now, before data or checkpoints are touched
        ModelConfig(**{**model_args, "vocab_size": model_args.get("vocab_size") or 1})
    except (ValueError, TypeError) as e:
        fail(str(e))

    # distributed set-up
    ddp = int(os.environ.get("RANK", -1)) != -1
    if ddp:
        dist_backend = "nccl" if device.startswith("cuda") else "gloo"
        torch.distributed.init_process_group(backend=dist_backend)
        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        local_rank = int(os.environ["LOCAL_RANK"])
        dev = f"cuda:{local_rank}" if device.startswith("cuda") else device
        if dev.startswith("cuda"):
            torch.cuda.set_device(dev)
        if gradient_accumulation_steps % world_size:
            fail(f"gradient_accumulation_steps={gradient_accumulation_steps} must be a multiple of the "
                 f"{world_size} processes: it counts micro-steps of all processes together")
    else:
        rank, world_size, local_rank, dev = 0, 1, 0, device
    master = rank == 0
    local_accum = gradient_accumulation_steps // world_size
    device_type = "cuda" if dev.startswith("cuda") else "cpu"
    if device_type == "cpu":
        keep_freed_cpu_memory()
    ptdtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    autocast = nullcontext() if dtype == "float32" else torch.autocast(device_type=device_type, dtype=ptdtype)
    tokens_per_iter = gradient_accumulation_steps * batch_size * model_args.get("block_size", block_size)

    if dry_run:
        if "vocab_size" not in model_args or not model_args["vocab_size"]:
            model_args["vocab_size"] = 50304 if model_args.get("arch", "gpt2") == "gpt2" else 32000
        with torch.device("meta"):
            m = GPT(ModelConfig(**model_args))
        print(json.dumps({**config, "model_args": asdict(m.config)}, indent=1))
        print(f"parameters: {m.get_num_params(non_embedding=False):,} ({m.get_num_params(non_embedding=False) / 1e6:.1f}M)"
              f" + {m.get_num_bitwidth_params():,} b_i")
        print(f"tokens per optimizer step: {tokens_per_iter:,}")
        return

    # data
    if dataset == "default" and not os.path.exists(os.path.join(data_dir, "meta.json")):
        if master:
            print("preparing the default corpus (Python's standard library) ...")
            sys.path.insert(0, data_dir)
            import prepare as default_prepare
            default_prepare.prepare(data_dir)
        if ddp:
            torch.distributed.barrier()
    meta = read_meta(data_dir)
    if not model_args.get("vocab_size"):
        model_args["vocab_size"] = meta["vocab_size"]
    if meta["vocab_size"] > model_args["vocab_size"]:
        fail(f"the data in {data_dir} has a vocabulary of {meta['vocab_size']} tokens ({meta.get('tokenizer')}), more "
             f"than the model's vocab_size={model_args['vocab_size']}; prepare the data with a tokenizer of at most "
             f"that many tokens, or pass --vocab_size={64 * -(-meta['vocab_size'] // 64)}")
    ckpt_path = os.path.join(out_dir, "ckpt.pt")

    # model
    checkpoint = None
    if init_from == "resume":
        if not os.path.exists(ckpt_path):
            fail(f"init_from=resume but {ckpt_path} does not exist; start with --init_from=scratch")
        try:
            checkpoint = torch.load(ckpt_path, map_location=dev, weights_only=True)
            saved_args = checkpoint["model_args"]
        except Exception as e:
            fail(f"{ckpt_path} is not a checkpoint this code can read ({type(e).__name__}); "
                 f"start a new run with --init_from=scratch --out_dir=<new dir>")
        wanted = asdict(ModelConfig(**model_args))
        diff = [f"{k}: checkpoint {saved_args.get(k)!r}, config {v!r}" for k, v in wanted.items() if saved_args.get(k) != v]
        if diff:
            fail(f"{ckpt_path} holds another model ({'; '.join(diff)}); resume with the settings it was trained "
                 f"with, or use another --out_dir")
        model_args = saved_args
    elif os.path.exists(ckpt_path) and not overwrite:
        fail(f"{ckpt_path} holds another run; resume it with --init_from=resume, choose another --out_dir, "
             f"or pass --overwrite=True to replace it")
    torch.manual_seed(seed)
    mconf = ModelConfig(**model_args)
    raw_model = GPT(mconf).to(dev)
    gaussws.set_noise_seed(raw_model, seed)
    fsdp = ddp and parallel == "fsdp"
    # Step mode (gaussws.begin_step): w_hat once per optimizer step, kept for all its micro-steps.
    # Not under FSDP, where weights are whole only inside a block's forward, nor when w_hat is
    # recomputed to save its memory; there every forward makes w_hat and every backward does Eq. 4.
    step_mode = not fsdp and not recompute_w_hat
    for layer in gaussws.pqt_layers(raw_model):
        layer.recompute = recompute_w_hat
    if fsdp:
        # FSDP2: each block's parameters are gathered whole for its forward, so PQTLinear adds the
        # noise to the unsharded weight, and the block max sees every element of its block.
        from torch.distributed.fsdp import fully_shard
        for block in raw_model.transformer.h:
            fully_shard(block)
        fully_shard(raw_model)

    # optimizers: b_i always in an AdamW group of its own, with its own weight decay
    named = [(pn, p) for pn, p in raw_model.named_parameters() if p.requires_grad]
    b_i = [p for pn, p in named if pn.endswith("b_i")]
    named = [(pn, p) for pn, p in named if not pn.endswith("b_i")]
    extra = dict(fused=True) if device_type == "cuda" else dict(foreach=not fsdp)
    if optimizer == "adamw":
        groups = [dict(params=[p for _, p in named if p.dim() >= 2], weight_decay=weight_decay),
                  dict(params=[p for _, p in named if p.dim() < 2], weight_decay=0.0)]
        if b_i:
            groups.append(dict(params=b_i, weight_decay=bitwidth_weight_decay))
        optimizers = [torch.optim.AdamW(groups, lr=learning_rate, betas=(beta1, beta2), **extra)]
    else:
        from adam_mini import Adam_mini
        mini = Adam_mini(named, lr=learning_rate, betas=(beta1, beta2), weight_decay=weight_decay, dim=mconf.n_embd,
                         n_heads=mconf.n_head, n_kv_heads=mconf.n_kv_head, verbose=False)
        # Adam-mini finds its blocks by name: teach it ours (one lr per head for q and k, and for
        # GPT2's fused c_attn; one per neuron for v and the output projections).
        mini.wqk_names.update({"attn.q.", "attn.k.", "attn.c_attn."})
        mini.wv_names.add("attn.v.")
        mini.attn_proj_names.update({"attn.out.", "attn.c_proj."})
        optimizers = [mini]
        if b_i:
            optimizers.append(torch.optim.AdamW([dict(params=b_i, weight_decay=bitwidth_weight_decay)],
                                                lr=learning_rate, betas=(beta1, beta2), **extra))
    iter_num, best_val_loss = 0, 1e9
    if checkpoint is not None:
        load_state(raw_model, optimizers, checkpoint, fsdp)
        iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
        torch.set_rng_state(checkpoint["rng_state"].cpu())
    checkpoint = None

    train_model = torch.compile(raw_model) if compile else raw_model
    if ddp and not fsdp:
        if step_mode:
            # Step mode gives b_i its gradient after DDP's all-reduce (gaussws.end_step), from the
            # averaged weight gradient: the same on every rank, so DDP must not wait for it.
            torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                raw_model, [pn for pn, _ in raw_model.named_parameters() if pn.endswith("b_i")])
        train_model = torch.nn.parallel.DistributedDataParallel(train_model, device_ids=[local_rank] if device_type == "cuda" else None)

    splits = {s: open_split(data_dir, s, meta, mconf.block_size) for s in ("train", "val")}
    T = mconf.block_size

    def get_batch(split, *key):
        data = splits[split]
        ix = torch.randint(len(data) - T - 1, (batch_size,), generator=batch_generator(seed, split, *key))
        x = torch.stack([torch.from_numpy(data[i:i + T].astype(np.int64)) for i in ix.tolist()])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + T].astype(np.int64)) for i in ix.tolist()])
        if device_type == "cuda":
            return x.pin_memory().to(dev, non_blocking=True), y.pin_memory().to(dev, non_blocking=True)
        return x.to(dev), y.to(dev)

    def all_mean(values):
        t = torch.tensor(values, dtype=torch.float64, device=dev)
        if ddp:
            torch.distributed.all_reduce(t)
            t /= world_size
        return t.tolist()

    @torch.no_grad()
    def estimate_loss():
        """Train and val loss with the noise off, on fixed batches, shared out over the processes."""
        raw_model.eval()
        out = {}
        for split in ("train", "val"):
            total, count = 0.0, 0
            # The same number of batches on every rank (FSDP forwards are collective); batches
            # past eval_iters count zero, so the val set does not depend on the world size.
            for k in range(rank, -(-eval_iters // world_size) * world_size, world_size):
                x, y = get_batch(split, "eval", k)
                with autocast:
                    _, loss = raw_model(x, y)
                if k < eval_iters:
                    total, count = total + loss.item(), count + 1
            total, count = all_mean([total, count])
            out[split] = total / count
        raw_model.train()
        return out

    def get_lr(it):
        if not decay_lr:
            return learning_rate
        if it < warmup_iters:
            return learning_rate * (it + 1) / (warmup_iters + 1)
        if it > lr_decay_iters:
            return min_lr
        ratio = (it - warmup_iters) / max(1, lr_decay_iters - warmup_iters)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)

    def save_checkpoint():
        model_state, optimizer_states = get_state(raw_model, optimizers, fsdp)  # collective under FSDP
        if not master:
            return
        state = {
            "model": model_state,
            "optimizer": optimizer_states,
            "model_args": asdict(mconf),
            "iter_num": iter_num,
            "best_val_loss": best_val_loss,
            "config": config,
            # What continues the run exactly besides the above: the data order and the noise
            # are functions of (seed, step), and seed is in config; dropout draws from this.
            "rng_state": torch.get_rng_state(),
        }
        tmp = ckpt_path + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, ckpt_path)  # atomic: a crash leaves the previous checkpoint whole

    versions = {"torch": torch.__version__, "python": sys.version.split()[0]}
    if master:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump({**config, "model_args": asdict(mconf), "world_size": world_size, "versions": versions}, f, indent=1)
        print(f"{raw_model.get_num_params(non_embedding=False) / 1e6:.2f}M parameters "
              f"({mconf.arch}, {mconf.method}, {len(gaussws.pqt_layers(raw_model))} PQT layers), "
              f"{tokens_per_iter:,} tokens per step, {world_size} process(es) on {dev}")
        if "unigram_entropy_nats" in meta:
            print(f"unigram entropy of the corpus: {meta['unigram_entropy_nats']:.4f} nats/token "
                  f"(the loss of a model that ignores context)")
    if wandb_log and master:
        import wandb
        wandb.init(project=wandb_project, name=wandb_run_name, mode=wandb_mode, dir=out_dir,
                   config={**config, "model_args": asdict(mconf), "world_size": world_size, "versions": versions})
    metrics_file = open(os.path.join(out_dir, "metrics.jsonl"), "a") if master else None

    def log(record):
        if master:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
            if wandb_log:
                wandb.log(record, step=record["iter"])

    # the loop
    t0 = time.time()
    while True:
        lr = get_lr(iter_num)
        for group in (g for o in optimizers for g in o.param_groups):
            group["lr"] = lr
        if iter_num % eval_interval == 0 or iter_num == max_iters or eval_only:
            losses = estimate_loss()
            record = {"iter": iter_num, "train/loss": losses["train"], "val/loss": losses["val"]}
            if master:
                print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            log(record)
            if wandb_log:  # the distribution of b_t in every PQT layer (collective under FSDP)
                hists = {f"b_t/{name}": layer.full_b_t().detach().float().cpu().flatten().numpy()
                         for name, layer in raw_model.named_modules() if isinstance(layer, gaussws.PQTLinear)}
                if master and hists:
                    wandb.log({k: wandb.Histogram(v) for k, v in hists.items()}, step=iter_num)
            if eval_only:
                break
            if save_checkpoints and iter_num > 0 and (losses["val"] < best_val_loss or always_save_checkpoint):
                best_val_loss = min(best_val_loss, losses["val"])
                save_checkpoint()
                if master:
                    print(f"saved checkpoint to {ckpt_path}")
            t0 = time.time()  # evaluation is not training time
        if iter_num == max_iters:
            break

        # This step's noise, the same for all its micro-steps
        if step_mode:
            gaussws.begin_step(raw_model, iter_num)
        else:
            gaussws.set_step(raw_model, iter_num)
        step_loss = 0.0
        for micro_step in range(local_accum):
            if ddp:
                train_model.require_backward_grad_sync = micro_step == local_accum - 1
            x, y = get_batch("train", iter_num, rank * local_accum + micro_step)
            with autocast:
                _, loss = train_model(x, y)
                if bitwidth_lambda:
                    loss = loss + bitwidth_lambda * gaussws.bitwidth_loss(raw_model)
            step_loss += loss.item() / local_accum
            (loss / local_accum).backward()
        if step_mode:
            gaussws.end_step(raw_model)  # Eq. 4 once, on the accumulated (and all-reduced) gradient
        (step_loss,) = all_mean([step_loss])
        if not math.isfinite(step_loss):
            kept = f"the last good checkpoint is {ckpt_path}" if os.path.exists(ckpt_path) else "no checkpoint was written"
            fail(f"loss is {step_loss} at step {iter_num}; stopping before the update ({kept}). "
                 f"Try a lower --learning_rate or --grad_clip")
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(raw_model.parameters(), grad_clip)
        for o in optimizers:
            o.step()
            o.zero_grad(set_to_none=True)
        iter_num += 1
        if iter_num % log_interval == 0 or iter_num == max_iters:
            dt = (time.time() - t0) / (log_interval if iter_num % log_interval == 0 else iter_num % log_interval)
            t0 = time.time()
            record = {"iter": iter_num, "loss": step_loss, "lr": lr, "ms_per_iter": 1000 * dt,
                      "tokens_per_s": tokens_per_iter / dt}
            stats = gaussws.bitwidth_stats(raw_model)
            if stats:
                record.update({f"b_t/{k}": v for k, v in stats.items()})
            log(record)
            if master:
                bits = f", b_t {stats['mean']:.2f} [{stats['min']:.2f}, {stats['max']:.2f}]" if stats else ""
                print(f"iter {iter_num}: loss {step_loss:.4f}, lr {lr:.2e}, {1000 * dt:.0f} ms/iter, "
                      f"{tokens_per_iter / dt:,.0f} tokens/s{bits}", flush=True)
    if ddp:
        torch.distributed.destroy_process_group()
        if fsdp:
            # fully_shard keeps the gloo process group referenced from C++, so destroy_process_group
            # cannot free it: its two worker threads and its TCP loop thread stay alive through the
            # interpreter's teardown and exit()'s C++ static destructors. A native thread that needs
            # the GIL then is ended by CPython with pthread_exit, and unwinding through a noexcept
            # destructor aborts ("terminate called without an active exception"): the likely cause
            # of the random SIGABRT of 2-process FSDP runs. Everything is written and flushed by
            # now, so the process ends without that teardown.
            if wandb_log and master:
                wandb.finish()
            if metrics_file:
                metrics_file.close()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
