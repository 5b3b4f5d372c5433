"""The benchmarks bench.py runs, one module each: fig6 (the noise kernel, `bench.py kernel`), table1 (train.py's
step per method, `bench.py train`), host (the host's time of a PQT step's begin and end against the number of
Linears, and the kernel launches it makes, `bench.py host`), gpu_check (`bench.py gpu-check`); options (the
command line) and common (printing, tables, timing)."""
