#!/bin/bash
# Session 38, call B (carry .whl, .peer, the two .so): issue 26 on the 30B-A3B synthetic Q4_K_M at
# --vram-budget 8GB: ours resident (the CPU's blocks' experts from the file's pages) and --streaming
# with the tiered cache at 8 GB of RAM, beside llama.cpp -ngl 99 -ncmoe 32 -t 16 in the same lease.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 NVMEDIRECT_CACHE=/tmp/nvd-cache
M=/tmp/nvmedirect-synth/synth-qwen3-30b-a3b-q4_k_m.gguf
[ -f "$M" ] || timeout 200 python3 -c "
from pathlib import Path
from bench.gpu_bench import synth_path
print(synth_path('qwen3-30b-a3b:q4_k_m', Path('/tmp/nvmedirect-synth')))"
mkdir -p /tmp/lb && tar xJf .peer/llama-bin.tar.xz -C /tmp/lb
export LD_LIBRARY_PATH=/tmp/lb:/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/cuda/lib64
LD_PRELOAD=$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}') timeout 150 /tmp/lb/llama-bench -m $M -p 512 -n 64 \
    -fa 1 -ngl 99 -ncmoe 32 -t 16 -r 2 -o json > "$OUT/llama-ncmoe32.json" 2> "$OUT/llama-ncmoe32.err"
echo "llama ncmoe rc=$? at ${SECONDS}s"
python3 -c "import json,sys; print([(r['n_prompt'], r['n_gen'], round(r['avg_ts'],2), r['samples_ts']) for r in json.load(open(sys.argv[1]))])" "$OUT/llama-ncmoe32.json"
common="-m $M --device gpu --vram-budget 8GB -n 64 --benchmark --json"
timeout 150 python3 -c "from infer.cli import main; main()" $common --expert-stream off > "$OUT/resident-8GB.json" 2> "$OUT/resident-8GB.err"
echo "resident rc=$? at ${SECONDS}s"; tail -n 3 "$OUT/resident-8GB.err"; cat "$OUT/resident-8GB.json"
if [ $SECONDS -lt 400 ]; then
    timeout $((570 - SECONDS)) python3 -c "from infer.cli import main; main()" $common --streaming --ram-budget 8GB \
        > "$OUT/tiered-8GB.json" 2> "$OUT/tiered-8GB.err"
    echo "tiered 8GB rc=$? at ${SECONDS}s"; tail -n 6 "$OUT/tiered-8GB.err"; cat "$OUT/tiered-8GB.json"
fi
echo "elapsed ${SECONDS}s"
