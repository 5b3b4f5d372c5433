# The deployment study's base (`python -m studies deploy`): config/mini_gpt2.py's model, data and
# recipe (4-layer, 128-wide GPT2 of 0.8M parameters on the default corpus, 2 x 16 x 128 = 4,096
# tokens a step, lr 2e-3 with 25 warmup steps and a cosine to 2e-4), but with no method settings of
# its own: each arm names its method, target format, phase and length (max_iters = lr_decay_iters of
# 200, 800 or 3200 steps: 1, 4 and 16 tokens per parameter), so that target_format alone sets b_t's
# level. FP32 throughout, so that the runs reproduce on CPUs with and without BF16 matmuls.

out_dir = "out/mini_gpt2_deploy"  # the study runner gives every run its own out_dir
dtype = "float32"

dataset = "default"
arch = "gpt2"
n_layer = 4
n_head = 4
n_embd = 128
block_size = 128
batch_size = 16
gradient_accumulation_steps = 2

optimizer = "adamw"
learning_rate = 2e-3
min_lr = 2e-4
warmup_iters = 25
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.99
grad_clip = 1.0

eval_iters = 20
log_interval = 10
