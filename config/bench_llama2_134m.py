# Table 1: training throughput (tokens/s) of Llama2-134M.
# Local batch 24, sequence 2048, as the paper; the rest, how to read the log and our choices:
# config/base/bench_llama2.py. Once per method (and each with --optimizer=adam_mini):
#   python train.py config/bench_llama2_134m.py --method=bf16
#   python train.py config/bench_llama2_134m.py --method="diffq[all]"
#   python train.py config/bench_llama2_134m.py --method="gaussws[all]"
# bench.py's interleaved timing of the methods in one process:
#   python bench.py train --model=llama2-134m --batch_size=24 --block_size=2048 --compile=True

base = "base/bench_llama2.py"
out_dir = "out/bench_llama2_134m"

model = "llama2-134m"
batch_size = 24
