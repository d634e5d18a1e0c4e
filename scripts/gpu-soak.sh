#!/bin/bash
# The serving soak on the GPU (issue 27 bar 6): `ntransformer serve` on the synthetic 8B Q4_K_M,
# bench.server_soak's mixed load for SOAK_SECONDS (default 600), then its drain and memory check;
# GPU memory in use before and after. JSON and logs under $OUT.
#
#   OUT=/path bash scripts/gpu-soak.sh
#   SOAK_SECONDS=240 SOAK_CLIENTS=24 SOAK_MODEL=m.gguf ...
#   SOAK_DEVICE=cpu SOAK_SERVE_ARGS="--max-batch 4 --queue-size 8 -c 512" ...   # a dry run without a GPU
#
# Carry .whl (the server's wheels: docs/SERVER.md).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-soak}
SYNTH_DIR=${SYNTH_DIR:-/tmp/nvmedirect-synth}
SECONDS_=${SOAK_SECONDS:-600}
CLIENTS=${SOAK_CLIENTS:-24}
DEVICE=${SOAK_DEVICE:-gpu}
read -r -a SERVE_ARGS <<< "${SOAK_SERVE_ARGS:---max-batch 16 --queue-size 16}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
    export PYTHONPATH="/tmp/site:$PWD"
fi
MODEL=${SOAK_MODEL:-$(python3 -c "from bench.gpu_bench import synth_path; from pathlib import Path; print(synth_path('8b:q4_k_m', Path('$SYNTH_DIR')))")}
vram() { nvidia-smi --query-gpu=memory.used --format=csv,noheader > "$OUT/$1" 2>/dev/null || echo "no GPU" > "$OUT/$1"; }

python3 -c "from infer.cli import main; main()" serve -m "$MODEL" --device "$DEVICE" "${SERVE_ARGS[@]}" \
    --port 8093 > "$OUT/server.log" 2>&1 &
pid=$!
python3 scripts/wait_health.py 8093 $pid || { echo "server did not come up: $(tail -3 "$OUT/server.log")"; kill -9 $pid; exit 1; }
vram vram-before.txt
python3 -m bench.server_soak --url http://127.0.0.1:8093 --pid $pid --seconds "$SECONDS_" --clients "$CLIENTS" \
    --out "$OUT/soak-gpu-${SECONDS_}s.json" > "$OUT/soak.log" 2>&1
rc=$?
vram vram-after.txt
kill -INT $pid
for _ in $(seq 1 60); do kill -0 $pid 2>/dev/null || break; sleep 1; done
kill -9 $pid 2>/dev/null
echo "soak exit $rc; VRAM $(cat "$OUT/vram-before.txt") before, $(cat "$OUT/vram-after.txt") after"
tail -5 "$OUT/soak.log"
exit $rc
