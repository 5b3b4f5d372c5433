"""The method's phases and the format it trains toward: when a run switches from plain Linears to its
method (pqt_start) and from PQT to the STE on a bit budget's formats (ste_start), and the b_t level a
target format sets (quant.budget.matched_b_t, budget_level), resolved from train.py's config and checked
before anything is built or written.

    notes = phases.resolve(c, explicit, model_args)   # c updated: the switches as steps, b_init, b_target
    gaussws.convert(model, c["method"], roles, **phases.method_args(c))

A switch before the end of the run trains plain Linears (the bf16 run, bit for bit) until pqt_start, the
method after it; a GGUF or block budget chooses its formats at ste_start (or pqt_start for ste[...]).
Every refusal is one line (ConfigError) naming the key, the value and what is accepted.
"""
import math

import torch

import gaussws
from configurator import ConfigError
from model import GPT, ROLES, ModelConfig
from quant.budget import budget_level, check_budget, matched_b_t
from quant.formats import BUDGET_TARGETS, GGML_FORMATS, GGUF_BUDGETS
from quant.grids import LATTICE_FORMATS, STE_FORMATS, check_format


def resolve(c, explicit, model_args):
    """The method's settings of config c, resolved in place and checked: pqt_start and ste_start as steps,
    b_init and b_target (phase_settings), lr_decay_iters (max_iters where 0), and the model's Linears able
    to hold the target format (a meta-device conversion, where the run's shape is the config's). Returns
    the notes to say at the start (check_switches). ConfigError (one line) for anything wrong."""
    roles = ROLES.get(model_args.get("arch", "gpt2"), {})
    given = {k: c[k] for k in ("pqt_start", "ste_start")}
    try:  # a bad method or shape fails now, before data or checkpoints are touched
        kind, _ = gaussws.parse_method(c["method"], roles.values())
        c.update(phase_settings(kind, c, explicit))  # pqt_start as a step; b_t's level for target_format
        mconf = ModelConfig(**{**model_args, "vocab_size": model_args.get("vocab_size") or 1})
        if c["init_from"] in ("scratch", "resume"):  # the model is this shape: a width the format cannot hold
            with torch.device("meta"):
                gaussws.convert(GPT(mconf), c["method"], roles, **method_args(c))
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None
    c["lr_decay_iters"] = c["lr_decay_iters"] or c["max_iters"]
    return check_switches(c, given)


def start_step(key, value, max_iters, zero):
    """A start given as 0 (`zero`), a fraction in (0, 1) of max_iters (rounded) or a whole step: the step."""
    if not (value == 0 or 0 < value < 1 or math.isfinite(value) and value >= 1 and value == int(value)):
        raise ValueError(f"{key}={value:g}: expected 0 ({zero}), a fraction in (0, 1) of max_iters, or a whole "
                         f"step >= 1")
    return round(value * max_iters) if value < 1 else int(value)


def check_targets(kind, config):
    """The refusals of phase_settings that concern the format (target_format, bits_per_weight) and the
    kinds of method that take each setting; ValueError (one line)."""
    value, fmt = config["pqt_start"], config["target_format"]
    ste_value, budget = config.get("ste_start", 0.0), config.get("bits_per_weight", 0.0)
    if kind == "bf16" and (value or fmt or ste_value or budget):
        key = next(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v:g}" for k, v in
                   (("pqt_start", value), ("target_format", fmt), ("ste_start", ste_value),
                    ("bits_per_weight", budget)) if v)
        raise ValueError(f"{key} is for a method that trains toward a format, but method is bf16: choose "
                         f"gaussws[...], diffq[...] or ste[...]")
    if kind == "ste" and not fmt:
        raise ValueError(f"method ste[...] needs --target_format, the grid it trains on: one of "
                         f"{', '.join(STE_FORMATS + tuple(GGML_FORMATS) + tuple(LATTICE_FORMATS))}")
    if kind == "ste" and ste_value:
        raise ValueError(f"ste_start={ste_value:g} switches a gaussws[...] or diffq[...] run from PQT to STE; an "
                         f"ste[...] run is STE from pqt_start on: drop ste_start")
    if budget and fmt not in BUDGET_TARGETS:
        raise ValueError(f"bits_per_weight={budget:g} is for target_format auto-int or error-int (int2/int3/int4 "
                         f"per block at that mean) or auto-gguf or error-gguf (a GGML type per tensor), not "
                         f"target_format={fmt!r}")
    if fmt in BUDGET_TARGETS:
        check_budget(fmt, budget, kind)
    elif fmt:
        check_format(fmt)
    if fmt in GGUF_BUDGETS and kind != "ste" and not ste_value:
        raise ValueError(f"target_format={fmt!r} chooses one GGML type per tensor when the STE starts, and this {kind} "
                         f"run has no ste_start: it would train PQT to its end and choose none, so export.py "
                         f"--format={fmt} would have no type to write; set ste_start (a fraction of max_iters or a "
                         f"step after pqt_start), or train toward one type (--target_format=q4_k, ...)")
    if ste_value and fmt not in BUDGET_TARGETS:
        raise ValueError(f"ste_start={ste_value:g} trains on per-block formats a bit budget chooses at that step, "
                         f"or per-tensor GGML types: set target_format=auto-int, error-int, auto-gguf or error-gguf "
                         f"and bits_per_weight (e.g. 3.0), not target_format={fmt!r}")


