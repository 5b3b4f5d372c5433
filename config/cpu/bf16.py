# The BF16 twin of config/cpu/gaussws_lowbit.py and gaussws_3bit.py: the same model, data, seed and
# 400 steps without PQT. export.py then quantizes its block Linears after training (plain
# post-training quantization, the baseline PQT is measured against).
#   python train.py config/cpu/bf16.py
#   python export.py --out_dir=out/cpu_bf16 --format=auto,auto-int,mxfp8_e4m3,mxfp6_e3m2,mxfp4,int4,int3
# Every setting this file does not name is train.py's default (the default CPU run's).

out_dir = "out/cpu_bf16"
method = "bf16"
