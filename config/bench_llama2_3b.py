# Table 1: training throughput (tokens/s) of Llama2-3B (OpenLLaMA-3B's shape).
# Local batch 2, sequence 2048, as the paper. Token budget: none; a throughput run of 50 steps.
# Use: run once per method (and optimizer); compare tokens/s of the log lines after the first,
# which includes compilation:
#   torchrun --standalone --nproc_per_node=8 train.py config/bench_llama2_3b.py --method=bf16
#   torchrun --standalone --nproc_per_node=8 train.py config/bench_llama2_3b.py --method="diffq[all]"
#   torchrun --standalone --nproc_per_node=8 train.py config/bench_llama2_3b.py --method="gaussws[all]"
#   (and each with --optimizer=adam_mini)
# The log's tokens/s counts all processes: divide it by the number of GPUs for Table 1's figure
# per GPU. bench.py times the methods interleaved in one process, which compares them more fairly:
#   python bench.py train --model=llama2-3b --batch_size=2 --block_size=2048 --compile=True
# Our choices: the offline default corpus as data (throughput does not depend on the tokens, and it
# needs no download; the model keeps Llama 2's vocab 32000), 50 steps, one evaluation batch, and the
# recipe of the Fig. 4 configs for the optimizer.
# The weights, gradients and AdamW state (16 bytes per parameter) do not fit one A100-40G, so the
# paper's run was sharded (it cites FSDP and ZeRO): FSDP over 8 GPUs, one micro-step per GPU; with N
# GPUs pass --gradient_accumulation_steps=N.

out_dir = "out/bench_llama2_3b"
save_checkpoints = False  # a throughput run: nothing here is worth resuming (70B† would be tens of GB)

dataset = "default"
model = "llama2-3b"
block_size = 2048
batch_size = 2
gradient_accumulation_steps = 8  # one micro-step per GPU on 8 GPUs
parallel = "fsdp"

method = "gaussws[all]"  # the method under test; --method=bf16 for the baseline

optimizer = "adamw"
learning_rate = 6e-4
min_lr = 6e-5
max_iters = 50
lr_decay_iters = 50
warmup_iters = 10
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0

eval_interval = 1000  # more than max_iters: evaluate only at the start and the end
eval_iters = 1
log_interval = 10
compile = True
