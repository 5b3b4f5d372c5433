"""llama.cpp's own quantizer beside ours: llama-quantize and llama-imatrix called and what they wrote read
back, and the table of a run's files (the run as an F32 GGUF, an importance matrix over its training split,
llama-quantize's file of each type asked for, and our files), each made once (the export directory's
manifest) and measured by llama.cpp on train.py's evaluation batches.

    tools.llama_quantize("out/model-fp32.gguf", "out/q4_k_m.gguf", "Q4_K_M", pure=False)   # llama.cpp's own
    t = tools.llama_cpp_table("out", tools.parse_specs("Q4_K_M+imatrix,Q4_0"))   # export_gguf.py's table

The tools are found and run by build.py (require_tool, run_tool: within a time limit), and what a tool
wrote is read back (tool_output) before it gets its name or a manifest entry. docs/GGUF.md describes the
table.
"""
import hashlib
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass

import gguf
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES

import checkpoint
from data import loader, tokenizer
from data.common import unusable_dir
from files import gguf_file, lowbit
from files.gguf_file import GGUFError
from llamacpp.build import cache_bin, require_tool, run_tool, time_limit
from llamacpp.runtime import file_val_losses, model_val_loss, require_llama_cpp_python
from model import ROLES
from util import commit, first_line, read_record, remove_stale_temporaries, temp_path, write_atomic


# --- llama.cpp's command-line tools: what they wrote ------------------------------------------------------

# The rates a call's work is counted at for its time limit (build.time_limit), 5 to 40 times below those
# measured on one busy thread (docs/GGUF.md): llama-quantize's weights a second by the type's first letters
# (IQ1_* and IQ2_* search a grid per block: IQ1_S measured 4.3e4), llama-imatrix's multiply-adds a second (2 per
# weight and token; attention aside).
QUANTIZE_WEIGHTS_PER_S = {"IQ1": 4e3, "IQ2": 1e4, "": 1e5}
IMATRIX_FLOPS_PER_S = 2e8


