"""What a weight is rounded to, shared by training and export: our 32x32 element formats, llama.cpp's
block types, the bit budgets' allocation and the STE converter that trains on them. Imports nothing of
files/ or llamacpp/ (tests/test_layout.py)."""
