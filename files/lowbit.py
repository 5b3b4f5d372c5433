"""The low-precision file export.py writes: which format each 32x32 block takes, the packed codes
and scales, the checksums, and the reader that verifies a file before it rebuilds its model.

    model, info = lowbit.load("out/model-auto.safetensors")  # the dequantized model, in eval mode
    data, mix = lowbit.export_bytes(model, quantized, b_t, "auto", torch.bfloat16, metadata)

The file (safetensors): for each quantized weight W, W.format (a uint8 format id per block, ids in
the metadata's "formats"), W.<format>.codes (that format's element codes, packed little-endian,
blocks in row-major order) and W.<format>.scales (E8M0 bytes, or BF16 for integers); every other
tensor under its own name; metadata with the architecture, the PQT settings, the format and its
mix, the training config, the dataset's meta.json and the SHA-256 of every tensor and of the
metadata (no pickle). A weight in one of llama.cpp's block types (formats.GGML_FORMATS: q4_0 ...
q6_k, mxfp4_row, iq4_nl, iq4_xs) is instead one tensor, W.ggml: its blocks' bytes as GGML stores them, uint8 (rows,
bytes per row) (ggml_quants.pack of ggml_quants.quantize), the bytes a GGUF file of it holds; its type
is in the metadata's "ggml_types" ({W: "Q4_K"}), and such a file has export version 3 ("pqt_export"),
which an export.py that reads only version 2 refuses in one line. load rebuilds those weights with
gguf's dequantizer (llama.cpp's Python reference, bit for bit ggml_quants.dequantize's values).

load refuses in one line (ExportError) a file that is damaged (a checksum differs), malformed (a
tensor of the wrong size for its blocks or its GGML type, a format id or GGML type the file does not
name, model_args the model does not know), of another tool or of an older export.py (no checksums:
export the run again), and a model that rebuilds non-finite. The element formats and their 32x32
block operations are formats.py's; sample.py, hf.py and the GGUF writer (gguf_file.py) read files
through load/rebuild.
"""
import hashlib
import json
import struct
from dataclasses import fields

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES

from kernels import BL
from model import GPT, ROLES, ModelConfig
from quant import ggml_quants
from quant.budget import FORMAT_STATE, UNCHOSEN, budget_format_ids, trained_formats, trained_ggml_types
from quant.formats import (BY_NAME, FORMATS, GGML_FORMATS, GGML_NAMES, GGUF_BUDGETS, INT_BUDGETS, block_weights,
                           dequantize_blocks, from_blocks, quantize_blocks, to_blocks)
from util import UserError, first_line, load_error


class ExportError(UserError):
    """Bad input or an unusable checkpoint; the message is one line that says what to do."""


# --- the checkpoint's model ------------------------------------------------------------------

def block_linears(state_dict, arch):
    """{module path: role} of every Linear of the transformer blocks, in the state dict's order
    (model.ROLES: the path inside a block, transformer.h.<i>.<path>, -> the layer's role)."""
    roles, found = ROLES[arch], {}
    for key in state_dict:
        parts = key.split(".")
        if key.startswith("transformer.h.") and key.endswith(".weight") and ".".join(parts[3:-1]) in roles:
            found[".".join(parts[:-1])] = roles[".".join(parts[3:-1])]
    return found


def build_model(state_dict, arch_args):
    """The model with the checkpoint's weights, b_i and the STE's state (FORMAT_STATE: format_ids,
    ggml_type, error-gguf's imatrix) aside: an eval-mode PQT or STE layer is a plain Linear."""
    try:
        model = GPT(ModelConfig(**arch_args))
        result = model.load_state_dict(state_dict, strict=False)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ExportError(f"the checkpoint does not fit this project's model ({load_error(e)}): export a checkpoint "
                          f"of train.py, of the run it names")
    unexpected = [k for k in result.unexpected_keys if not k.endswith((".b_i", *FORMAT_STATE))]
    if result.missing_keys or unexpected:
        raise ExportError(f"the checkpoint does not fit this project's model: missing {result.missing_keys[:3]}, "
                          f"unexpected {unexpected[:3]}")
    return model.eval()


def run_metadata(ckpt, meta):
    """What an exported file records of its run (checkpoint.read's dict, the dataset's meta.json):
    the architecture, the PQT settings, the training config, the data's meta and the step."""
    return {"model_args": json.dumps(ckpt["model_args"]), "pqt": json.dumps(ckpt["pqt"]),
            "config": json.dumps(ckpt["config"]), "meta": json.dumps(meta), "iter_num": json.dumps(ckpt["iter_num"])}


