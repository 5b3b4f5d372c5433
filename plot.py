"""Plots of training runs: their loss and b_t against tokens, and the loss paired with the bf16 run's.

The loss panels are laid out as the paper's Fig. 1b, 3 and 4; a PQT run is paired with the bf16 run of
the same settings and seed.

    python plot.py out/run_a out/run_b out/run_c --out=plots

Each plain argument is a run directory of train.py (metrics.jsonl and config.json); runs whose settings
differ only in their seed are one line. Writes loss.png, bitwidth.png (where a run has PQT layers) and
paired.png (where a PQT run's bf16 twin is among the runs) under --out: figures.py says what each shows.
"""
import sys

import configurator
import figures
from util import cli, unusable_dir

DEFAULTS = dict(
    out="plots",  # the directory loss.png, bitwidth.png and paired.png are written to
)
USAGE = "usage: python plot.py RUN_DIR [RUN_DIR ...] [--out=DIR]"


def main(argv):
    c, run_dirs = dict(DEFAULTS), []
    configurator.configure(c, argv, positional=run_dirs, usage=USAGE)
    if not run_dirs:
        raise figures.PlotError(f"no run directory given; {USAGE} (--help says more)")
    why = unusable_dir(c["out"]) if c["out"] else "it is empty"
    if why:
        raise figures.PlotError(f"--out={c['out']!r} cannot take the figures: {why}; choose another directory")
    for path in figures.make_plots(run_dirs, c["out"]):
        print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(cli(main))
