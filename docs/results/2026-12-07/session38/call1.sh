#!/bin/bash
# Session 38, call 1 (carry .whl, .carry, infer/_cpu_kernels.abi3.so, nvmedirect/_vfio_cffi.abi3.so):
# session 36's SM uploads (GPU tests, bench.upload_bench), then session 37's tiered MoE GPU tests; the
# 30B-A3B synthetic file for runH.sh bench is written in the background meanwhile (outlives the call).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
lscpu | grep -E "Model name|^CPU\(s\)" | tee "$OUT/cpu.txt"
OUT=$OUT/uploads bash docs/results/2026-12-07/session36/runG.sh tests
setsid bash -c "PYTHONPATH=/tmp/site:$PWD python3 -c \"
from pathlib import Path
from bench.gpu_bench import synth_path
print(synth_path('qwen3-30b-a3b:q4_k_m', Path('/tmp/nvmedirect-synth')))\" > /tmp/synth.log 2>&1" < /dev/null > /dev/null 2>&1 &
OUT=$OUT/moe bash docs/results/2026-12-07/session37/runH.sh tests
ls -la /tmp/nvmedirect-synth/ 2>/dev/null; echo "elapsed ${SECONDS}s"
