#!/bin/bash
# session 32, call A: the real pair joined (pieces carried before), the draft's step and the loop
# profiled (after the attention tests and the head-split sweep), then issue 24 bar 4 on the HumanEval set with the tuner and two fixed shapes.
set -u
cd "$(dirname "$0")/../../../../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
OUT="$OUT" bash scripts/gpu-spec-e2e.sh join > "$OUT/join.log" 2>&1 || { cat "$OUT/join.log"; exit 1; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > "$OUT/gpu.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels.py tests/gpu/test_speculative_gpu.py -k "head_split or forced_rows or attention or draft or spec or best_first" > "$OUT/pytest-attention-spec.txt" 2>&1
echo "attention and speculation tests: $(tail -n 1 "$OUT/pytest-attention-spec.txt")"
timeout 120 python3 -m bench.kernel_sweep --skip-products --out "$OUT/sweep-others.json" > "$OUT/sweep-others.txt" 2>&1
grep -h "splits" "$OUT/sweep-others.txt" | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line); print(r['kernel'][10:40], r['case'], r['splits'], r['default'], r['us'])"
timeout 200 python3 -m bench.spec_profile --target /tmp/models/target.gguf --draft /tmp/models/draft.gguf \
    --depth 16 --nodes 1,17,65 --loop 64 --out "$OUT/profile" > "$OUT/profile.stdout" 2> "$OUT/profile.log"
echo "profile exit $?"; python3 -c "
import json; r=json.load(open('$OUT/profile/spec-profile.json')); print({k: v for k, v in r.items() if k != 'traces'})" 2>&1 | cut -c1-1500
OUT="$OUT/code" E2E_PROMPT_SET=humaneval E2E_SHAPES=${SHAPES:-auto,4x4,16x4} timeout 300 bash scripts/gpu-spec-e2e.sh run
