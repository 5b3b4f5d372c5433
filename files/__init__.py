"""What export writes and reads: our low-precision .safetensors (lowbit), the GGUF file llama.cpp runs
(gguf_file, with the data's tokenizer as its vocabulary: gguf_vocab), and Hugging Face models in and out
(pretrained). Imports quant/, nothing of llamacpp/ (tests/test_layout.py)."""
