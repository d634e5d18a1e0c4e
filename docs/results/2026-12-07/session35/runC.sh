#!/bin/bash
# session 35, call C: issue 24 bar 4 with drafting ahead (the branches launched as the tree is drafted),
# 40 prompts x 128 tokens on prose and on code (HumanEval), the tuner's shape with and without it;
# BRANCHES / STEPS: NVMEDIRECT_DRAFT_AHEAD_BRANCHES / _STEPS (the best of call B)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NVMEDIRECT_DRAFT_AHEAD_BRANCHES=${BRANCHES:-4} NVMEDIRECT_DRAFT_AHEAD_STEPS=${STEPS:-6}
if [ -n "${TESTS:-}" ]; then  # drafting ahead on the GPU (now launched early): the same trees and text
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
    PYTHONPATH="/tmp/site:$PWD" timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_speculative_gpu.py \
        -k drafting_ahead > "$OUT/pytest-ahead.txt" 2>&1; echo "ahead tests rc=$?"; tail -n 2 "$OUT/pytest-ahead.txt"
fi
for set in ${SETS:-prose humaneval}; do
    OUT="$OUT/$set" E2E_PROMPT_SET=$set E2E_PROMPTS=40 E2E_SHAPES="${SHAPES:-auto,ahead:auto}" \
        timeout ${EACH:-270} bash scripts/gpu-spec-e2e.sh run
done
