"""Check a GGUF file of export.py in llama.cpp itself, and put llama.cpp's own quantizer beside ours.

    python export.py --out_dir=out --format=mxfp4 --gguf=True    # writes out/model-mxfp4.gguf (files/gguf_file.py)
    python export_gguf.py --gguf=out/model-mxfp4.gguf   # (--plain_cpu=True where llama.cpp's AMX kernels fault)
    python export_gguf.py --out_dir=out --llama_quantize=Q4_K_M+imatrix,Q4_0 --gguf=out/model-q4_k.gguf --json=t.json
    python export_gguf.py --build_llama_cpp   # llama-quantize, llama-imatrix, llama-perplexity into a cache

The check (--gguf=FILE): its logits and val loss on train.py's evaluation batches against our model of
the .safetensors export beside it (files.lowbit.load, FP32). The file is verified first (its checksums, and
that it was written from the .safetensors beside it: gguf_file.open_export); a damaged, foreign or
mismatched file, a missing one or a directory is one line and exit status 1, and llama.cpp is not run.
Then llama.cpp's logits are compared with the file's model computed with llama.cpp's roundings
reproduced (llamacpp.arithmetic.LlamaCppArithmetic): beyond the bound docs/GGUF.md derives, exit status 1.
Needs llama-cpp-python (docs/GGUF.md).

llama.cpp's quantizer beside ours (--out_dir=RUN with --llama_quantize=SPEC,...; llamacpp.tools.llama_cpp_table):
into --export_dir (RUN/llama.cpp) the run's checkpoint as model-fp32.gguf, an importance matrix over
the training split (imatrix.gguf) where a SPEC ends in +imatrix, and llama-quantize's file of each SPEC
(llama-<TYPE>[-imatrix].gguf), each reused only where manifest.json shows it made from the same inputs;
then one table of those files and ours (--gguf=F1,F2): their block Linears' types and bits per weight,
bytes, llama.cpp's val loss, our model of the file's, the run's unquantized model's and the change.
llama.cpp's tools are found in $LLAMA_CPP_BIN, on PATH or in the cache --build_llama_cpp fills. Each call of
one (and each build step) runs within a time limit derived from its work (--tool_timeout=SECONDS sets one for
all), and what it wrote is read back before it gets its name or a manifest entry: a tool that hangs, fails, or
exits 0 with no file or a wrong one is one line naming it, and nothing is recorded.
"""
import json
import math
import os
import sys
import time

from configurator import ConfigError, configure
from files import gguf_file
from llamacpp import build, runtime, tools
from util import check_json_path, cli, write_atomic

# -----------------------------------------------------------------------------------------------
DEFAULTS = dict(
    gguf="out/model-mxfp4.gguf",  # the file to check; with --out_dir, a comma list of our files for the table
    eval_iters=0,  # batches of train.py's evaluation; 0 -> the run's own eval_iters
    plain_cpu=False,  # llama.cpp without its extra CPU kernels (AMX, repacked): AMX faults in some virtual machines
    out_dir="",  # a run directory: llama.cpp's quantizer of its checkpoint beside our files, in one table
    llama_quantize="",  # llama-quantize types for --out_dir, each optionally +imatrix: Q4_K_M+imatrix,Q4_0
    export_dir="",  # where --out_dir's files go; "" -> <out_dir>/llama.cpp
    imatrix_chunks=0,  # chunks of block_size training tokens in the importance matrix; 0 -> 2^18 tokens' worth
    threads=0,  # threads of llama-imatrix, llama-quantize and llama.cpp's evaluation; 0 -> their own default
    json="",  # with --out_dir: also write the table (one record per file) to this path as JSON
    build_llama_cpp=False,  # build llama.cpp's tools into ~/.cache/pqt/llama.cpp-<version>/bin (cmake, ninja; ~25 min)
    tool_timeout=0.0,  # seconds each call of a llama.cpp tool (or build step) may run; 0 -> derived from its work
)
# -----------------------------------------------------------------------------------------------


def main(argv):
    cfg = dict(DEFAULTS)
    explicit = configure(cfg, argv)
    if not (math.isfinite(cfg["tool_timeout"]) and cfg["tool_timeout"] >= 0):
        raise ConfigError(f"--tool_timeout={cfg['tool_timeout']!r}: expected the seconds each call of a llama.cpp tool "
                          f"may run, or 0 for a limit derived from each call's work")
    if cfg["imatrix_chunks"] < 0 or cfg["threads"] < 0 or cfg["eval_iters"] < 0:
        raise ConfigError("--imatrix_chunks, --threads and --eval_iters take a count >= 1, or 0 for the default")
    table_only = [k for k in ("json", "imatrix_chunks", "threads", "export_dir") if k in explicit]
    if table_only and not (cfg["out_dir"] or cfg["llama_quantize"]):
        raise ConfigError(f"--{table_only[0]} is for the table of a run's files (--out_dir=RUN, with "
                          f"--llama_quantize=TYPES); checking one file (--gguf=F) takes --eval_iters and --plain_cpu")
    if cfg["build_llama_cpp"]:
        build.build_llama_cpp(tool_timeout=cfg["tool_timeout"])
        if not (cfg["out_dir"] or cfg["llama_quantize"] or "gguf" in explicit):
            return
    if cfg["out_dir"] or cfg["llama_quantize"]:
        table(cfg, "gguf" in explicit)
    else:
        check(cfg)


