#!/bin/bash
# Session 39, call S (carry .whl, .carry; after the 29 pieces of the real pair): issue 27 bar 4,
# speculation in serve, 8 concurrent greedy clients x 128 tokens, the target half streamed, on
# HumanEval's prompts as raw completions (as bench.spec_bench e2e sends them; sessions 20 and 34
# measured only the prose questions as chat turns): the plain server, then --draft-model with
# trees of TREES nodes (scripts/gpu-spec-serve.sh once per tree, each with its own plain run).
# PROMPTS=prose: the prose questions instead.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
HUMANEVAL=~/.cache/nvmedirect/humaneval/HumanEval.jsonl.gz
[ -f "$HUMANEVAL" ] || { mkdir -p "$(dirname "$HUMANEVAL")" && cp .carry/HumanEval.jsonl.gz "$HUMANEVAL"; }
set_=${PROMPTS:-humaneval}
[ "$set_" = prose ] && file=bench/prompts/prose_questions.txt || file=humaneval
for tree in ${TREES-9 33}; do
    OUT="$OUT/$set_-tree$tree" SPEC_SERVE_PROMPTS=$file SPEC_SERVE_TREE=$tree timeout 280 bash scripts/gpu-spec-serve.sh
    echo "== $set_ tree $tree rc=$? at ${SECONDS}s"; tail -n 4 "$OUT/$set_-tree$tree/summary.txt"
done
for shape in ${SHAPES:-}; do  # --draft-shape DxW (added after this session's lease)
    OUT="$OUT/$set_-shape$shape" SPEC_SERVE_PROMPTS=$file SPEC_SERVE_SHAPE=$shape timeout 280 bash scripts/gpu-spec-serve.sh
    echo "== $set_ shape $shape rc=$? at ${SECONDS}s"; tail -n 4 "$OUT/$set_-shape$shape/summary.txt"
done
