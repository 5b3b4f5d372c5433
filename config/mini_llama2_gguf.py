# The llama.cpp study's Llama (`python -m studies gguf_llama`): config/mini_gpt2_gguf.py's data, recipe and
# tokens per parameter on llama.cpp's `llama` architecture, the one most GGUF files use: RMSNorm, SwiGLU,
# rotary embeddings, untied head, no biases. Every Linear's input width is a multiple of 256, so that
# llama.cpp can store each block Linear in its K-quants: 4 layers, 256 wide, 4 heads, the MLP 768 wide (Llama
# 2's rule: 2/3 of 4 x 256 rounded up to a multiple of 256; the down projection reads 768), 3.54M parameters
# with the embedding and the head, on the default corpus (byte tokens), 2 x 16 x 128 = 4,096 tokens a step.
# Our choice of length: 6,900 steps = 28.3M tokens = 8 tokens per parameter, as the GPT2's 6,400.

out_dir = "out/mini_llama2_gguf"  # the study runner gives every run its own out_dir
dtype = "float32"

dataset = "default"
arch = "llama2"
n_layer = 4
n_head = 4
n_embd = 256
ffn_hidden = 768
block_size = 128
bias = False
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
