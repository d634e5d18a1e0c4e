#!/bin/bash
# session 32, call S: the draft's step and the speculative loop profiled on synthetic models of the
# Qwen2.5-Coder pair's shapes, then the attention and speculation GPU tests (the device time left
# after many refused starts allowed no more: the real pair did not travel).
set -u
cd "$(dirname "$0")/../../../../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > "$OUT/gpu.txt"; cat "$OUT/gpu.txt"
timeout 200 python3 -m bench.spec_profile --synth --depth 16 --nodes 1,17,65 --loop 64 --out "$OUT/profile-synth" \
    > "$OUT/profile-synth.stdout" 2> "$OUT/profile-synth.log"; echo "profile exit $?" >> "$OUT/profile-synth.log"
tail -n 2 "$OUT/profile-synth.log"; cut -c1-1200 "$OUT/profile-synth.stdout"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels.py tests/gpu/test_speculative_gpu.py -k "head_split or forced_rows or draft or spec or best_first" > "$OUT/pytest-attention-spec.txt" 2>&1
echo "attention and speculation tests: $(tail -n 1 "$OUT/pytest-attention-spec.txt")"
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_model.py -k "biased_greedy_walk" > "$OUT/pytest-biased-walk.txt" 2>&1
echo "biased walk tests: $(tail -n 1 "$OUT/pytest-biased-walk.txt")"
