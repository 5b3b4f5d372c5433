"""GGUF files of export.py's models, the format llama.cpp runs (transformers reads it too), written
with llama.cpp's own Python writer, the gguf package, and read back verified.

    plan = gguf_file.plan(model, quantized, meta, run_config, formats, export_dir, cfg)  # before writing
    report = gguf_file.write(plan, "mxfp4", data)    # model-mxfp4.gguf of an exported file's bytes
    reader = gguf_file.read("out/model-mxfp4.gguf")  # gguf's reader, after the checksums below

Weights. A weight export.py quantized to one of llama.cpp's block types (formats.GGML_FORMATS: q4_0,
q8_0, q4_k, q5_k, q3_k, q2_k, q6_k -> Q4_0 ... Q6_K, mxfp4_row -> MXFP4, iq4_nl, iq4_xs -> IQ4_NL, IQ4_XS;
auto-gguf and error-gguf one of them per weight) goes to GGUF as the .safetensors holds it: its GGML
blocks' bytes, written raw (GGUFWriter.add_tensor's raw_dtype), never quantized again, so the two files
hold the same bytes.
For our 32x32 formats: a GGUF block is 32 consecutive weights of one row with one scale; ours is a
32x32 block with one scale, so each of its 32 rows becomes a GGUF block carrying the block's scale,
and no value changes where the GGUF type can hold the element format: mxfp4 -> MXFP4 (codes and E8M0 scale
copied), int2..int4 -> Q4_0 and int5..int8, mxfp6_e2m3 -> Q8_0 (our BF16 scale is an FP16 value
from 2^-17 to 65280), bf16, fp32 -> BF16, F32. GGUF has no FP6/FP8 element types: mxfp6_e3m2 and
mxfp8 go to Q8_0, fp16 and int9..int16 to F16 or BF16 (the smaller error), rounded by gguf's own
quantizer where a block does not fit, as are integer blocks whose scale FP16 cannot hold
(docs/GGUF.md has the table). Per tensor the type is the cheapest that holds its widest element
format (auto and auto-int mix formats per block: one type per tensor); every tensor is read back
with gguf's dequantizer, and the loss is reported: which tensors changed, their relative RMS and
largest change, the bits per weight, and the logits and val loss of the file's model (llama.cpp's
GELU, in our code) against ours. Embeddings and head keep the export's BF16/F32; norms and biases
are F32, as llama.cpp's converter writes them.

Checksums (docs/GGUF.md): pqt.gguf_export, pqt.sha256.<tensor> (each tensor's bytes in the file),
pqt.header_sha256 (every byte before the tensor data, its own digits read as zeros) and SOURCE_KEYS
(what identifies the .safetensors export it was written from). read() checks a file before anything
uses it, open_export() against the export beside it: a damaged, foreign or mismatched file is one
line (GGUFError). Running llama.cpp on a file, and its roundings reproduced in our code:
llamacpp/.

Architectures: gpt2 and llama of llama.cpp. Our Llama2 already orders each head's query and key
rows in adjacent pairs, as Meta's checkpoints and llama.cpp's rotary embedding do (llama.cpp's
converter permutes Hugging Face's rotate_half order back to it), so they go unpermuted;
grouped-query attention is head_count_kv. A GPT2 without biases gets zero biases (llama.cpp
requires them). llama.cpp's GPT-2 computes the tanh GELU: a model trained with the exact GELU is
told so, with the measured difference.

Tokenizer: the data's, as gguf_vocab.py writes it.
"""
import contextlib
import hashlib
import json
import os
from dataclasses import dataclass

import gguf
import numpy as np
import torch

from configurator import ConfigError
from data import loader
from files import gguf_vocab, lowbit
from model import GPT, ModelConfig
from quant.formats import FORMATS
from util import UserError, commit, first_line, temp_path

