#!/bin/bash
# Session 39, call A: issue 26 bar 1's decode at 8 GB. The 30B-A3B synthetic Q4_K_M, --experts auto:
# this tree (the routed experts' weighted sum in their native call, no wait after the copy back,
# the CPU's decode share timed against the RAM's read bandwidth), the tree before it (abc135a), this
# tree again; then llama-bench -ngl 99 -ncmoe 32 -t 16 on the same file.
source docs/results/2026-12-08/session39/common.sh
[ -f "$M" ] || timeout 200 python3 -c "
from pathlib import Path
from bench.gpu_bench import synth_path
print(synth_path('qwen3-30b-a3b:q4_k_m', Path('/tmp/nvmedirect-synth')))"
echo "file at ${SECONDS}s"; cat "$M" > /dev/null  # in the page cache before either engine reads it
bench="-m bench.gpu_bench --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth --no-kernels --vram-budget 8GB --experts auto --pp 512 --tg 64"
for run in new1 old new2; do
    if [ $run = old ]; then pp="$OLD:/tmp/site:$PWD"; else pp="/tmp/site:$PWD"; fi
    PYTHONPATH="$pp" timeout 180 python3 $bench --out "$OUT/bench-8GB-$run.json" > "$OUT/bench-8GB-$run.txt" 2>&1
    echo "== $run rc=$? at ${SECONDS}s"; grep -i "tok/s\|CPU's\|error" "$OUT/bench-8GB-$run.txt" | head -4
done
LD_PRELOAD=$CUDA_PRELOAD timeout 150 /tmp/lb/llama-bench -m $M -p 512 -n 64 -fa 1 -ngl 99 -ncmoe 32 -t 16 -r 2 \
    -o json > "$OUT/llama-ncmoe32.json" 2> "$OUT/llama-ncmoe32.err"
echo "llama ncmoe32 rc=$? at ${SECONDS}s"
python3 -c "import json,sys; print([(r['n_prompt'], r['n_gen'], round(r['avg_ts'],2), r['samples_ts']) for r in json.load(open(sys.argv[1]))])" "$OUT/llama-ncmoe32.json"