def _tool_failure(tool, what, status, output):
    """The one line of a llama.cpp tool that failed: its last line that says error, else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()] or ["no message"]
    said = [line for line in lines if "error" in line.lower()] or lines
    return GGUFError(f"{os.path.basename(tool)} {what} failed (exit status {status}): {said[-1][:300]}")


def tool_output(tool, what, path, expect):
    """gguf's reader of the file a llama.cpp tool wrote at path, read before the file gets its name:
    GGUFError (one line naming the tool, the file kept nowhere) where the tool exited 0 and wrote nothing,
    bytes gguf cannot read, or a file of which expect(reader) says what is wrong (a line; None: right)."""
    cache = cache_bin()
    if os.path.dirname(os.path.abspath(tool)) == os.path.abspath(cache):  # a complete cache is never rebuilt
        remedy = f"remove {cache} and build it again: python export_gguf.py --build_llama_cpp"
    else:
        remedy = (f"replace it with llama.cpp's (python export_gguf.py --build_llama_cpp builds them into {cache}, "
                  f"the place used where $LLAMA_CPP_BIN is unset and PATH has none)")
    broken = f"{tool} is broken or not llama.cpp's: {remedy}"
    said = f"{os.path.basename(tool)} ({what}) exited 0"
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        raise GGUFError(f"{said} and wrote no file: {broken}")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # gguf's reader of bytes that are no GGUF fails with anything (ValueError, IndexError)
        raise GGUFError(f"{said} and wrote a file gguf cannot read ({type(e).__name__}: {first_line(e)[:120]}): "
                        f"{broken}") from None
    wrong = expect(reader)
    if wrong:
        raise GGUFError(f"{said} and wrote a file that {wrong}: {broken}")
    return reader


def _quantized_expect(source, qtype):
    """expect of tool_output for llama-quantize's file of the GGUF reader `source` in qtype: the same
    tensors (names, shapes) and general.file_type the type's (llama-quantize's Q3_K, Q4_K, Q5_K are its _M)."""
    name = {"F32": "ALL_F32", "Q3_K": "MOSTLY_Q3_K_M", "Q4_K": "MOSTLY_Q4_K_M", "Q5_K": "MOSTLY_Q5_K_M"}.get(
        qtype, f"MOSTLY_{qtype}")
    shapes = {t.name: t.shape.tolist() for t in source.tensors}

    def expect(reader):
        field = reader.fields.get("general.file_type")
        found = {t.name: t.shape.tolist() for t in reader.tensors}
        if found != shapes:
            odd = sorted(set(found) ^ set(shapes)) or [k for k in shapes if found[k] != shapes[k]]
            return f"does not hold the model's tensors ({odd[0]} differs, of {len(found)} tensors)"
        if field is None or field.contents() != gguf.LlamaFileType[name]:
            return f"says general.file_type {field.contents() if field else None}, not {qtype}'s"
        return None
    return expect


def llama_quantize(src, dst, qtype, pure=True, keep="bf16", imatrix=None, threads=0, tool_timeout=0.0):
    """llama-quantize of the GGUF file src into dst in qtype (its name for a type or a mix: Q4_0, Q4_K_M,
    ...): every other 2-D weight in that type where pure (--pure: no K-quant mixture), the token embeddings
    and the head in `keep` (as export.py keeps them, so that files compare by their block Linears), with
    the importance matrix at imatrix where given, `threads` threads (0: llama-quantize's default), within
    time_limit (its work: src's weights at qtype's QUANTIZE_WEIGHTS_PER_S). dst is written to a temporary name
    beside it, read back (tool_output: src's tensors, qtype's file type) and renamed. GGUFError (one
    line) where the tool is absent, fails, hangs or writes anything else."""
    tool = require_tool("llama-quantize")
    source = gguf_file.open_reader(str(src))
    rate = next(r for prefix, r in QUANTIZE_WEIGHTS_PER_S.items() if qtype.startswith(prefix))
    limit = time_limit(sum(int(t.n_elements) for t in source.tensors) / rate, tool_timeout)
    tmp = temp_path(dst)
    args = [tool, *(["--pure"] if pure else []), "--token-embedding-type", keep, "--output-tensor-type", keep,
            *(["--imatrix", str(imatrix)] if imatrix else []), str(src), tmp, qtype]
    args += [str(threads)] if threads else []
    try:
        status, output = run_tool(args, f"{qtype} of {src}", limit)
        if status != 0:
            raise _tool_failure(tool, f"{qtype} of {src}", status, output)
        tool_output(tool, f"{qtype} of {src}", tmp, _quantized_expect(source, qtype))
        commit(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return dst


# --- llama.cpp's quantizer beside ours -----------------------------------------------------------------

# llama-quantize's type names (QUANT_OPTIONS of tools/quantize/quantize.cpp in the llama.cpp that llama-cpp-python
# 0.3.36 carries) whose files gguf 0.19 reads back; not Q1_0 (gguf has no dequantizer of it), Q2_0 (gguf does not
# know it), MXFP4_MOE (for mixture-of-experts weights) nor COPY.
QUANTIZE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q2_K_S", "Q3_K", "Q3_K_S", "Q3_K_M", "Q3_K_L",
                  "Q4_K", "Q4_K_S", "Q4_K_M", "Q5_K", "Q5_K_S", "Q5_K_M", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS",
                  "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "F16",
                  "BF16", "F32")
IMATRIX_TOKENS = 2 ** 18  # tokens of the training split the importance matrix sees unless told (imatrix_chunks)
KEEP = "bf16"  # the token embeddings and the head in every llama-quantize file: export.py's other_dtype default
MANIFEST = "manifest.json"  # what made each file of the export directory: a file is reused only if its key matches
F32_FILES = ("model-fp32.gguf", "model-fp32.safetensors")  # export.py --format=fp32 --gguf=True's names
IMATRIX = "imatrix.gguf"


def parse_specs(text):
    """[(spec, type, imatrix)] of a comma list of llama-quantize types, each optionally +imatrix (Q4_K_M+imatrix,
    Q4_0): the type upper-cased, as llama-quantize reads it, repeats dropped. GGUFError (one line) for any
    other entry."""
    specs = {}
    for part in [s.strip() for s in str(text).split(",") if s.strip()]:
        qtype, plus, rest = part.partition("+")
        if qtype.upper() not in QUANTIZE_TYPES or (plus and rest != "imatrix"):
            raise GGUFError(f"--llama_quantize: {part!r} is not a llama-quantize type, optionally with +imatrix (e.g. "
                            f"Q4_K_M+imatrix or Q4_0); the types: {', '.join(QUANTIZE_TYPES)}")
        spec = qtype.upper() + ("+imatrix" if plus else "")
        specs[spec] = (spec, qtype.upper(), bool(plus))
    return list(specs.values())


def quantized_name(qtype, imatrix):
    """The file name of llama-quantize's file of a type, with or without the importance matrix."""
    return f"llama-{qtype}{'-imatrix' if imatrix else ''}.gguf"


def block_linear_names(config):
    """llama.cpp's names of the block Linears' weights (model.ROLES): what block bits per weight counts."""
    names = gguf_file.gguf_names(config)
    return {names[f"transformer.h.{i}.{path}.weight"] for i in range(config.n_layer) for path in ROLES[config.arch]}


def describe_file(path, reader, config):
    """A GGUF file of the model config: its size on disk in bytes, its block Linears' tensor types
    ({type: count}) and their bits per weight, counted from the types' block sizes (GGML_QUANT_SIZES:
    weights and bytes per block); and each block Linear's own (tensors: {llama.cpp's name: {type,
    bits_per_weight, weights}}, in the file's order), what a mix chose. Embeddings, norms, biases and head
    are not counted."""
    names = block_linear_names(config)
    found = {t.name: t for t in reader.tensors if t.name in names}
    if len(found) != len(names):
        raise GGUFError(f"{path} lacks block Linears of the run's model ({sorted(names - set(found))[0]}, ...): it is "
                        f"a file of another model")
    types, tensors, bits, weights = {}, {}, 0, 0
    for name, t in found.items():
        per_block, block_bytes = GGML_QUANT_SIZES[t.tensor_type]
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        tensors[name] = dict(type=t.tensor_type.name, bits_per_weight=8 * block_bytes / per_block,
                             weights=int(t.n_elements))
        bits += 8 * block_bytes * int(t.n_elements) // per_block
        weights += int(t.n_elements)
    return dict(bytes=os.path.getsize(path), tensor_types=dict(sorted(types.items())),
                block_bits_per_weight=bits / weights, tensors=tensors)


# --- the files of a run, each made once -----------------------------------------------------------------

def sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def weights_sha256(model):
    """SHA-256 of a model's weights: of every tensor's SHA-256 (lowbit.tensor_sha256), by name."""
    sums = {key: lowbit.tensor_sha256(value) for key, value in model.state_dict().items()}
    return hashlib.sha256(json.dumps(sums, sort_keys=True).encode()).hexdigest()


class Manifest:
    """The export directory's manifest.json: for each file made there, the key of what made it (the
    SHA-256 of its inputs and of the tool, the arguments) and the file's own SHA-256. A file is reused
    only where its key is the same and its bytes are those recorded, else made again. The manifest is
    written (atomically) before any file, which makes the directory this command's, and after each."""

    def __init__(self, directory):
        self.directory, self.path = directory, os.path.join(directory, MANIFEST)
        record = read_record(self.path, "a manifest of export_gguf.py (an object with 'files')",
                             lambda r: isinstance(r.get("files"), dict) and all(
                                 isinstance(v, dict) and "sha256" in v for v in r["files"].values()), GGUFError,
                             "remove it, and the files beside it are made again")
        self.files = record["files"] if record else None  # None: the directory has none yet

    def claim(self, names):
        """Write the manifest (an empty one where there is none): GGUFError, before anything is written,
        where one of names exists in a directory without one (another tool's file, not to be replaced)."""
        if self.files is None:
            there = [name for name in names if os.path.exists(os.path.join(self.directory, name))]
            if there:
                raise GGUFError(f"{os.path.join(self.directory, there[0])} exists, and {self.directory} has no "
                                f"{MANIFEST} of this command: choose another --export_dir, or remove that file")
            self.files = {}
        self.save()

    def reusable(self, names, key):
        """Whether the files names were made from key and hold the bytes recorded."""
        return all(self.files.get(name, {}).get("key") == key and os.path.isfile(os.path.join(self.directory, name))
                   and sha256_file(os.path.join(self.directory, name)) == self.files[name]["sha256"] for name in names)

    def record(self, names, key, info=None):
        for name in names:
            self.files[name] = dict(key=key, sha256=sha256_file(os.path.join(self.directory, name)), info=info)
        self.save()

    def save(self):
        os.makedirs(self.directory, exist_ok=True)
        write_atomic(self.path, json.dumps(dict(files=self.files), indent=1) + "\n")


@dataclass
class Run:
    """A run as the quantizer's table needs it: its checkpoint (checkpoint.read), model, data's meta.json,
    the export directory, the F32 GGUF's plan, the evaluation batches and the importance matrix's chunks."""
    ckpt: dict
    model: torch.nn.Module
    meta: dict
    export_dir: str
    plan: gguf_file.Plan
    batches: list
    chunks: int


def open_run(run_dir, export_dir, eval_iters, imatrix_chunks, with_imatrix=True):
    """The Run of run_dir, everything checked before anything is written (the training split's room for
    the importance matrix's chunks where with_imatrix): GGUFError (or the checkpoint's, the data's, the
    tokenizer's own error), one line."""
    ckpt = checkpoint.read(run_dir)
    config = ckpt["config"]
    lacking = [k for k in ("dataset", "seed", "batch_size", "eval_iters") if k not in config]
    if lacking:
        raise GGUFError(f"{ckpt['path']} does not record {', '.join(lacking)} of its run, so train.py's evaluation "
                        f"batches cannot be drawn again")
    model = lowbit.build_model(ckpt["model"], ckpt["model_args"])
    block_size = model.config.block_size
    directory = loader.data_dir(config["dataset"])
    meta = loader.read_meta(directory)
    export_dir = export_dir or os.path.join(os.path.dirname(ckpt["path"]), "llama.cpp")
    why = unusable_dir(export_dir)
    if why:
        raise GGUFError(f"--export_dir={export_dir!r} is unusable: {why}; choose a directory that can be written")
    quantized = lowbit.block_linears(ckpt["model"], model.config.arch)
    plan = gguf_file.plan(model, quantized, meta, config, ["fp32"], export_dir, dict(save=True, overwrite=True))
    fit = len(loader.open_split(directory, "train", meta, block_size)) // block_size - 2  # chunks + 1 windows, shifts
    chunks = imatrix_chunks or max(1, min(IMATRIX_TOKENS // block_size, fit))
    if with_imatrix and chunks > fit:
        raise GGUFError(f"--imatrix_chunks={chunks}: the training split holds {fit} chunks of {block_size} tokens "
                        f"(and one more); choose at most {fit}")
    return Run(ckpt, model, meta, export_dir, plan, loader.eval_batches(config, block_size, eval_iters), chunks)


def write_f32(run, manifest):
    """model-fp32.safetensors and model-fp32.gguf of the run, as export.py --format=fp32 --gguf=True writes
    them: the block Linears in F32, the embeddings and head in BF16 (export.py's other_dtype), norms and
    biases F32. Reused where the manifest has them of the same weights, run config and data meta.
    Returns whether reused."""
    metadata = lowbit.run_metadata(run.ckpt, run.meta)  # the run's config and the data's meta (its tokenizer)
    key = dict(weights_sha256=weights_sha256(run.model), metadata_sha256=lowbit.metadata_sha256(metadata),
               format="fp32", other_dtype="bfloat16", export=lowbit.EXPORT_VERSION, gguf_export=gguf_file.GGUF_EXPORT)
    if manifest.reusable(F32_FILES, key):
        return True
    quantized = lowbit.block_linears(run.ckpt["model"], run.model.config.arch)
    data, _ = lowbit.export_bytes(run.model, quantized, {}, "fp32", torch.bfloat16, metadata)
    write_atomic(os.path.join(run.export_dir, F32_FILES[1]), data)
    gguf_file.write(run.plan, "fp32", data, log=None)
    manifest.record(F32_FILES, key)
    return False


SHIFT = 16  # tokens a window of imatrix_text may move forward to a start whose text encodes back to it


def imatrix_text(run):
    """The text llama-imatrix reads: chunks + 1 windows of block_size tokens spread evenly over the training
    split, each decoded with the data's tokenizer (the end-of-sequence token as its text, which llama-imatrix's
    --parse-special reads as the token) and moved forward by up to SHIFT tokens to the first start whose text
    the tokenizer encodes back to those tokens (for the bytes: not inside a UTF-8 character). llama.cpp's
    chunks of block_size tokens are then these windows; the one window more makes up for one that is not."""
    config, block_size = run.ckpt["config"], run.model.config.block_size
    directory = loader.data_dir(config["dataset"])
    data = loader.open_split(directory, "train", run.meta, block_size)
    tok = tokenizer.from_meta(run.meta, directory)
    pieces = []
    for start in np.linspace(0, len(data) - block_size - SHIFT, run.chunks + 1).astype(np.int64).tolist():
        ids = data[start:start + block_size].tolist()
        for shift in range(SHIFT):
            moved = data[start + shift:start + shift + block_size].tolist()
            if tok.encode(tok.decode(moved), special=True) == moved:
                ids = moved
                break
        pieces.append(tok.decode(ids))
    return "".join(pieces)


def _imatrix_expect(names, chunks, context):
    """expect of tool_output for llama-imatrix's file: `chunks` chunks of `context` tokens, and for each
    block Linear of names its sums of squared inputs (finite, >= 0) over chunks * context tokens."""
    def expect(reader):
        fields = {k: reader.fields[k].contents() if k in reader.fields else None
                  for k in ("imatrix.chunk_count", "imatrix.chunk_size")}
        if list(fields.values()) != [chunks, context]:
            return f"says {fields}, not {chunks} chunks of {context} tokens"
        data = {t.name: np.asarray(t.data, dtype=np.float64) for t in reader.tensors}
        for name in sorted(names):
            sums, counts = data.get(name + ".in_sum2"), data.get(name + ".counts")
            if sums is None or counts is None or not (np.isfinite(sums).all() and (sums >= 0).all()) \
                    or counts.tolist() != [chunks * context]:
                return f"holds no importance matrix of {name} over {chunks * context} tokens"
        return None
    return expect


def make_imatrix(run, manifest, tool, threads, tool_timeout=0.0):
    """imatrix.gguf: llama-imatrix of model-fp32.gguf over imatrix_text (its chunks of block_size tokens,
    the model's context, no perplexity), reused where the manifest has it of the same model, text, tool and
    chunks; within time_limit (its work: 2 multiply-adds per weight of the F32 file and token, at
    IMATRIX_FLOPS_PER_S) and read back (tool_output: every block Linear's sums) before it is named and
    recorded. Returns (whether reused, {chunks, tokens, context}: what llama.cpp computed over)."""
    block_size, text = run.model.config.block_size, imatrix_text(run)
    key = dict(model=manifest.files[F32_FILES[0]]["sha256"], tool=sha256_file(tool), chunks=run.chunks,
               context=block_size, text_sha256=hashlib.sha256(text.encode("utf-8")).hexdigest())
    if manifest.reusable([IMATRIX], key):
        return True, manifest.files[IMATRIX]["info"]
    path = os.path.join(run.export_dir, IMATRIX)
    tmp = temp_path(path) + ".gguf"  # llama-imatrix warns of another suffix
    batch = block_size * max(1, 2048 // block_size)  # whole chunks a batch, as llama-imatrix requires
    f32 = os.path.join(run.export_dir, F32_FILES[0])
    work = 2 * sum(int(t.n_elements) for t in gguf_file.open_reader(f32).tensors) * run.chunks * block_size
    with tempfile.TemporaryDirectory(prefix="pqt-imatrix-") as folder:
        text_path = os.path.join(folder, "train.txt")
        with open(text_path, "w", encoding="utf-8") as f:
            f.write(text)
        args = [tool, "-m", f32, "-f", text_path, "-o", tmp, "--output-format", "gguf", "-c", str(block_size), "-b",
                str(batch), "--chunks", str(run.chunks), "--no-ppl", "--parse-special", "--output-frequency",
                str(run.chunks), *(["-t", str(threads)] if threads else [])]
        try:
            status, output = run_tool(args, f"of {args[2]}", time_limit(work / IMATRIX_FLOPS_PER_S, tool_timeout))
            if status != 0:
                raise _tool_failure(tool, f"of {args[2]}", status, output)
            found = re.search(r"computing over (\d+) chunks", output)
            if found is None or int(found.group(1)) != run.chunks:
                raise GGUFError(f"llama-imatrix computed over {found.group(1) if found else 'no'} chunks of the "
                                f"{run.chunks} of {block_size} tokens asked for: it tokenized the training text "
                                f"otherwise than the data's tokenizer")
            tool_output(tool, f"of {args[2]}", tmp, _imatrix_expect(block_linear_names(run.model.config), run.chunks,
                                                                     block_size))
            commit(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    info = dict(chunks=run.chunks, tokens=run.chunks * block_size, context=block_size)
    manifest.record([IMATRIX], key, info)
    return False, info


def make_quantized(run, manifest, tool, qtype, imatrix, threads, tool_timeout=0.0):
    """llama-<type>[-imatrix].gguf: llama-quantize of model-fp32.gguf to qtype with llama.cpp's own type mix
    (not --pure: what a user of llama-quantize gets), the embeddings and head kept in KEEP, with imatrix.gguf
    where imatrix; reused where the manifest has it of the same inputs and tool. Returns whether reused."""
    name = quantized_name(qtype, imatrix)
    key = dict(model=manifest.files[F32_FILES[0]]["sha256"], tool=sha256_file(tool), type=qtype, keep=KEEP,
               imatrix=manifest.files[IMATRIX]["sha256"] if imatrix else None)
    if manifest.reusable([name], key):
        return True
    llama_quantize(os.path.join(run.export_dir, F32_FILES[0]), os.path.join(run.export_dir, name), qtype, pure=False,
                   keep=KEEP, imatrix=os.path.join(run.export_dir, IMATRIX) if imatrix else None, threads=threads,
                   tool_timeout=tool_timeout)
    manifest.record([name], key)
    return False


# --- the table ----------------------------------------------------------------------------------------

SHAPE_KEYS = ("arch", "n_layer", "n_head", "n_embd", "vocab_size", "block_size")  # what makes two models comparable


def open_ours(path, run):
    """(the GGUF reader, the .safetensors export's info) of one of our files (export.py --gguf=True),
    verified (gguf_file.open_export), and of a model and data the run's evaluation batches fit: the same
    shapes and dataset (a file of another run, an STE phase after this one, compares on the same batches)."""
    _, info = gguf_file.open_export(path)
    mine, theirs = run.ckpt["model_args"], info["model_args"]
    differ = [k for k in SHAPE_KEYS if mine.get(k) != theirs.get(k)]
    if differ or info["config"].get("dataset") != run.ckpt["config"]["dataset"]:
        what = (f"{differ[0]}={theirs.get(differ[0])!r}, the run's {mine.get(differ[0])!r}" if differ else
                f"dataset {info['config'].get('dataset')!r}, the run's {run.ckpt['config']['dataset']!r}")
        raise GGUFError(f"{path} holds another model or data than {run.ckpt['path']} ({what}): files compare on the "
                        f"run's evaluation batches only where both are the same")
    return gguf_file.read(path), info


def llama_cpp_table(run_dir, specs, export_dir="", ours=(), imatrix_chunks=0, threads=0, eval_iters=0,
                    plain_cpu=False, log=print, tool_timeout=0.0):
    """From a run (a bf16 run's checkpoint, or any run's master weights), into export_dir (default
    <run>/llama.cpp): model-fp32.gguf (write_f32), an importance matrix over the training split where a spec
    asks for one (make_imatrix) and llama-quantize's file of every spec of parse_specs (make_quantized),
    each reused where the manifest shows it made from the same inputs; then, for those files and `ours`
    (paths of export.py's GGUF files), one record each: the file, its block Linears' types and bits per
    weight, its bytes, llama.cpp's val loss on train.py's evaluation batches (check_llama_cpp's), our model
    of the file's, and the run's unquantized model's (val_loss_source). Everything is checked before
    anything is written; a failure is one line (GGUFError or the input's own UserError)."""
    run = open_run(run_dir, export_dir, eval_iters, imatrix_chunks, any(imatrix for _, _, imatrix in specs))
    tools = {}
    if specs:
        tools["llama-quantize"] = require_tool("llama-quantize")
    if any(imatrix for _, _, imatrix in specs):
        tools["llama-imatrix"] = require_tool("llama-imatrix")
    require_llama_cpp_python()
    opened = [(path, *open_ours(path, run)) for path in ours]
    manifest = Manifest(run.export_dir)
    remove_stale_temporaries(run.export_dir)  # what a command killed mid-write left (a live one's are kept)
    manifest.claim([*F32_FILES, IMATRIX, *(quantized_name(qtype, imatrix) for _, qtype, imatrix in specs)])
    seconds, reused, started = {}, {}, time.time()
    try:
        reused[F32_FILES[0]] = write_f32(run, manifest)
        seconds["fp32"] = time.time() - started
        log(f"{'reused' if reused[F32_FILES[0]] else 'wrote'} {F32_FILES[0]} ({seconds['fp32']:.1f} s)")
        imatrix = None
        if "llama-imatrix" in tools:
            started = time.time()
            reused[IMATRIX], imatrix = make_imatrix(run, manifest, tools["llama-imatrix"], threads,
                                                      tool_timeout)
            imatrix = dict(imatrix, path=os.path.join(run.export_dir, IMATRIX), reused=reused[IMATRIX],
                           seconds=time.time() - started)
            seconds["imatrix"] = imatrix["seconds"]
            log(f"{'reused' if imatrix['reused'] else 'wrote'} {IMATRIX}: {imatrix['chunks']} chunks of "
                f"{imatrix['context']} training tokens ({imatrix['seconds']:.1f} s)")
        for spec, qtype, with_imatrix in specs:
            started = time.time()
            reused[spec] = make_quantized(run, manifest, tools["llama-quantize"], qtype, with_imatrix, threads,
                                          tool_timeout)
            seconds[f"quantize {spec}"] = time.time() - started
            log(f"{'reused' if reused[spec] else 'wrote'} {quantized_name(qtype, with_imatrix)} "
                f"({seconds[f'quantize {spec}']:.1f} s)")
    except OSError as e:
        raise GGUFError(f"cannot write in {run.export_dir} ({first_line(e)}): free space or choose another "
                        f"--export_dir; no finished file there was replaced") from None
    files = _evaluate(run, specs, opened, reused, (plain_cpu, threads), seconds, log)
    evaluation = dict(batches=len(run.batches), tokens=sum(y.numel() for _, y in run.batches))
    return dict(run=run_dir, checkpoint=run.ckpt["path"], iter_num=run.ckpt["iter_num"], export_dir=run.export_dir,
                evaluation=evaluation, imatrix=imatrix, seconds=seconds, files=files)


def _evaluate(run, specs, opened, reused, llama_cpp, seconds, log):
    """The records of llama_cpp_table's files (the F32 file, llama-quantize's, ours), one schema."""
    started = time.time()
    source = model_val_loss(run.model, run.batches)
    seconds["evaluate source"] = time.time() - started
    f32 = os.path.join(run.export_dir, F32_FILES[0])
    rows = [(dict(spec=None, path=f32, type="fp32", imatrix=False, made_by="export.py"), gguf_file.read(f32),
             run.ckpt["model_args"], reused[F32_FILES[0]])]
    for spec, qtype, imatrix in specs:
        path = os.path.join(run.export_dir, quantized_name(qtype, imatrix))
        rows.append((dict(spec=spec, path=path, type=qtype, imatrix=imatrix, made_by="llama-quantize"),
                     gguf_file.open_reader(path, f"make it again with python export_gguf.py --out_dir=RUN "
                                                 f"--llama_quantize={spec}"), run.ckpt["model_args"], reused[spec]))
    for path, reader, info in opened:
        rows.append((dict(spec=None, path=path, type=info["format"], imatrix=False, made_by="export.py"), reader,
                     info["model_args"], None))
    files = []
    for fields, reader, model_args, was_reused in rows:
        started = time.time()
        llama, file_loss = file_val_losses(fields["path"], reader, model_args, run.batches, *llama_cpp)
        files.append(dict(fields, **describe_file(fields["path"], reader, run.model.config), val_loss_llama_cpp=llama,
                          val_loss_file=file_loss, val_loss_source=source, relative_change=llama / source - 1,
                          reused=was_reused, seconds_evaluate=time.time() - started))
        seconds[f"evaluate {os.path.basename(fields['path'])}"] = files[-1]["seconds_evaluate"]
        log(f"evaluated {fields['path']} ({files[-1]['seconds_evaluate']:.1f} s)")
    return files
