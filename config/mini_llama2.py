# Fig. 4 at laptop scale: the Llama2 base of `python -m studies fig4`.
# What it changes from the paper's runs (config/llama2_134m_*.py): a 4-layer, 128-wide Llama2 (SwiGLU
# MLP of Llama 2's width rule, RoPE, RMSNorm, untied head) on the offline default corpus (byte tokens)
# instead of Llama2-134M on C4, and the token budget of config/mini_gpt2.py: 200 steps of 2 x 16 x 128 =
# 4,096 tokens (0.82M tokens) instead of 300B. The arms (bf16, diffq[all], gaussws[all]; seeds) are
# overrides of this file, listed in studies/definitions.py.
# Wall time: about that of config/mini_gpt2.py (the README's results tables give it per arm).
# Our choices: the recipe of config/mini_gpt2.py (lr 2e-3, 25 warmup steps, cosine to 2e-4, AdamW
# betas (0.9, 0.99), weight decay 0.1, clip 1.0), so the two architectures differ in the model only.

out_dir = "out/mini_llama2"  # the study runner gives every run its own out_dir

dataset = "default"
arch = "llama2"
n_layer = 4
n_head = 4
n_embd = 128
block_size = 128
bias = False
batch_size = 16
gradient_accumulation_steps = 2  # over all processes: the same batches and losses on 1 or 2 (--nproc=2)

method = "gaussws[all]"
b_init = 6.0
b_target = 4.0
bitwidth_weight_decay = 0.1

optimizer = "adamw"
learning_rate = 2e-3
min_lr = 2e-4
max_iters = 200
lr_decay_iters = 200
warmup_iters = 25
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.99
grad_clip = 1.0

eval_interval = 50
eval_iters = 20
log_interval = 10
