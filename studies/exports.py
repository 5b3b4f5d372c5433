"""The exported models of a study's runs: export.py run on a run's checkpoint, its val loss per format
kept in the run directory (export.json), so each format is exported once; the GGUF files of the
llama.cpp study (export_gguf.py's llama-quantize files of a bf16 run, export.py's GGUF of a trained one),
each measured by llama.cpp and kept in the run directory (gguf.json) with its per-tensor types; and a
trunk's tensors rounded one at a time (studies.sensitivity), kept in the run directory (sensitivity.json).
Each record is made once, and a report over committed records (without checkpoints) reads them alone."""
import json
import os
import subprocess
import sys
import tempfile

import checkpoint as ckpt_io
from studies.definitions import REPO
from studies.records import STUDY_LOCK, StudyError, bad_gguf_entry, read_json, write_json


def export_losses(run_dir, formats):
    """{format: val loss of the run's checkpoint exported at that format, or why there is none}.

    The one place that knows export.py's command line: `python export.py --out_dir=RUN
    --format=F1,F2 --json=PATH --save=False` writes one JSON object to PATH whose "exports" hold a record
    per format with its "val_loss" (on train.py's evaluation batches), "val_loss_unquantized" and
    "bits_per_weight". export.py also draws the b_t histograms per layer role of a PQT checkpoint
    (bitwidths.png in the run directory). Records are kept in the run directory (export.json), so
    each format is exported once. Without export.py: "export unavailable".
    """
    try:  # one runner exports a run at a time; the other then finds the records
        with ckpt_io.lock(run_dir, wait=True, name=STUDY_LOCK):
            return _export_losses(run_dir, formats)
    except ckpt_io.CheckpointError as e:
        raise StudyError(str(e)) from None


def _export_losses(run_dir, formats):
    """export_losses under the run's lock. A format "F@B" is F at a budget of B bits per weight
    (export.py --bits_per_weight=B), one export.py call per budget."""
    cache_path = os.path.join(run_dir, "export.json")
    cache = read_json(cache_path) or {}
    missing = [f for f in formats if f not in cache]
    if missing and not os.path.exists(os.path.join(REPO, "export.py")):
        return {f: cache.get(f, "export unavailable") for f in formats}
    for budget in dict.fromkeys(f.partition("@")[2] for f in missing):
        group = [f for f in missing if f.partition("@")[2] == budget]
        records = _run_export(run_dir, [f.partition("@")[0] for f in group], budget)
        if isinstance(records, str):  # why export.py gave none
            return {f: cache.get(f, records) for f in formats}
        for f in group:
            record = records.get(f.partition("@")[0], {})
            if not isinstance(record.get("val_loss"), (int, float)):
                return {f: cache.get(f, f"export.py reported no val_loss for {f}") for f in formats}
            cache[f] = {k: record.get(k) for k in ("val_loss", "val_loss_unquantized", "bits_per_weight")}
        write_json(cache_path, cache)
    return {f: cache[f] for f in formats}


