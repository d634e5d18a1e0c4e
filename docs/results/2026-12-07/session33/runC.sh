#!/bin/bash
# session 33, call C: issue 27 bar 4, speculation in serve on the real pair (8 greedy clients)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
OUT="$OUT/serve" timeout 570 bash scripts/gpu-spec-serve.sh
tail -n 20 "$OUT/serve/summary.txt"
