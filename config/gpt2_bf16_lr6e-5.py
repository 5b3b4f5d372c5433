# Fig. 1b: GPT2-124M on OpenWebText, BF16 at lr 6e-5 (the paper's diverging BF16 run).
# The recipe, the token budget and our choices: config/base/gpt2_owt.py.
# Launch: torchrun --standalone --nproc_per_node=8 train.py config/gpt2_bf16_lr6e-5.py

base = "base/gpt2_owt.py"
out_dir = "out/gpt2_bf16_lr6e-5"
wandb_run_name = "gpt2_bf16_lr6e-5"

method = "bf16"
learning_rate = 6e-5
min_lr = 6e-6
