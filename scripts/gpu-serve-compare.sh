#!/bin/bash
# Ours (`ntransformer serve`) and llama-server on one file, one at a time on the GPU, measured by the
# same load generator (bench.server_bench --url): 1 streaming client, N streaming clients (ignore_eos,
# --tokens each), and a 16-turn chat replay that resends its history (time to first token per turn),
# ours with and without the prefix cache. JSON per run under $OUT, a summary last.
#
#   OUT=/path bash scripts/gpu-serve-compare.sh              # the synthetic 8B Q4_K_M, 32 clients x 64
#   SERVE_COMPARE_MODEL=m.gguf SERVE_COMPARE_CLIENTS=16 ...  # another file, another load
#   SERVE_COMPARE_WRITE_ONLY=1 ...                           # only write the synthetic model (setsid it)
#   SERVE_COMPARE_PARTS="many offline" ...                   # which runs (default "one many chat"):
#       one = 1 client, many = N clients, chat = the replay with and without the prefix cache,
#       offline = ours in process (bench.server_bench --model): N clients and the offline batch of
#       the same N sequences on the same loaded model
#   SERVE_COMPARE_SYNTH=70b:q4_k_m SERVE_COMPARE_NGL=40 SERVE_COMPARE_OURS_ARGS="--streaming --vram-budget 24GB"
#       another synthetic shape, llama-server's GPU layers (default 99) and ours' extra flags
#       (the streamed 70B of issue 27 bar 2)
#
# Carry .whl (the server's wheels: docs/SERVER.md) and .peer/llama-bin.tar.xz (scripts/llama-cpp-cuda.sh).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/serve-compare}
SYNTH_DIR=${SYNTH_DIR:-/tmp/nvmedirect-synth}
mkdir -p "$OUT" "$SYNTH_DIR"
export PYTHONPATH="$PWD"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
    export PYTHONPATH="/tmp/site:$PWD"
fi
SYNTH_SHAPE=${SERVE_COMPARE_SYNTH:-8b:q4_k_m}
MODEL=${SERVE_COMPARE_MODEL:-$SYNTH_DIR/synth-${SYNTH_SHAPE/:/-}.gguf}
if [ ! -f "$MODEL" ]; then
    python3 -c "from bench.gpu_bench import synth_path; from pathlib import Path; synth_path('$SYNTH_SHAPE', Path('$SYNTH_DIR'))"
fi
[ -n "${SERVE_COMPARE_WRITE_ONLY:-}" ] && exit 0
CLIENTS=${SERVE_COMPARE_CLIENTS:-32}
TOKENS=${SERVE_COMPARE_TOKENS:-64}
TURNS=${SERVE_COMPARE_TURNS:-16}
SLOT=${SERVE_COMPARE_SLOT:-2048}  # context per slot, both servers
PARTS=" ${SERVE_COMPARE_PARTS:-one many chat} "
has() { [[ "$PARTS" == *" $1 "* ]]; }
NGL=${SERVE_COMPARE_NGL:-99}
read -r -a OURS_ARGS <<< "${SERVE_COMPARE_OURS_ARGS:-}"
BENCH_TIMEOUT=${SERVE_COMPARE_TIMEOUT:-300}
VOCAB=$(python3 -c "from infer.gguf_file import GGUFModel; from infer.arch import check_model; print(check_model(GGUFModel('$MODEL')).vocab_size)")
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

DEVICE=${SERVE_COMPARE_DEVICE:-gpu}
[ -f .peer/llama-bin.tar.xz ] && mkdir -p /tmp/lcbin && tar xJf .peer/llama-bin.tar.xz -C /tmp/lcbin
cublas=$(find /usr/local/cuda*/ /opt /usr/lib -name 'libcublas.so.1*' 2>/dev/null | head -1)
export LD_LIBRARY_PATH="/tmp/lcbin:${cublas:+$(dirname "$cublas"):}/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"

up() { python3 scripts/wait_health.py "$1" "$pid"; }  # /health answers 200 within 5 minutes (not waited for once $pid is gone)
bench() {  # name port args...: one bench.server_bench --url run, its headline in the summary
    local name=$1 port=$2
    shift 2
    timeout "$BENCH_TIMEOUT" python3 -m bench.server_bench --url "http://127.0.0.1:$port" --vocab-size "$VOCAB" --tokens "$TOKENS" \
        --out "$OUT/$name.json" "$@" > /dev/null 2> "$OUT/$name.err"
    note "$name: exit $?; $(python3 - "$OUT/$name.json" <<'EOF' 2>&1 | tail -1
import json, sys
r = json.load(open(sys.argv[1]))
s = r.get("server")
if s:
    print(f"{s['aggregate_tok_s']} tok/s, TTFT p50 {s['ttft_p50_s']} s p95 {s['ttft_p95_s']} s")
else:
    full = f" (context full at turn {r['context_full_at_turn']})" if r.get("context_full_at_turn") else ""
    print(f"TTFT median turns 2..{r.get('turns_done', r['turns'])}{full} {r['ttft_median_turns_2_on_s']} s; "
          f"per turn {r['ttft_s']}")
EOF
)"
}
stop() { kill -INT "$1" 2>/dev/null; for _ in $(seq 1 60); do kill -0 "$1" 2>/dev/null || return; sleep 1; done; kill -9 "$1"; }

