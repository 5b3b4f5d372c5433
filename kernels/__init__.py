"""Noise kernels for PQT: the same R from two backends.

triton_noise.py: Triton kernels (GPU; CPU tensors under TRITON_INTERPRET=1).
torch_noise.py:  PyTorch replaying the same Philox bits (CPU, or anywhere Triton is absent).
Both expose gen(numel, seed, method, device), apply(w, r_store, scale_bl, method) and
block_sums(g, r_store, method); tests/test_kernels.py holds them equal bit for bit.
"""
BL = 32  # square block size of the scale (MX block size); square makes it transpose-commutative

# Philox-4x32-10, exactly as triton.language.random uses it.
PHILOX_ROUNDS = 10
PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57
PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
