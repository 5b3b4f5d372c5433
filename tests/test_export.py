"""export.py: element formats against torch's casts and hand-decoded bits, OCP MX block scales,
Table C's choice of format, the file, the quantized loss, bad input."""
import hashlib
import json
import math
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import export as E
import train
import util
from conftest import ROOT, greedy_text
from data import loader
from files import lowbit
from model import GPT, ModelConfig
from quant import formats
from step import get_lr

# Contract of the model: the role of each Linear of a transformer block, by its path in the block.
ROLES = {"gpt2": {"attn.c_attn": "qkv", "attn.c_proj": "out", "mlp.c_fc": "up", "mlp.c_proj": "down"},
         "llama2": {"attn.q": "q", "attn.k": "k", "attn.v": "v", "attn.out": "out",
                    "mlp.gate": "gate", "mlp.up": "up", "mlp.down": "down"}}
FMT = {f.name: f for f in lowbit.FORMATS}


def make_checkpoint(out_dir, data_dir, arch="gpt2", pqt_roles=None, b_t=None, layout="new", nan=False, seed=0):
    """A tiny model's checkpoint with b_i on the layers of `pqt_roles` (None: all roles; (): a bf16 run).

    b_t(name, shape) gives the wanted b_t of each block; b_i follows from Eq. 11 with b_init 6, b_target 4.
    n_embd = 48: 32x32 blocks with partial edges everywhere.
    """
    torch.manual_seed(seed)
    arch_args = dict(arch=arch, n_layer=2, n_head=2, n_embd=48, vocab_size=256, block_size=32, bias=arch == "gpt2")
    model = GPT(ModelConfig(**arch_args))
    sd = model.state_dict()
    roles = ROLES[arch]
    pqt_roles = set(roles.values()) if pqt_roles is None else set(pqt_roles)
    gen = torch.Generator().manual_seed(seed)
    for key in list(sd):
        path = ".".join(key.split(".")[3:-1])
        if key.startswith("transformer.h.") and key.endswith(".weight") and roles.get(path) in pqt_roles:
            m, n = sd[key].shape
            shape = (-(-m // 32), -(-n // 32))
            want = b_t(key[:-7], shape) if b_t else 4.0 + 4.0 * torch.rand(shape, generator=gen, dtype=torch.float64)
            sd[key[:-7] + ".b_i"] = ((torch.as_tensor(want, dtype=torch.float64) - 4.0) / 2.0).float()
    if nan:
        sd["transformer.h.1.attn.c_attn.weight"][3, 5] = float("nan")
    method = "bf16" if not pqt_roles else "gaussws[all]"
    pqt = dict(method=method, b_init=6.0, b_target=4.0)
    ckpt = dict(model=sd, optimizer=[], model_args=dict(arch_args), iter_num=7, best_val_loss=9.0,
                config=dict(dataset=data_dir, seed=1337, batch_size=4, block_size=32, eval_iters=3, dtype="float32"))
    if layout == "new":
        ckpt["pqt"] = pqt
    else:
        ckpt["model_args"].update(pqt)
    os.makedirs(out_dir, exist_ok=True)
    torch.save(ckpt, os.path.join(out_dir, "ckpt.pt"))
    return sd


def run(argv, capsys):
    if not any(a.startswith("--plot=") for a in argv):
        argv = [*argv, "--plot=False"]  # matplotlib takes seconds; one test draws
    rc = util.cli(E.main, [str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def run_json(argv, capsys, path):
    """run() with --json=path: (exit status, the JSON it wrote, stdout, stderr)."""
    rc, out, err = run([*argv, f"--json={path}"], capsys)
    if rc:
        return rc, None, out, err
    with open(path) as f:
        return rc, json.load(f), out, err


def blocks_of(w):
    """(i, j, view) of every 32x32 block of w, edge blocks partial."""
    m, n = w.shape
    return [(i // 32, j // 32, w[i:i + 32, j:j + 32]) for i in range(0, m, 32) for j in range(0, n, 32)]


# --- element formats -------------------------------------------------------------------------

def hand_decode(code, e, m):
    """The value of an FP code (sign, e exponent bits, m mantissa bits, no Inf/NaN) from its bits."""
    bias = 2 ** (e - 1) - 1
    s, E_, M = code >> (e + m), (code >> m) & (2 ** e - 1), code & (2 ** m - 1)
    value = 2.0 ** (1 - bias) * M / 2 ** m if E_ == 0 else 2.0 ** (E_ - bias) * (1 + M / 2 ** m)
    return -value if s else value


SMALL = [("mxfp4", 2, 1), ("mxfp6_e2m3", 2, 3), ("mxfp6_e3m2", 3, 2)]


@pytest.mark.parametrize("name,e,m", SMALL)
def test_every_code_of_fp4_and_fp6_decodes_as_its_bits_say(name, e, m):
    codes = torch.arange(2 ** (1 + e + m))
    expected = torch.tensor([hand_decode(c, e, m) for c in codes.tolist()], dtype=torch.float64)
    if name == "mxfp4":  # the eight magnitudes of e2m1, as the OCP MX v1.0 spec lists them
        assert expected[:8].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert torch.equal(formats.fp_decode(codes, FMT[name]), expected)
    assert expected.abs().max().item() == FMT[name].max
    assert torch.equal(formats.fp_round(expected, FMT[name]), expected)  # grid values stay
    assert torch.equal(formats.fp_encode(expected, FMT[name]), codes)  # and encode to their own bits


def nearest_even(v, grid, codes):
    """Brute force: the grid value nearest to v; at a tie, the one with an even code (mantissa LSB 0)."""
    d = (v[:, None] - grid[None, :]).abs()
    best = d.min(dim=1, keepdim=True).values
    tie_break = (d == best) * (2 - (codes % 2))[None, :]  # even codes score 2, odd 1
    return grid[tie_break.argmax(dim=1)]


@pytest.mark.parametrize("name,e,m", SMALL)
def test_rounding_is_to_nearest_with_ties_to_even_and_saturates(name, e, m):
    fmt = FMT[name]
    codes = torch.arange(2 ** (e + m))  # the non-negative half
    grid = torch.tensor([hand_decode(c, e, m) for c in codes.tolist()], dtype=torch.float64)
    midpoints = (grid[1:] + grid[:-1]) / 2
    v = torch.cat([torch.rand(2000, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 1.5 * fmt.max,
                   midpoints, grid, torch.tensor([fmt.max * 1.01, fmt.max * 3, 1e4])])
    expected = nearest_even(v, grid, codes)
    assert torch.equal(formats.fp_round(v, fmt), expected)
    assert torch.equal(formats.fp_round(-v, fmt), -expected)
    if name == "mxfp4":
        got = formats.fp_round(torch.tensor([0.25, 0.75, 1.25, 2.5, 5.0, 7.0, 1e9], dtype=torch.float64), fmt)
        assert got.tolist() == [0.0, 1.0, 1.0, 2.0, 4.0, 6.0, 6.0]  # ties to the even code; 7 and beyond saturate


@pytest.mark.parametrize("name,dtype", [("mxfp8_e4m3", torch.float8_e4m3fn), ("mxfp8_e5m2", torch.float8_e5m2),
                                        ("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_fp8_fp16_bf16_match_torch_casts(name, dtype):
    """Values and bits as torch's round-to-nearest-even casts, once saturated at the largest finite value
    (torch's fp8 casts give NaN or Inf beyond it): normals, subnormals, exact ties, zeros, overflow."""
    fmt = FMT[name]
    bits = 8 * torch.tensor([], dtype=dtype).element_size()
    every = torch.arange(2 ** bits, dtype=torch.int64).to(torch.uint8 if bits == 8 else torch.int16).view(dtype).float()
    every = every[torch.isfinite(every)].unique()  # every finite value of the format
    ties = (every[1:].double() + every[:-1].double()) / 2
    gen = torch.Generator().manual_seed(2)
    spread = torch.randn(20000, generator=gen) * torch.exp2(torch.randint(-30, 20, (20000,), generator=gen).float())
    x = torch.cat([every, ties.float(), spread, torch.tensor([0.0, -0.0, fmt.max * 1.5, -fmt.max * 4, 3e38])])
    x = x[torch.isfinite(x)]
    assert torch.equal(ties.float().double(), ties)  # the ties are exact in float32, so they really are ties
    ref = x.clamp(-fmt.max, fmt.max).to(dtype)
    got = formats.fp_round(x.double(), fmt)
    assert torch.equal(got, ref.double())
    ref_bits = ref.view(torch.uint8 if bits == 8 else torch.int16).long() & (2 ** bits - 1)
    assert torch.equal(formats.fp_encode(got, fmt), ref_bits)
    assert torch.equal(formats.fp_decode(ref_bits, fmt), ref.double())


def test_int_formats_are_symmetric_absmax_grids_with_ties_to_even():
    for bits in (2, 3, 4, 8):
        fmt, levels = FMT[f"int{bits}"], 2 ** (bits - 1) - 1
        w = torch.randn(40, 70, generator=torch.Generator().manual_seed(bits))
        w[:32, 32:64] = 0.0  # an all-zero block
        t = lowbit.quantize_weight("w", w, torch.full((2, 3), lowbit.BY_NAME[fmt.name], dtype=torch.uint8))
        got = lowbit.dequantize_weight(t, 40, 70).double()
        s = t[f"{fmt.name}.scales"].double()
        assert len(s) == 6 and s[1] == 0 and torch.equal(got[:32, 32:64], torch.zeros(32, 32, dtype=torch.float64))
        for (i, j, block), scale in zip(blocks_of(w.double()), s.tolist()):
            if scale == 0:
                continue
            amax = block.abs().max().item()
            below = (torch.tensor(scale, dtype=torch.bfloat16).view(torch.int16) - 1).view(torch.bfloat16).item()
            assert below < amax / levels <= scale  # the smallest BF16 scale that keeps amax within the levels
            q = got[32 * i:32 * i + 32, 32 * j:32 * j + 32] / scale
            assert torch.equal(q, q.round()) and q.abs().max() == levels  # the largest weight reaches the top level
            assert ((q * scale - block).abs() <= scale / 2 + 1e-12).all()  # nearest level
    w = torch.tensor([[3.0, 0.5, 1.5, 2.5, -0.5, -2.5, 9.0 / 8]])  # int3: levels -3..3, amax 3 so s = 1
    t = lowbit.quantize_weight("w", w, torch.full((1, 1), lowbit.BY_NAME["int3"], dtype=torch.uint8))
    assert lowbit.dequantize_weight(t, 1, 7).tolist() == [[3.0, 0.0, 2.0, 2.0, 0.0, -2.0, 1.0]]


def test_nan_or_inf_in_a_weight_is_refused():
    for bad in (float("nan"), float("inf")):
        w = torch.ones(8, 8)
        w[2, 3] = bad
        with pytest.raises(lowbit.ExportError, match="non-finite"):
            lowbit.quantize_weight("h.0.w", w, torch.zeros(1, 1, dtype=torch.uint8))


# --- scales ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["mxfp4", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2"])
def test_e8m0_scale_of_each_block_from_its_absmax(name):
    """OCP MX v1.0: X = 2^(floor(log2 amax) - emax), emax of the element format; edge blocks too."""
    emax = {"mxfp4": 2, "mxfp6_e3m2": 4, "mxfp8_e4m3": 8, "mxfp8_e5m2": 15}[name]
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(70, 45, generator=gen)
    for i, j, block in blocks_of(w):
        block.mul_(2.0 ** (5 * i - 4 * j + torch.rand((), generator=gen).item()))
    w[64:, :32] = 0.0  # an all-zero edge block
    t = lowbit.quantize_weight("w", w, torch.full((3, 2), lowbit.BY_NAME[name], dtype=torch.uint8))
    scales = t[f"{name}.scales"].tolist()
    got = lowbit.dequantize_weight(t, 70, 45)
    for (i, j, block), code in zip(blocks_of(w), scales):
        amax = block.abs().max().item()
        if amax == 0:
            assert code == 0 and (got[32 * i:32 * i + 32, 32 * j:32 * j + 32] == 0).all()
            continue
        k = math.frexp(amax)[1] - 1 - emax
        assert code == k + 127
        assert 2.0 ** emax <= amax / 2.0 ** k < 2.0 ** (emax + 1)


# --- Table C ---------------------------------------------------------------------------------

# b_t -> the smallest format Table C allows (exponent bits >= ceil(log2(b_t + 3)), mantissa >= b_t - 2).
AUTO = {1: "mxfp4", 4: "mxfp6_e3m2", 4.01: "mxfp8_e4m3", 5: "mxfp8_e4m3", 5.01: "bf16", 9: "bf16",
        12: "fp16", 12.01: "fp32"}
AUTO_INT = {1: "int2", 4: "int4", 4.01: "int5", 5: "int5", 5.01: "int6", 9: "int9", 12: "int12", 12.01: "int13"}


def test_auto_and_auto_int_pick_the_rules_format_from_the_file(tiny_corpus, tmp_path, capsys):
    values = list(AUTO)

    def b_t(name, shape):  # the first layer gets the tier edges, one per block; the rest b_t = 6
        out = torch.full(shape, 6.0, dtype=torch.float64)
        if name == "transformer.h.0.mlp.c_fc":  # (192, 48): 6 x 2 blocks
            out.view(-1)[:len(values)] = torch.tensor(values, dtype=torch.float64)
        return out
    make_checkpoint(tmp_path, tiny_corpus, b_t=b_t)
    rc, out, err = run([f"--out_dir={tmp_path}", "--format=auto,auto-int", "--evaluate=False"], capsys)
    assert rc == 0, err
    for fmt, table in (("auto", AUTO), ("auto-int", AUTO_INT)):
        ids = load_tensors(tmp_path / f"model-{fmt}.safetensors")["transformer.h.0.mlp.c_fc.weight.format"]
        names = [lowbit.FORMATS[i].name for i in ids.flatten().tolist()]
        assert names[:len(values)] == [table[v] for v in values]
        assert set(names[len(values):]) == {"bf16" if fmt == "auto" else "int6"}
    names = lambda ids: [lowbit.FORMATS[i].name for i in ids.tolist()]  # noqa: E731
    assert names(lowbit.auto_format_ids(torch.tensor([0.5, -2.0]))) == ["mxfp4", "mxfp4"]
    assert names(lowbit.auto_int_format_ids(torch.tensor([0.5, 1.5]))) == ["int2", "int2"]


# --- the file --------------------------------------------------------------------------------

def load_tensors(path):
    from safetensors.torch import load_file
    return load_file(str(path))


def header_bytes(path):
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def expected_weight(w, b_t, fmt):
    """The dequantized weight by independent means: torch's casts for fp8/fp16/bf16, the brute-force
    nearest-even grid for fp4/fp6, the OCP scale from each block's absmax; per block for auto."""
    out = torch.empty_like(w)
    for i, j, block in blocks_of(w):
        name = fmt if fmt != "auto" else next(n for bound, n in ((1, "mxfp4"), (4, "mxfp6_e3m2"), (5, "mxfp8_e4m3"),
                                                                   (9, "bf16"), (12, "fp16"), (math.inf, "fp32"))
                                              if b_t[i, j] <= bound)
        f, amax = FMT[name], block.abs().max().item()
        if f.kind == "int":  # levels -Q..Q times the smallest BF16 scale s with amax / s <= Q
            Q = 2 ** (f.bits - 1) - 1
            s = torch.tensor(amax / Q, dtype=torch.float64).to(torch.bfloat16)
            if s.item() < amax / Q:
                s = (s.view(torch.int16) + 1).view(torch.bfloat16)
            s = s.item()
            out[32 * i:32 * i + 32, 32 * j:32 * j + 32] = ((block / s).round().clamp(-Q, Q) * s).float() if s else 0.0
            continue
        X = 1.0 if not f.scaled else (2.0 ** (math.frexp(amax)[1] - 1 - f.emax) if amax else 2.0 ** -127)
        v = (block / X).clamp(-f.max, f.max)
        torch_dtype = {"mxfp8_e4m3": torch.float8_e4m3fn, "mxfp8_e5m2": torch.float8_e5m2, "fp16": torch.float16,
                       "bf16": torch.bfloat16, "fp32": torch.float32}.get(name)
        if torch_dtype is not None:
            q = v.to(torch_dtype).double()
        else:
            e, m = {"mxfp4": (2, 1), "mxfp6_e2m3": (2, 3), "mxfp6_e3m2": (3, 2)}[name]
            codes = torch.arange(2 ** (e + m))
            grid = torch.tensor([hand_decode(c, e, m) for c in codes.tolist()], dtype=torch.float64)
            q = (nearest_even(v.abs().flatten().double(), grid, codes) * v.sign().flatten()).view(v.shape)
        out[32 * i:32 * i + 32, 32 * j:32 * j + 32] = (q * X).float()
    return out


@pytest.mark.parametrize("arch", ["gpt2", "llama2"])
def test_file_gives_back_the_quantized_values_bit_for_bit_and_its_size_is_the_bits(arch, tiny_corpus, tmp_path, capsys):
    def b_t(name, shape):  # every tier of auto, and all-zero blocks below
        out = 0.5 + 13.0 * torch.rand(shape, generator=torch.Generator().manual_seed(len(name)), dtype=torch.float64)
        out.view(-1)[0] = 0.7
        return out
    sd = make_checkpoint(tmp_path, tiny_corpus, arch=arch, b_t=b_t)
    pqt_layers = [k[:-4] for k in sd if k.endswith(".b_i")]
    zeroed = pqt_layers[0] + ".weight"
    sd[zeroed][:32, :32] = 0.0
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    ckpt["model"][zeroed][:32, :32] = 0.0
    torch.save(ckpt, tmp_path / "ckpt.pt")
    formats = ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp4", "bf16", "int4", "auto"]
    rc, report, out, err = run_json([f"--out_dir={tmp_path}", f"--format={','.join(formats)}", "--evaluate=False"],
                                    capsys, tmp_path / "export.json")
    assert rc == 0, err
    exports = {r["format"]: r for r in report["exports"]}
    bits = {"mxfp8_e4m3": 8, "mxfp8_e5m2": 8, "mxfp6_e2m3": 6, "mxfp4": 4, "bf16": 16, "int4": 4}
    scale_bytes = {"mxfp8_e4m3": 1, "mxfp8_e5m2": 1, "mxfp6_e2m3": 1, "mxfp4": 1, "bf16": 0, "int4": 2}
    for fmt in formats:
        path = tmp_path / f"model-{fmt}.safetensors"
        model, info = lowbit.load(str(path))
        got = model.state_dict()
        for layer in pqt_layers:
            w = sd[layer + ".weight"].double()
            b = 4.0 + 2.0 * sd[layer + ".b_i"].double()
            assert torch.equal(got[layer + ".weight"], expected_weight(w, b, fmt)), (fmt, layer)
        others = {k: v for k, v in sd.items() if not k.endswith(".b_i") and k[:-7] not in pqt_layers}
        for k, v in others.items():
            assert torch.equal(got[k], v.to(torch.bfloat16).float()), k
        if arch == "gpt2":
            assert model.lm_head.weight is model.transformer.wte.weight
        # the size on disk: header + BF16 tensors (a tied weight once) + the quantized bytes the mix reports
        other_bytes = 2 * sum(v.numel() for k, v in others.items() if not (arch == "gpt2" and k == "lm_head.weight"))
        n = sum(sd[layer + ".weight"].numel() for layer in pqt_layers)
        quantized_bytes = exports[fmt]["quantized_bytes"]
        assert exports[fmt]["bits_per_weight"] * n / 8 == pytest.approx(quantized_bytes, abs=1e-6)
        assert os.path.getsize(path) == header_bytes(path) + other_bytes + quantized_bytes
        assert exports[fmt]["file_bytes"] == os.path.getsize(path)
        if fmt in bits:  # by hand: packed codes of each layer, one scale and one format id per block
            by_hand = sum(math.ceil(sd[layer + ".weight"].numel() * bits[fmt] / 8)
                          + (1 + scale_bytes[fmt]) * sd[layer + ".b_i"].numel() for layer in pqt_layers)
            assert quantized_bytes == by_hand
            assert exports[fmt]["share"] == {fmt: 1.0}
        assert info["format"] == fmt and info["meta"]["tokenizer"] == "bytes"
        assert info["pqt"] == dict(method="gaussws[all]", b_init=6.0, b_target=4.0, pqt_start=0.0, target_format="",
                                   ste_start=0.0, bits_per_weight=0.0)  # no phase, no budget: what read() fills in
    assert set(exports["auto"]["share"]) == {"mxfp4", "mxfp6_e3m2", "mxfp8_e4m3", "bf16", "fp16", "fp32"}


def test_reported_loss_is_the_loss_of_the_model_rebuilt_from_the_file(tiny_corpus, tmp_path, capsys):
    sd = make_checkpoint(tmp_path, tiny_corpus, layout="old")  # the older checkpoint layout reads the same
    rc, report, out, err = run_json([f"--out_dir={tmp_path}", "--format=mxfp4,auto,int3"], capsys, tmp_path / "e.json")
    assert rc == 0, err
    val = np.fromfile(os.path.join(tiny_corpus, "val.bin"), dtype=np.uint16).astype(np.int64)

    def loss_of(model):  # train.py's evaluation batches, written out again
        losses = []
        for k in range(3):
            ix = torch.randint(len(val) - 33, (4,), generator=loader.batch_generator(1337, "val", "eval", k)).tolist()
            x = torch.stack([torch.from_numpy(val[i:i + 32]) for i in ix])
            y = torch.stack([torch.from_numpy(val[i + 1:i + 33]) for i in ix])
            with torch.no_grad():
                logits, _ = model.eval()(x, y)
            losses.append(F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)).item())
        return sum(losses) / len(losses)
    reference = GPT(ModelConfig(arch="gpt2", n_layer=2, n_head=2, n_embd=48, vocab_size=256, block_size=32))
    reference.load_state_dict({k: v for k, v in sd.items() if not k.endswith(".b_i")})
    for r in report["exports"]:
        model, _ = lowbit.load(r["path"])
        assert r["val_loss"] == pytest.approx(loss_of(model), rel=1e-6)
        assert r["val_loss_unquantized"] == pytest.approx(loss_of(reference), rel=1e-6)
        assert r["increase_pct"] == pytest.approx(100 * (r["val_loss"] / r["val_loss_unquantized"] - 1))
    assert report["exports"][0]["val_loss"] != report["exports"][0]["val_loss_unquantized"]


# --- the bitwidth report ---------------------------------------------------------------------

def test_bitwidth_report_shares_of_weights_per_tier(tiny_corpus, tmp_path, capsys):
    tiers = {"qkv": 3.5, "out": 4.5, "up": 7.0, "down": 13.0}
    roles = ROLES["gpt2"]

    def b_t(name, shape):
        return torch.full(shape, tiers[roles[".".join(name.split(".")[3:])]], dtype=torch.float64)
    sd = make_checkpoint(tmp_path, tiny_corpus, b_t=b_t)
    rc, out, err = run([f"--out_dir={tmp_path}", "--format=auto", "--evaluate=False", "--plot=True"], capsys)
    assert rc == 0, err
    report = json.loads((tmp_path / "bitwidths.json").read_text())
    role_of = {k: roles.get(".".join(k.split(".")[3:-1])) for k in sd if k.endswith(".weight")}
    weights = {role: sum(sd[k].numel() for k, r in role_of.items() if r == role) for role in tiers}
    total = sum(weights.values())
    assert report["overall"]["tiers"] == pytest.approx({"<=4": weights["qkv"] / total, "4-5": weights["out"] / total,
                                                        "5-9": weights["up"] / total, "9-12": 0.0,
                                                        ">12": weights["down"] / total})
    assert report["overall"]["mean"] == pytest.approx(sum(tiers[r] * weights[r] for r in tiers) / total)
    assert report["roles"]["up"]["tiers"]["5-9"] == 1.0 and report["roles"]["up"]["weights"] == weights["up"]
    assert (tmp_path / "bitwidths.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "qkv" in out and "mxfp6_e3m2" in out


# --- bad input -------------------------------------------------------------------------------

def test_bad_input_is_one_line_and_changes_nothing(tiny_corpus, tmp_path, capsys):
    rc, out, err = run([f"--out_dir={tmp_path / 'none'}"], capsys)
    assert rc == 1 and "no checkpoint at" in err and len(err.strip().splitlines()) == 1

    make_checkpoint(tmp_path, tiny_corpus)
    rc, out, err = run([f"--out_dir={tmp_path}", "--format=auto,mxfp5"], capsys)
    assert rc == 1 and "unknown format 'mxfp5'" in err and "mxfp4" in err and len(err.strip().splitlines()) == 1

    target = tmp_path / "model-mxfp4.safetensors"
    target.write_bytes(b"keep")
    rc, out, err = run([f"--out_dir={tmp_path}", "--format=mxfp4", "--evaluate=False"], capsys)
    assert rc == 1 and "exists" in err and "--overwrite=True" in err and target.read_bytes() == b"keep"
    rc, out, err = run([f"--out_dir={tmp_path}", "--format=mxfp4", "--evaluate=False", "--overwrite=True"], capsys)
    assert rc == 0, err
    assert lowbit.load(str(target))[1]["format"] == "mxfp4"

    with pytest.raises(lowbit.ExportError, match="not a model file written by export.py"):
        lowbit.load(str(tmp_path / "ckpt.pt"))

    make_checkpoint(tmp_path / "nan", tiny_corpus, nan=True)
    rc, out, err = run([f"--out_dir={tmp_path / 'nan'}", "--format=mxfp4"], capsys)
    assert rc == 1 and "non-finite" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "nan" / "model-mxfp4.safetensors").exists()


def test_a_run_without_pqt_layers_has_nothing_for_auto_to_choose_from(tiny_corpus, tmp_path, capsys):
    make_checkpoint(tmp_path, tiny_corpus, pqt_roles=())
    rc, out, err = run([f"--out_dir={tmp_path}", "--format=auto,mxfp4", "--evaluate=False"], capsys)
    assert rc == 0, err
    note = [line for line in out.splitlines() if line.startswith("note:")]
    assert len(note) == 1 and "no PQT layers" in note[0] and "no learned b_t" in note[0] and "bf16" in note[0]
    auto = load_tensors(tmp_path / "model-auto.safetensors")
    ids = [v for k, v in auto.items() if k.endswith(".weight.format")]
    assert len(ids) == 8 and all((v == lowbit.BY_NAME["bf16"]).all() for v in ids)  # every block Linear, in bf16
    mxfp4 = load_tensors(tmp_path / "model-mxfp4.safetensors")
    assert sum(k.endswith(".weight.format") for k in mxfp4) == 8  # post-training quantization of a bf16 run
    assert not (tmp_path / "bitwidths.json").exists()


def test_command_line_error_has_no_traceback(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "export.py"), f"--out_dir={tmp_path}", "--format=fp5"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 1 and p.stderr.strip().count("\n") == 0 and "unknown format 'fp5'" in p.stderr


# --- --json=PATH -------------------------------------------------------------------------------

def test_json_path_gets_the_summary_the_tables_print(tiny_corpus, tmp_path, capsys):
    """--json=PATH writes one JSON object (as bench.py's --json): the checkpoint, its step, and per
    format the file written (its size as on disk) and the val losses the printed table shows."""
    make_checkpoint(tmp_path / "run", tiny_corpus)
    rc, report, out, err = run_json([f"--out_dir={tmp_path / 'run'}", "--format=mxfp4,int4"], capsys,
                                    tmp_path / "out.json")
    assert rc == 0, err
    assert set(report) == {"checkpoint", "iter_num", "notes", "bitwidths", "exports"}
    assert report["checkpoint"] == str(tmp_path / "run" / "ckpt.pt") and report["iter_num"] == 7
    assert set(report["bitwidths"]["roles"]) == {"qkv", "out", "up", "down"}
    table = {line.split()[0]: line.split() for line in out.split("val loss on")[1].splitlines()[2:] if line.strip()}
    assert [r["format"] for r in report["exports"]] == ["mxfp4", "int4"]
    for r in report["exports"]:
        assert r["path"] == str(tmp_path / "run" / f"model-{r['format']}.safetensors")
        assert r["file_bytes"] == os.path.getsize(r["path"])
        assert f"{r['val_loss']:.4f}" == table[r["format"]][1]
        assert f"{r['val_loss_unquantized']:.4f}" == table[r["format"]][2]
    assert out.strip().splitlines()[-1] == f"wrote {tmp_path / 'out.json'}"
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []  # written atomically: no temporary left


@pytest.mark.parametrize("path,message", [("True", "takes the path of the JSON file"),
                                          ("{tmp}", "is a directory"),
                                          ("{tmp}/no/such/dir/x.json", "does not exist")])
def test_a_bad_json_path_is_one_line_before_any_work(tiny_corpus, tmp_path, capsys, path, message):
    make_checkpoint(tmp_path, tiny_corpus)
    rc, out, err = run([f"--out_dir={tmp_path}", "--format=mxfp4", f"--json={path.format(tmp=tmp_path)}"], capsys)
    assert rc == 1 and len(err.strip().splitlines()) == 1 and message in err and "--json=" in err
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]  # nothing written


# --- the runs whose b_t falls ----------------------------------------------------------------

def test_cpu_configs_pull_b_t_into_the_low_tiers_and_have_a_bf16_twin(capsys):
    """config/cpu/: each passes train.py's dry run; AdamW's decoupled decay alone (b_i *= 1 - lr * decay
    every step, lr on the config's schedule, step.get_lr) leaves b_t <= 5 (lowbit) and < 3 (3bit);
    the bf16 twin differs only in its method and out_dir."""
    settings = {}
    for name in ("gaussws_lowbit", "gaussws_3bit", "bf16"):
        path = os.path.join(ROOT, "config", "cpu", name + ".py")
        train.main([path, "--dry_run=True"])
        settings[name] = json.loads(capsys.readouterr().out.split("\nparameters")[0])
    for name, ceiling in (("gaussws_lowbit", 5.0), ("gaussws_3bit", 3.0)):
        s = settings[name]
        b_i = 1.0
        for it in range(s["max_iters"]):
            b_i *= 1 - get_lr(it, s) * s["bitwidth_weight_decay"]
        assert s["b_target"] + b_i * (s["b_init"] - s["b_target"]) < ceiling - 0.3, name
        assert s["method"] == "gaussws[all]" and s["dataset"] == "default"
    differ = {k for k in settings["bf16"] if settings["bf16"][k] != settings["gaussws_lowbit"][k]}
    assert differ <= {"out_dir", "method", "b_target", "bitwidth_weight_decay", "model_args"}
    assert settings["bf16"]["method"] == "bf16" and settings["bf16"]["seed"] == settings["gaussws_lowbit"]["seed"]


def test_sample_py_generates_from_an_exported_file(tiny_corpus, tmp_path, capsys):
    import sample
    make_checkpoint(tmp_path, tiny_corpus)
    rc, out, err = run([f"--out_dir={tmp_path}", "--format=mxfp4"], capsys)
    assert rc == 0, err
    path = str(tmp_path / "model-mxfp4.safetensors")
    sample.main([f"--init_from={path}", "--start=def ", "--num_samples=1", "--max_new_tokens=8",
                 "--temperature=0.0", "--device=cpu"])
    text = capsys.readouterr().out.split("\n---------------")[0]
    model, _ = lowbit.load(path)  # the dequantized model
    assert text == greedy_text(model, "def ", 8)
    with pytest.raises(sample.UsageError, match="expected 'resume' or a .safetensors file"):
        sample.main([f"--init_from={tmp_path / 'ckpt.pt'}", "--device=cpu"])


def test_an_exported_file_goes_to_transformers_with_its_dequantized_weights(tiny_corpus, tmp_path, capsys):
    import transformers
    import hf
    make_checkpoint(tmp_path, tiny_corpus)
    rc, out, err = run([f"--out_dir={tmp_path}", "--format=int4"], capsys)
    assert rc == 0, err
    path = str(tmp_path / "model-int4.safetensors")
    hf.main([f"--ckpt={path}", f"--out={tmp_path / 'hf'}"])
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours, _ = lowbit.load(path)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(x, torch.zeros_like(x))[0], theirs(x).logits
    assert (a - b).abs().max().item() <= 1e-5 * (1 + b.abs().max().item())  # FP32, as tests/test_hf.py


# --- a file is verified before it is loaded ----------------------------------------------------

@pytest.fixture(scope="module")
def exported(tiny_corpus, tmp_path_factory):
    """Good files of a small PQT run: mxfp4 (E8M0 scales), int4 (BF16 scales), auto (a mix)."""
    d = tmp_path_factory.mktemp("exported")
    make_checkpoint(d, tiny_corpus)
    assert util.cli(E.main, [f"--out_dir={d}", "--format=mxfp4,int4,auto", "--evaluate=False", "--plot=False"]) == 0
    return d


def raw_header(data):
    """(tensor entries, metadata, where the tensor bytes start) of safetensors bytes, read by hand."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    return header, header.pop("__metadata__"), 8 + n


def file_parts(path):
    """(tensors, metadata) of a file, read by safetensors itself."""
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())


def seal(path, tensors, metadata):
    """Write a file as export.py would, its checksums made here by hand: SHA-256 of each tensor's bytes
    in the file, and of the other metadata entries as JSON with sorted keys."""
    from safetensors.torch import save
    meta = {k: v for k, v in metadata.items() if k != "sha256"}
    header, _, base = raw_header(save(tensors, metadata=meta))  # the tensors' byte ranges, as in the final file
    data = save(tensors, metadata=meta)
    sums = {k: hashlib.sha256(data[base + e["data_offsets"][0]:base + e["data_offsets"][1]]).hexdigest()
            for k, e in header.items()}
    meta["sha256"] = json.dumps({"tensors": sums, "metadata": hashlib.sha256(json.dumps(meta, sort_keys=True)
                                                                             .encode()).hexdigest()})
    with open(path, "wb") as f:
        f.write(save(tensors, metadata=meta))
    return str(path)


def test_a_file_records_the_checksum_of_every_tensor_and_of_its_metadata(exported):
    for fmt in ("mxfp4", "int4", "auto"):
        data = (exported / f"model-{fmt}.safetensors").read_bytes()
        header, metadata, base = raw_header(data)
        sums = json.loads(metadata["sha256"])
        assert sums["tensors"] == {k: hashlib.sha256(data[base + e["data_offsets"][0]:base + e["data_offsets"][1]])
                                   .hexdigest() for k, e in header.items()}
        rest = {k: v for k, v in metadata.items() if k != "sha256"}
        assert sums["metadata"] == hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()
        assert metadata["pqt_export"] == "2"


def flip_byte(name):
    def corrupt(data):
        header, _, base = raw_header(data)
        at = base + header[name]["data_offsets"][0] + 1
        return data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1:]
    return corrupt


def edit_metadata(key, value):
    def corrupt(data):  # the header rewritten, its tensors' bytes kept: only the metadata's checksum can tell
        header, metadata, base = raw_header(data)
        header["__metadata__"] = {**metadata, key: value}
        text = json.dumps(header).encode()
        return struct.pack("<Q", len(text)) + text + data[base:]
    return corrupt


def older_export(data):
    header, metadata, base = raw_header(data)
    header["__metadata__"] = {k: ("1" if k == "pqt_export" else v) for k, v in metadata.items() if k != "sha256"}
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data[base:]


CORRUPT = {  # the mxfp4 file's bytes -> damaged bytes
    "a flipped bit in codes": flip_byte("transformer.h.0.mlp.c_fc.weight.mxfp4.codes"),
    "a flipped bit in a norm": flip_byte("transformer.ln_f.weight"),
    "a flipped bit in a scale": flip_byte("transformer.h.1.attn.c_proj.weight.mxfp4.scales"),
    "truncated": lambda data: data[:-100],
    "model_args edited": edit_metadata("model_args", json.dumps({"arch": "gpt2", "n_layer": 3, "n_head": 2,
                                                                 "n_embd": 48, "vocab_size": 256, "block_size": 32})),
    "cut inside the header": lambda data: data[:40],
    "empty": lambda data: b"",
}


@pytest.mark.parametrize("case", list(CORRUPT))
def test_a_damaged_file_is_refused_in_one_line(exported, tmp_path, case):
    path = tmp_path / "model.safetensors"
    path.write_bytes(CORRUPT[case]((exported / "model-mxfp4.safetensors").read_bytes()))
    with pytest.raises(lowbit.ExportError) as e:
        lowbit.load(str(path))
    message = str(e.value)
    assert "\n" not in message and str(path) in message
    assert ("checksum" in message if case not in ("cut inside the header", "empty")
            else "not a model file written by export.py" in message), message


def test_any_flipped_bit_or_cut_is_refused_in_one_line(exported):
    """Bits flipped at random anywhere in the file (header, metadata, tensors) and cuts at random lengths."""
    data = (exported / "model-auto.safetensors").read_bytes()
    rng = np.random.default_rng(0)
    damaged = [data[:int(n)] for n in rng.integers(0, len(data), 30)]
    for i, bit in zip(rng.integers(0, len(data), 300).tolist(), rng.integers(0, 8, 300).tolist()):
        damaged.append(data[:i] + bytes([data[i] ^ (1 << bit)]) + data[i + 1:])
    for d in damaged:
        with pytest.raises(lowbit.ExportError) as e:
            lowbit.rebuild(d)
        assert "\n" not in str(e.value)


def foreign(tiny_corpus, tmp_path):
    """safetensors files of other tools, or of an older export.py, that do not verify."""
    from safetensors.torch import save_file
    save_file({"w": torch.ones(3)}, tmp_path / "hf.safetensors", metadata={"format": "pt"})
    save_file({"transformer.wte.weight": torch.ones(3)}, tmp_path / "claims.safetensors",
              metadata={"pqt_export": "2", "model_args": "{}"})
    return {"another tool's": (tmp_path / "hf.safetensors", "not a model file written by export.py"),
            "one claiming to be an export": (tmp_path / "claims.safetensors", "checksums cannot be read"),
            "an older export": (tmp_path / "old.safetensors", "older export.py that recorded no checksums")}


def test_files_of_other_tools_and_older_exports_are_refused(exported, tiny_corpus, tmp_path):
    (tmp_path / "old.safetensors").write_bytes(older_export((exported / "model-mxfp4.safetensors").read_bytes()))
    for case, (path, expect) in foreign(tiny_corpus, tmp_path).items():
        with pytest.raises(lowbit.ExportError) as e:
            lowbit.load(str(path))
        assert expect in str(e.value) and "\n" not in str(e.value), (case, str(e.value))
    assert "export the run again" in str(e.value)


def set_tensor(name, fn):
    return lambda tensors, metadata: tensors.update({name: fn(tensors[name].clone())})


def set_meta(key, fn):
    return lambda tensors, metadata: metadata.update({key: fn(metadata[key])})


def args_with(**change):
    return set_meta("model_args", lambda s: json.dumps({**json.loads(s), **change}))


def drop(name):
    return lambda tensors, metadata: tensors.pop(name)


def bad_format_id(t):
    t.view(-1)[0] = 200
    return t


def set_first(value):
    def fn(t):
        t.view(-1)[0] = value
        return t
    return fn


C_FC = "transformer.h.0.mlp.c_fc.weight"
MALFORMED = {  # (file, change made to its tensors and metadata, then sealed with valid checksums, the message)
    "bad format id": ("mxfp4", set_tensor(f"{C_FC}.format", bad_format_id), "holds format id 200"),
    "metadata not JSON": ("mxfp4", set_meta("model_args", lambda s: s[:-3]), "'model_args' is not JSON"),
    "metadata of another type": ("mxfp4", set_meta("quantized", lambda s: "[1, 2]"), "'quantized' is a JSON list"),
    "a norm of another shape": ("mxfp4", set_tensor("transformer.ln_f.weight", lambda t: t[:40].clone()),
                                "transformer.ln_f.weight should be a float tensor of shape (48,), got"),
    "a quantized shape the model lacks": ("mxfp4", set_meta("quantized", lambda s: json.dumps(
        {**json.loads(s), C_FC: [100, 48]})), f"quantized weight {C_FC} [100, 48] is not a weight of the model"),
    "format ids of another shape": ("mxfp4", set_tensor(f"{C_FC}.format", lambda t: t[:-1].clone()),
                                    "one uint8 format id per 32x32 block (6, 2)"),
    "truncated codes": ("mxfp4", set_tensor(f"{C_FC}.mxfp4.codes", lambda t: t[:-1].clone()),
                        f"{C_FC}.mxfp4.codes should be torch.uint8 (4608,)"),  # 192 x 48 weights of 4 bits
    "missing scales": ("mxfp4", drop(f"{C_FC}.mxfp4.scales"), f"{C_FC}.mxfp4.scales should be torch.uint8 (12,)"),
    "scales of another dtype": ("int4", set_tensor(f"{C_FC}.int4.scales", lambda t: t.float()),
                                f"{C_FC}.int4.scales should be torch.bfloat16 (12,)"),
    "a missing norm": ("mxfp4", drop("transformer.ln_f.weight"), "transformer.ln_f.weight should be a float tensor"),
    "an extra tensor": ("mxfp4", lambda t, m: t.update(extra=torch.zeros(2)), "tensors the model does not have: "
                                                                              "['extra']"),
    "a missing metadata entry": ("mxfp4", lambda t, m: m.pop("quantized"), "lacks the metadata entry 'quantized'"),
    "unknown model_args keys": ("mxfp4", args_with(n_experts=4), "model_args has keys this project's model does "
                                                                  "not know: ['n_experts']"),
    "model_args of zero heads": ("mxfp4", args_with(n_head=0), "do not describe a model (ZeroDivisionError"),
    "model_args of text": ("mxfp4", args_with(n_layer="2"), "do not describe a model (TypeError"),
    "an Inf scale": ("int4", set_tensor(f"{C_FC}.int4.scales", set_first(float("inf"))),
                     f"{C_FC} holds 1024 non-finite values"),  # the first block's 32 x 32 weights
    "a NaN E8M0 scale": ("mxfp4", set_tensor(f"{C_FC}.mxfp4.scales", set_first(255)), "scale code 255 (NaN)"),
    "an E8M0 scale past float32": ("mxfp4", set_tensor(f"{C_FC}.mxfp4.scales", set_first(254)),
                                   f"{C_FC} holds"),  # 2^127 times a code of 1.5 or more is Inf in float32
    "a NaN norm": ("mxfp4", set_tensor("transformer.h.1.ln_2.weight", set_first(float("nan"))),
                   "transformer.h.1.ln_2.weight holds 1 non-finite values"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_file_with_valid_checksums_is_refused_in_one_line(exported, tmp_path, case):
    fmt, change, expect = MALFORMED[case]
    tensors, metadata = file_parts(exported / f"model-{fmt}.safetensors")
    change(tensors, metadata)
    path = seal(tmp_path / "model.safetensors", tensors, metadata)
    with pytest.raises(lowbit.ExportError) as e:
        lowbit.load(path)
    assert expect in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_sealing_by_hand_makes_a_file_that_loads(exported, tmp_path):
    """The malformed files above fail for what was changed, not for how they were written."""
    tensors, metadata = file_parts(exported / "model-mxfp4.safetensors")
    model, _ = lowbit.load(seal(tmp_path / "model.safetensors", tensors, metadata))
    reference, _ = lowbit.load(str(exported / "model-mxfp4.safetensors"))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))


def test_sample_and_hf_refuse_a_damaged_file_in_one_line_and_write_nothing(exported, tmp_path):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(CORRUPT["a flipped bit in codes"]((exported / "model-mxfp4.safetensors").read_bytes()))
    for script, args in (("sample.py", [f"--init_from={bad}", "--device=cpu"]),
                         ("hf.py", [f"--ckpt={bad}", f"--out={tmp_path / 'hf'}"])):
        p = subprocess.run([sys.executable, os.path.join(ROOT, script), *args], capture_output=True, text=True,
                           timeout=120, cwd=tmp_path)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 1 and len(lines) == 1 and "does not match its checksum" in lines[0], p.stderr
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]  # hf.py wrote no model


# --- the command's output place, its device, a full disk ----------------------------------------

def test_a_bad_device_is_one_line_before_any_work(tmp_path, capsys):
    """No checkpoint at --out_dir: the device is checked first, so its line, not the checkpoint's, comes."""
    absent = "cuda:99" if torch.cuda.is_available() else "cuda"
    for device, expect in (("gpu0", "expected cpu, cuda or cuda:N"), ("mps", "expected cpu, cuda or cuda:N"),
                           (absent, "CUDA GPU"), ("cuda:99", "CUDA GPU")):
        rc, out, err = run([f"--out_dir={tmp_path}", f"--device={device}"], capsys)
        assert rc == 1 and expect in err and f"--device={device!r}" in err and len(err.strip().splitlines()) == 1, err


def test_an_unusable_export_dir_is_one_line_before_any_work(tmp_path, capsys):
    from disk_faults import read_only_dir
    (tmp_path / "a_file").write_text("keep")
    for export_dir in (tmp_path / "a_file", tmp_path / "a_file" / "sub", read_only_dir(tmp_path),
                       "/proc/no/such/place"):
        rc, out, err = run([f"--out_dir={tmp_path / 'no_run'}", f"--export_dir={export_dir}"], capsys)
        assert rc == 1 and "--export_dir=" in err and "is unusable" in err and len(err.strip().splitlines()) == 1, err
    assert (tmp_path / "a_file").read_text() == "keep"


@pytest.mark.parametrize("run_kind", ["pqt", "bf16"])  # PQT: bitwidths.json is the first write; bf16: the model file
def test_a_full_disk_is_one_line_and_replaces_nothing(tiny_corpus, tmp_path, capsys, monkeypatch, run_kind):
    from disk_faults import full_disk_open
    make_checkpoint(tmp_path, tiny_corpus, pqt_roles=None if run_kind == "pqt" else ())
    rc, out, err = run([f"--out_dir={tmp_path}", "--format=mxfp4", "--evaluate=False"], capsys)
    assert rc == 0, err
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    make_checkpoint(tmp_path, tiny_corpus, pqt_roles=None if run_kind == "pqt" else (), seed=1)  # other weights
    before["ckpt.pt"] = (tmp_path / "ckpt.pt").read_bytes()
    monkeypatch.setattr(os, "fdopen", full_disk_open(os.fdopen))  # export.py writes through util.atomic_open
    rc, out, err = run([f"--out_dir={tmp_path}", "--format=mxfp4", "--evaluate=False", "--overwrite=True"], capsys)
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "No space left on device" in err, err
    assert "cannot write" in err and ("bitwidths.json" if run_kind == "pqt" else "model-mxfp4.safetensors") in err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no temporary left, nothing replaced
