# Fig. 1b: GPT2-124M on OpenWebText, gaussws[all] (every Linear of every block) at lr 6e-5.
# Fig. 1b draws two curves each of GaussWS and DiffQ beside the two BF16 runs; we read them as the
# same two learning rates, 6e-4 and 6e-5.
# The recipe, the token budget and our choices: config/base/gpt2_owt.py.
# Launch: torchrun --standalone --nproc_per_node=8 train.py config/gpt2_gaussws_all_lr6e-5.py

base = "base/gpt2_owt.py"
out_dir = "out/gpt2_gaussws_all_lr6e-5"
wandb_run_name = "gpt2_gaussws_all_lr6e-5"

method = "gaussws[all]"
learning_rate = 6e-5
min_lr = 6e-6
