#!/bin/bash
# Session 31, call 3 (same lease as calls 1-2): the 8 GB decode with 8, 2 and 1 chunks a pool thread
# (NVMEDIRECT_CPU_CHUNKS) in turn, and the CPU-only 8-block file with 2.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH="/tmp/site:$PWD"
for c in 8 2 1 2 8; do
  NVMEDIRECT_CPU_CHUNKS=$c timeout 100 python3 -m bench.gpu_bench --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth --no-kernels --vram-budget 8GB --experts auto --pp 512 --tg 64 --out $OUT/bench-8GB-chunks$c-$SECONDS.json > /tmp/b.txt 2>&1; echo "== 8GB chunks $c rc=$?"; grep -i "tok/s\|error" /tmp/b.txt | head -3
done
for c in 2 8; do
  NVMEDIRECT_CPU_CHUNKS=$c NVMEDIRECT_CPU_THREADS=16 timeout 100 python3 -m bench.cpu_decode --model /tmp/moe8v.gguf --engines native --pp 32 --tg 32 --threads 16 --repeat 2 --out $OUT/cpu-native-16-chunks$c.json 2>&1 | tail -1 | grep -o '"pp_tok_s": [0-9.]*, "tg_tok_s": [0-9.]*' | head -1
done
echo "elapsed ${SECONDS}s"
