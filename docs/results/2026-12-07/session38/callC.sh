#!/bin/bash
# Session 38, call C (carry .whl, .peer, the two .so; same machine as call B): the 8 GB run with the
# default placement (long prompts stream the CPU blocks' experts) as session 31's run 2 measured it;
# CPU-only at 16 threads on an 8-block file of the 30B's shape (ours, llama.cpp's CPU backend), after
# session 37's chunk change; one block's MoE feed-forward split into its parts (moe_block.py).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 NVMEDIRECT_CACHE=/tmp/nvd-cache
mkdir -p /tmp/lb && tar xJf .peer/llama-bin.tar.xz -C /tmp/lb
export LD_LIBRARY_PATH=/tmp/lb:/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/cuda/lib64
timeout 200 python3 -m bench.gpu_bench --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth --no-kernels \
    --vram-budget 8GB --experts auto --pp 512 --tg 64 --out "$OUT/bench-8GB.json" > /tmp/b.txt 2>&1
echo "== 8GB rc=$? at ${SECONDS}s"; grep -i "tok/s\|error" /tmp/b.txt | head -4
python3 -c "
import dataclasses
from infer.synth import SHAPES, write_model
write_model('/tmp/moe8v.gguf', dataclasses.replace(SHAPES['qwen3-30b-a3b'], n_layers=8, vocab_size=1024), 'q4_k_m', seed=1)"
NVMEDIRECT_CPU_THREADS=16 timeout 120 python3 -m bench.cpu_decode --model /tmp/moe8v.gguf --engines native --pp 32 --tg 32 \
    --threads 16 --repeat 2 --out "$OUT/cpu-native-16.json" 2>&1 | grep "native " | cut -c1-200
CUDA_VISIBLE_DEVICES= timeout 100 /tmp/lb/llama-bench -m /tmp/moe8v.gguf -p 32 -n 32 -ngl 0 -t 16 -r 2 -o json \
    > "$OUT/cpu-llama-16.json" 2> /tmp/lc.err
echo "llama cpu rc=$? at ${SECONDS}s"; grep load_backend /tmp/lc.err | tail -1
python3 -c "import json,sys; print([(r['n_prompt'], r['n_gen'], round(r['avg_ts'],2), r['samples_ts']) for r in json.load(open(sys.argv[1]))])" "$OUT/cpu-llama-16.json"
for t in 2 16; do NVMEDIRECT_CPU_THREADS=$t timeout 60 python3 docs/results/2026-12-07/session38/moe_block.py /tmp/moe8v.gguf 2>&1 \
    | grep -v "huge pages" | sed "s/^/threads $t: /" | tee -a "$OUT/moe-block-parts.txt"; done
echo "elapsed ${SECONDS}s"
