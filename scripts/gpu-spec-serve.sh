#!/bin/bash
# Issue 27 bar 4 on the GPU machine: `serve` with and without `--draft-model` on the real Qwen pair
# (Qwen2.5-Coder-1.5B-Instruct Q4_K_M target streamed with about half its layer bytes in VRAM, the
# 0.5B draft resident), 8 concurrent greedy clients asking prose questions through the chat
# template, measured by the same load generator (bench.server_bench --url --prompt-file --chat).
# The two servers keep the same share of the target in VRAM (the draft's planned bytes come on top
# of the plain server's budget); the replies of the two runs are compared, text for text.
#
#   models: as scripts/gpu-spec-e2e.sh says (its `piece` calls), joined and checked here
#   OUT=/path bash scripts/gpu-spec-serve.sh      (carry .whl: the server's wheels)
#   SPEC_SERVE_CLIENTS (8), SPEC_SERVE_TOKENS (128), SPEC_SERVE_TREE (9), SPEC_SERVE_SLOT (1024),
#   SPEC_SERVE_ROUNDS (1: waves of the clients one after another, each on the next prompts),
#   SPEC_SERVE_SHAPE (DxW: --draft-shape instead of --draft-tree, e.g. 12x1: a chain for code),
#   SPEC_SERVE_STOP_AT_EOS (unset: every reply runs SPEC_SERVE_TOKENS, ignore_eos; 1: replies end at
#   the model's end of generation, as bench.spec_bench e2e's do),
#   SPEC_SERVE_PROMPTS (bench/prompts/prose_questions.txt, sent as chat turns; "humaneval": HumanEval's
#   prompts as raw text to /v1/completions, as bench.spec_bench e2e sends them), SPEC_SERVE_FRACTION (0.5)
#   SPEC_SERVE_DEVICE=cpu SPEC_SERVE_TARGET=a.gguf SPEC_SERVE_DRAFT=b.gguf: a dry run of the plumbing
#       on the CPU (--exact, resident, no budgets)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/spec-serve}
mkdir -p "$OUT"
DEVICE=${SPEC_SERVE_DEVICE:-gpu}
if [ "$DEVICE" = gpu ]; then
    OUT="$OUT" bash scripts/gpu-spec-e2e.sh join > "$OUT/join.log" 2>&1 || { cat "$OUT/join.log"; exit 1; }
fi
TARGET=${SPEC_SERVE_TARGET:-/tmp/models/target.gguf}
DRAFT=${SPEC_SERVE_DRAFT:-/tmp/models/draft.gguf}
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    [ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
    export PYTHONPATH="/tmp/site:$PWD"
fi
if ! python3 -c "import fastapi, uvicorn, pydantic" 2> /dev/null; then  # the server's stack: not on the GPU machine
    echo "the server's packages are missing: carry their wheels (.whl, docs/SERVER.md: fetch-wheels.sh fastapi ...)" >&2
    exit 1
fi
CLIENTS=${SPEC_SERVE_CLIENTS:-8}
TOKENS=${SPEC_SERVE_TOKENS:-128}
TREE=${SPEC_SERVE_TREE:-9}
SHAPE=${SPEC_SERVE_SHAPE:-}
if [ -n "$SHAPE" ]; then TREE=$((1 + ${SHAPE%%x*} * ${SHAPE##*x})); fi  # the budgets plan its nodes
SLOT=${SPEC_SERVE_SLOT:-1024}
PROMPTS=${SPEC_SERVE_PROMPTS:-bench/prompts/prose_questions.txt}
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

# the budgets: the draft's planned bytes (loaded alone once), then the target's half-resident budget
PLAIN_BUDGET=cpu SPEC_BUDGET=cpu
[ "$DEVICE" = gpu ] && read -r PLAIN_BUDGET SPEC_BUDGET < <(python3 - "$TARGET" "$DRAFT" "$SLOT" "$CLIENTS" "$TREE" "${SPEC_SERVE_FRACTION:-0.5}" <<'PY'
import sys
from bench.spec_bench import half_resident_budget
from infer.gguf_file import GGUFModel
from infer.gpu import load_gpu_transformer
target, draft, slot, clients, tree, fraction = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
planned = load_gpu_transformer(GGUFModel(draft), slot, None, batch=clients).account.planned_total
nodes = min(tree * clients, 512)
spec = half_resident_budget(GGUFModel(target), slot, 512, clients, planned, fraction, nodes)
print(spec - planned, spec)
PY
)
note "target $TARGET, draft $DRAFT, $CLIENTS clients x $TOKENS tokens, tree $TREE, budgets: plain $PLAIN_BUDGET, with draft $SPEC_BUDGET"

up() { python3 scripts/wait_health.py "$1" "$2"; }  # port, the server pid (a server that died is not waited for)
stop() { kill -INT "$1" 2>/dev/null; for _ in $(seq 1 60); do kill -0 "$1" 2>/dev/null || return; sleep 1; done; kill -9 "$1"; }
run() {  # name budget extra-flags...
    local name=$1 budget=$2
    shift 2
    local where=(--device cpu --exact)
    [ "$DEVICE" = gpu ] && where=(--device gpu --streaming --vram-budget "$budget")
    python3 -c "from infer.cli import main; main()" serve -m "$TARGET" "${where[@]}" \
        --max-batch "$CLIENTS" -c "$SLOT" --port 8093 "$@" > "$OUT/$name.log" 2>&1 &
    local pid=$!
    if up 8093 $pid; then
        local prompts=(--prompt-file "$PROMPTS" --chat)
        [ "$PROMPTS" = humaneval ] && prompts=(--prompt-set humaneval)
        timeout 500 python3 -m bench.server_bench --url http://127.0.0.1:8093 --clients "$CLIENTS" --tokens "$TOKENS" \
            "${prompts[@]}" --rounds "${SPEC_SERVE_ROUNDS:-1}" ${SPEC_SERVE_STOP_AT_EOS:+--stop-at-eos} --out "$OUT/$name.json" > /dev/null 2> "$OUT/$name.err"
        note "$name: exit $? $(python3 -c "import json; s = json.load(open('$OUT/$name.json'))['server']; print(s['aggregate_tok_s'], 'tok/s, TTFT p50', s['ttft_p50_s'])" 2>&1 | tail -1)"
        curl -s http://127.0.0.1:8093/metrics | grep -E "^ntransformer_(draft|pass_seconds_(count|sum))" >> "$OUT/$name.metrics"
    else
        note "$name did not come up: $(tail -3 "$OUT/$name.log")"
    fi
    stop $pid
}
run plain "$PLAIN_BUDGET"
if [ -n "$SHAPE" ]; then
    run draft "$SPEC_BUDGET" --draft-model "$DRAFT" --draft-shape "$SHAPE"
else
    run draft "$SPEC_BUDGET" --draft-model "$DRAFT" --draft-tree "$TREE"
fi
python3 - "$OUT" <<'PY' | tee -a "$SUMMARY"
import json, sys
out = sys.argv[1]
try:
    plain, draft = (json.load(open(f"{out}/{n}.json"))["server"] for n in ("plain", "draft"))
    print(f"speculation in serve: {draft['aggregate_tok_s']} vs {plain['aggregate_tok_s']} tok/s "
          f"({draft['aggregate_tok_s'] / plain['aggregate_tok_s']:.2f}x); replies identical: "
          f"{draft['replies'] == plain['replies']} ({sum(a == b for a, b in zip(draft['replies'], plain['replies']))}"
          f"/{len(plain['replies'])})")
except (OSError, KeyError) as err:
    print(f"no comparison ({err})")
PY
