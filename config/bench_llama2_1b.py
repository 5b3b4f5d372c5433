# Table 1: training throughput (tokens/s) of Llama2-1B (TinyLlama-1.1B's shape).
# Local batch 8, sequence 2048, as the paper; the rest, how to read the log and our choices:
# config/base/bench_llama2.py. Once per method (and each with --optimizer=adam_mini):
#   python train.py config/bench_llama2_1b.py --method=bf16
#   python train.py config/bench_llama2_1b.py --method="diffq[all]"
#   python train.py config/bench_llama2_1b.py --method="gaussws[all]"
# bench.py's interleaved timing of the methods in one process:
#   python bench.py train --model=llama2-1b --batch_size=8 --block_size=2048 --compile=True

base = "base/bench_llama2.py"
out_dir = "out/bench_llama2_1b"

model = "llama2-1b"
batch_size = 8
