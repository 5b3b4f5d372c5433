"""Check a GGUF file of export.py in llama.cpp itself: its logits and val loss on train.py's evaluation
batches against our model of the .safetensors export beside it (lowbit.load, FP32).

    python export.py --out_dir=out --format=mxfp4 --gguf=True    # writes out/model-mxfp4.gguf (gguf_file.py)
    python export_gguf.py --gguf=out/model-mxfp4.gguf   # (--plain_cpu=True where llama.cpp's AMX kernels fault)

The file is verified first (its checksums, and that it was written from the .safetensors beside it:
gguf_file.open_export); a damaged, foreign or mismatched file, a missing one or a directory is one
line and exit status 1, and llama.cpp is not run. Then llama.cpp's logits are compared with the file's
model computed with llama.cpp's roundings reproduced (llama_tools.LlamaCppArithmetic): beyond the bound
docs/GGUF.md derives, exit status 1. Needs llama-cpp-python (docs/GGUF.md).
"""
import sys
import time

import gguf_file
import llama_tools
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
    r = llama_tools.check_llama_cpp(cfg["gguf"], cfg["eval_iters"], cfg["plain_cpu"])
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


if __name__ == "__main__":
    sys.exit(cli(main))
