"""The studies: each a list of arms (a config file and train.py --key=value overrides of it) times seeds,
and the name and train.py arguments of each of its runs.

A run's NAME is made from its config and overrides (run_name), so an arm that two studies share (the
bf16 run of Fig. 1b and of the 3-bit study) is one run directory, trained once.
"""
import math
import os
import re
import statistics

import configurator
from figures import PQT_ONLY
from gaussws import R_SECOND_MOMENT
from studies.records import StudyError
from step import get_lr

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT2, LLAMA2 = "config/mini_gpt2.py", "config/mini_llama2.py"
HIGH_LR = 1e-2  # 5x the configs' 2e-3; our choice, to strain bf16 as the paper's unstable arm does
# At equal b_t, gaussws' R injects E[R²]/E[U²] times the noise variance of DiffQ's U(-1/2, 1/2)
# (gaussws.R_SECOND_MOMENT, from Eq. 10: 3.506x). The noise of Eq. 3 scales as 2^-b_t, its variance
# as 4^-b_t: DiffQ at b_t - log2(sqrt(3.506)) = b_t - 0.905 injects the variance of gaussws at b_t.
NOISE_BITS = round(0.5 * math.log2(R_SECOND_MOMENT["gaussws"] / R_SECOND_MOMENT["diffq"]), 3)  # 0.905


def arm(config, **overrides):
    """One setting of a study: a config file and --key=value overrides of it (not the seed)."""
    return {"config": config, "overrides": overrides}


BF16, BF16_HIGH = arm(GPT2, method="bf16"), arm(GPT2, method="bf16", learning_rate=HIGH_LR)
GAUSSWS = arm(GPT2, method="gaussws[all]")
GAUSSWS_HIGH = arm(GPT2, method="gaussws[all]", learning_rate=HIGH_LR)
DIFFQ, DIFFQ_HIGH = arm(GPT2, method="diffq[all]"), arm(GPT2, method="diffq[all]", learning_rate=HIGH_LR)
# The 3-bit regime: b_t = 2 + 4 b_i pulled toward b_target 2 by a b_i decay of 10: AdamW's decay
# alone (b_i *= 1 - lr * 10 a step, learning rates summing to about 0.22 over mini_gpt2.py's 200
# steps) leaves b_i near e^-2.2 = 0.11, b_t near 2.45 (measured: 2.47 [2.3, 2.7] over blocks, the
# loss's own gradient barely pushes back), where auto-int stores every block as int3 (ceil(b_t)).
# (config/cpu/gaussws_3bit.py: the same pull over 400 steps with a decay of 5.) Our choice.
LOW_BITS = dict(b_target=2.0, bitwidth_weight_decay=10.0)

STUDIES = {
    "fig1b": dict(
        about="Fig. 1b at laptop scale: bf16, gaussws[all] and diffq[all] at a comfortable lr (2e-3) and "
              "a high one (1e-2), from the same start (same seed) and the same batches",
        arms=[BF16, GAUSSWS, DIFFQ, BF16_HIGH, GAUSSWS_HIGH, DIFFQ_HIGH],
        seeds=(1, 2, 3), export=("auto", "mxfp6_e3m2"), export_bf16=False),
    "fig3a": dict(
        about="Fig. 3a at laptop scale: gaussws on one kind of layer at a time, b_target 0, at the high lr "
              "(where the paper looked for the source of bf16's instability)",
        arms=[BF16_HIGH] + [arm(GPT2, method=f"gaussws[{p}]", b_target=0.0, learning_rate=HIGH_LR)
                            for p in ("qkv", "out", "up", "down", "od")],
        seeds=(1,), export=("auto", "mxfp6_e3m2"), export_bf16=False),
    "fig3b": dict(
        about="Fig. 3b at laptop scale: Fig. 1b's high-lr arm with Adam-mini in place of AdamW",
        arms=[arm(GPT2, method=m, learning_rate=HIGH_LR, optimizer="adam_mini")
              for m in ("bf16", "gaussws[all]", "diffq[all]")],
        seeds=(1, 2, 3), export=("auto", "mxfp6_e3m2"), export_bf16=False),
    "fig4": dict(
        about="Fig. 4 at laptop scale: a small Llama2 with bf16, diffq[all] and gaussws[all]",
        arms=[arm(LLAMA2, method=m) for m in ("bf16", "diffq[all]", "gaussws[all]")],
        seeds=(1, 2, 3), export=("auto", "mxfp6_e3m2"), export_bf16=False),
    "3bit": dict(
        about="The 3-bit regime (beyond the paper): gaussws[all] and diffq[all] trained toward b_t <= 3, "
              "against the bf16 run quantized after training (PTQ), each exported at auto-int, int3 and mxfp4",
        arms=[BF16, arm(GPT2, method="gaussws[all]", **LOW_BITS), arm(GPT2, method="diffq[all]", **LOW_BITS)],
        seeds=(1, 2, 3), export=("auto-int", "int3", "mxfp4"), export_bf16=True),
    "noise": dict(
        about=f"DiffQ at an equal noise budget: diffq[all] with b_init and b_target lowered by "
              f"log2(sqrt(E[R²] * 12)) = {NOISE_BITS} bit, beside gaussws[all] and diffq[all] at equal b_t",
        arms=[GAUSSWS, DIFFQ, arm(GPT2, method="diffq[all]", b_init=round(6.0 - NOISE_BITS, 3),
                                  b_target=round(4.0 - NOISE_BITS, 3))],
        seeds=(1, 2, 3), export=("auto", "mxfp6_e3m2"), export_bf16=False),
}

