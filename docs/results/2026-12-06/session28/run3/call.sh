#!/bin/bash
# Lease call (session 28, 3): batch 32 with its pairs grouped (the threshold's other side) and the
# prompt pass's kernels at 24 GB.
set -u
export PYTHONPATH="/tmp/site:$PWD"
NVMEDIRECT_EXPERTS_GROUPED_FROM=1 timeout 150 python3 -m bench.gpu_bench --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth \
  --vram-budget 24GB --experts gpu --pp 64 --tg 8 --batch 32 --no-kernels \
  --out $OUT/bench-24GB-grouped1.json > $OUT/bench-24GB-grouped1.txt 2>&1
echo "== 24GB grouped from 1 rc=$?"; grep -i "tok/s\|error" $OUT/bench-24GB-grouped1.txt | head -8
timeout 150 python3 -m bench.pass_profile --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth --vram-budget 24GB \
  --pp 512 --steps 4 --out $OUT/profile-pp512.json > $OUT/profile-pp512.txt 2>&1
echo "profile rc=$?"; head -50 $OUT/profile-pp512.txt
echo "elapsed ${SECONDS}s"