QK = 32  # weights per GGUF block of MXFP4, Q4_0, Q8_0: a row of one of our 32x32 blocks
Q = gguf.GGMLQuantizationType
# The GGUF types for a tensor whose widest element format has up to `bits` bits, cheapest first.
LADDER = [(4, (Q.MXFP4, Q.Q4_0)), (8, (Q.Q8_0,)), (16, (Q.BF16, Q.F16)), (32, (Q.F32,))]
BLOCK_TYPES = (Q.MXFP4, Q.Q4_0, Q.Q8_0)
MEASURE_TOKENS = 64  # tokens (seeded) on which the file's model's logits are compared with ours
T = gguf.MODEL_TENSOR
NAMES = {  # our module path (inside transformer.h.<i> for blocks) -> llama.cpp's tensor
    "gpt2": ({"transformer.wte": T.TOKEN_EMBD, "transformer.wpe": T.POS_EMBD, "transformer.ln_f": T.OUTPUT_NORM},
             {"ln_1": T.ATTN_NORM, "attn.c_attn": T.ATTN_QKV, "attn.c_proj": T.ATTN_OUT, "ln_2": T.FFN_NORM,
              "mlp.c_fc": T.FFN_UP, "mlp.c_proj": T.FFN_DOWN}),
    "llama2": ({"transformer.wte": T.TOKEN_EMBD, "transformer.ln_f": T.OUTPUT_NORM, "lm_head": T.OUTPUT},
               {"ln_1": T.ATTN_NORM, "attn.q": T.ATTN_Q, "attn.k": T.ATTN_K, "attn.v": T.ATTN_V,
                "attn.out": T.ATTN_OUT, "ln_2": T.FFN_NORM, "mlp.gate": T.FFN_GATE, "mlp.up": T.FFN_UP,
                "mlp.down": T.FFN_DOWN}),
}
ARCH = {"gpt2": gguf.MODEL_ARCH.GPT2, "llama2": gguf.MODEL_ARCH.LLAMA}


@dataclass
class Tensor:
    """One tensor of the GGUF file: its type and data, the values gguf's dequantizer reads back (float32),
    ours (float64), and whether it is one of export.py's quantized weights."""
    name: str
    qtype: gguf.GGMLQuantizationType
    data: np.ndarray
    back: np.ndarray
    w: np.ndarray
    quantized: bool


@dataclass
class Plan:
    """What every GGUF file of one export shares: where each goes, and the data's vocabulary."""
    paths: dict  # format -> path of model-<format>.gguf
    vocab: dict  # the GGUF tokenizer fields (gguf_vocab.vocabulary())
    notes: list  # what llama.cpp reads or computes otherwise than the data and our model do


class GGUFError(UserError):
    """A GGUF file that cannot be used (damaged, not export.py's, not of the export beside it, a failed
    llama.cpp check): the message is one line that says what to do."""


# --- the plan: what every file of an export shares, checked first ----------------------------------

def plan(model, quantized, meta, run_config, formats, export_dir, cfg):
    """Check that every model-<format>.gguf can be written, before anything is: the architecture's
    weights fit GGUF's 32-weight rows, the data's tokenizer has a GGUF vocabulary, no file would be
    overwritten without --overwrite. Raises ConfigError (one line)."""
    config = model.config
    if not cfg["save"]:
        raise ConfigError("--gguf=True writes model-<format>.gguf beside each exported file: drop --save=False")
    paths = {f: os.path.join(export_dir, f"model-{f}.gguf") for f in formats}
    if not cfg["overwrite"]:
        for path in paths.values():
            if os.path.exists(path):
                raise ConfigError(f"{path} exists; pass --overwrite=True to replace it, or choose another --export_dir")
    shapes = {name: tuple(model.state_dict()[name + ".weight"].shape) for name in quantized}
    ragged = {name: s for name, s in shapes.items() if s[1] % QK}
    blocked = [f for f in formats if f not in ("bf16", "fp16", "fp32") + tuple(f"int{b}" for b in range(9, 17))]
    if ragged and blocked:
        name, shape = next(iter(ragged.items()))
        raise ConfigError(f"GGUF's block types hold rows of a multiple of {QK} weights; {name}.weight has {shape[1]} "
                          f"columns, so --format={blocked[0]} cannot go to GGUF (n_embd and ffn_hidden multiples of "
                          f"{QK} can; --format=bf16 or fp32 can as they are)")
    if meta is None or "dataset" not in run_config:
        raise ConfigError("the checkpoint records no dataset, so the tokenizer a GGUF file carries is unknown")
    vocab = gguf_vocab.vocabulary(meta, loader.data_dir(run_config["dataset"]), config.vocab_size)
    notes = []
    if vocab.get("normalization", "identity") != "identity":
        notes.append(f"the SentencePiece model normalizes text ({vocab['normalization']}) and llama.cpp does not: "
                     f"texts that normalization changes tokenize otherwise there")
    if config.arch == "gpt2" and config.gelu != "tanh":
        notes.append("this GPT2 uses the exact GELU and llama.cpp's GPT-2 the tanh approximation: the logits and "
                     "val loss below are the tanh GELU's")
    return Plan(paths, vocab, notes)


