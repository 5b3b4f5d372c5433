"""Check a GGUF file of export.py in llama.cpp itself: its logits and val loss on train.py's evaluation
batches against our model of the .safetensors export beside it (lowbit.load, FP32).

    python export.py --out_dir=out --format=mxfp4 --gguf=True    # writes out/model-mxfp4.gguf (gguf_file.py)
    python export_gguf.py --gguf=out/model-mxfp4.gguf   # (--plain_cpu=True where llama.cpp's AMX kernels fault)

The file is verified first (its checksums, and that it was written from the .safetensors beside it:
gguf_file.open_export); a damaged, foreign or mismatched file, a missing one or a directory is one
line and exit status 1, and llama.cpp is not run. Needs llama-cpp-python (docs/GGUF.md).
"""
import sys
import time

import gguf_file
from configurator import configure
from util import cli

# -----------------------------------------------------------------------------------------------
DEFAULTS = dict(
    gguf="out/model-mxfp4.gguf",  # a file of export.py --gguf=True; its .safetensors beside it is the reference
    eval_iters=0,  # batches of train.py's evaluation; 0 -> the run's own eval_iters
    plain_cpu=False,  # llama.cpp without its extra CPU kernels (AMX, repacked): AMX faults in some virtual machines
)
# -----------------------------------------------------------------------------------------------


def main(argv):
    cfg = dict(DEFAULTS)
    configure(cfg, argv)
    start = time.time()
    r = gguf_file.check_llama_cpp(cfg["gguf"], cfg["eval_iters"], cfg["plain_cpu"])
    print(f"{cfg['gguf']}: {r['batches']} batches of train.py's evaluation, {r['tokens']:,} tokens; val loss: ours "
          f"(FP32) {r['val_loss']:.4f}, llama.cpp {r['val_loss_llama_cpp']:.4f} "
          f"({100 * (r['val_loss_llama_cpp'] / r['val_loss'] - 1):+.3f}%); max |logit difference| "
          f"{r['max_logit_difference']:.3f} (logits up to {r['max_logit']:.2f}); the same next token at "
          f"{100 * r['same_next_token']:.2f}% of positions ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    sys.exit(cli(main))
