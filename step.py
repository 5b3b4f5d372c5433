"""One optimizer step of training, as train.py takes it and bench.py times it: the micro-steps
(gradient accumulation) inside a gaussws.TrainStep, the gradient norm and its clipping, the check
that the loss and the norm are finite, and the update; which part of a step's global batch each of
several processes takes (share_out); the step's learning rate (get_lr, and what a schedule may
hide: schedule_notes); and what train.py checks of the model at every evaluation, before it may
save it (check_sane): its weights finite (all_finite), the sane-model rule (insanity).

    first, accum, rows = share_out(gradient_accumulation_steps, batch_size, world_size, rank)
    loss, grad_norm, batch = train_step(model, optimizers, step, batch, micro_batch, accum, ...)
"""
import math
import time
from contextlib import contextmanager, nullcontext

import torch

import gaussws
from configurator import ConfigError
from util import UserError


class Diverging(UserError):
    """Training went wrong in a way that going on cannot mend: what broke ("loss", "grad_norm" of a
    step; "model", "eval_loss", "val_loss", "b_t" of an evaluated model), its value and the limit it
    passed (None where there is none), for train.py's divergence record."""

    def __init__(self, message, what, value, limit=None):
        super().__init__(message)
        self.what, self.value, self.limit = what, value, limit


class NonFinite(Diverging):
    """The loss or the gradient norm of a step is NaN or Inf; the update was not applied."""


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def _timed(timer, device):
    """Add the seconds of the block (the device synchronized at its end) to timer["pqt_s"]; nothing
    when timer is None."""
    t = time.perf_counter()
    yield
    if timer is not None:
        sync(device)
        timer["pqt_s"] = timer.get("pqt_s", 0.0) + time.perf_counter() - t


def train_step(model, optimizers, step, batch, micro_batch, accum, *, forward=None, autocast=nullcontext(),
               grad_clip=0.0, bitwidth_lambda=0.0, timer=None):
    """Optimizer step `step` of model: accum micro-steps, then the clipped update of every optimizer.

    batch: the first micro-batch (x, y); micro_batch(step, m) draws micro-batch m of a step, each
    fetched while the previous one's backward runs (on GPUs the copy overlaps it), the last the next
    step's first. forward: what computes the loss, model itself or model compiled and/or wrapped in
    DDP (whose gradient all-reduce then runs in the last micro-step's backward only). The loss of a
    micro-step is the model's plus bitwidth_lambda times Eq. 12's, over accum. grad_clip: the largest
    gradient norm, 0 for none (the norm is measured either way). timer: a dict that gets "pqt_s",
    the seconds of TrainStep's begin and end (bench.py's measure of the method's own work).

    Returns (the loss, summed over the micro-steps and averaged over the processes; the gradient
    norm before clipping; the next step's first micro-batch). Raises NonFinite, before the update,
    when either is NaN or Inf: a non-finite gradient must not reach the weights.
    """
    forward = model if forward is None else forward
    ddp = isinstance(forward, torch.nn.parallel.DistributedDataParallel)
    x, y = batch
    loss_sum = torch.zeros((), device=x.device)
    pqt_step = gaussws.TrainStep(model, step)  # selects the step's noise; applies Eq. 4 at its end
    with _timed(timer, x.device):
        pqt_step.begin()
    try:
        for micro_step in range(accum):
            if ddp:
                forward.require_backward_grad_sync = micro_step == accum - 1
            with autocast:
                _, loss = forward(x, y)
                if bitwidth_lambda:
                    loss = loss + bitwidth_lambda * gaussws.bitwidth_loss(model)
                loss = loss / accum
            # fetch the next micro-batch while this one's backward runs (on GPUs)
            x, y = micro_batch(*((step, micro_step + 1) if micro_step + 1 < accum else (step + 1, 0)))
            loss.backward()
            loss_sum += loss.detach()  # on the device: no host sync per micro-step
    except BaseException:
        pqt_step.end(apply_eq4=False)  # as leaving a `with TrainStep` by an exception: no gradient touched
        raise
    with _timed(timer, x.device):
        pqt_step.end()
    # The gradient norm, clipped or not: a non-finite one must not reach the weights.
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float("inf"))
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(loss_sum)
        loss_sum /= torch.distributed.get_world_size()
    step_loss, norm = torch.stack([loss_sum.float(), grad_norm.float().to(loss_sum.device)]).tolist()  # one sync a step
    if not math.isfinite(step_loss):
        raise NonFinite(f"loss is {step_loss}", "loss", step_loss)
    if not math.isfinite(norm):
        raise NonFinite(f"gradient norm is {norm} (loss {step_loss:.4f})", "grad_norm", norm)
    for o in optimizers:
        o.step()
        o.zero_grad(set_to_none=True)
    return step_loss, norm, (x, y)


