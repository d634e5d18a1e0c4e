#!/bin/bash
# Session 39, call T (carry .whl, .carry, infer/_cpu_kernels.abi3.so; after the 29 pieces): issue 27
# bar 4 on HumanEval's prompts after the fix of the mixed pass's logits copy (call S's two tries died
# of it), tree 9; then the GPU tests nearest this session's GPU-side changes (speculation, the MoE's
# CPU blocks, the tree passes).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH="/tmp/site:$PWD"
TREES=9 timeout 200 bash docs/results/2026-12-08/session39/callS.sh 2>&1 | grep -v "^target" | tail -4
python3 -m pytest -q -p no:cacheprovider tests/gpu/test_speculative_gpu.py tests/gpu/test_moe_gpu.py \
    -k "spec or draft or cpu" -x \
    > "$OUT/pytest-gpu.txt" 2>&1
echo "pytest rc=$? at ${SECONDS}s"; tail -n 5 "$OUT/pytest-gpu.txt"