# --- the weights -----------------------------------------------------------------------------------

def block_layout(tensors, key, m, n):
    """Per GGUF block (row r, columns 32j..32j+31) of weight `key` in export's tensors: the element bits
    of its 32x32 block's format, the block's E8M0 code (-1 unless mxfp4) and its step: the integer
    formats' scale, the scaled FP formats' smallest step 2^(k + emin - mbits), NaN for bf16/fp32."""
    ids = tensors[key + ".format"].flatten().long()
    bits = torch.zeros(ids.shape, dtype=torch.int64)
    e8m0 = torch.full(ids.shape, -1, dtype=torch.int64)
    step = torch.full(ids.shape, float("nan"), dtype=torch.float64)
    for fid in ids.unique().tolist():
        fmt, sel = FORMATS[fid], ids == fid
        bits[sel] = fmt.bits
        scales = tensors.get(f"{key}.{fmt.name}.scales")
        if fmt.kind == "int":
            step[sel] = scales.double()
        elif scales is not None:
            step[sel] = torch.exp2(scales.double() - 127 + fmt.emin - fmt.mbits)
            if fmt.name == "mxfp4":
                e8m0[sel] = scales.long()
    grid = (-(-m // QK), -(-n // QK))
    rows = lambda t: np.repeat(t.view(grid).numpy(), QK, axis=0)[:m]  # noqa: E731 (each row takes its block's)
    return rows(bits), rows(e8m0), rows(step)


def _scaled_blocks(qtype, w, step):
    """Q8_0 (d, q) or Q4_0 (d, q + 8) blocks that hold w exactly where the block's own step is an FP16
    value and w / step are integers in range; all-zero blocks with d = 0. (blocks, exact per block)."""
    lo, hi = (-127, 127) if qtype == Q.Q8_0 else (-8, 7)
    v = w.reshape(w.shape[0], -1, QK)
    with np.errstate(over="ignore"):  # a scale past FP16's range: Inf, not usable
        d = step.astype(np.float16)
    usable = np.isfinite(step) & (step > 0) & (d.astype(np.float64) == step)
    q = v / np.where(usable, step, 1.0)[..., None]
    zero = (v == 0).all(-1)
    exact = zero | (usable & (q == np.rint(q)).all(-1) & (q >= lo).all(-1) & (q <= hi).all(-1))
    q = np.where(exact[..., None] & ~zero[..., None], np.rint(q), 0)
    d = np.ascontiguousarray(np.where(zero, np.float16(0), d)[..., None]).view(np.uint8)
    if qtype == Q.Q8_0:
        payload = q.astype(np.int8).view(np.uint8)
    else:
        nibbles = (q + 8).astype(np.uint8)  # element j in the low nibble of byte j, element j + 16 in the high
        payload = nibbles[..., :QK // 2] | (nibbles[..., QK // 2:] << 4)
    return np.concatenate([d, payload], axis=-1), exact


def _mxfp4_blocks(w, e8m0):
    """MXFP4 blocks with our E8M0 code and E2M1 codes (gguf's kvalues are the doubled E2M1 values, its
    scale half of 2^(e - 127)); exact wherever the 32x32 block was mxfp4. (blocks, exact per block)."""
    v = w.reshape(w.shape[0], -1, QK)
    usable = e8m0 >= 0
    t = v / np.exp2(np.where(usable, e8m0, 128) - 128.0)[..., None]
    codes = np.full(t.shape, -1)
    for code, value in enumerate(gguf.quants.MXFP4.kvalues):
        if code != 8:  # 8 is E2M1's negative zero; a zero takes code 0
            codes[t == value] = code
    exact = usable & (codes >= 0).all(-1)
    codes = np.where(exact[..., None], codes, 0).astype(np.uint8)
    payload = codes[..., :QK // 2] | (codes[..., QK // 2:] << 4)
    return np.concatenate([np.where(usable, e8m0, 0).astype(np.uint8)[..., None], payload], axis=-1), exact


def own_blocks(qtype, w, layout):
    """(blocks, exact per block) of w in a block type with our own scales; None for F32/F16/BF16."""
    if qtype not in BLOCK_TYPES:
        return None
    _, e8m0, step = layout
    return _mxfp4_blocks(w, e8m0) if qtype == Q.MXFP4 else _scaled_blocks(qtype, w, step)


def encode(qtype, w, own=None):
    """(GGUF data of w (m, n) float64 in qtype, w as gguf's dequantizer reads it back): own_blocks where
    they hold the values exactly, gguf's quantizer (llama.cpp's reference rounding) elsewhere."""
    w32 = w.astype(np.float32)
    if own is None:
        data = gguf.quants.quantize(w32, qtype)
    else:
        blocks, exact = own
        if not exact.all():
            blocks = np.where(exact[..., None], blocks, gguf.quants.quantize(w32, qtype).reshape(blocks.shape))
        data = blocks.reshape(w.shape[0], -1)
    return data, gguf.quants.dequantize(data, qtype).reshape(w.shape)


def choose(w, layout):
    """(type, data, read back) of a quantized weight: in the cheapest class of LADDER that holds its widest
    element format, a type our scales fill exactly, else the first that reads back exact, else the one
    with the smallest squared error."""
    widest = int(layout[0].max())
    types = next(t for bits, t in LADDER if bits >= widest)
    own = {qtype: own_blocks(qtype, w, layout) for qtype in types}
    types = sorted(types, key=lambda qtype: own[qtype] is None or not own[qtype][1].all())  # exact ones first
    w32, best = w.astype(np.float32), None
    for qtype in types:
        data, back = encode(qtype, w, own[qtype])
        if np.array_equal(back, w32):
            return qtype, data, back
        err = float(((back.astype(np.float64) - w) ** 2).sum())
        if best is None or err < best[0]:
            best = (err, qtype, data, back)
    return best[1:]


def gguf_names(config):
    """{our state-dict key: llama.cpp's tensor name} (gguf.TENSOR_NAMES), weights and biases."""
    top, block = NAMES[config.arch]
    names = {}
    for suffix in ("weight", "bias"):
        for path, t in top.items():
            names[f"{path}.{suffix}"] = f"{gguf.TENSOR_NAMES[t]}.{suffix}"
        for i in range(config.n_layer):
            for path, t in block.items():
                names[f"transformer.h.{i}.{path}.{suffix}"] = f"{gguf.TENSOR_NAMES[t].format(bid=i)}.{suffix}"
    return names


def tensors_of(data):
    """(the exported model, its info, [Tensor]) of an exported file's bytes: every tensor llama.cpp reads."""
    from safetensors.torch import load as load_tensors
    model, info = lowbit.rebuild(data)
    config, raw, names = model.config, load_tensors(data), gguf_names(model.config)
    own, out = model.state_dict(), []
    for key, value in own.items():
        if key not in names:
            continue  # GPT2's head is its embedding: llama.cpp reads token_embd when output is absent
        w = value.double().numpy()
        quantized = key in info["quantized"]
        if key in info["ggml_types"]:  # the .safetensors' GGML blocks, written as they are
            qtype, blob = Q[info["ggml_types"][key]], raw[key + ".ggml"].numpy()
            back = gguf.quants.dequantize(blob, qtype).reshape(w.shape)
        elif quantized:
            qtype, blob, back = choose(w, block_layout(raw, key, *w.shape))
        elif w.ndim == 1:  # norms and biases: F32, as llama.cpp's converter writes every 1-D tensor
            qtype, blob, back = Q.F32, w.astype(np.float32), w.astype(np.float32)
        else:  # embeddings, head, Linears left unquantized: the export's own dtype, exactly
            qtype = Q.BF16 if raw[key].dtype == torch.bfloat16 else Q.F32
            blob, back = encode(qtype, w)
        out.append(Tensor(names[key], qtype, blob, back, w, quantized))
    if config.arch == "gpt2" and not config.bias:  # llama.cpp's GPT-2 requires biases: zeros change nothing
        for key in [k for k in names if k.endswith(".bias") and k.startswith(("transformer.h.", "transformer.ln_f."))]:
            zeros = np.zeros(own[key[:-len("bias")] + "weight"].shape[0])
            out.append(Tensor(names[key], Q.F32, zeros.astype(np.float32), zeros.astype(np.float32), zeros, False))
    return model, info, out


# --- the file --------------------------------------------------------------------------------------

def _add_header(writer, config, vocab):
    writer.add_context_length(config.block_size)
    writer.add_embedding_length(config.n_embd)
    writer.add_block_count(config.n_layer)
    writer.add_feed_forward_length(config.ffn_hidden)
    writer.add_head_count(config.n_head)
    if config.arch == "gpt2":
        writer.add_layer_norm_eps(1e-5)  # our LayerNorm's, PyTorch's default
    else:
        writer.add_head_count_kv(config.n_kv_head)
        writer.add_layer_norm_rms_eps(config.norm_eps)
        writer.add_rope_dimension_count(config.n_embd // config.n_head)
        writer.add_rope_freq_base(config.rope_theta)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    gguf_vocab.add_vocabulary(writer, vocab)


class _Data(np.ndarray):
    """A tensor's bytes, which gguf's writer hands to tofile: written here by the file object, whose
    error on a full disk says ENOSPC (numpy's tofile says only "N requested and 0 written")."""

    def tofile(self, fid, *args, **kwargs):
        fid.write(memoryview(np.ascontiguousarray(self).reshape(-1).view(np.uint8)))


def _write_atomic(path, config, vocab, tensors, source):
    """The GGUF file at path, written to a temporary file beside it (gguf's writer opens it by name),
    sealed (_seal), synced, renamed (util.commit): a crash or a full disk leaves no half file, and the
    OSError of a failed write is raised as it is, the temporary file removed."""
    tmp, writer = temp_path(path), None
    try:
        writer = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[ARCH[config.arch]])
        _add_header(writer, config, vocab)
        _add_checksums(writer, tensors, source)
        for t in tensors:
            data = np.ascontiguousarray(t.data)
            writer.add_tensor(t.name, data.view(_Data), raw_dtype=t.qtype if data.dtype == np.uint8 else None)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        _seal(tmp)
        commit(tmp, path)
    finally:
        if writer is not None:
            with contextlib.suppress(OSError):  # a full disk fails again as close flushes what is buffered
                writer.close()
        if os.path.exists(tmp):
            os.remove(tmp)


# --- what ties the file to its bytes and to its source --------------------------------------------

GGUF_EXPORT = 1  # pqt.gguf_export: the checksums below
VERSION_KEY = "pqt.gguf_export"
TENSOR_KEY = "pqt.sha256."  # + a tensor's name: the SHA-256 of its bytes in the file
HEADER_KEY = "pqt.header_sha256"  # the SHA-256 of the file before its tensor data, these 64 digits read as zeros
SOURCE_KEYS = ("pqt.source.arch", "pqt.source.format", "pqt.source.metadata_sha256", "pqt.source.tensors_sha256")
UNSEALED = "0" * 64
AGAIN = "write it again with python export.py --out_dir=RUN --format=... --gguf=True"


def source_keys(model, info):
    """What identifies the .safetensors export (lowbit.rebuild's model and info) a GGUF is written from:
    its architecture, its format, its metadata checksum and the SHA-256 of its tensor checksums."""
    tensors = json.dumps(info["sha256"]["tensors"], sort_keys=True).encode()
    values = (model.config.arch, info["format"], info["sha256"]["metadata"], hashlib.sha256(tensors).hexdigest())
    return dict(zip(SOURCE_KEYS, values))


def _add_checksums(writer, tensors, source):
    writer.add_uint32(VERSION_KEY, GGUF_EXPORT)
    for key, value in source.items():
        writer.add_string(key, value)
    for t in tensors:
        writer.add_string(TENSOR_KEY + t.name, hashlib.sha256(np.ascontiguousarray(t.data).reshape(-1).view(np.uint8))
                          .hexdigest())
    writer.add_string(HEADER_KEY, UNSEALED)  # _seal writes the digest once the header's bytes are on disk


def _span(field):
    """(start, end) in the file of a string field's value bytes (a field's parts are its bytes, in order)."""
    start = int(field.offset) + sum(part.nbytes for part in field.parts[:-1])
    return start, start + field.parts[-1].nbytes


def _header_sha256(reader):
    """SHA-256 of the bytes before the tensor data, HEADER_KEY's digits read as zeros."""
    start, end = _span(reader.fields[HEADER_KEY])
    header = bytearray(reader.data[:reader.data_offset])
    header[start:end] = UNSEALED.encode()
    return hashlib.sha256(header).hexdigest()


def _seal(tmp):
    """Write HEADER_KEY's digest into the finished file, in place of its zeros."""
    reader = gguf.GGUFReader(tmp)
    digest, (start, _) = _header_sha256(reader), _span(reader.fields[HEADER_KEY])
    del reader  # its memory map of the file
    with open(tmp, "r+b") as f:
        f.seek(start)
        f.write(digest.encode())


def _text(reader, key):
    """The string value of key, or None where it is absent or not one string."""
    field = reader.fields.get(key)
    try:
        return field.contents() if field is not None and field.types == [gguf.GGUFValueType.STRING] else None
    except (UnicodeDecodeError, ValueError, IndexError):
        return None


def open_reader(path, again=AGAIN):
    """gguf's GGUFReader of path, or GGUFError: a missing file, a directory, bytes gguf cannot read; `again`
    names the command that makes the file (export.py's, by default)."""
    if os.path.isdir(path):
        raise GGUFError(f"{path} is a directory; give the path of a .gguf file written by export.py --gguf=True")
    if not os.path.exists(path):
        raise GGUFError(f"no file {path}: {again}")
    try:
        return gguf.GGUFReader(path)
    except OSError as e:
        raise GGUFError(f"cannot read {path}: {first_line(e)}") from None
    except Exception as e:  # gguf's reader of damaged bytes fails with anything (ValueError, IndexError, ...)
        raise GGUFError(f"{path} is not a readable GGUF file ({type(e).__name__}: {first_line(e)}): damaged, cut "
                        f"short, or not a GGUF file; {again}") from None


def read(path):
    """gguf's GGUFReader of a file export.py wrote, verified before anything uses it: the bytes before
    the tensor data (metadata, tensor list) against pqt.header_sha256, each tensor's bytes against its
    pqt.sha256.<name>. Anything else is GGUFError, one line."""
    reader = open_reader(path)
    field = reader.fields.get(VERSION_KEY)
    if field is None:
        raise GGUFError(f"{path} carries no checksums ({VERSION_KEY}): it was not written by export.py, or by an "
                        f"older one, so it cannot be verified; {AGAIN}")
    version = field.contents() if field.types == [gguf.GGUFValueType.UINT32] else None
    if version != GGUF_EXPORT:
        raise GGUFError(f"{path} has {VERSION_KEY} {version!r}; this code reads {GGUF_EXPORT}: {AGAIN}")
    damaged = f"{path} fails verification (damaged, or not written by export.py)"
    recorded = _text(reader, HEADER_KEY)
    if recorded is None or len(recorded) != 64 or _header_sha256(reader) != recorded:
        raise GGUFError(f"{damaged}: its metadata and tensor list do not match their checksum; {AGAIN}")
    names = {t.name for t in reader.tensors}
    if names != {k[len(TENSOR_KEY):] for k in reader.fields if k.startswith(TENSOR_KEY)}:
        raise GGUFError(f"{damaged}: its tensors are not those it has checksums of; {AGAIN}")
    for t in reader.tensors:
        start, end = int(t.data_offset), int(t.data_offset) + int(t.n_bytes)
        if end > len(reader.data) or hashlib.sha256(reader.data[start:end]).hexdigest() != _text(reader,
                                                                                                TENSOR_KEY + t.name):
            raise GGUFError(f"{damaged}: tensor {t.name} does not match its checksum (flipped or missing bytes); "
                            f"{AGAIN}")
    return reader


def check_source(reader, model, info, path, source):
    """GGUFError unless the GGUF at path (reader) was written from the export at source (lowbit.load's
    model and info): its pqt.source.* keys are that export's."""
    want = source_keys(model, info)
    got = {key: _text(reader, key) for key in SOURCE_KEYS}
    arch, fmt = SOURCE_KEYS[:2]
    if (got[arch], got[fmt]) != (want[arch], want[fmt]):
        raise GGUFError(f"{path} holds a {got[arch]} model in format {got[fmt]}, and {source} beside it a "
                        f"{want[arch]} model in format {want[fmt]}: a GGUF is checked against the .safetensors "
                        f"written with it (python export.py --out_dir=RUN --format=... --gguf=True writes both)")
    if got != want:
        raise GGUFError(f"{path} was written from another export than {source} (their checksums differ): a GGUF is "
                        f"checked against the .safetensors written with it; export both again with --gguf=True")


def open_export(path):
    """(model, info) of the .safetensors export beside the GGUF file at path (lowbit.load), the GGUF
    verified (read) and shown to be written from it (check_source); anything else is one line."""
    reader = read(path)
    source = os.path.splitext(path)[0] + ".safetensors"
    try:
        model, info = lowbit.load(source)
    except lowbit.ExportError as e:
        raise GGUFError(f"{path} is checked against the export beside it, and {e}") from None
    check_source(reader, model, info, path, source)
    return model, info


def model_from_gguf(path, model_args, reader=None):
    """Our model with the weights gguf's reader and dequantizer give for the file at path, and the GELU
    llama.cpp computes: the model llama.cpp and transformers run, in our code. reader: the file's
    GGUFReader where it is read otherwise than by read() (a llama-quantize file carries no checksums)."""
    args = dict(model_args, gelu="tanh") if model_args.get("arch", "gpt2") == "gpt2" else dict(model_args)
    model = GPT(ModelConfig(**args))
    keys = {v: k for k, v in gguf_names(model.config).items()}
    own = model.state_dict()
    state = {}
    for t in (reader or read(path)).tensors:
        key = keys[t.name]
        if key in own:  # zero biases of a GPT2 without biases are not ours
            state[key] = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).view(own[key].shape)
    if model.config.arch == "gpt2":
        state["lm_head.weight"] = state["transformer.wte.weight"]
    model.load_state_dict(state)
    return model.eval()


@torch.no_grad()
def max_logit_difference(a, b, vocab_size, block_size):
    """max |logits of a - logits of b| over every position of MEASURE_TOKENS seeded tokens."""
    x = torch.randint(0, vocab_size, (1, min(MEASURE_TOKENS, block_size)), generator=torch.Generator().manual_seed(0))
    return (a(x, torch.zeros_like(x))[0] - b(x, torch.zeros_like(x))[0]).abs().max().item()


def write(plan, fmt_name, data, evaluate=None, log=print):
    """Write model-<fmt_name>.gguf of an exported file's bytes; return (and log, unless log is None)
    what changed: types, exactness, bits per weight, and the logits and val loss (evaluate(model) ->
    loss) of the file's model (model_from_gguf) against the exported model's."""
    model, info, tensors = tensors_of(data)
    bad = [t.name for t in tensors if not np.isfinite(t.back).all()]
    if bad:
        raise ConfigError(f"{bad[0]} would hold non-finite values in GGUF; export --format=fp32 instead")
    path = plan.paths[fmt_name]
    _write_atomic(path, model.config, plan.vocab, tensors, source_keys(model, info))
    report = summary(tensors, path, info["mix"].get("bits_per_weight"))
    theirs = model_from_gguf(path, info["model_args"])
    report["max_logit_difference"] = max_logit_difference(theirs, model, plan.vocab["real"], model.config.block_size)
    if evaluate is not None and report["max_logit_difference"] > 0:
        report.update(val_loss=evaluate(theirs), val_loss_exported=evaluate(model))
    report["notes"] = plan.notes
    if log is not None:
        for line in describe(report):
            log(f"gguf: {line}")
    return report


def summary(tensors, path, safetensors_bits):
    """The file's tensor types, which tensors changed and how much, and the bits per weight."""
    types, changed = {}, []
    for t in tensors:
        types[t.qtype.name] = types.get(t.qtype.name, 0) + 1
        if not np.array_equal(t.back, t.w.astype(np.float32)):
            diff = t.back.astype(np.float64) - t.w
            changed.append(dict(tensor=t.name, type=t.qtype.name, weights_changed=int((diff != 0).sum()),
                                rel_rms=float(np.sqrt((diff ** 2).sum() / max((t.w ** 2).sum(), 1e-300))),
                                max_abs=float(np.abs(diff).max())))
    quantized = [t for t in tensors if t.quantized]
    weights = sum(t.w.size for t in quantized)
    return dict(path=path, file_bytes=os.path.getsize(path), types=types, exact=not changed, changed=changed,
                quantized_types={t.name: t.qtype.name for t in quantized},
                bits_per_weight=8 * sum(t.data.nbytes for t in quantized) / weights if weights else None,
                bits_per_weight_safetensors=safetensors_bits,
                bits_per_parameter=8 * os.path.getsize(path) / sum(t.w.size for t in tensors))


def describe(report):
    """The report as lines for the terminal."""
    lines = [f"wrote {report['path']} ({report['file_bytes']:,} bytes, {report['bits_per_parameter']:.2f} "
             f"bits per parameter): " + ", ".join(f"{n} {t}" for t, n in report["types"].items())]
    if report["bits_per_weight"] is not None:
        lines.append(f"the quantized Linears: {report['bits_per_weight']:.3f} bits per weight "
                     f"(in the .safetensors: {report['bits_per_weight_safetensors']:.3f})")
    if report["exact"]:
        lines.append("every weight is the exported model's, exactly (read back with gguf's dequantizer)")
    else:
        worst = max(report["changed"], key=lambda c: c["rel_rms"])
        moved = sum(c["weights_changed"] for c in report["changed"])
        lines.append(f"{len(report['changed'])} tensors changed ({moved} weights): the most, {worst['tensor']} "
                     f"({worst['type']}), by relative RMS {worst['rel_rms']:.2e}, at most {worst['max_abs']:.2e}")
    lines += [f"note: {note}" for note in report["notes"]]
    lines.append(f"logits of the file's model (its weights read back, llama.cpp's GELU) against the exported "
                 f"model's: max |difference| {report['max_logit_difference']:.3e} on {MEASURE_TOKENS} seeded tokens")
    if "val_loss" in report:
        lines.append(f"its val loss {report['val_loss']:.4f}, the exported model's {report['val_loss_exported']:.4f} "
                     f"({100 * (report['val_loss'] / report['val_loss_exported'] - 1):+.3f}%)")
    return lines