def _run_export(run_dir, formats, budget):
    """{format: export.py's record} of one export.py call, or a line saying why there is none."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "export.json")
        cmd = [sys.executable, "export.py", f"--out_dir={run_dir}", f"--format={','.join(formats)}",
               f"--json={report}", "--save=False"]
        r = subprocess.run(cmd + ([f"--bits_per_weight={budget}"] if budget else []), cwd=REPO,
                           capture_output=True, text=True)
        if r.returncode != 0:
            return f"export failed: {(r.stderr.strip() or r.stdout.strip() or 'no output').splitlines()[-1]}"
        try:
            with open(report) as fh:
                return {e["format"]: e for e in json.load(fh)["exports"]}
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"export.py's --json file is not the JSON expected ({type(e).__name__})"


# --- GGUF files measured by llama.cpp (the llama.cpp study) -----------------------------------------
GGUF_DIR = "gguf"  # the run directory's folder of its GGUF files
# What gguf.json keeps of export_gguf.py's record of a file: its GGML type (or llama.cpp's mix), whether an
# importance matrix made it, its size, the bits per weight of its block Linears (scales included),
# llama.cpp's val loss on train.py's evaluation batches with what computed it; and its block Linears' types: how
# many of each, and each one's (type, bits per weight, weights), what a mix chose
GGUF_KEPT = ("type", "imatrix", "bytes", "block_bits_per_weight", "val_loss_llama_cpp", "val_loss_source",
             "tensor_types", "tensors")
# The record, among a bf16 run's llama.cpp files, of the run as an F32 GGUF (export_gguf.py's model-fp32.gguf,
# which llama-quantize quantizes): llama.cpp's val loss of the unquantized model, every share's denominator
F32_SPEC = "F32"
# Embeddings and head in BF16 in every file, so that files differ by their block Linears alone: export.py's
# --other_dtype, as llamacpp.tools.llama_quantize keeps them (its keep="bf16") in export_gguf.py's files
OTHER_DTYPE = "bfloat16"


def llama_cpp_files(run_dir, specs):
    """{spec: record, or a line saying why there is none} of llama-quantize's files of a bf16 run's
    checkpoint, spec a type or mix of llama.cpp with "+imatrix" where made with the importance matrix of
    the training split ("Q4_K_M+imatrix", "Q4_0"), and F32_SPEC's: the F32 file they are made from.

    The one place that knows export_gguf.py's command line for them: `python export_gguf.py
    --out_dir=RUN --llama_quantize=S1,S2 --export_dir=DIR --json=PATH --threads=1` writes the files into
    DIR and one JSON object to PATH whose "files" hold a record per file with its "spec" (GGUF_KEPT's
    fields and "path"), the F32 file's first with none. Kept in the run directory (gguf.json) under the
    run's lock, each spec made once."""
    return _gguf_records(run_dir, [F32_SPEC, *specs], _llama_cpp_records)


def trained_files(run_dir, specs):
    """{spec: record, or a line saying why there is none} of the GGUF files of a trained run, spec
    export.py's format ("q4_k"), or a GGUF budget at its bits per weight ("auto-gguf@4.2708").

    The one place that knows export.py's command line for them: `python export.py --out_dir=RUN
    --format=F [--bits_per_weight=B] --gguf=True --export_dir=DIR --other_dtype=bfloat16 --json=PATH`
    writes model-F.gguf into DIR (its path in the JSON's "exports" record, under "gguf"), then
    `python export_gguf.py --out_dir=RUN --gguf=FILE --export_dir=DIR --json=PATH --threads=1` measures it in
    llama.cpp as it measures llama-quantize's files (llama_cpp_files), its record matched by "path". Kept as
    llama_cpp_files keeps them."""
    return _gguf_records(run_dir, specs, _trained_records)


def _gguf_records(run_dir, specs, make):
    """The records of specs from the run's gguf.json, those missing made (make(run_dir, specs) -> {spec:
    record} or a line saying why none) and kept, under the run's lock (one runner exports a run at a time)."""
    try:
        with ckpt_io.lock(run_dir, wait=True, name=STUDY_LOCK):
            cache_path = os.path.join(run_dir, "gguf.json")
            cache = read_json(cache_path) or {}
            missing = [s for s in specs if s not in cache]
            made = make(run_dir, missing) if missing else {}
            if isinstance(made, str):
                return {s: cache.get(s, made) for s in specs}
            config = read_json(os.path.join(run_dir, "config.json")) or {}  # train.py's: its vocabulary's limit
            for s in missing:
                record = made.get(s) or {}
                why = bad_gguf_entry(record, config.get("model_args", {}).get("vocab_size"))
                if why:
                    made[s] = f"export_gguf.py reported {why} for {s}"
                    continue
                cache[s] = {k: record.get(k) for k in GGUF_KEPT}
                path = record.get("path")
                cache[s]["file"] = os.path.relpath(_where(path), _where(run_dir)) if path else None
            if any(s in cache for s in missing):
                write_json(cache_path, cache)
            return {s: cache.get(s, made.get(s)) for s in specs}
    except ckpt_io.CheckpointError as e:
        raise StudyError(str(e)) from None


def _where(path):
    """A path the scripts wrote (relative to the repository, where they run) as one that compares."""
    return os.path.realpath(os.path.join(REPO, path))


def _command(cmd, report):
    """Run a script of the repository; its --json file's object, or a line saying why there is none."""
    r = subprocess.run([sys.executable, *cmd], cwd=REPO, capture_output=True, text=True)
    script = " ".join(cmd[:2]) if cmd[0] == "-m" else cmd[0]
    if r.returncode != 0:
        return f"{script} failed: {(r.stderr.strip() or r.stdout.strip() or 'no output').splitlines()[-1]}"
    try:
        with open(report) as fh:
            return json.load(fh)
    except (OSError, ValueError) as e:
        return f"{script}'s --json file is not the JSON expected ({type(e).__name__})"


def _llama_cpp_records(run_dir, specs):
    """One export_gguf.py call for all the specs (one importance matrix serves every +imatrix file); the F32
    file's record (spec null: this call names none of ours) under F32_SPEC."""
    quantized = [s for s in specs if s != F32_SPEC]
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "gguf.json")
        out = _command(["export_gguf.py", f"--out_dir={run_dir}",
                        *([f"--llama_quantize={','.join(quantized)}"] if quantized else []),
                        f"--export_dir={os.path.join(run_dir, GGUF_DIR)}", f"--json={report}", "--threads=1"], report)
    if isinstance(out, str):
        return out
    try:
        return {f["spec"] or F32_SPEC: f for f in out["files"]}
    except (KeyError, TypeError):
        return "export_gguf.py's --json file holds no \"files\" with a \"spec\" each"


def _trained_records(run_dir, specs):
    """One export.py call per spec (each its own budget), then one export_gguf.py on all their files."""
    paths = {}
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "export.json")
        for spec in specs:
            fmt, _, budget = spec.partition("@")
            cmd = ["export.py", f"--out_dir={run_dir}", f"--format={fmt}", "--gguf=True",
                   f"--export_dir={os.path.join(run_dir, GGUF_DIR)}", f"--other_dtype={OTHER_DTYPE}",
                   "--overwrite=True", f"--json={report}"]
            out = _command(cmd + ([f"--bits_per_weight={budget}"] if budget else []), report)
            if isinstance(out, str):
                return out
            try:
                paths[spec] = _where(out["exports"][0]["gguf"]["path"])
            except (KeyError, IndexError, TypeError):
                return f"export.py wrote no GGUF file for {spec} (its --json has no exports[0].gguf.path)"
        report = os.path.join(tmp, "gguf.json")
        out = _command(["export_gguf.py", f"--out_dir={run_dir}", f"--gguf={','.join(paths.values())}",
                        f"--export_dir={os.path.join(run_dir, GGUF_DIR)}", f"--json={report}", "--threads=1"], report)
    if isinstance(out, str):
        return out
    try:
        by_path = {_where(f["path"]): f for f in out["files"]}
    except (KeyError, TypeError):
        return "export_gguf.py's --json file holds no \"files\" with a \"path\" each"
    return {spec: by_path.get(path) for spec, path in paths.items()}


SENSITIVITY = "sensitivity.json"  # a trunk's tensors rounded one at a time, beside its other records


def sensitivity(run_dir, step, types):
    """python -m studies.sensitivity's record of the run's checkpoint at `step` (each block Linear rounded
    alone to each of types: the val loss it costs and error-gguf's proxy of it), or a line saying why there
    is none. Kept in the run directory (SENSITIVITY) under the run's lock, made once: `python -m
    studies.sensitivity --checkpoint=RUN/ckpt_STEP.pt --types=T1,T2 --threads=1 --json=PATH`; without the
    checkpoint (committed records keep none) only the kept record is read."""
    try:
        with ckpt_io.lock(run_dir, wait=True, name=STUDY_LOCK):
            path = os.path.join(run_dir, SENSITIVITY)
            kept = read_json(path)
            if kept is not None and kept.get("iter_num") == step and kept.get("types") == list(types):
                return kept
            checkpoint = os.path.join(run_dir, f"ckpt_{step}.pt")
            if not os.path.isfile(checkpoint):
                return f"no {SENSITIVITY} of step {step} and no ckpt_{step}.pt to measure"
            with tempfile.TemporaryDirectory() as tmp:
                report = os.path.join(tmp, SENSITIVITY)
                out = _command(["-m", "studies.sensitivity", f"--checkpoint={checkpoint}", f"--types={','.join(types)}",
                                "--threads=1", f"--json={report}"], report)
            if isinstance(out, str):
                return out
            out["checkpoint"] = os.path.relpath(_where(out["checkpoint"]), _where(run_dir))
            write_json(path, out)
            return out
    except ckpt_io.CheckpointError as e:
        raise StudyError(str(e)) from None
