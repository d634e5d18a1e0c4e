#!/bin/bash
# session 36: does a ring the link can fill during the draft's steps lift prose? The real pair, prose,
# 40 prompts, the tuner's shape, per-layer path; ring slots 8 (the default), 20 and 28 in one lease
set -u
OUT=${OUT:-/tmp/out}
for s in ${SLOTLIST:-8 20 28}; do
    GRAPH=0 SHAPES=auto SETS=${SETS:-prose} SLOTS=$s EACH=${EACH:-150} OUT=$OUT/slots$s \
        bash docs/results/2026-12-07/session36/runE.sh 2>&1 | tail -n 3
done
