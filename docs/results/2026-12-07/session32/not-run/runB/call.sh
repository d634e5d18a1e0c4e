#!/bin/bash
# session 32, call B: issue 24 bar 4 on the prose set (the tuner and fixed shapes).
set -u
cd "$(dirname "$0")/../../../../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
OUT="$OUT/prose" E2E_PROMPT_SET=prose E2E_SHAPES=${SHAPES:-auto,4x4,8x4} timeout 560 bash scripts/gpu-spec-e2e.sh run
