#!/bin/bash
# session 34, call D: session 33's runD.sh (the real pair's profile, a 4 x 4 loop with and without
# drafting ahead), then the GPU test of sample_rows' span rows (session 33's change)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
OUT="$OUT" bash "$(dirname "$0")/../session33/runD.sh"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels.py -k sample_rows > "$OUT/pytest-sample-rows.txt" 2>&1
tail -n 3 "$OUT/pytest-sample-rows.txt"
