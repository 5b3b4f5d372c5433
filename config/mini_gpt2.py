# Fig. 1b, 3a and 3b at laptop scale: the GPT2 base of `python -m studies fig1b|fig3a|fig3b|3bit|noise`.
# What it changes from the paper's runs (config/gpt2_*.py): a 4-layer, 128-wide GPT2 (0.8M
# parameters) on the offline default corpus (byte tokens) instead of GPT2-124M on OpenWebText, and
# 200 steps of 2 x 16 x 128 = 4,096 tokens (0.82M tokens) instead of 300B. The study's arms (method,
# learning rate, optimizer, b_target, seed) are overrides of this file, listed in studies/definitions.py;
# every arm has this shape, budget and schedule.
# Wall time: about 3 minutes a run on one core of a 2-core AMD EPYC (AVX2, FP32: no BF16 matmuls), two
# runs at a time (OMP_NUM_THREADS=1 each); we measured 0.75 s a step there. The results tables in the
# README give each arm's measured wall time.
# Our choices: the default run's recipe (train.py) at half its steps, so a 50-run study fits an
# afternoon on 2 cores: lr 2e-3 with 25 warmup steps and a cosine to 2e-4, AdamW betas (0.9, 0.99),
# weight decay 0.1, clip 1.0. The evaluation every 50 steps on 20 fixed batches of 16 (5 points per
# val curve; the train loss is logged every 10 steps).

out_dir = "out/mini_gpt2"  # the study runner gives every run its own out_dir

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
