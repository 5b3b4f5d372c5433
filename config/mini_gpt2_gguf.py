# The llama.cpp study's base (`python study.py gguf`): a GPT2 whose every Linear input width is a
# multiple of 256, so that llama.cpp can store each block Linear in its K-quants (Q2_K ... Q6_K need
# rows of 256 weights): 4 layers, 256 wide (the MLP's down projection reads 1,024), 3.26M parameters
# with embeddings, on the default corpus (byte tokens), 2 x 16 x 128 = 4,096 tokens a step.
# The deployment study's recipe otherwise (config/mini_gpt2_deploy.py: lr 2e-3 with 25 warmup steps
# and a cosine to 2e-4, AdamW betas (0.9, 0.99), weight decay 0.1, clip 1.0, FP32 throughout so the
# runs reproduce on CPUs with and without BF16 matmuls); each arm names its method, target format and
# phase. Our choice of length: 6,400 steps = 26.2M tokens = 8 tokens per parameter (5.4 passes over
# the corpus's 4.9M training tokens), so that 3 seeds of every arm fit about a day on 2 cores:
# measured 1.14 s a step for bf16 on one core of a 2-core AMD EPYC (FP32), 2.0 h a trunk.

out_dir = "out/mini_gpt2_gguf"  # study.py gives every run its own out_dir
dtype = "float32"

dataset = "default"
arch = "gpt2"
n_layer = 4
n_head = 4
n_embd = 256
block_size = 128
batch_size = 16
gradient_accumulation_steps = 2

optimizer = "adamw"
learning_rate = 2e-3
min_lr = 2e-4
warmup_iters = 25
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.99
grad_clip = 1.0

eval_iters = 20
log_interval = 50