def share_out(accum, batch_size, world_size, rank):
    """(first, count, rows): process `rank` of world_size takes micro-steps first .. first + count - 1
    of each optimizer step, and of each such micro-batch the rows `rows` (a slice of batch_size), so
    that the processes together take every sequence of the global batch once: the micro-steps are
    shared out over g = gcd(accum, world_size) groups of processes, and the world_size / g processes
    of a group split each micro-batch's rows. That works exactly where world_size divides
    accum * batch_size (then world_size / g, coprime with accum / g, divides batch_size); elsewhere a
    one-line ConfigError names the flags that work."""
    groups = math.gcd(accum, world_size)
    split = world_size // groups
    if batch_size % split:
        raise ConfigError(
            f"gradient_accumulation_steps={accum} x batch_size={batch_size} sequences do not share out over "
            f"{world_size} processes (they split the micro-steps, then each micro-batch's sequences: the number of "
            f"processes must divide {accum} x {batch_size}); use --gradient_accumulation_steps="
            f"{-(-accum // world_size) * world_size} or --batch_size={-(-batch_size // split) * split} (more tokens "
            f"per step), or --nproc_per_node={max(n for n in range(1, world_size) if accum * batch_size % n == 0)}")
    count, rows = accum // groups, batch_size // split
    return rank // split * count, count, slice(rank % split * rows, (rank % split + 1) * rows)


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


def schedule_notes(c):
    """What the user may not expect of the learning-rate schedule: a cosine that ends before the
    run, or a warmup as long as the run."""
    notes = []
    if c["decay_lr"] and c["lr_decay_iters"] < c["max_iters"]:
        notes.append(f"note: the cosine ends at lr_decay_iters={c['lr_decay_iters']}, before "
                     f"max_iters={c['max_iters']}: the last {c['max_iters'] - c['lr_decay_iters']} steps run at "
                     f"min_lr={c['min_lr']:g}")
    if c["decay_lr"] and 0 < c["max_iters"] <= c["warmup_iters"]:
        notes.append(f"note: warmup_iters={c['warmup_iters']} is not below max_iters={c['max_iters']}: the whole run "
                     f"warms up, to lr {get_lr(c['max_iters'] - 1, c):.2e} of learning_rate={c['learning_rate']:g}")
    return notes


def all_finite(model, distributed):
    """Whether every parameter is finite on every process (each checks its own shard under FSDP)."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    ok = torch.stack([torch.isfinite(p).all() for p in local]).all().float()
    if distributed:
        torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)
    return bool(ok)


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


def check_sane(model, losses, step, b_floor, distributed, kept):
    """Raise Diverging unless the model evaluated at step (losses: estimate_loss's) is sane: its weights
    finite on every process (b_i, unseen by the eval, included) and none of insanity's rules broken
    (b_floor: min(b_init, b_target)). The message says what broke, that nothing is saved, and what the
    run keeps instead (kept)."""
    if not all_finite(model, distributed):
        raise Diverging(f"the model holds non-finite values at step {step}; stopping without saving ({kept})",
                        "model", None)
    broken = insanity(losses, gaussws.bitwidth_stats(model), model.config.vocab_size, b_floor, trained=step > 0)
    if broken:
        what, value, limit = broken
        told = (f"eval loss is {losses}" if what == "eval_loss" else
                f"val loss is {value:.4g}, above ln(vocab_size) + {VAL_LOSS_MARGIN:g} = {limit:.4f}"
                if what == "val_loss" else
                f"b_t fell to {value:.4g}, below min(b_init, b_target) - {B_T_MARGIN:g} = {limit:g}")
        raise Diverging(f"{told} at step {step}; stopping without saving ({kept}). Try a lower --learning_rate or "
                        f"--grad_clip", what, value, limit)
