#!/bin/bash
# session 34, call C (as session 33's): issue 27 bar 4, speculation in serve on the real pair (8 greedy clients)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
OUT="$OUT/serve" timeout 570 bash scripts/gpu-spec-serve.sh
tail -n 20 "$OUT/serve/summary.txt"
