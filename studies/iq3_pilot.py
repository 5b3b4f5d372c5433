"""A run's weights in llama.cpp's IQ3_XXS, every block Linear (llama-quantize --pure, with the run's importance
matrix), judged by llama.cpp on train.py's evaluation batches, and its blocks set beside quant.lattice's:

    python -m studies.iq3_pilot --out_dir=RUN --export_dir=DIR --json=iq3.json

First export_gguf.py's table of the run (model-fp32.gguf, imatrix.gguf and llama-quantize's own IQ3_XXS mix,
llama-IQ3_XXS-imatrix.gguf, which moves some tensors to IQ3_S); then llama-pure-IQ3_XXS-imatrix.gguf, evaluated
the same way; then ours-STE-IQ3_XXS.gguf, that file with each block Linear's bytes replaced by quant.lattice's of
the STE's grid (what an STE run on iq3_xxs trained on, written bit for bit), evaluated too; then, per block
Linear, the share of the --pure file's 256-weight blocks whose bytes quant.lattice writes too: by llama.cpp's
rule with the same importance matrix (31 trial scales), and by the STE's grid (lattice.STE_TRIALS, no
importance matrix), and the share of weights whose values the STE's grid gives exactly. docs/GGUF.md
("IQ3_XXS") reports what it measured of an STE run on IQ3_XXS and of a bf16 one.
"""
import json
import os
import shutil
import sys

import numpy as np
import torch

import configurator
from files import gguf_file
from llamacpp import runtime, tools
from quant import lattice
from util import check_json_path, cli, write_atomic

DEFAULTS = dict(
    out_dir="out",  # the run directory (its ckpt.pt)
    export_dir="",  # where the GGUF files go; "" -> <out_dir>/llama.cpp
    json="",  # also write the records to this file
    threads=1,  # threads of llama.cpp's tools and evaluation
)
PURE = "llama-pure-IQ3_XXS-imatrix.gguf"
OURS = "ours-STE-IQ3_XXS.gguf"


def imatrix_weights(path):
    """{tensor name: llama-quantize's importance of each input column}: the imatrix file's sums of squared
    inputs over its count of them."""
    from gguf import GGUFReader
    found = {t.name: np.asarray(t.data, dtype=np.float32).reshape(-1) for t in GGUFReader(path).tensors}
    return {name[:-len(".in_sum2")]: s / found[name[:-len(".in_sum2")] + ".counts"][0]
            for name, s in found.items() if name.endswith(".in_sum2")}


def write_ste_file(pure_path, dst, names):
    """A copy of the --pure file whose block Linears hold pack(quantize(w, trials=STE_TRIALS)) of the F32 weights
    (read back from the --pure file's own F32 source, model-fp32.gguf beside it): the same types, shapes and
    offsets, so only the tensors' bytes change."""
    from gguf import GGUFReader
    f32 = {t.name: np.array(t.data, dtype=np.float32) for t in
           GGUFReader(os.path.join(os.path.dirname(pure_path), tools.F32_FILES[0])).tensors if t.name in names}
    tmp = dst + ".tmp"
    shutil.copyfile(pure_path, tmp)
    try:
        reader = GGUFReader(tmp, "r+")
        for t in reader.tensors:
            if t.name in names:
                t.data[...] = lattice.pack(lattice.quantize(torch.from_numpy(f32[t.name]),
                                                            trials=lattice.STE_TRIALS))
        reader.data.flush()
        del reader
        os.replace(tmp, dst)
    except BaseException:
        os.remove(tmp)  # no half-written file left
        raise
    return dst


def evaluate(path, spec, run, threads, source):
    """export_gguf.py's record of a file that is not export.py's: its types, bits, bytes and llama.cpp's val loss."""
    reader = gguf_file.open_reader(path, "make it again with python -m studies.iq3_pilot")
    loss, file_loss = runtime.file_val_losses(path, reader, run.ckpt["model_args"], run.batches, False, threads)
    return dict(spec=spec, path=path, type="IQ3_XXS", imatrix="imatrix" in spec, made_by=spec.split(" ")[0],
                **tools.describe_file(path, reader, run.model.config), val_loss_llama_cpp=loss,
                val_loss_file=file_loss, val_loss_source=source, relative_change=loss / source - 1)


