# Fig. 4 (bottom row): Llama2-1B on C4, gaussws[all] with Adam-mini.
# The model, its token budget and our choices: config/base/llama2_1b_c4.py.
# Launch: torchrun --standalone --nproc_per_node=8 train.py config/llama2_1b_gaussws_all_adam_mini.py

base = "base/llama2_1b_c4.py"
out_dir = "out/llama2_1b_gaussws_all_adam_mini"
wandb_run_name = "llama2_1b_gaussws_all_adam_mini"

method = "gaussws[all]"
optimizer = "adam_mini"
