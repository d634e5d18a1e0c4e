#!/bin/bash
# Session 38, call A (carry .whl, .carry, infer/_cpu_kernels.abi3.so, nvmedirect/_vfio_cffi.abi3.so): the
# tiered MoE GPU tests (session 37), then session 36's SM-upload tests and bench while time is left
# under the 10-minute limit; the 30B-A3B synthetic file is written in the background for call B.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
lscpu | grep -E "Model name|^CPU\(s\)" | tee "$OUT/cpu.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
setsid bash -c "PYTHONPATH=/tmp/site:$PWD python3 -c \"
from pathlib import Path
from bench.gpu_bench import synth_path
print(synth_path('qwen3-30b-a3b:q4_k_m', Path('/tmp/nvmedirect-synth')))\" > /tmp/synth.log 2>&1" < /dev/null > /dev/null 2>&1 &
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 NVMEDIRECT_CACHE=/tmp/nvd-cache
timeout 300 python3 -m pytest -q -p no:cacheprovider --tb=short tests/gpu/test_moe_gpu.py -k "tiered or speculation" \
    > "$OUT/pytest-moe-tiered.txt" 2>&1
echo "tiered MoE GPU tests rc=$? at ${SECONDS}s"; tail -n 8 "$OUT/pytest-moe-tiered.txt"
if [ $SECONDS -lt 330 ]; then
    OUT=$OUT/uploads timeout $((560 - SECONDS)) bash docs/results/2026-12-07/session36/runG.sh tests
fi
ls -la /tmp/nvmedirect-synth/ 2>/dev/null; tail -n 2 /tmp/synth.log; echo "elapsed ${SECONDS}s"
