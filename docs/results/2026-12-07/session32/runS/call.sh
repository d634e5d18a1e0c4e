#!/bin/bash
# session 32, call S: the wheels, the attention and speculation GPU tests, then the draft's step
# and the speculative loop profiled on synthetic models of the Qwen2.5-Coder pair's shapes.
set -u
cd "$(dirname "$0")/../../../../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
mkdir -p ~/.cache/nvmedirect/humaneval && cp .carry/HumanEval.jsonl.gz ~/.cache/nvmedirect/humaneval/ 2>/dev/null
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > "$OUT/gpu.txt"; cat "$OUT/gpu.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels.py tests/gpu/test_speculative_gpu.py -k "head_split or forced_rows or attention or draft or spec or best_first" > "$OUT/pytest-attention-spec.txt" 2>&1
echo "attention and speculation tests: $(tail -n 1 "$OUT/pytest-attention-spec.txt")"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_model.py -k "biased_greedy_walk or device_argmax" > "$OUT/pytest-biased-walk.txt" 2>&1
echo "biased walk tests: $(tail -n 1 "$OUT/pytest-biased-walk.txt")"
timeout 280 python3 -m bench.spec_profile --synth --depth 16 --nodes 1,17,65 --loop 64 --out "$OUT/profile-synth" \
    > "$OUT/profile-synth.stdout" 2> "$OUT/profile-synth.log"; echo "profile exit $?" >> "$OUT/profile-synth.log"
tail -n 3 "$OUT/profile-synth.log"; cat "$OUT/profile-synth.stdout" | cut -c1-1500
