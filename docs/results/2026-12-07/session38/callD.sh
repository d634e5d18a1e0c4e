#!/bin/bash
# Session 38, call D (carry .carry and the two .so; after the 29 pieces on the same machine): issue 24
# bar 4 with small uploads by the SMs (NVMEDIRECT_SM_UPLOADS=1) and a ring of 20 slots: prose with the
# SMs and without, then code with the SMs (session 36's runE.sh: per-layer path, the tuner's shape).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for run in "1 20 prose" "0 20 prose" "1 20 humaneval"; do
    set -- $run
    SMS=$1 GRAPH=0 SHAPES=auto SETS=$3 SLOTS=$2 EACH=150 OUT=$OUT/sms$1-slots$2 \
        bash docs/results/2026-12-07/session36/runE.sh 2>&1 | grep -v '^{"prompt"' | tail -n 4
    echo "at ${SECONDS}s"
done
