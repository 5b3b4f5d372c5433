# Table 1: training throughput (tokens/s) of Llama2-70B† (Llama-2-70B's shape, 4 of 80 layers).
# Local batch 2, sequence 2048, as the paper; the rest, how to read the log and our choices:
# config/base/bench_llama2.py. Once per method (and each with --optimizer=adam_mini):
#   torchrun --standalone --nproc_per_node=8 train.py config/bench_llama2_70b.py --method=bf16
#   torchrun --standalone --nproc_per_node=8 train.py config/bench_llama2_70b.py --method="diffq[all]"
#   torchrun --standalone --nproc_per_node=8 train.py config/bench_llama2_70b.py --method="gaussws[all]"
# bench.py's interleaved timing of the methods in one process:
#   python bench.py train --model=llama2-70b --batch_size=2 --block_size=2048 --n_layer=4 --compile=True
# The weights, gradients and AdamW state (16 bytes per parameter) do not fit one A100-40G, so the
# paper's run was sharded (it cites FSDP and ZeRO): FSDP over 8 GPUs, one micro-step per GPU; with N
# GPUs pass --gradient_accumulation_steps=N.

base = "base/bench_llama2.py"
out_dir = "out/bench_llama2_70b"

model = "llama2-70b"
n_layer = 4  # the paper's †: 4 of the 80 layers
batch_size = 2
gradient_accumulation_steps = 8  # one micro-step per GPU on 8 GPUs
parallel = "fsdp"
