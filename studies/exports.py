"""The exported models of a study's runs: export.py run on a run's checkpoint, its val loss per format
kept in the run directory (export.json), so each format is exported once."""
import json
import os
import subprocess
import sys
import tempfile

import checkpoint as ckpt_io
from studies.definitions import REPO
from studies.records import STUDY_LOCK, StudyError, read_json, write_json


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
