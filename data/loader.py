"""Batches and evaluation: one home for train.py, export.py and bench.py.

    directory, meta = open_data(dataset)                      # data/<dataset>; meta.json checked against the .bin files
    data = open_split(directory, "train", meta, block_size)
    x, y = get_batch(data, (seed, "train", step, micro), batch_size=B, block_size=T, device=dev)
    losses = estimate_loss(model, {"val": data}, seed=seed, eval_iters=K, ...)   # {split: mean loss}

The batches are functions of their key, nothing else: training micro-step m of step i draws
(seed, "train", i, m), evaluation batch k of a split (seed, split, "eval", k). So a resumed run sees
the batches of an uninterrupted one, any number of processes share out the same global batch, and
export.py evaluates a model on exactly the batches of its run's evaluations.
"""
import hashlib
import os
from contextlib import nullcontext

import numpy as np
import torch

from data.common import DataError, load_meta, prepare_default_if_missing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


def data_dir(dataset):
    """The folder of a dataset: data/<dataset> of this repository (a path stays a path)."""
    return os.path.join(ROOT, "data", dataset)


def open_data(dataset, master=True, barrier=None):
    """(data_dir, meta) of a dataset, meta.json checked against its files (read_meta). The default
    corpus (data.common.prepare_default) is prepared where it is missing, by the master process while
    the others wait at barrier (torch.distributed.barrier under torchrun); two first runs at once: the
    second waits for the first and uses its files. A full disk or an unwritable data/default is one
    line (DataError)."""
    directory = data_dir(dataset)
    if dataset == "default" and not os.path.exists(os.path.join(directory, "meta.json")):
        if master:
            print("preparing the default corpus (Python's standard library) ...")
            prepare_default_if_missing(directory)
        if barrier is not None:
            barrier()
    return directory, read_meta(directory)


def prepare_hint(data_dir):
    """How to (re)make a dataset: its prepare.py where it has one."""
    script = os.path.join(data_dir, "prepare.py")
    if os.path.isfile(script):
        return f"python {os.path.relpath(script) if not os.path.isabs(data_dir) else script}"
    return f"write train.bin, val.bin and meta.json into {data_dir} (it has no prepare.py)"


def read_meta(data_dir, bins=True):
    """meta.json of a prepared dataset, checked against its .bin files unless bins=False
    (data.common.load_meta); an error says how to prepare it."""
    try:
        return load_meta(data_dir, bins=bins)
    except DataError as e:
        raise DataError(f"{e}: {prepare_hint(data_dir)}") from None


def open_split(data_dir, split, meta, block_size):
    """The tokens of split ("train" or "val") as a read-only memmap, checked to hold whole tokens and
    more than one window of block_size + 1."""
    path = os.path.join(data_dir, f"{split}.bin")
    dt = np.dtype(meta.get("dtype", "uint16"))
    if not os.path.exists(path):
        raise DataError(f"{path} not found; prepare the data first: {prepare_hint(data_dir)}")
    size = os.path.getsize(path)
    if size % dt.itemsize:
        raise DataError(f"{path} is corrupt ({size} bytes, not a whole number of {dt.name} tokens); prepare the data "
                        f"again: {prepare_hint(data_dir)}")
    if size // dt.itemsize <= block_size + 1:
        raise DataError(f"{path} holds {size // dt.itemsize} tokens, too few for block_size={block_size}: "
                        f"use --block_size below {max(size // dt.itemsize - 1, 1)}, or prepare more data")
    return np.memmap(path, dtype=dt, mode="r")


def batch_generator(*key):
    """A torch.Generator seeded by a tuple: the sampler's state is the step, nothing to save.

    blake2b rather than hash(): str hashes differ between processes (PYTHONHASHSEED)."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def get_batch(data, key, *, batch_size, block_size, device, rows=slice(None)):
    """batch_size random windows of block_size (+1) tokens of `data`, drawn by batch_generator(*key):
    training micro-steps use key (seed, "train", step, micro-step), evaluation (seed, split, "eval", k).
    rows: the windows kept, a slice of the batch_size drawn (a process's share of a split batch)."""
    T = block_size
    ix = torch.randint(len(data) - T - 1, (batch_size,), generator=batch_generator(*key)).tolist()[rows]
    x = torch.stack([torch.from_numpy(data[i:i + T].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + T].astype(np.int64)) for i in ix])
    if torch.device(device).type == "cuda":  # pinned and non-blocking: the copy overlaps the compute
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def eval_batch(data, split, k, *, seed, batch_size, block_size, device):
    """Evaluation batch k of a split: the same for every run of this seed, every step, every reader
    (train.py's evaluation, export.py's val loss, llama.cpp's check in export_gguf.py)."""
    return get_batch(data, (seed, split, "eval", k), batch_size=batch_size, block_size=block_size, device=device)


def eval_batches(config, block_size, eval_iters):
    """train.py's evaluation batches (x, y) of a run of this config (its dataset, seed, batch size):
    eval_iters of them, 0 -> the run's own eval_iters."""
    directory = data_dir(config["dataset"])
    data = open_split(directory, "val", read_meta(directory), block_size)
    return [eval_batch(data, "val", k, seed=config["seed"], batch_size=config["batch_size"], block_size=block_size,
                       device="cpu")
            for k in range(eval_iters or config["eval_iters"])]


@torch.no_grad()
def estimate_loss(model, splits, *, seed, eval_iters, batch_size, block_size, device, autocast=nullcontext(),
                  rank=0, world_size=1):
    """{split: mean loss} on the fixed batches (seed, split, "eval", k), k < eval_iters, noise off.

    The batches are shared out over the processes; every rank runs the same number of forwards
    (FSDP forwards are collective) and batches past eval_iters count zero, so the result does not
    depend on the world size.
    """
    was_training = model.training
    model.eval()
    out = {}
    for split, data in splits.items():
        total = torch.zeros(2, dtype=torch.float64, device=device)  # sum of losses, count
        for k in range(rank, -(-eval_iters // world_size) * world_size, world_size):
            x, y = eval_batch(data, split, k, seed=seed, batch_size=batch_size, block_size=block_size,
                              device=device)
            with autocast:
                _, loss = model(x, y)
            if k < eval_iters:
                total += torch.stack([loss.double(), torch.ones((), dtype=torch.float64, device=device)])
        if world_size > 1:
            torch.distributed.all_reduce(total)
        out[split] = (total[0] / total[1]).item()
    model.train(was_training)
    return out


def autocast_for(dtype, device):
    """train.py's autocast of the matmuls for config dtype "bfloat16" (BF16) or "float32" (none)."""
    device_type = torch.device(device).type
    return nullcontext() if dtype == "float32" else torch.autocast(device_type=device_type, dtype=torch.bfloat16)