# --- which format a block takes (the formats themselves: formats.py) ---------------------------

# auto's candidates, cheapest first (element bits, then scale bits): a block takes the first one
# that Table C allows for its b_t. fp32 allows every b_t up to 25, and is the master weight itself.
AUTO_ORDER = ["mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2", "bf16", "fp16", "fp32"]


def table_c_allows(fmt, b_t):
    """Table C of the paper (appendix C; METHOD.md section 3): w_hat of bitwidth b_t needs an FP
    exponent of ceil(log2(b_t + 3)) bits and a mantissa of b_t - 2 bits. ceil(log2(b_t + 3)) <= e
    is b_t <= 2^e - 3, which spares a log of a float at the tier edges (b_t = 5 exactly: e = 3)."""
    return (b_t <= 2 ** fmt.ebits - 3) & (b_t <= fmt.mbits + 2)


def auto_format_ids(b_t):
    """Per block, the cheapest format of AUTO_ORDER that Table C allows for its b_t."""
    ids = torch.full(b_t.shape, BY_NAME["fp32"], dtype=torch.uint8)
    for name in reversed(AUTO_ORDER):  # cheaper formats overwrite dearer ones
        ids[table_c_allows(FORMATS[BY_NAME[name]], b_t)] = BY_NAME[name]
    return ids


def auto_int_format_ids(b_t):
    """Per block, the symmetric integer of ceil(b_t) bits (at least 2): its step, max_bl / (2^(b-1) - 1),
    is the grid Eq. 3's noise scale max_bl * 2^(1 - b_t) stands in for. Past 16 bits: fp32."""
    bits = torch.ceil(b_t).clamp(min=2)
    ids = torch.full(b_t.shape, BY_NAME["fp32"], dtype=torch.uint8)
    for b in range(2, 17):
        ids[bits == b] = BY_NAME[f"int{b}"]
    return ids


