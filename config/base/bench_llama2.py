# The base of config/bench_llama2_*.py (Table 1, training throughput in tokens/s). Not a run of its
# own: each model's file names it and sets the model and the paper's local batch.
# Use: run each model once per method (and optimizer), as its file shows; compare tokens/s of the log
# lines after the first, which includes compilation. The log's tokens/s counts all processes: divide
# it by the number of GPUs for Table 1's figure per GPU. bench.py times the methods interleaved in
# one process, which compares them more fairly (its command is in each model's file).
# Our choices: the offline default corpus as data (throughput does not depend on the tokens, and it
# needs no download; the model keeps Llama 2's vocab 32000), 50 steps, one evaluation batch, and the
# recipe of the Fig. 4 configs (base/llama2_c4.py) for the optimizer.

save_checkpoints = False  # a throughput run: nothing here is worth resuming (70B† would be tens of GB)

dataset = "default"
block_size = 2048  # as the paper
gradient_accumulation_steps = 1  # one micro-step per optimizer step, as Table 1

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