def blocks_alike(f32_path, pure_path, imatrix_path, names):
    """Per block Linear: the share of llama-quantize's IQ3_XXS blocks that quant.lattice writes byte for byte
    (its rule with the importance matrix; the STE's grid), and of the weights whose values the STE's grid gives."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    f32 = {t.name: np.asarray(t.data) for t in GGUFReader(f32_path).tensors if t.name in names}
    pure = {t.name: t for t in GGUFReader(pure_path).tensors if t.name in names}
    importance = imatrix_weights(imatrix_path)
    out = {}
    for name in names:
        w = torch.from_numpy(np.array(f32[name], dtype=np.float32))
        theirs = np.asarray(pure[name].data).reshape(-1, lattice.BYTES)
        rule = lattice.pack(lattice.quantize(w, weights=torch.from_numpy(importance[name]))).reshape(-1, lattice.BYTES)
        ste = lattice.quantize(w, trials=lattice.STE_TRIALS)
        ste_bytes = lattice.pack(ste).reshape(-1, lattice.BYTES)
        values = torch.from_numpy(dequantize(theirs, pure[name].tensor_type).reshape(w.shape))
        out[name] = dict(blocks=len(theirs), rule_same_blocks=float((rule == theirs).all(1).mean()),
                         ste_same_blocks=float((ste_bytes == theirs).all(1).mean()),
                         ste_same_values=float((lattice.dequantize(ste) == values).double().mean()),
                         rms_file=float((values - w).square().mean().sqrt()))
    return out


def main(argv):
    c = dict(DEFAULTS)
    configurator.configure(c, argv, usage="usage: python -m studies.iq3_pilot [--key=value ...]")
    configurator.check_at_least(c, {"threads": 0})
    check_json_path(c["json"], "iq3.json")
    table = tools.llama_cpp_table(c["out_dir"], tools.parse_specs("IQ3_XXS+imatrix"), c["export_dir"],
                                  threads=c["threads"])
    run = tools.open_run(c["out_dir"], table["export_dir"], 0, 0)
    f32, imatrix = (os.path.join(run.export_dir, f) for f in (tools.F32_FILES[0], tools.IMATRIX))
    pure = tools.llama_quantize(f32, os.path.join(run.export_dir, PURE), "IQ3_XXS", pure=True, keep=tools.KEEP,
                                imatrix=imatrix, threads=c["threads"])
    names = sorted(tools.block_linear_names(run.model.config))
    ours = write_ste_file(pure, os.path.join(run.export_dir, OURS), names)
    source = table["files"][0]["val_loss_source"]
    table["files"] += [evaluate(pure, "llama-quantize IQ3_XXS+imatrix --pure", run, c["threads"], source),
                       evaluate(ours, "quant.lattice IQ3_XXS (the STE's grid)", run, c["threads"], source)]
    table["blocks_alike"] = blocks_alike(f32, pure, imatrix, names)
    for f in table["files"]:
        print(f"{os.path.basename(f['path']):<36} {f['block_bits_per_weight']:.4f} bits/w  llama.cpp val loss "
              f"{f['val_loss_llama_cpp']:.5f} (source {source:.5f})")
    alike = table["blocks_alike"].values()  # each tensor's share, weighted by its blocks: the file's share
    print("blocks of the --pure file that quant.lattice writes: " + ", ".join(
        f"{k} {np.average([a[k] for a in alike], weights=[a['blocks'] for a in alike]):.4f}"
        for k in ("rule_same_blocks", "ste_same_blocks", "ste_same_values")))
    if c["json"]:
        write_atomic(c["json"], json.dumps(table, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(cli(main))