def format_ids_for(name, fmt_name, b_t, shape):
    """The format id of each block of layer `name` under --format (auto/auto-int need the layer's b_t)."""
    nb = (-(-shape[0] // BL), -(-shape[1] // BL))
    if fmt_name in ("auto", "auto-int"):
        if b_t is None:  # a block Linear without PQT: nothing learned to choose from
            return torch.full(nb, BY_NAME["bf16"], dtype=torch.uint8)
        return auto_format_ids(b_t) if fmt_name == "auto" else auto_int_format_ids(b_t)
    return torch.full(nb, BY_NAME[fmt_name], dtype=torch.uint8)


def budget_formats(fmt_name, budget, model, state_dict, pqt, quantized, b_t, notes):
    """{layer: format ids} of --format auto-int or error-int at a bit budget (--bits_per_weight; None
    without one): the per-block formats the run trained on, where it trained on this budget's (a note
    says so), else budget_format_ids's choice from the weights (and b_t, for auto-int)."""
    if not budget or fmt_name not in INT_BUDGETS:
        return None
    chosen = trained_formats(state_dict, pqt, quantized, fmt_name, budget)
    if chosen is not None:
        notes.append(f"{fmt_name} at {budget:g} bits per weight: the per-block formats the run trained on, "
                     f"chosen at its step {pqt.get('ste_start') or pqt.get('pqt_start'):.0f}")
        return chosen
    if fmt_name == "auto-int" and any(k not in b_t for k in quantized):
        raise ExportError("auto-int with --bits_per_weight ranks blocks by their learned b_t, and these layers "
                          "have none (no PQT): use --format=error-int, which ranks them by their own error")
    weights = {k: model.get_submodule(k).weight for k in quantized}
    return budget_format_ids(fmt_name, weights, b_t, budget)


# --- which GGML type a weight takes (the types themselves: ggml_quants.py) ----------------------


def _type_name(value):
    return ggml_quants.T(value).name if value in set(ggml_quants.T) else str(value)


def ggml_types(fmt_name, budget, state_dict, pqt, quantized, notes):
    """{layer: GGML type name} of --format fmt_name: a GGML format's one type for every quantized layer, or
    the types an auto-gguf / error-gguf run trained on (a note says so); None for the 32x32 formats.
    A weight whose rows (its input width) the type's blocks do not divide is one line (ExportError)."""
    if fmt_name in GGML_FORMATS:
        types = {k: GGML_FORMATS[fmt_name] for k in quantized}
        trained = {int(v) for k, v in state_dict.items() if k.endswith(".ggml_type") and k[:-len(".ggml_type")]
                   in quantized} - {int(ggml_quants.ggml_type(types[k])) for k in quantized} - {UNCHOSEN}
        if trained:
            notes.append(f"the run trained on other GGML types ({', '.join(_type_name(v) for v in sorted(trained))}): "
                         f"--format={fmt_name} quantizes its master weights afresh, as a post-training quantization")
    elif fmt_name in GGUF_BUDGETS:
        types = trained_ggml_types(state_dict, pqt, quantized, fmt_name, budget)
        notes.append(f"{fmt_name} at {budget:g} bits per weight: the GGML type each weight trained on, chosen at the "
                     f"run's step {pqt.get('ste_start') or pqt.get('pqt_start'):.0f}")
    else:
        return None
    for layer, t in types.items():
        n, size = state_dict[layer + ".weight"].shape[1], ggml_quants.block_size(t)
        if n % size:
            other = "q4_0, q8_0 or mxfp4_row (32)" if n % 32 == 0 else "one of our 32x32-block formats (int4, ...)"
            raise ExportError(f"--format={fmt_name}: {layer}.weight has rows of {n} weights (its input width), and "
                              f"{t} blocks rows of a multiple of {size}: export {other}, or a model whose Linears "
                              f"read widths of a multiple of {size}")
    return types


# --- 32x32 blocks and bit packing ----------------------------------------------------------------


def pack(codes, bits):
    """Codes (int64, each < 2^bits) as a little-endian bit stream: code i in bits [i*bits, (i+1)*bits)."""
    c = codes.numpy()
    stream = np.empty((len(c), bits), dtype=np.uint8)
    for j in range(bits):
        stream[:, j] = (c >> j) & 1
    return torch.from_numpy(np.packbits(stream.reshape(-1), bitorder="little"))


def unpack(packed, bits, count):
    stream = np.unpackbits(packed.numpy(), count=count * bits, bitorder="little").reshape(count, bits)
    codes = np.zeros(count, dtype=np.int64)
    for j in range(bits):
        codes |= stream[:, j].astype(np.int64) << j
    return torch.from_numpy(codes)


def _check_finite(name, w):
    if not torch.isfinite(w).all():
        raise ExportError(f"{name} holds {int((~torch.isfinite(w)).sum())} non-finite values (NaN or Inf); "
                          f"a non-finite model cannot be exported: export an earlier checkpoint")


def quantize_weight(name, w, format_ids):
    """A weight (m, n) and the format id of each 32x32 block -> the file's tensors for it, by suffix:
    "format" (uint8 ids, (ceil(m/32), ceil(n/32))) and, per format used, "<format>.codes" (its blocks'
    codes, packed in block order, only the real elements of edge blocks) and "<format>.scales"."""
    _check_finite(name, w)
    blocks, real = to_blocks(w.double()), to_blocks(torch.ones(w.shape, dtype=torch.bool))
    ids = format_ids.flatten()
    out = {"format": format_ids.to(torch.uint8).contiguous()}
    for fid in ids.unique().tolist():
        fmt, sel = FORMATS[fid], ids == fid
        codes, scales = quantize_blocks(blocks[sel], fmt)
        out[f"{fmt.name}.codes"] = pack(codes[real[sel]], fmt.bits)
        if scales is not None:
            out[f"{fmt.name}.scales"] = scales.contiguous()
    return out


def dequantize_weight(tensors, m, n):
    """The float32 weight (m, n) from quantize_weight's tensors."""
    ids = tensors["format"].flatten().long()
    real = to_blocks(torch.ones(m, n, dtype=torch.bool))
    blocks = torch.zeros(real.shape, dtype=torch.float64)
    for fid in ids.unique().tolist():
        fmt, sel = FORMATS[fid], ids == fid
        mask = real[sel]
        codes = torch.zeros(mask.shape, dtype=torch.int64)
        codes[mask] = unpack(tensors[f"{fmt.name}.codes"], fmt.bits, int(mask.sum()))
        blocks[sel] = dequantize_blocks(codes, tensors.get(f"{fmt.name}.scales"), fmt)
    return from_blocks(blocks, m, n).float()


def quantize_ggml(name, w, type_name):
    """A weight (m, n) in one GGML type -> the file's tensor for it: "ggml", the type's blocks as llama.cpp
    stores them (uint8 (m, bytes per row): ggml_quants.pack of ggml_quants.quantize's codes and scales)."""
    _check_finite(name, w)
    try:
        return {"ggml": torch.from_numpy(ggml_quants.pack(ggml_quants.quantize(w.float(), type_name), type_name))}
    except ggml_quants.QuantError as e:
        raise ExportError(f"{name}: {e}") from None


def dequantize_ggml(blocks, type_name):
    """The float32 weight (m, n) of a GGML type's blocks (uint8 (m, bytes per row)): gguf's dequantizer,
    llama.cpp's Python reference, which gives ggml_quants.dequantize's values bit for bit."""
    import gguf
    return torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), ggml_quants.ggml_type(type_name)).copy())


