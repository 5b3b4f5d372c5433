# The base of config/llama2_134m_*.py (Fig. 4, top row): Llama2-134M on C4, the recipe of
# base/llama2_c4.py. Not a run of its own: each run's file names it and sets its method and optimizer.
# Token budget: 300B (paper): 300e9 / 524,288 tokens/step = 572,204.6 -> max_iters 572,205 (300.0B).
# Shape: the paper's Llama2-134M: dim 768, 12 layers, 12 heads, FFN 2048, vocab 32000 (Llama 2's
# tokenizer), untied head.
# Our choice: 2^19 = 524,288 tokens per step (16 x 2048 x 16; a micro-batch of 16 leaves room on an
# A100-40G, where the paper's throughput test ran 24).

base = "llama2_c4.py"

model = "llama2-134m"
batch_size = 16
gradient_accumulation_steps = 16  # over all processes: 2 micro-steps per GPU on 8 GPUs
max_iters = 572205
lr_decay_iters = 572205
