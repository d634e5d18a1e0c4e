#!/bin/bash
# Session 39, call B: issue 26 bar 1's decode before and after (call A's "old" run imported this
# tree: see README); its third figure, 32 sequences at 8 GB (ours: bench.gpu_bench
# --batch 32, prompts of 128, 64 new tokens; llama.cpp: llama-batched-bench -npl 32 -npp 128 -ntg 64
# with -ncmoe 34, whose peak leaves the 32 sequences' cache room in 8 GB); one block's MoE
# feed-forward in parts at 16 threads, before and after; the RAM's read bandwidth.
source docs/results/2026-12-08/session39/common.sh
# the decode at 8 GB before and after this session's change, one after the other (the tree before it
# run from its own directory: `python -m` puts the working directory first on the path)
bench="-m bench.gpu_bench --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth --no-kernels --vram-budget 8GB --experts auto --pp 512 --tg 64"
for run in old new3; do
    if [ $run = old ]; then dir=$OLD pp="$OLD:/tmp/site"; else dir=$PWD pp="/tmp/site:$PWD"; fi
    (cd "$dir" && PYTHONPATH="$pp" timeout 150 python3 $bench --out "$OUT/bench-8GB-$run.json" > "$OUT/bench-8GB-$run.txt" 2>&1)
    echo "== $run rc=$? at ${SECONDS}s"; grep -i "tok/s\|CPU's\|error" "$OUT/bench-8GB-$run.txt" | head -4
done
timeout 200 python3 -m bench.gpu_bench --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth --no-kernels \
    --vram-budget 8GB --experts auto --pp 16 --tg 8 --batch 32 --batch-prompt 128 --batch-new 64 \
    --out "$OUT/bench-8GB-batch32.json" > "$OUT/bench-8GB-batch32.txt" 2>&1
echo "== batch32 rc=$? at ${SECONDS}s"; grep -i "sequences\|error" "$OUT/bench-8GB-batch32.txt" | head -3
(while sleep 0.5; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits; done) > "$OUT/llama-batched-vram.txt" &
watch=$!
LD_PRELOAD=$CUDA_PRELOAD timeout 200 /tmp/lb/llama-batched-bench -m $M -c 6400 -b 2048 -ub 512 -npp 128 -ntg 64 -npl 32 \
    -fa on -ngl 99 -ncmoe 34 -t 16 > "$OUT/llama-batched-ncmoe34.txt" 2>&1
echo "llama batched rc=$? at ${SECONDS}s"; kill $watch
grep "^|" "$OUT/llama-batched-ncmoe34.txt"; echo "llama peak MiB: $(sort -n "$OUT/llama-batched-vram.txt" | tail -1)"
python3 -c "
import dataclasses
from infer.synth import SHAPES, write_model
write_model('/tmp/moe8v.gguf', dataclasses.replace(SHAPES['qwen3-30b-a3b'], n_layers=8, vocab_size=1024), 'q4_k_m', seed=1)"
for t in 16; do
    NVMEDIRECT_CPU_THREADS=$t timeout 60 python3 docs/results/2026-12-08/session39/moe_block.py /tmp/moe8v.gguf 2>/dev/null \
        | sed "s/^/new, threads $t: /" | tee -a "$OUT/moe-block-parts.txt"
    PYTHONPATH="$OLD:/tmp/site:$PWD" NVMEDIRECT_CPU_THREADS=$t timeout 60 python3 docs/results/2026-12-08/session39/moe_block.py \
        /tmp/moe8v.gguf 2>/dev/null | sed "s/^/old, threads $t: /" | tee -a "$OUT/moe-block-parts.txt"
done
python3 -c "
from bench.cpu_kernels import read_bandwidth_gbs
for t in (1, 8, 16): print(f'RAM read, {t} threads: {read_bandwidth_gbs(t):.1f} GB/s')" | tee "$OUT/ram-read.txt"
echo "elapsed ${SECONDS}s"