# --- the exported file -------------------------------------------------------------------------

EXPORT_VERSION = "2"  # the file's "pqt_export"; "1": an older export.py, which recorded no checksums
GGML_VERSION = "3"  # a file with weights in GGML types ("ggml_types"), which an export.py of version 2 cannot read
INFO_KEYS = ("model_args", "pqt", "formats", "quantized", "mix", "config", "meta", "iter_num")  # JSON in the metadata


def _format_order(name):
    """The 32x32 formats in FORMATS' order, then the GGML formats in GGML_FORMATS'."""
    return BY_NAME[name] if name in BY_NAME else len(FORMATS) + list(GGML_FORMATS).index(name)


def _quantized_parts(key, value, ids, ggml_type):
    """(the file's tensors of a quantized weight by suffix, {format: weights in it}): one GGML type (ggml_type)
    or the format ids of its 32x32 blocks."""
    w = value.detach().float().cpu()
    if ggml_type is not None:
        return quantize_ggml(key, w, ggml_type), {GGML_NAMES[ggml_type]: w.numel()}
    counts, flat = block_weights(*value.shape).flatten(), ids.flatten()
    return quantize_weight(key, w, ids), {FORMATS[fid].name: int(counts[flat == fid].sum().item())
                                          for fid in flat.unique().tolist()}


def export_bytes(model, quantized, b_t, fmt_name, other_dtype, metadata, chosen=None, ggml=None):
    """The safetensors file (bytes) of `model` with the weights of `quantized` ({module path: role})
    quantized per block, and its mix: share of quantized weights per format and bits per weight.
    chosen: {layer: format ids} made beforehand (a bit budget's), instead of format_ids_for's; ggml:
    {layer: GGML type name} (ggml_types), each of those weights in its one type."""
    from safetensors.torch import save
    tensors, seen, shapes = {}, set(), {}
    weights_by_format, quantized_bytes = {}, 0
    for key, value in model.state_dict().items():
        if value.data_ptr() in seen:  # a tied weight (GPT2's lm_head is wte) is stored once
            continue
        seen.add(value.data_ptr())
        layer = key[:-len(".weight")]
        if key.endswith(".weight") and layer in quantized:
            ggml_type, ids = (ggml or {}).get(layer), None
            if ggml_type is None:
                ids = chosen[layer] if chosen else format_ids_for(layer, fmt_name, b_t.get(layer), value.shape)
            parts, counts = _quantized_parts(key, value, ids, ggml_type)
            tensors.update({f"{key}.{suffix}": t for suffix, t in parts.items()})
            quantized_bytes += sum(t.numel() * t.element_size() for t in parts.values())
            shapes[key] = list(value.shape)
            for name, count in counts.items():
                weights_by_format[name] = weights_by_format.get(name, 0) + count
        else:
            tensors[key] = value.detach().to(other_dtype).cpu().contiguous()
    n = sum(weights_by_format.values())
    mix = dict(format=fmt_name, quantized_weights=n, quantized_bytes=quantized_bytes,
               bits_per_weight=8 * quantized_bytes / n if n else None,
               share={f: c / n for f, c in sorted(weights_by_format.items(), key=lambda fc: _format_order(fc[0]))})
    metadata = {**metadata, "pqt_export": EXPORT_VERSION, "format": fmt_name,
                "formats": json.dumps([f.name for f in FORMATS]), "quantized": json.dumps(shapes),
                "mix": json.dumps(mix)}
    if ggml:
        metadata.update(pqt_export=GGML_VERSION, ggml_types=json.dumps({k + ".weight": t for k, t in ggml.items()}))
    metadata["sha256"] = checksums(tensors, metadata)
    return save(tensors, metadata=metadata), mix