note "model $MODEL ($(du -h "$MODEL" | cut -f1)), $CLIENTS clients x $TOKENS tokens, slots of $SLOT, $(cat /tmp/lcbin/BUILD 2>/dev/null | head -1)"
/tmp/lcbin/llama-server -m "$MODEL" -ngl "$NGL" -np "$CLIENTS" -c $((CLIENTS * SLOT)) -fa on --port 8090 \
    > "$OUT/llama-server.log" 2>&1 &
pid=$!
if [ ! -x /tmp/lcbin/llama-server ]; then
    note "llama-server: no binary (carry .peer/llama-bin.tar.xz)"
elif up 8090; then
    has one && bench llama-server-1client 8090 --clients 1
    { has many || has offline; } && bench "llama-server-${CLIENTS}clients" 8090 --clients "$CLIENTS"
    has chat && bench "llama-server-chat$TURNS" 8090 --chat-turns "$TURNS"
else
    note "llama-server did not come up: $(tail -3 "$OUT/llama-server.log")"
fi
stop $pid

if has offline; then  # ours in process: the server and the offline batch on one loaded model
    timeout "$BENCH_TIMEOUT" python3 -m bench.server_bench --model "$MODEL" --device "$DEVICE" "${OURS_ARGS[@]}" \
        --clients "$CLIENTS" --tokens "$TOKENS" --out "$OUT/ours-inprocess-${CLIENTS}clients.json" \
        > "$OUT/ours-inprocess.log" 2>&1
    note "ours in process: exit $?; $(python3 - "$OUT/ours-inprocess-${CLIENTS}clients.json" <<'EOF' 2>&1 | tail -1
import json, sys
r = json.load(open(sys.argv[1]))
s, o = r["server"], r["offline"]
print(f"server {s['aggregate_tok_s']} tok/s (TTFT p50 {s['ttft_p50_s']} s), offline batch {o['aggregate_tok_s']} tok/s "
      f"end to end, {o['decode_tok_s']} decode only: {r['server_vs_offline']}x / {r['server_vs_offline_decode']}x")
EOF
)"
fi

if has one || has many || has chat; then
    python3 -c "from infer.cli import main; main()" serve -m "$MODEL" --device "$DEVICE" "${OURS_ARGS[@]}" \
        --max-batch "$CLIENTS" -c "$SLOT" --port 8091 > "$OUT/ours.log" 2>&1 &
    pid=$!
    if up 8091; then
        has one && bench ours-1client 8091 --clients 1
        has many && bench "ours-${CLIENTS}clients" 8091 --clients "$CLIENTS"
        has chat && bench "ours-chat$TURNS" 8091 --chat-turns "$TURNS"
    else
        note "ours did not come up: $(tail -3 "$OUT/ours.log")"
    fi
    stop $pid
fi

has chat || exit 0

python3 -c "from infer.cli import main; main()" serve -m "$MODEL" --device "$DEVICE" "${OURS_ARGS[@]}" --max-batch 1 \
    -c "$SLOT" --no-prefix-cache --port 8092 > "$OUT/ours-nocache.log" 2>&1 &
pid=$!
if up 8092; then
    bench "ours-nocache-chat$TURNS" 8092 --chat-turns "$TURNS"
else
    note "ours without the prefix cache did not come up: $(tail -3 "$OUT/ours-nocache.log")"
fi
stop $pid
python3 - "$OUT" "$TURNS" <<'EOF' | tee -a "$SUMMARY"
import json, sys
out, turns = sys.argv[1], sys.argv[2]
try:
    if int(turns) < 2:
        raise ValueError("a replay of one turn has no later turns to compare")
    on = json.load(open(f"{out}/ours-chat{turns}.json"))
    off = json.load(open(f"{out}/ours-nocache-chat{turns}.json"))
    print(f"prefix cache: TTFT median {on['ttft_median_turns_2_on_s']} s vs {off['ttft_median_turns_2_on_s']} s without "
          f"({on['ttft_median_turns_2_on_s'] / off['ttft_median_turns_2_on_s']:.3f}x); answers identical: "
          f"{on['answers'] == off['answers']}")
except (OSError, KeyError, ValueError) as err:
    print(f"prefix cache: no comparison ({err})")
EOF
