#!/bin/bash
# Session 39, call C (carry .whl, infer/_cpu_kernels.abi3.so): the GPU suite, scripts/gpu-check.sh
# without its benchmarks.
set -u
OUT=${OUT:-/tmp/out}
GPU_CHECK_SKIP_BENCH=1 OUT="$OUT/gpu-check" timeout 570 bash scripts/gpu-check.sh > "$OUT/gpu-check.log" 2>&1
echo "gpu-check rc=$?"; cat "$OUT/gpu-check/summary.txt"; grep -E "^(FAILED|ERROR)" "$OUT/gpu-check/pytest.log" | head -20
