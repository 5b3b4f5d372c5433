# Fig. 4 (top row): Llama2-134M on C4, gaussws[all] with Adam-mini.
# Token budget: 300B (paper): 300e9 / 524,288 tokens/step = 572,204.6 -> max_iters 572,205 (300.0B).
# Shape: the paper's Llama2-134M: dim 768, 12 layers, 12 heads, FFN 2048, vocab 32000 (Llama 2's
# tokenizer), untied head; sequence 2048. data/c4/prepare.py tokenizes with tiktoken's gpt2
# (50257 tokens), which train.py refuses for a 32000-token model: prepare C4 with a tokenizer of at
# most 32000 tokens (--tokenizer), or add --vocab_size=50304 (+28.1M parameters at 134M: the
# embedding and the untied head grow by 18304 x 768 each; 134.1M -> 162.2M in --dry_run).
# Our choices (the paper's settings appendix is missing): 2^19 = 524,288 tokens per step (16 x 2048
# x 16; a micro-batch of 16 leaves room on an A100-40G, where the paper's throughput test ran 24),
# and nanoGPT's GPT2 recipe for the rest: lr 6e-4 cosine to 6e-5 after 2000 warmup steps, weight
# decay 0.1, betas (0.9, 0.95), clip 1.0 (the decay, betas and clip of Llama 2's own pre-training
# too).
# b_init 6 and b_target 4 are the paper's; the weight decay of b_i, which pulls b_t toward b_target
# (Eq. 11), is our choice: the model's 0.1.
# Adam-mini takes AdamW's hyperparameters, as its paper advises.
# Launch: torchrun --standalone --nproc_per_node=8 train.py config/llama2_134m_gaussws_all_adam_mini.py

out_dir = "out/llama2_134m_gaussws_all_adam_mini"
wandb_log = True  # --wandb_mode=offline without a network, --wandb_log=False without an account
wandb_run_name = "llama2_134m_gaussws_all_adam_mini"

dataset = "c4"
model = "llama2-134m"
block_size = 2048
batch_size = 16
gradient_accumulation_steps = 16  # over all processes: 2 micro-steps per GPU on 8 GPUs

method = "gaussws[all]"
b_init = 6.0
b_target = 4.0
bitwidth_weight_decay = 0.1

optimizer = "adam_mini"
learning_rate = 6e-4
min_lr = 6e-5
max_iters = 572205
lr_decay_iters = 572205
warmup_iters = 2000
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0

eval_interval = 1000
eval_iters = 200
log_interval = 10
compile = True
