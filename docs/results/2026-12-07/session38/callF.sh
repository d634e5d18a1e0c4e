#!/bin/bash
# Session 38, call F (carry .carry and the two .so; same machine as call E): the SMs' uploads and a
# ring of 28 slots for both sets in one call: prose at 4 x 8 (call E's best) and code at the tuner's shape.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for run in "prose 4x8 130" "humaneval auto 150"; do
    set -- $run
    SMS=1 GRAPH=0 SHAPES=$2 SETS=$1 SLOTS=28 EACH=$3 OUT=$OUT/s28 \
        bash docs/results/2026-12-07/session36/runE.sh 2>&1 | grep -v '^{"prompt"' | tail -n 3
    rm -f $OUT/s28/$1/spec-e2e.stdout $OUT/s28/$1/models-sha256.txt
    echo "at ${SECONDS}s"
done
