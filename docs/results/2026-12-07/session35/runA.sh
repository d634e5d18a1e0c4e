#!/bin/bash
# session 35, lease 1: the stages' GPU tests not yet run on a GPU (interleaved shares, streamed chunk 2,
# the MoE split across stages, the review's device contexts, the reused events), then the GPU suite
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 180 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_stages_gpu.py \
    "tests/gpu/test_moe_gpu.py::test_a_split_across_gpus_places_each_stages_experts_on_the_gpu" \
    > "$OUT/pytest-stages.txt" 2>&1
echo "stages rc=$?"; tail -n 15 "$OUT/pytest-stages.txt"
OUT="$OUT/gpu-check" GPU_CHECK_SKIP_BENCH=1 GPU_CHECK_SKIP_COMPILE=1 GPU_CHECK_TESTS_SECONDS=370 timeout 390 bash scripts/gpu-check.sh > "$OUT/gpu-check.log" 2>&1
echo "gpu-check rc=$?"; tail -n 12 "$OUT/gpu-check.log"
