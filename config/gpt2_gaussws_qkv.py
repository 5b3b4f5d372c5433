# Fig. 3a: GPT2-124M on OpenWebText, gaussws[qkv] with AdamW and b_target = 0.
# gaussws[qkv]: the attention's q, k, v projection of every block gets the noise; the rest stays
# BF16.
# The per-layer study looks for the source of the BF16 instability, so it runs at the lr where BF16
# diverges, 6e-5 (the paper: [od] "yields the best result with the smaller learning rate").
# The recipe, the token budget and our choices: config/base/gpt2_owt.py.
# Launch: torchrun --standalone --nproc_per_node=8 train.py config/gpt2_gaussws_qkv.py

base = "base/gpt2_owt.py"
out_dir = "out/gpt2_gaussws_qkv"
wandb_run_name = "gpt2_gaussws_qkv"

method = "gaussws[qkv]"
b_target = 0.0  # Fig. 3a's (the paper's)
learning_rate = 6e-5
min_lr = 6e-6
