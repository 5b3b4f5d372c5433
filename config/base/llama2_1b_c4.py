# The base of config/llama2_1b_*.py (Fig. 4, bottom row): Llama2-1B on C4, the recipe of
# base/llama2_c4.py. Not a run of its own: each run's file names it and sets its method and optimizer.
# Token budget: 275B (paper): 275e9 / 524,288 tokens/step = 524,520.9 -> max_iters 524,521 (275.0B).
# Shape: TinyLlama-1.1B's, as the paper prints none: dim 2048, 22 layers, 32 heads, 4 kv heads, FFN
# 5632, vocab 32000 (Llama 2's tokenizer), untied head.
# Our choice: 2^19 = 524,288 tokens per step (8 x 2048 x 32; a micro-batch of 8, as the paper's
# throughput test on an A100-40G).

base = "llama2_c4.py"

model = "llama2-1b"
batch_size = 8
gradient_accumulation_steps = 32  # over all processes: 4 micro-steps per GPU on 8 GPUs
max_iters = 524521
lr_decay_iters = 524521
