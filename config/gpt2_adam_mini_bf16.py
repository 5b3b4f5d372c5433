# Fig. 3b: GPT2-124M on OpenWebText, bf16 with the Adam-mini optimizer.
# Fig. 3b sets Adam-mini against the AdamW runs of Fig. 1b, and Adam-mini "stabilizes BF16", so it
# runs at the lr where BF16 with AdamW diverges, 6e-5 (our reading). b_target 4: the paper's
# default, as the caption names no other.
# Adam-mini takes AdamW's hyperparameters, as its paper advises.
# The recipe, the token budget and our choices: config/base/gpt2_owt.py.
# Launch: torchrun --standalone --nproc_per_node=8 train.py config/gpt2_adam_mini_bf16.py

base = "base/gpt2_owt.py"
out_dir = "out/gpt2_adam_mini_bf16"
wandb_run_name = "gpt2_adam_mini_bf16"

method = "bf16"
optimizer = "adam_mini"
learning_rate = 6e-5
min_lr = 6e-6
