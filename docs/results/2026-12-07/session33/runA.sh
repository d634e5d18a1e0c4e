#!/bin/bash
# session 33, call A (run from the repository root, after the 29 pieces): the real pair joined and
# checked, the GPU tests of session 32's review commit (PassIndex carry, one _steps, the fallback) and of drafting ahead,
# then issue 24 bar 4 on HumanEval (the tuner, with and without drafting ahead)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
OUT="$OUT" bash scripts/gpu-spec-e2e.sh join > "$OUT/join.log" 2>&1 || { cat "$OUT/join.log"; exit 1; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > "$OUT/gpu.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_speculative_gpu.py tests/gpu/test_model.py tests/gpu/test_streaming.py \
    -k "generation or decode or draft or chain or greedy or lone or biased or spec or best_first or tree" > "$OUT/pytest-review.txt" 2>&1
echo "review GPU tests: $(tail -n 1 "$OUT/pytest-review.txt")"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels.py -k "head_split or forced_rows or sample_rows" > "$OUT/pytest-head-split.txt" 2>&1
echo "head-split tests: $(tail -n 1 "$OUT/pytest-head-split.txt")"
OUT="$OUT/code" E2E_PROMPT_SET=humaneval E2E_SHAPES=${SHAPES:-auto,noahead:auto} timeout 300 bash scripts/gpu-spec-e2e.sh run
