#!/bin/bash
# session 33, call B: issue 24 bar 4 on the prose set (the tuner with and without drafting ahead, 4x4)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
OUT="$OUT/prose" E2E_PROMPT_SET=prose E2E_SHAPES=${SHAPES:-auto,noahead:auto,4x4} timeout 560 bash scripts/gpu-spec-e2e.sh run
