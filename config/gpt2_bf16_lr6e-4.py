# Fig. 1b: GPT2-124M on OpenWebText, BF16 at lr 6e-4 (the paper's smooth, best BF16 run).
# The recipe, the token budget and our choices: config/base/gpt2_owt.py.
# Launch: torchrun --standalone --nproc_per_node=8 train.py config/gpt2_bf16_lr6e-4.py

base = "base/gpt2_owt.py"
out_dir = "out/gpt2_bf16_lr6e-4"
wandb_run_name = "gpt2_bf16_lr6e-4"

method = "bf16"
