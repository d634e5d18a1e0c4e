#!/bin/bash
# Session 38, call E (carry .carry and the two .so; same machine as call D): prose with the SMs' uploads,
# the ring at 28 slots (the tuner's shape and 4 x 4, 4 x 8) and at 20 slots (4 x 4, 4 x 8).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for run in "28 auto,4x4,4x8 210" "20 4x4,4x8 150"; do
    set -- $run
    SMS=1 GRAPH=0 SHAPES=$2 SETS=prose SLOTS=$1 EACH=$3 OUT=$OUT/s$1 \
        bash docs/results/2026-12-07/session36/runE.sh 2>&1 | grep -v '^{"prompt"' | tail -n 5
    rm -f $OUT/s$1/prose/spec-e2e.stdout $OUT/s$1/prose/models-sha256.txt
    echo "at ${SECONDS}s"
done