def tensor_sha256(t):
    """SHA-256 of a tensor's bytes as safetensors stores them (little-endian, row-major)."""
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def metadata_sha256(metadata):
    """SHA-256 of the metadata entries but the checksums themselves, in a canonical order."""
    return hashlib.sha256(json.dumps({k: v for k, v in metadata.items() if k != "sha256"}, sort_keys=True).encode()
                          ).hexdigest()


def checksums(tensors, metadata):
    """The "sha256" metadata entry: every tensor's checksum and the metadata's, checked by load."""
    return json.dumps({"tensors": {k: tensor_sha256(t) for k, t in tensors.items()},
                       "metadata": metadata_sha256(metadata)})


def _header(data, where):
    """(tensor entries {name: {dtype, shape, data_offsets}}, metadata) of a safetensors file's bytes."""
    foreign = f"{where} is not a model file written by export.py"
    if len(data) < 8 or struct.unpack("<Q", data[:8])[0] > len(data) - 8:
        raise ExportError(f"{foreign} (shorter than its header says: truncated, or not a safetensors file)")
    (n,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as e:
        raise ExportError(f"{foreign} (its header is not JSON: {e})") from None
    metadata = header.pop("__metadata__", None) if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or "pqt_export" not in metadata:
        raise ExportError(f"{foreign} (no pqt_export metadata)")
    if metadata["pqt_export"] == "1" and "sha256" not in metadata:
        raise ExportError(f"{where} was written by an older export.py that recorded no checksums, so it cannot be "
                          f"verified; export the run again (python export.py --out_dir=RUN --format=...)")
    if metadata["pqt_export"] not in (EXPORT_VERSION, GGML_VERSION):
        raise ExportError(f"{where} has export version {metadata['pqt_export']!r}; this export.py reads "
                          f"{EXPORT_VERSION!r} and {GGML_VERSION!r}: export the run again with this export.py")
    return header, metadata


def _verify(data, header, metadata, where):
    """Every tensor's bytes and the metadata against the checksums recorded at export; returns them."""
    damaged = f"{where} fails verification (damaged, or not written by export.py)"
    try:
        sums = json.loads(metadata["sha256"])
        tensor_sums, metadata_sum = dict(sums["tensors"]), sums["metadata"]
    except (KeyError, TypeError, ValueError):
        raise ExportError(f"{damaged}: its checksums cannot be read; export the run again") from None
    if metadata_sha256(metadata) != metadata_sum:
        raise ExportError(f"{damaged}: its metadata does not match its checksum; export the run again")
    if set(tensor_sums) != set(header):
        odd = sorted(set(tensor_sums) ^ set(header))
        raise ExportError(f"{damaged}: tensors {odd[:3]} are missing or were added; export the run again")
    base = 8 + struct.unpack("<Q", data[:8])[0]
    view = memoryview(data)
    for name, entry in header.items():
        try:
            start, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ExportError(f"{damaged}: the header entry of {name} is malformed; export the run again") from None
        if not 0 <= start <= end <= len(data) - base or hashlib.sha256(view[base + start:base + end]).hexdigest() \
                != tensor_sums[name]:
            raise ExportError(f"{damaged}: tensor {name} does not match its checksum (flipped or missing bytes); "
                              f"export the run again")
    return {"tensors": tensor_sums, "metadata": metadata_sum}


def _info(metadata, where):
    """The metadata's JSON entries, parsed and type-checked."""
    info = {"format": metadata.get("format")}
    if not isinstance(info["format"], str):
        raise ExportError(f"{where} lacks the metadata entry 'format' export.py writes; export the run again")
    for key in INFO_KEYS:
        if key not in metadata:
            raise ExportError(f"{where} lacks the metadata entry {key!r} export.py writes; export the run again")
        try:
            info[key] = json.loads(metadata[key])
        except (TypeError, ValueError) as e:
            raise ExportError(f"{where}: metadata entry {key!r} is not JSON ({e}); export the run again") from None
    kinds = dict(model_args=dict, pqt=dict, formats=list, quantized=dict, mix=dict, config=dict,
                 meta=(dict, type(None)))
    for key, kind in kinds.items():
        if not isinstance(info[key], kind):
            raise ExportError(f"{where}: metadata entry {key!r} is a JSON {type(info[key]).__name__}, not what "
                              f"export.py writes; export the run again")
    if info["formats"] != [f.name for f in FORMATS][:len(info["formats"])]:
        raise ExportError(f"{where} numbers its formats differently from this export.py: {info['formats']}")
    unknown = sorted(set(info["model_args"]) - {f.name for f in fields(ModelConfig)})
    if unknown:
        raise ExportError(f"{where}: model_args has keys this project's model does not know: {unknown}")
    info["ggml_types"] = _ggml_types_entry(metadata, where)
    return info


def _ggml_types_entry(metadata, where):
    """The metadata's "ggml_types", {weight: GGML type name}, which a file of GGML_VERSION has ({} before)."""
    if metadata["pqt_export"] != GGML_VERSION:
        return {}
    try:
        types = json.loads(metadata["ggml_types"])
    except KeyError:
        raise ExportError(f"{where} lacks the metadata entry 'ggml_types' export.py writes; export the run again") \
            from None
    except (TypeError, ValueError) as e:
        raise ExportError(f"{where}: metadata entry 'ggml_types' is not JSON ({e}); export the run again") from None
    if not isinstance(types, dict) or not types:
        raise ExportError(f"{where}: metadata entry 'ggml_types' is not the weights' GGML types export.py writes; "
                          f"export the run again")
    odd = sorted({str(t) for t in types.values()} - set(GGML_FORMATS.values()))
    if odd:
        raise ExportError(f"{where}: ggml_types names {odd[0]!r}, none of the GGML types export.py writes "
                          f"({', '.join(GGML_FORMATS.values())})")
    return types


def _reference(info, where):
    """{key: shape} of the unique tensors (a tied weight once) of the model that info describes (meta device)."""
    try:
        with torch.device("meta"):
            model = GPT(ModelConfig(**info["model_args"]))
    except (TypeError, ValueError, ZeroDivisionError, RuntimeError, OverflowError) as e:
        raise ExportError(f"{where}: model_args {info['model_args']} do not describe a model "
                          f"({type(e).__name__}: {e})") from None
    shapes, seen = {}, set()
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) not in seen:  # export_bytes stores a tied weight once, under its first name
            seen.add(id(value))
            shapes[key] = tuple(value.shape)
    return shapes