def check(cfg):
    start = time.time()
    r = runtime.check_llama_cpp(cfg["gguf"], cfg["eval_iters"], cfg["plain_cpu"])
    pct = lambda loss: f"{100 * (loss / r['val_loss'] - 1):+.4f}%"  # noqa: E731
    print(f"{cfg['gguf']}: {r['batches']} batches of train.py's evaluation, {r['tokens']:,} tokens "
          f"({time.time() - start:.0f} s)")
    print(f"val loss: ours (FP32) {r['val_loss']:.5f}; llama.cpp {r['val_loss_llama_cpp']:.5f} "
          f"({pct(r['val_loss_llama_cpp'])}); the file's model {r['val_loss_file']:.5f} ({pct(r['val_loss_file'])}), "
          f"with llama.cpp's roundings {r['val_loss_arithmetic']:.5f} ({pct(r['val_loss_arithmetic'])})")
    print(f"max |logit difference| of llama.cpp (logits up to {r['max_logit']:.2f}): to ours "
          f"{r['max_logit_difference']:.2e}, to the file's model {r['max_logit_difference_file']:.2e} (bound: twice "
          f"the effect of llama.cpp's roundings, {2 * r['rounding_effect']:.2e}), to the file's model with them "
          f"{r['max_logit_difference_arithmetic']:.2e}; the same next token as ours at "
          f"{100 * r['same_next_token']:.2f}% of positions")
    print(f"RMS of llama.cpp's logits less the file's model's {r['rms_logit_difference_file']:.2e}, less its "
          f"arithmetic's {r['rms_logit_difference_arithmetic']:.2e}")
    if not r["within_bound"]:
        raise gguf_file.GGUFError(f"llama.cpp's logits differ from the file's model's by "
                                  f"{r['max_logit_difference_file']:.3e}, more than twice the effect of its own "
                                  f"roundings ({r['rounding_effect']:.3e}): llama.cpp does not compute the model "
                                  f"this file holds (docs/GGUF.md)")


def check_table_args(cfg, with_ours):
    """(specs, our files) of the table's command line, every value checked before any work."""
    if not cfg["out_dir"]:
        raise ConfigError("--llama_quantize quantizes a run's checkpoint: pass --out_dir=RUN, its run directory")
    specs = tools.parse_specs(cfg["llama_quantize"])
    ours = [p.strip() for p in cfg["gguf"].split(",") if p.strip()] if with_ours else []
    check_json_path(cfg["json"], "llama_cpp.json")
    return specs, ours


def table(cfg, with_ours):
    specs, ours = check_table_args(cfg, with_ours)
    summary = tools.llama_cpp_table(cfg["out_dir"], specs, cfg["export_dir"], ours, cfg["imatrix_chunks"],
                                    cfg["threads"], cfg["eval_iters"], cfg["plain_cpu"],
                                    tool_timeout=cfg["tool_timeout"])
    print_table(summary)
    if cfg["json"]:
        write_atomic(cfg["json"], json.dumps(summary, indent=1) + "\n")
        print(f"wrote {cfg['json']}")


def print_table(summary):
    """One row per file: its block Linears' types and bits per weight, its bytes, llama.cpp's val loss, our
    model of the file's, the run's unquantized model's (source) and llama.cpp's change from it."""
    imatrix, evaluation = summary["imatrix"], summary["evaluation"]
    print(f"\n{summary['checkpoint']} (step {summary['iter_num']}); files in {summary['export_dir']}")
    if imatrix:
        print(f"importance matrix: llama-imatrix over {imatrix['chunks']} chunks of {imatrix['context']} tokens of "
              f"the training split ({imatrix['tokens']:,} tokens)")
    print(f"val loss on {evaluation['batches']} batches of train.py's evaluation ({evaluation['tokens']:,} tokens)\n")
    print(f"{'file':<28}{'block Linears':<28}{'bytes':>12}{'bits/w':>8}{'llama.cpp':>11}{'its model':>11}"
          f"{'source':>9}{'change':>9}")
    for r in summary["files"]:
        inside = os.path.dirname(os.path.abspath(r["path"])) == os.path.abspath(summary["export_dir"])
        name = os.path.basename(r["path"]) if inside else r["path"]
        types = ", ".join(f"{t} x{n}" for t, n in r["tensor_types"].items())
        print(f"{name:<28}{types:<28}{r['bytes']:>12,}{r['block_bits_per_weight']:>8.3f}"
              f"{r['val_loss_llama_cpp']:>11.5f}{r['val_loss_file']:>11.5f}{r['val_loss_source']:>9.5f}"
              f"{100 * r['relative_change']:>+8.3f}%")


if __name__ == "__main__":
    sys.exit(cli(main))
