#!/bin/bash
# session 34, call F (after the 29 piece calls): issue 24 bar 4 on prose with wider leaves than the
# tuner's fixed width of 4 (bench.spec_ahead_sim on the draft's ranks: 4x16 about 6% over 4x4 when
# a 65-node verify costs what a 17-node one does)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
OUT="$OUT/prose-width" E2E_PROMPT_SET=prose E2E_SHAPES="${SHAPES:-auto,4x4,4x8,4x16,3x16,5x12}" \
    timeout 560 bash scripts/gpu-spec-e2e.sh run
