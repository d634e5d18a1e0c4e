#!/bin/bash
# Lease call 3 (issue 28's last bar): the 70B at --vram-budget 24GB, ours with the CPU tier's split
# (auto), then llama-bench on the same file with 40 layers on the GPU, both on this machine.
set -u
export PYTHONPATH="/tmp/site:$PWD"
MODES=auto STREAM_TIMEOUT=220 STREAM_DEADLINE=210 OUT=$OUT bash .devrun/callF.sh
LLAMA=/tmp/lc/llama.cpp/build/bin/llama-bench; m=/tmp/nvmd-bench/synth-llama70b-q4_k_m.gguf
ls -la $m
timeout $((585 - SECONDS)) $LLAMA -m $m -p 0 -n 32 -ngl 40 -t $(nproc) -fa 1 -r 2 -o json \
  > $OUT/llama-70b-ngl40.json 2> $OUT/llama-70b-ngl40.log
echo "llama 70b ngl40 rc=$?"; tail -3 $OUT/llama-70b-ngl40.log
python3 -c "import json,sys; print([(r['n_prompt'], r['n_gen'], round(r['avg_ts'],3), r['samples_ts']) for r in json.load(open(sys.argv[1]))])" $OUT/llama-70b-ngl40.json
echo "elapsed ${SECONDS}s"
