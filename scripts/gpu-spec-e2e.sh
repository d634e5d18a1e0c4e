#!/bin/bash
# Issue 14's end-to-end measurement on the GPU machine, with the real pair (Qwen2.5-Coder-1.5B-Instruct
# Q4_K_M target, 0.5B draft). The machine has no PyPI and a call carries at most 64 MiB (the working
# tree included, about 8 MB on disk in 2026-12), so the two models (1.6 GB) travel as 56 MB pieces
# of their concatenation (29), one piece per call, into /tmp/models/pieces of one warm machine (it is
# handed back 30 s after a call: make the calls back to back):
#
#   here:   cat 1.5b.gguf 0.5b.gguf | split -b 56000000 -d -a 2 - /work/pieces/p; ln -s /work/pieces .pieces
#           (.pieces ignored through .git/info/exclude)
#   there:  bash scripts/gpu-spec-e2e.sh piece .pieces  (carry [".pieces/pNN"]: keeps it in /tmp/models/pieces)
#   last:   OUT=... bash scripts/gpu-spec-e2e.sh run    (joins, checks the sha256 below, runs bench.spec_bench e2e)
#
# E2E_PROMPT_SET (humaneval, or prose: bench/prompts/prose_questions.txt through the chat template),
# E2E_PROMPTS (40), E2E_TOKENS (128), E2E_SHAPES (16x4,12x1,16x1,auto) set the run. The machine has
# no PyPI: `run` installs the carried wheels (.whl, from /work/shared/device/fetch-wheels.sh) into
# /tmp/site when they are not there yet, and takes the HumanEval prompts from .carry/HumanEval.jsonl.gz
# (a copy of ~/.cache/nvmedirect/humaneval/HumanEval.jsonl.gz) when the cache has none: carry .whl and
# .carry in a call of their own (with a piece they exceed the 64 MiB a call carries).
set -u
cd "$(dirname "$0")/.."
DIR=/tmp/models
TARGET_BYTES=1117320768
TARGET_SHA=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
DRAFT_SHA=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
mkdir -p "$DIR/pieces"
case "${1:-}" in
piece)
    cp "${2:-.carry}"/p* "$DIR/pieces/" && ls "$DIR/pieces" | tr "\n" " " && du -sb "$DIR/pieces" ;;
join|run)  # join: only the models, into $DIR/target.gguf and $DIR/draft.gguf, checked (gpu-spec-serve.sh)
    OUT=${OUT:-/tmp/spec-e2e}
    mkdir -p "$OUT"
    if [ ! -f "$DIR/draft.gguf" ]; then
        cat "$DIR"/pieces/p* > "$DIR/both" || exit 1
        head -c $TARGET_BYTES "$DIR/both" > "$DIR/target.gguf"
        tail -c +$((TARGET_BYTES + 1)) "$DIR/both" > "$DIR/draft.gguf"
        rm -f "$DIR/both"
    fi
    echo "$TARGET_SHA  $DIR/target.gguf" > "$DIR/sums"
    echo "$DRAFT_SHA  $DIR/draft.gguf" >> "$DIR/sums"
    sha256sum -c "$DIR/sums" 2>&1 | tee "$OUT/models-sha256.txt" || { echo "models: checksum FAILED"; exit 1; }
    [ "$1" = join ] && exit 0
    if [ ! -d /tmp/site ] && ls .whl/*.whl > /dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1 \
            || { echo "wheels: install FAILED (pip.log)"; exit 1; }
    fi
    HUMANEVAL=~/.cache/nvmedirect/humaneval/HumanEval.jsonl.gz
    if [ ! -f "$HUMANEVAL" ] && [ -f .carry/HumanEval.jsonl.gz ]; then
        mkdir -p "$(dirname "$HUMANEVAL")" && cp .carry/HumanEval.jsonl.gz "$HUMANEVAL"
    fi
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}:$PWD" PYTHONUNBUFFERED=1
    python3 -m bench.spec_bench e2e --target "$DIR/target.gguf" --draft "$DIR/draft.gguf" \
        --prompt-set "${E2E_PROMPT_SET:-humaneval}" --prompts "${E2E_PROMPTS:-40}" --tokens "${E2E_TOKENS:-128}" --shapes "${E2E_SHAPES:-16x4,12x1,16x1,auto}" ${E2E_SLOTS:+--slots "$E2E_SLOTS"} \
        --out "$OUT/spec-e2e.json" > "$OUT/spec-e2e.stdout" 2> "$OUT/spec-e2e.log"
    echo "e2e exit $?"
    tail -n 5 "$OUT/spec-e2e.log"
    python3 - "$OUT/spec-e2e.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print({k: r[k] for k in ("prompt_set", "prompts", "tokens_generated", "plain_tok_s", "plain_decode_tok_s", "peak_device_bytes", "vram_budget_bytes",
                         "plan_bytes_by_tier")})
for name, row in r["shapes"].items():
    print(name, row)
PY
    ;;
*) echo "usage: scripts/gpu-spec-e2e.sh piece|join|run" >&2; exit 2 ;;
esac
