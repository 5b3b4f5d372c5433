# The recipe of config/llama2_*.py (Fig. 4) on C4, shared by both sizes: config/base/llama2_134m_c4.py
# and llama2_1b_c4.py name it as their base and add the model, its batch and its token budget.
# Data: python data/c4/prepare.py --tokenizer=path/to/tokenizer.model (Llama 2's own, 32000 tokens;
# see the README); sequence 2048.
# Our choices (the paper's settings appendix is missing): nanoGPT's GPT2 recipe: lr 6e-4 cosine to
# 6e-5 after 2000 warmup steps, weight decay 0.1, betas (0.9, 0.95), clip 1.0 (the decay, betas and
# clip of Llama 2's own pre-training too).
# b_init 6 and b_target 4 are the paper's; the weight decay of b_i, which pulls b_t toward b_target
# (Eq. 11), is our choice: the model's 0.1. A bf16 run has no b_i: the three keys do nothing there.
# Adam-mini (the *_adam_mini runs) takes AdamW's hyperparameters, as its paper advises.

wandb_log = True  # --wandb_mode=offline without a network, --wandb_log=False without an account

dataset = "c4"
block_size = 2048

b_init = 6.0
b_target = 4.0
bitwidth_weight_decay = 0.1

optimizer = "adamw"
learning_rate = 6e-4
min_lr = 6e-5
warmup_iters = 2000
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0

eval_interval = 1000
eval_iters = 200
log_interval = 10
compile = True