def _check_quantized(tensors, key, shape, n_formats, where):
    """The names of a quantized weight's tensors, each checked against the block count of its shape."""
    ids = tensors.get(f"{key}.format")
    nb = (-(-shape[0] // BL), -(-shape[1] // BL))
    if ids is None or ids.dtype != torch.uint8 or tuple(ids.shape) != nb:
        got = "missing" if ids is None else f"{ids.dtype} {tuple(ids.shape)}"
        raise ExportError(f"{where}: {key}.format should hold one uint8 format id per 32x32 block {nb}, got {got}")
    ids = ids.flatten().long()
    if (ids >= n_formats).any():
        raise ExportError(f"{where}: {key}.format holds format id {int(ids.max())}; the file names {n_formats} formats")
    real = to_blocks(torch.ones(shape, dtype=torch.bool)).sum(dim=1)  # elements of each block (edge blocks fewer)
    names = {f"{key}.format"}
    for fid in ids.unique().tolist():
        fmt, sel = FORMATS[fid], ids == fid
        want = {f"{key}.{fmt.name}.codes": (torch.uint8, (-(-int(real[sel].sum()) * fmt.bits // 8),))}
        if fmt.scaled:
            want[f"{key}.{fmt.name}.scales"] = (torch.bfloat16 if fmt.kind == "int" else torch.uint8, (int(sel.sum()),))
        for name, (dtype, size) in want.items():
            t = tensors.get(name)
            if t is None or t.dtype != dtype or tuple(t.shape) != size:
                got = "missing" if t is None else f"{t.dtype} {tuple(t.shape)}"
                raise ExportError(f"{where}: {name} should be {dtype} {size} for the blocks of {key}, got {got}")
        scales = tensors.get(f"{key}.{fmt.name}.scales")
        if fmt.kind == "fp" and scales is not None and (scales == 255).any():
            raise ExportError(f"{where}: {key} has the E8M0 scale code 255 (NaN), which export.py never writes")
        names |= want.keys()
    return names


def _check_ggml(tensors, key, shape, type_name, where):
    """The name of a GGML-typed weight's one tensor, checked against its shape and type."""
    t = ggml_quants.ggml_type(type_name)
    weights, size = GGML_QUANT_SIZES[t]
    if shape[1] % weights:
        raise ExportError(f"{where}: {key} {list(shape)} is {type_name}, whose blocks of {weights} weights do not "
                          f"divide its rows")
    want, got = (shape[0], shape[1] // weights * size), tensors.get(f"{key}.ggml")
    if got is None or got.dtype != torch.uint8 or tuple(got.shape) != want:
        got = "missing" if got is None else f"{got.dtype} {tuple(got.shape)}"
        raise ExportError(f"{where}: {key}.ggml should be torch.uint8 {want} for the {type_name} blocks of {key}, "
                          f"got {got}")
    return {f"{key}.ggml"}


def _check_tensors(tensors, info, where):
    """Every tensor of the model is in the file, of its shape; nothing else is."""
    reference, quantized, ggml = _reference(info, where), info["quantized"], info["ggml_types"]
    if set(ggml) - set(quantized):
        raise ExportError(f"{where}: ggml_types names {sorted(set(ggml) - set(quantized))[0]}, which is not one of "
                          f"its quantized weights")
    expected = set()
    for key, shape in quantized.items():
        if key not in reference or list(reference[key]) != shape or len(shape) != 2:
            raise ExportError(f"{where}: quantized weight {key} {shape} is not a weight of the model "
                              f"{info['model_args']} ({list(reference.get(key, ())) or 'no such weight'})")
        if key in ggml:
            expected |= _check_ggml(tensors, key, tuple(shape), ggml[key], where)
        else:
            expected |= _check_quantized(tensors, key, tuple(shape), len(info["formats"]), where)
    for key, shape in reference.items():
        if key in quantized:
            continue
        t = tensors.get(key)
        if t is None or not t.is_floating_point() or tuple(t.shape) != shape:
            got = "missing" if t is None else f"{t.dtype} {tuple(t.shape)}"
            raise ExportError(f"{where}: {key} should be a float tensor of shape {shape}, got {got}")
        expected.add(key)
    if set(tensors) - expected:
        raise ExportError(f"{where} holds tensors the model does not have: {sorted(set(tensors) - expected)[:3]}")


def rebuild(data, device="cpu", where="the exported file"):
    """(model in eval mode with the dequantized weights, info) from an exported file's bytes, verified
    first: the checksums export recorded, every tensor's size against the model and its blocks, and
    the rebuilt model finite. Anything else is ExportError, one line."""
    from safetensors.torch import load as load_tensors
    header, metadata = _header(data, where)
    sums = _verify(data, header, metadata, where)
    info = dict(_info(metadata, where), sha256=sums)
    try:
        tensors = load_tensors(data)
    except Exception as e:  # safetensors' own errors have no common base class
        raise ExportError(f"{where} is not a valid safetensors file ({type(e).__name__}: {e})") from None
    _check_tensors(tensors, info, where)
    model = GPT(ModelConfig(**info["model_args"]))
    own = model.state_dict()
    state = {k: v.float() for k, v in tensors.items() if k in own and k not in info["quantized"]}
    for key, (m, n) in info["quantized"].items():
        prefix = key + "."
        if key in info["ggml_types"]:
            state[key] = dequantize_ggml(tensors[prefix + "ggml"], info["ggml_types"][key])
        else:
            state[key] = dequantize_weight({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)},
                                           m, n)
    model.load_state_dict(state, strict=False)  # complete, as _check_tensors found; a tied weight comes with its twin
    for key, value in model.state_dict().items():
        if not torch.isfinite(value).all():
            raise ExportError(f"{where}: {key} holds {int((~torch.isfinite(value)).sum())} non-finite values (an Inf "
                              f"or NaN scale, norm or weight); a non-finite model is not loaded: export the run again")
    return model.to(device).eval(), info


def load(path, device="cpu"):
    """(model, info) from a file written by export.py, verified (rebuild): the model (eval mode) holds
    the dequantized weights; info holds model_args, pqt, format, mix, config, meta (the dataset's
    tokenizer) and sha256 (the file's checksums: {"tensors": {name: hex}, "metadata": hex})."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ExportError(f"cannot read {path}: {first_line(e)}")
    return rebuild(data, device, where=path)
