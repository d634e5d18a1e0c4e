#!/bin/bash
# session 35, call B (after the 29 piece calls): drafting ahead launched as the tree is drafted (before
# the target's streamed pass is queued: DraftAhead's early), prose, 16 prompts x 128 tokens, with
# 16, 4 and 2 branches (NVMEDIRECT_DRAFT_AHEAD_BRANCHES); each run measures plain in the same process
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
N=${PROMPTS:-16}
OUT="$OUT/b16" E2E_PROMPT_SET=prose E2E_PROMPTS=$N E2E_SHAPES="auto,4x4,ahead:4x4,ahead:auto" \
    timeout 230 bash scripts/gpu-spec-e2e.sh run
OUT="$OUT/b4" NVMEDIRECT_DRAFT_AHEAD_BRANCHES=4 E2E_PROMPT_SET=prose E2E_PROMPTS=$N E2E_SHAPES="ahead:4x4,ahead:auto" \
    timeout 170 bash scripts/gpu-spec-e2e.sh run
OUT="$OUT/b2" NVMEDIRECT_DRAFT_AHEAD_BRANCHES=2 NVMEDIRECT_DRAFT_AHEAD_STEPS=5 E2E_PROMPT_SET=prose E2E_PROMPTS=$N \
    E2E_SHAPES="ahead:4x4,ahead:auto" timeout 170 bash scripts/gpu-spec-e2e.sh run
