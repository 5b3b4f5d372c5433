# Fig. 1b, 3a and 3b at laptop scale: the GPT2 base of `python study.py fig1b|fig3a|fig3b|3bit|noise`.
# What it changes from the paper's runs (config/gpt2_*.py): a 4-layer, 128-wide GPT2 (0.8M
# parameters) on the offline default corpus (byte tokens) instead of GPT2-124M on OpenWebText, and
# 400 steps of 2 x 16 x 128 = 4,096 tokens (1.64M tokens) instead of 300B. The study's arms (method,
# learning rate, optimizer, b_target, seed) are overrides of this file, listed in study.py; every arm
# has this shape, budget and schedule.
# Wall time: about 3 minutes a run on two free CPU cores, from the default run (train.py's defaults:
# this shape and token budget in one micro-batch of 32, fewer evaluations), which took 2 min 35 s on
# a free 2-core CPU. Our own measurement of this file was made on 2 cores shared with about 8 other
# busy processes and says little: with OMP_NUM_THREADS=1, 23-28 s a step (6.7 s of process CPU time
# a step), with a first-step compile of minutes; on such a machine a study takes many times longer.
# Our choices: the default run's shape and recipe (train.py): lr 2e-3 with 50 warmup steps and a
# cosine to 2e-4, AdamW betas (0.9, 0.99), weight decay 0.1, clip 1.0. The evaluation every 50 steps
# on 20 fixed batches of 16 gives 9 points per val curve for about 15 % more time.

out_dir = "out/mini_gpt2"  # study.py gives every run its own out_dir

dataset = "default"
arch = "gpt2"
n_layer = 4
n_head = 4
n_embd = 128
block_size = 128
batch_size = 16
gradient_accumulation_steps = 2  # over all processes: the same batches and losses on 1 or 2 (--nproc=2)

method = "gaussws[all]"
b_init = 6.0
b_target = 4.0
bitwidth_weight_decay = 0.1

optimizer = "adamw"
learning_rate = 2e-3
min_lr = 2e-4
max_iters = 400
lr_decay_iters = 400
warmup_iters = 50
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.99
grad_clip = 1.0

eval_interval = 50
eval_iters = 20
log_interval = 10
