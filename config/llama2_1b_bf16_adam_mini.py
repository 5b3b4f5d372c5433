# Fig. 4 (bottom row): Llama2-1B on C4, bf16 with Adam-mini.
# Token budget: 275B (paper): 275e9 / 524,288 tokens/step = 524,520.9 -> max_iters 524,521 (275.0B).
# Shape: TinyLlama-1.1B's, as the paper prints none: dim 2048, 22 layers, 32 heads, 4 kv heads, FFN
# 5632, vocab 32000 (Llama 2's tokenizer), untied head; sequence 2048. Data: python
# data/c4/prepare.py --tokenizer=path/to/tokenizer.model (Llama 2's own, 32000 tokens; see the
# README).
# Our choices (the paper's settings appendix is missing): 2^19 = 524,288 tokens per step (8 x 2048 x
# 32; a micro-batch of 8, as the paper's throughput test on an A100-40G), and nanoGPT's GPT2 recipe
# for the rest: lr 6e-4 cosine to 6e-5 after 2000 warmup steps, weight decay 0.1, betas (0.9, 0.95),
# clip 1.0 (the decay, betas and clip of Llama 2's own pre-training too).
# Adam-mini takes AdamW's hyperparameters, as its paper advises.
# Launch: torchrun --standalone --nproc_per_node=8 train.py config/llama2_1b_bf16_adam_mini.py

out_dir = "out/llama2_1b_bf16_adam_mini"
wandb_log = True  # --wandb_mode=offline without a network, --wandb_log=False without an account
wandb_run_name = "llama2_1b_bf16_adam_mini"

dataset = "c4"
model = "llama2-1b"
block_size = 2048
batch_size = 8
gradient_accumulation_steps = 32  # over all processes: 4 micro-steps per GPU on 8 GPUs

method = "bf16"

optimizer = "adam_mini"
learning_rate = 6e-4
min_lr = 6e-5
max_iters = 524521
lr_decay_iters = 524521
warmup_iters = 2000
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0

eval_interval = 1000
eval_iters = 200
log_interval = 10
compile = True
