"""llama.cpp as an outside program: its CPU arithmetic reproduced in our code (arithmetic), running a GGUF
file with llama-cpp-python and checking it against ours (runtime), finding and building its command-line
tools (build), and llama-quantize, llama-imatrix and the table of a run's files (tools). Imports files/ and
quant/; nothing below it imports this package (tests/test_layout.py)."""
