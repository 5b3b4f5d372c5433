# Fig. 4 (top row): Llama2-134M on C4, bf16 with AdamW.
# The model, its token budget and our choices: config/base/llama2_134m_c4.py.
# Launch: torchrun --standalone --nproc_per_node=8 train.py config/llama2_134m_bf16_adamw.py

base = "base/llama2_134m_c4.py"
out_dir = "out/llama2_134m_bf16_adamw"
wandb_run_name = "llama2_134m_bf16_adamw"

method = "bf16"
