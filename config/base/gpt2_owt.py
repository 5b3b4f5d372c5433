# The base of config/gpt2_*.py (Fig. 1b, 3a, 3b): GPT2-124M on OpenWebText with nanoGPT's recipe.
# Not a run of its own: each run's file names it (`base = "base/gpt2_owt.py"`) and sets only what
# differs, its method and learning rate (configurator.py applies this file first).
# Token budget: 300B (paper); nanoGPT's 600,000 steps x 491,520 tokens = 294.9B.
# Our choices (the paper's settings appendix is missing), from nanoGPT's config/train_gpt2.py: 12 x
# 1024 x 40 = 491,520 tokens per step, cosine schedule to learning_rate / 10 after 2000 warmup
# steps, weight decay 0.1, betas (0.9, 0.95), gradient clip 1.0.
# b_init 6 and b_target 4 are the paper's; the weight decay of b_i, which pulls b_t toward b_target
# (Eq. 11), is our choice: the model's 0.1. A bf16 run has no b_i: the three keys do nothing there.
# A run at the paper's "lr 6e-5" sets learning_rate = 6e-5 and min_lr = 6e-6: "lr 6e-5" is read as
# the peak learning rate (a run that only decays to 6e-5 is nanoGPT's 6e-4 run itself), and min_lr
# keeps nanoGPT's ratio of 10 (our choice).

wandb_log = True  # --wandb_mode=offline without a network, --wandb_log=False without an account

dataset = "openwebtext"
model = "gpt2-124m"
block_size = 1024
batch_size = 12
gradient_accumulation_steps = 40  # over all processes: 5 micro-steps per GPU on 8 GPUs

b_init = 6.0
b_target = 4.0
bitwidth_weight_decay = 0.1

optimizer = "adamw"
learning_rate = 6e-4
min_lr = 6e-5
max_iters = 600000
lr_decay_iters = 600000
warmup_iters = 2000
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0

eval_interval = 1000
eval_iters = 200
log_interval = 10
compile = True