# --- the deployment study (beyond the paper): where PQT pays against PTQ and STE-QAT -------------
# A bf16 run per training length is the trunk; every phase arm forks from its checkpoint at the
# arm's switch step (train.py --fork_from): until the switch a phase run *is* the bf16 run (the
# same weights, optimizer state, batches and seed; tests/test_phase.py), so it spends exactly the
# bf16 run's tokens and only its phase is trained again. Our choices: the lengths (1, 4 and 16
# tokens per parameter of mini_gpt2_deploy.py's 0.8M parameters), a phase of the last 15 % (ParetoQ:
# about 10 %), 3 seeds at the longest and 1 elsewhere, the 3.5-bit budget of the mixed arms.
DEPLOY = "config/mini_gpt2_deploy.py"
DEPLOY_STEPS = (200, 800, 3200)
DEPLOY_SEEDS = {200: (1,), 800: (1,), 3200: (1, 2, 3)}
DEPLOY_FORMATS = {200: ("int3", "int4"), 800: ("int3", "int4"), 3200: ("int3", "int2", "int4", "mxfp4")}
# Element bits per weight of the mixed-precision arms (int2/int3/int4 per block, export.py's budget):
# half-way between int3 and int4, so that the ranking decides which blocks get the fourth bit. At a
# whole 3.0 every ranking gives uniform int3 here: a block gets int4 before another gets int3 only
# where their b_t (or errors, in bits) differ by more than a bit, and a phase moves b_t by about the
# sum of its learning rates, a few hundredths of a bit.
BUDGET = 3.5
PHASE = 0.85  # where the phases start, as a fraction of the run: the last 15 %
MIX_PHASE = 0.7  # where the learned mix's gaussws phase starts (it learns the b_t that allocate, then STE from PHASE)
SWEEP_B_T = (3.0, 4.0)  # the gaussws int3 phase's b_t swept at 800 steps, beside the matched level 3.49
# The sweep's lowest exported int3 loss (one seed; studies/results/deploy/results.md): the longest
# length runs the gaussws int3 phase at it too, beside the matched level. None: the matched level alone.
BEST_B_T = 4.0


def config_settings(config):
    """The settings a config file gives (its bases' first, then its own), as train.py reads them."""
    settings = {}
    for _, own in configurator.file_settings(os.path.join(REPO, config)):
        settings.update(own)
    return settings


def scratch_decay(steps):
    """bitwidth_weight_decay that brings b_i from 1 to 0.1 over a run of DEPLOY from scratch of `steps`
    steps: AdamW multiplies b_i by (1 - lr * decay) a step, so b_i ends near exp(-decay * the sum of the
    learning rates), each step's learning rate train.py's (step.get_lr) on the config's schedule."""
    schedule = ("learning_rate", "min_lr", "warmup_iters")
    c = config_settings(DEPLOY)
    if any(k not in c for k in schedule):
        raise StudyError(f"{DEPLOY} must set {', '.join(schedule)}: the from-scratch arms' b_i decay is "
                         f"computed from its schedule")
    c = {"decay_lr": True, **c, "max_iters": steps, "lr_decay_iters": steps}  # decay_lr: train.py's default
    return round(math.log(10) / sum(get_lr(i, c) for i in range(steps)), 2)


