#!/bin/bash
# session 36: issue 24 bar 4 with the streamed pass captured as one CUDA graph (NVMEDIRECT_STREAM_GRAPH=1)
# for the plain run and every speculative one alike, the tuner's shape with and without drafting ahead;
# 40 prompts x 128 tokens, prose then code (HumanEval). GRAPH=0 gives the per-layer path of the same lease;
# SMS=1 small uploads by the SMs (infer/gpu/uploads.py); SLOTS the ring's slots (8: about 86 MiB, 1.7 ms of the link; a draft of 3.8 ms leaves the link idle for the rest).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NVMEDIRECT_STREAM_GRAPH=${GRAPH:-1} NVMEDIRECT_SM_UPLOADS=${SMS:-0}
export NVMEDIRECT_DRAFT_AHEAD_BRANCHES=${BRANCHES:-4} NVMEDIRECT_DRAFT_AHEAD_STEPS=${STEPS:-6}
export NVMEDIRECT_DRAFT_AHEAD_WHEN=${WHEN:-drafted}
for set in ${SETS:-prose humaneval}; do
    OUT="$OUT/$set" E2E_PROMPT_SET=$set E2E_PROMPTS=${PROMPTS:-40} E2E_SHAPES="${SHAPES:-auto,ahead:auto}" E2E_SLOTS=${SLOTS:-} \
        timeout ${EACH:-280} bash scripts/gpu-spec-e2e.sh run
done