def phase_settings(kind, config, explicit=()):
    """The keys of the method, resolved and checked: {"pqt_start", "ste_start", "b_init", "b_target"}.

    kind: the method without its layers (gaussws.parse_method). config holds pqt_start, max_iters,
    target_format, b_init, b_target, and ste_start and bits_per_weight (0 where missing); explicit,
    the keys the user set. Raises ValueError (one line).
    pqt_start: 0 trains with the method from the first step; a fraction in (0, 1) of max_iters
    (rounded) or a whole step >= 1 is the step at which the Linears switch from plain, the bf16 run
    until then, to the method (convert's `start`). Returned as that step.
    target_format: the format the run trains toward. ste needs one: its grid. For gaussws and diffq
    it sets b_target to matched_b_t(R_SECOND_MOMENT[kind], format), the level whose noise is the
    format's rounding error, and in a phase b_init too (unless b_init is set), so that b_t is at that level from the
    first noisy step to the last: a phase is too short for decay or Eq. 12 to bring b_t down from
    b_init. Decay shrinks b_i by a factor 1 - lr * bitwidth_weight_decay per step (2e-4 of it at the
    defaults); Eq. 12 through AdamW moves b_i by about lr per step, 0.06 over 30 steps at lr 2e-3.
    A bit budget, target_format auto-int or error-int with bits_per_weight in [2, 4], mixes
    int2/int3/int4 per block (ste: error-int only, chosen at pqt_start). For gaussws and diffq b_t is
    then free per block: b_target is the budget's level (budget_level; int3's for 3.0), the pull of
    b_i's decay toward the average, and in a phase b_init is one bit above it (unless set), since
    b_init = b_target would fix b_t (Eq. 11 then ignores b_i). AdamW moves b_i by about lr a step, so
    a phase spreads b_t by at most the sum of its lr times (b_init - b_target), and auto-int, which
    ranks an upgrade by b_t - bits, mixes formats at a whole budget (3.0) only where b_t spread > 1 bit.
    A GGUF budget, auto-gguf or error-gguf with bits_per_weight from Q2_K's 2.625 to Q8_0's 8.5, gives
    each Linear one GGML type (quant.budget.gguf_types; ste: error-gguf only, chosen at pqt_start >= 1, after
    some steps' input activations); its level is budget_level's between the types' matched levels.
    ste_start (gaussws, diffq with a budget; same forms as pqt_start, 0: none): from that step, after
    pqt_start, STE on the formats the budget chooses then (convert's `ste_start`).
    """
    value, fmt, max_iters = config["pqt_start"], config["target_format"], config["max_iters"]
    ste_value, budget = config.get("ste_start", 0.0), config.get("bits_per_weight", 0.0)
    start = start_step("pqt_start", value, max_iters, "the method from the first step")
    ste_start = start_step("ste_start", ste_value, max_iters, "no STE phase")
    check_targets(kind, config)
    if fmt == "error-gguf" and (kind == "ste" or ste_start):
        check_budget(fmt, budget, kind, switch=start if kind == "ste" else ste_start)
    if ste_value and ste_start <= start:
        raise ValueError(f"ste_start={ste_value:g} (step {ste_start}) must come after pqt_start={value:g} (step "
                         f"{start}): PQT from pqt_start, STE from ste_start")
    b_init, b_target = float(config["b_init"]), float(config["b_target"])
    if kind in gaussws.R_SECOND_MOMENT and fmt:
        if "b_target" in explicit:
            raise ValueError(f"b_target={b_target:g} and target_format={fmt!r} both set the level b_t is pulled "
                             f"to; drop one")
        second_moment = gaussws.R_SECOND_MOMENT[kind]
        b_target = budget_level(second_moment, budget, fmt) if budget else matched_b_t(second_moment, fmt)
        if start > 0 and "b_init" not in explicit:
            b_init = b_target + 1.0 if budget else b_target
    return {"pqt_start": float(start), "ste_start": float(ste_start), "b_init": b_init, "b_target": b_target}


def check_switches(c, given):
    """Refuse a switch (pqt_start, ste_start: resolved steps in c; `given`, as the user wrote them) at
    or past the end of the run, which would then never train what it switches to and still record it
    as its method. The end is max_iters, or lr_decay_iters where the schedule is set to end later:
    such a run stops early as the first part of a longer one, and resumed (init_from=resume) with a
    larger max_iters it reaches its switch. Returns the notes that say so (one per switch not reached)."""
    end, notes = max(c["max_iters"], c["lr_decay_iters"]), []
    for key, before in (("pqt_start", "bf16"), ("ste_start", "PQT")):
        step = int(c[key])
        said = f"{key}={given[key]:g}" + (f" (step {step})" if given[key] != step else "")
        if step and step >= end:
            raise ConfigError(f"{said} is at or past max_iters={c['max_iters']}: the run would end before its switch "
                              f"and train {before} throughout; set {key} below max_iters, or raise max_iters (a run "
                              f"stopped before its switch, to be resumed past it, sets lr_decay_iters, the end of its "
                              f"schedule, beyond the switch)")
        if step and step >= c["max_iters"]:
            notes.append(f"note: {said} is at or past max_iters={c['max_iters']}: this run stops before its switch, "
                         f"{before} throughout; resume it (--init_from=resume) with max_iters up to "
                         f"lr_decay_iters={c['lr_decay_iters']} to train past it")
    return notes


def method_args(c):
    """gaussws.convert's settings of the method from the config (resolved by phase_settings)."""
    return dict(b_init=c["b_init"], b_target=c["b_target"], seed=c["seed"], start=int(c["pqt_start"]),
                fmt=c["target_format"], ste_start=int(c["ste_start"]), bits_per_weight=c["bits_per_weight"])