def deploy_arm(kind, fmt, steps, export, trunk=None, **overrides):
    a = arm(DEPLOY, **overrides, max_iters=steps, lr_decay_iters=steps, eval_interval=steps // 4)
    return {**a, "kind": kind, "format": fmt, "steps": steps, "seeds": DEPLOY_SEEDS[steps], "export": export,
            "trunk": trunk}


def deploy_forks(n, trunk, bits):
    """The arms of length n that fork from its trunk, and those from scratch (the costliest, last)."""
    phase = round(PHASE * n)
    forks, scratch = [], []
    for f in DEPLOY_FORMATS[n]:
        forks.append(deploy_arm("STE phase", f, n, [f], trunk, method="ste[all]", target_format=f, pqt_start=phase))
        # b_t at the level matched to the format's rounding error (quant.budget.matched_b_t)
        forks.append(deploy_arm("gaussws phase", f, n, [f], trunk, method="gaussws[all]", target_format=f,
                                pqt_start=phase))
        if n == DEPLOY_STEPS[-1] and f == "int3" and BEST_B_T is not None:  # the 800-step sweep's pick
            forks.append(deploy_arm(f"gaussws phase b_t {BEST_B_T:g}", f, n, [f], trunk, method="gaussws[all]",
                                    pqt_start=phase, b_init=BEST_B_T, b_target=BEST_B_T))
        forks.append(deploy_arm("diffq phase", f, n, [f], trunk, method="diffq[all]", target_format=f,
                                pqt_start=phase))
        scratch.append(deploy_arm("gaussws from scratch", f, n, [f], method="gaussws[all]", target_format=f,
                                  bitwidth_weight_decay=scratch_decay(n)))
    forks.append(deploy_arm(f"learned mix {bits} bits", "int3", n, [f"auto-int@{bits}"], trunk,
                            method="gaussws[all]", target_format="auto-int", bits_per_weight=BUDGET,
                            pqt_start=round(MIX_PHASE * n), ste_start=phase))
    forks.append(deploy_arm(f"error mix {bits} bits", "int3", n, [f"error-int@{bits}"], trunk, method="ste[all]",
                            target_format="error-int", bits_per_weight=BUDGET, pqt_start=phase))
    if n == DEPLOY_STEPS[-1]:  # the learned mix's phases exactly, only the ranking by error: the allocator alone
        forks.append(deploy_arm(f"gaussws phase + error mix {bits} bits", "int3", n, [f"error-int@{bits}"], trunk,
                                method="gaussws[all]", target_format="error-int", bits_per_weight=BUDGET,
                                pqt_start=round(MIX_PHASE * n), ste_start=phase))
    if n == 800:
        forks += [deploy_arm(f"gaussws phase b_t {b:g}", "int3", n, ["int3"], trunk, method="gaussws[all]",
                             pqt_start=phase, b_init=b, b_target=b) for b in SWEEP_B_T]
        forks += [deploy_arm(f"{kind} 50 %", "int3", n, ["int3"], trunk, method=method, target_format="int3",
                             pqt_start=n // 2) for kind, method in (("STE phase", "ste[all]"),
                                                                    ("gaussws phase", "gaussws[all]"))]
    return forks, scratch


def deploy_arms():
    """Every arm of the deployment study: per length its bf16 trunk, the arms that fork from it, then
    the arms from scratch (the costliest, last)."""
    arms, bits = [], f"{BUDGET:g}"
    for n in DEPLOY_STEPS:
        trunk = deploy_arm("bf16 + PTQ", "", n, [*DEPLOY_FORMATS[n], f"error-int@{bits}"], method="bf16")
        forks, scratch = deploy_forks(n, trunk, bits)
        trunk["keep"] = sorted({a["overrides"]["pqt_start"] for a in forks})
        arms += [trunk, *forks, *scratch]
    return arms


STUDIES["deploy"] = dict(
    about="Where PQT pays (beyond the paper): bf16 + PTQ against a PQT (gaussws, diffq) or STE-QAT (torchao) "
          "phase over the last 15 %, gaussws from scratch, and learned mixed precision, over 1-16 tokens per "
          "parameter",
    arms=deploy_arms(), seeds=(1,), export=(), export_bf16=True, report="deploy")

# --- the llama.cpp study (beyond the paper): trained GGUF files against llama-quantize -------------
# A model llama.cpp can K-quantize (config/mini_gpt2_gguf.py: every Linear input width a multiple of
# 256), one bf16 trunk per seed trained to 8 tokens per parameter; its phases fork from the trunk's
# checkpoints at 70 % (the learned mix's gaussws phase) and 85 % (the STE phases), as the deployment
# study's do, and llama.cpp's own quantizer starts from its last one.
GGUF_CONFIG = "config/mini_gpt2_gguf.py"
GGUF_STEPS = 6400
GGUF_SEEDS = (1, 2, 3)
GGUF_STE_FORMATS = ("q4_0", "q4_k", "q3_k", "q2_k", "iq4_nl", "iq4_xs")  # the STE phases' grids (formats.GGML_FORMATS)
# llama-quantize of each trunk's last checkpoint (export_gguf.py --llama_quantize): each type or mix with the
# importance matrix of the training split (+imatrix), and the two most used without it. Q3_K_S and Q2_K_S are
# there because on this model their mixes are Q3_K and Q2_K on every block Linear (tests/test_llama_tools.py):
# llama.cpp's file of the STE q3_k and q2_k phases' bytes, where Q3_K_M (4.27 bits) and Q2_K (3.17) are larger.
# Then what llama.cpp's users download at 2-4.5 bits, the IQ types with the importance matrix (IQ2_XS, IQ2_M,
# IQ3_XXS, IQ3_S, IQ4_XS, IQ4_NL: lattice and non-uniform grids, which lose less than a K-quant of their bytes),
# and the K-quant mixes above Q4_K_M (Q5_K_M, Q6_K), so that every trained file has llama.cpp's best file of no
# more bytes to be judged against (studies/gguf_report.py).
LLAMA_CPP_SPECS = ("Q8_0+imatrix", "Q4_0+imatrix", "Q4_K_M+imatrix", "Q3_K_M+imatrix", "Q2_K+imatrix", "Q4_0",
                   "Q3_K_M", "Q3_K_S+imatrix", "Q2_K_S+imatrix", "IQ2_XS+imatrix", "IQ2_M+imatrix", "IQ3_XXS+imatrix",
                   "IQ3_S+imatrix", "IQ4_XS+imatrix", "IQ4_NL+imatrix", "Q5_K_M+imatrix", "Q6_K+imatrix")
# The type llama-quantize gives each block Linear in the mixes whose sizes the per-tensor mixes are trained at,
# by llama.cpp's tensor name and layer i of n, as llama.cpp's llama_tensor_get_type chooses it
# (src/llama-quant.cpp) for a model without experts, not Falcon, with fewer than 4 query heads per KV head (these
# GPT2s and Llamas: one): GPT2's fused attn_qkv counts as attn_v. Q3_K_M: attn_v Q5_K in the first two layers,
# Q4_K after; attn_output Q4_K; ffn_down Q5_K in the first n/16 layers (none of 4), else Q4_K; the rest (attn_q,
# attn_k, ffn_gate, ffn_up) the mix's Q3_K. Q3_K_S: Q3_K throughout (its exceptions are for experts), so a mix
# at its size has the bytes of the STE q3_k phase's file: a learned allocation against one type everywhere at
# equal size. Q2_K: attn_v, attn_output and ffn_down Q3_K, the rest Q2_K.
ATTN_V = ("attn_v", "attn_qkv")


def _q3_k_m(name, i, n):
    if name in ATTN_V:
        return "Q5_K" if i < 2 else "Q4_K"
    return {"attn_output": "Q4_K", "ffn_down": "Q5_K" if i < n // 16 else "Q4_K"}.get(name, "Q3_K")


LLAMA_MIXES = {
    "Q3_K_M": _q3_k_m,
    "Q3_K_S": lambda name, i, n: "Q3_K",
    "Q2_K": lambda name, i, n: "Q3_K" if name in (*ATTN_V, "attn_output", "ffn_down") else "Q2_K",
}
# What a step costs on one core of a 2-core AMD EPYC (FP32, OMP_NUM_THREADS=1): bf16 1.14 s (the config's
# measurement, uncontended); the others the CPU time of steps 5-25 of a run of each method on this model,
# beside two such runs of bf16 measured alike at 1.04 and 1.24 s (mean 1.14): the STE on llama.cpp's grids
# (its fake quantization made once a step) and gaussws cost a bf16 step within that spread on this small
# model. IQ4_NL and IQ4_XS search 16 scales for each block of 32 (ggml_quants), a step 44 % and 40 % dearer
# than bf16's: CPU seconds of steps 5-25 of train.py's runs of each beside bf16's and q4_k's, on a busier core
# (bf16 1.32, q4_k 1.33, iq4_nl 1.90, iq4_xs 1.84 with OMP_NUM_THREADS=1), scaled here by 1.14 / 1.32.
# `python -m studies gguf --dry_run` prints each arm's cost from these.
GGUF_STEP_S = {"bf16": 1.14, "q4_0": 1.18, "q4_k": 1.18, "q3_k": 1.16, "q2_k": 1.13, "gaussws": 1.17,
               "iq4_nl": 1.64, "iq4_xs": 1.60}


def type_bits(name):
    """A GGML type's bits per weight, scales included: gguf's block sizes, as ggml_quants.bits_per_weight
    computes them (which imports torch._dynamo, seconds at every `python -m studies`)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    weights, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    return size * 8 / weights


def block_linear_shapes(config):
    """{llama.cpp's tensor name: (out, in)} of a config's block Linears (model.py's GPT2: attn_qkv,
    attn_output, ffn_up, ffn_down; its Llama2: attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up,
    ffn_down), and its layers; the defaults of n_kv_head and ffn_hidden are model.ModelConfig's."""
    from model import ModelConfig
    c = config_settings(config)
    m = ModelConfig(**{k: c[k] for k in ("arch", "n_layer", "n_head", "n_kv_head", "n_embd", "ffn_hidden") if k in c})
    e, h, kv = m.n_embd, m.ffn_hidden, m.n_kv_head * (m.n_embd // m.n_head)
    if m.arch == "gpt2":
        return {"attn_qkv": (3 * e, e), "attn_output": (e, e), "ffn_up": (h, e), "ffn_down": (e, h)}, m.n_layer
    return {"attn_q": (e, e), "attn_k": (kv, e), "attn_v": (kv, e), "attn_output": (e, e), "ffn_gate": (h, e),
            "ffn_up": (h, e), "ffn_down": (e, h)}, m.n_layer


def llama_mix_bits(mix, config=GGUF_CONFIG):
    """The bits per weight of the block Linears in llama-quantize's mix (LLAMA_MIXES) of config's model:
    each Linear's type's bits weighted by its weights."""
    shapes, n = block_linear_shapes(config)
    bits = sum(type_bits(LLAMA_MIXES[mix](name, i, n)) * o * k for i in range(n) for name, (o, k) in shapes.items())
    return bits / (n * sum(o * k for o, k in shapes.values()))


# The budgets of the per-tensor mixes, per model: llama.cpp's Q3_K_M, Q3_K_S and Q2_K sizes on it (the GPT2's
# 4.2708, 3.4375 and 3.1666; the Llama's 3.8846, 3.4375 and 2.9375), fixed here, not read from the trunk's
# llama.cpp files, since they name the runs and their train.py arguments before any run; rounded down to 4
# decimals, so that a trained mix never holds more bytes.
GGUF_LLAMA_CONFIG, GGUF_LLAMA_STEPS = "config/mini_llama2_gguf.py", 6900
GGUF_MIX_BITS = {config: {mix: math.floor(llama_mix_bits(mix, config) * 1e4) / 1e4 for mix in LLAMA_MIXES}
                 for config in (GGUF_CONFIG, GGUF_LLAMA_CONFIG)}


# Which block Linears a bit helps most, measured on each trunk's checkpoint at the mixes' fork (python -m
# studies.sensitivity): each rounded alone to these types, cheapest first, the upgrades a mix of them ranks
SENSITIVITY_TYPES = ("q2_k", "q3_k", "q4_k")


def gguf_trunk(config, steps, seeds, step_s):
    """A llama.cpp study's bf16 trunk of `steps` steps, kept at the phases' fork steps (70 %: the mixes'
    gaussws phase, 85 %: the STE phases), exported by llama-quantize (LLAMA_CPP_SPECS) and measured tensor by
    tensor at the mixes' fork (sensitivity: the checkpoint's step and SENSITIVITY_TYPES)."""
    trunk = arm(config, method="bf16", max_iters=steps, lr_decay_iters=steps, eval_interval=steps // 4)
    trunk.update(kind="bf16", seeds=seeds, keep=sorted({round(MIX_PHASE * steps), round(PHASE * steps)}),
                 llama_cpp=list(LLAMA_CPP_SPECS), step_s=step_s,
                 sensitivity=dict(step=round(MIX_PHASE * steps), types=SENSITIVITY_TYPES))
    return trunk


def gguf_arm(kind, spec, trunk, step_s, **overrides):
    """A phase arm of a llama.cpp study, forked from its trunk (its config, length and seeds); spec: its GGUF
    file (export.py's format, at @bits for a budget); step_s: its seconds per step (GGUF_STEP_S)."""
    steps = trunk["overrides"]["max_iters"]
    a = arm(trunk["config"], **overrides, max_iters=steps, lr_decay_iters=steps, eval_interval=steps // 4)
    return {**a, "kind": kind, "seeds": trunk["seeds"], "trunk": trunk, "gguf": [spec], "step_s": step_s}


MIX_KINDS = {"learned mix": "auto-gguf", "error mix": "error-gguf"}  # a per-tensor mix's ranking: its budget format


def gguf_arms(config=GGUF_CONFIG, steps=GGUF_STEPS, seeds=GGUF_SEEDS, ste_formats=GGUF_STE_FORMATS,
              mixes=tuple(MIX_KINDS)):
    """A llama.cpp study's arms: per seed, the bf16 trunk (gguf_trunk); STE phases over the last 15 % on
    each grid of ste_formats; and for each kind of mixes (MIX_KINDS), at each llama.cpp mix's size on the
    config's model (GGUF_MIX_BITS) the learned per-tensor mix (a gaussws phase from 70 % whose b_t rank
    the tensors, then STE on the types chosen from 85 %) and the error-ranked one (the same phases, the
    tensors ranked by their imatrix-weighted rounding error)."""
    trunk = gguf_trunk(config, steps, seeds, GGUF_STEP_S["bf16"])
    phase, mix_phase = round(PHASE * steps), round(MIX_PHASE * steps)
    arms = [trunk]
    arms += [gguf_arm("STE phase", f, trunk, GGUF_STEP_S[f], method="ste[all]", target_format=f, pqt_start=phase)
             for f in ste_formats]
    # a mix: the gaussws phase, then as long an STE phase on the K-quants (their mean cost)
    ste_k = statistics.mean(GGUF_STEP_S[f] for f in GGUF_STE_FORMATS if f.endswith("_k"))
    mix_s = round(((phase - mix_phase) * GGUF_STEP_S["gaussws"] + (steps - phase) * ste_k) / (steps - mix_phase), 2)
    for mix, bits in GGUF_MIX_BITS[config].items():
        for kind in mixes:
            fmt = MIX_KINDS[kind]
            arms.append(gguf_arm(f"{kind} at {mix}'s size", f"{fmt}@{bits:g}", trunk, mix_s,
                                 method="gaussws[all]", target_format=fmt, bits_per_weight=bits,
                                 pqt_start=mix_phase, ste_start=phase))
    return arms


STUDIES["gguf"] = dict(
    about="Trained GGUF files against llama.cpp's quantizer (beyond the paper): STE phases on llama.cpp's grids "
          "and learned per-tensor types, against llama-quantize with an importance matrix, judged by llama.cpp",
    arms=gguf_arms(), seeds=GGUF_SEEDS, export=(), export_bf16=False, report="gguf")

# The same comparison at 2 tokens per parameter (1,600 steps of the GPT2): the arms that decide the headline
# (the trunk and llama.cpp's files of it, STE q4_0, the learned mixes), to see how the trained files' lead
# moves with training length. And on a Llama (config/mini_llama2_gguf.py, 8 tokens per parameter).
GGUF_SHORT_STEPS = 1600
STUDIES["gguf_short"] = dict(
    about="The llama.cpp study's headline arms at 2 tokens per parameter (1,600 steps): bf16 and llama-quantize, "
          "STE q4_0, the learned per-tensor mixes",
    arms=gguf_arms(steps=GGUF_SHORT_STEPS, ste_formats=("q4_0",), mixes=("learned mix",)), seeds=GGUF_SEEDS,
    export=(), export_bf16=False, report="gguf")
STUDIES["gguf_llama"] = dict(
    about="The llama.cpp study on a Llama (config/mini_llama2_gguf.py, llama.cpp's llama architecture): bf16 and "
          "llama-quantize, STE phases on llama.cpp's grids, learned and error-ranked per-tensor mixes at the sizes "
          "of llama.cpp's Q3_K_M, Q3_K_S and Q2_K on this model",
    arms=gguf_arms(GGUF_LLAMA_CONFIG, GGUF_LLAMA_STEPS), seeds=GGUF_SEEDS, export=(), export_bf16=False,
    report="gguf")

# --- the runs of an arm ---------------------------------------------------------------------------
SHORT = {"method": "", "learning_rate": "lr", "optimizer": "", "b_init": "binit", "b_target": "btarget",
         "bitwidth_weight_decay": "bwd", "target_format": "", "pqt_start": "from", "ste_start": "ste",
         "bits_per_weight": "bpw", "max_iters": "n", "lr_decay_iters": "decay", "eval_interval": "eval"}


def run_name(a, seed):
    """A directory name for one run, readable and unique for (config, overrides, seed)."""
    stem = os.path.basename(a["config"])[:-3].removeprefix("mini_")
    keys = sorted(a["overrides"], key=lambda k: (k != "method", k))
    value = {k: f"{v:g}" if isinstance(v, float) else str(v) for k, v in a["overrides"].items()}
    parts = [stem] + [SHORT.get(k, k) + value[k] for k in keys] + [f"s{seed}"]
    return re.sub(r"[^A-Za-z0-9.=+-]+", "_", "-".join(parts)).strip("_").replace("_-", "-")


def runs_of(study):
    """[(name, arm, seed)] of a study: every arm with every seed, arms first."""
    return [(run_name(a, s), a, s) for a in study["arms"] for s in a.get("seeds", study["seeds"])]


def train_args(a, seed, out_dir):
    """train.py's arguments for one run (without --init_from)."""
    return [a["config"], *(f"--{k}={v}" for k, v in a["overrides"].items()), f"--seed={seed}", f"--out_dir={out_dir}"]


def arm_label(a):
    return " ".join([os.path.basename(a["config"])] + [f"{k}={v}" for k, v in a["overrides"].items()])


def arm_steps(a):
    """(first, last) step a run of arm a trains: from 0, or from its fork step (an arm with a trunk
    starts from the trunk's checkpoint at pqt_start), to max_iters (its override, else its config's)."""
    last = a["overrides"].get("max_iters")
    last = config_settings(a["config"]).get("max_iters") if last is None else last
    if last is None:
        raise StudyError(f"{a['config']} sets no max_iters, nor does the arm {arm_label(a)}; a study's run must say "
                         f"how long it trains")
    return (a["overrides"]["pqt_start"] if a.get("trunk") else 0), last


def reference_arm(a):
    """The bf16 arm an arm is paired with: the same config and overrides, less what only PQT reads
    (figures.PQT_ONLY: the method's settings, its phases), method bf16; None for a bf16 arm. With the
    same seed the two start from the same weights and see the same batches, so their difference per
    seed is free of the seed-to-seed spread."""
    if a["overrides"].get("method", "bf16") == "bf16":
        return None
    return arm(a["config"], **{**{k: v for k, v in a["overrides"].items() if k not in PQT_ONLY}, "method": "bf16"})
