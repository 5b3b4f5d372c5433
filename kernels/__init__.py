"""Noise kernels for PQT: the same R from two backends.

triton_noise.py: Triton kernels (GPU; CPU tensors under TRITON_INTERPRET=1), among them the one pass of
                 Eq. 3 and Eq. 4 over many weights that gaussws.TrainStep launches once a step.
torch_noise.py:  PyTorch replaying the same Philox bits (CPU, or anywhere Triton is absent).
ops.py:          Eq. 3 and Eq. 4 as differentiable ops over either backend (pseudo_quantize).
batches.py:      Eq. 3 and Eq. 4 of many layers in one launch each, as gaussws.TrainStep serves them (a step's
                 layers of one kind; per micro-step, a transformer block's).
Both expose gen(numel, seed, method, device), apply(w, r_store, scale_bl, method) and
block_sums(g, r_store, method). tests/test_kernels.py holds what they agree on:
  - gen and apply (R, w_hat): equal bit for bit.
  - block_sums: the same FP32 products g * R (exact for gaussws, whose R is 0, +-1 or +-2; one
    rounding each for diffq, no FMA in either backend), each block's 1024 of them summed in FP32
    in each backend's own order: Triton's tree over threads and warps on the GPU, NumPy's
    np.sum in the interpreter, PyTorch's sums in PyTorch (rows of 16 first where 16 divides
    n). Both are therefore within gamma_1023 * sum |g * R| of the exact sum (gamma_k = k u /
    (1 - k u), u = 2^-24), and equal bit for bit wherever every order is exact (e.g. sums of
    integers below 2^24). One fixed order in both would cost the GPU kernel a shared-memory round
    trip per level of an explicit tree.
"""
BL = 32  # square block size of the scale (MX block size); square makes it transpose-commutative

# Philox-4x32-10, exactly as triton.language.random uses it.
PHILOX_ROUNDS = 10
PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57
PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
