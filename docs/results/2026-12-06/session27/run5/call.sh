#!/bin/bash
# Lease call (session 27, after the first profile): moe_route a warp a row, fgemv's 16-byte loads,
# attention's head split; their GPU tests, then the 30B-A3B at 24 GB (experts in VRAM) with its
# profile, then at 8 GB (the budget's split) with no build beside it.
set -u
export PYTHONPATH="$PWD"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH="/tmp/site:$PWD"
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt; nproc > $OUT/nproc.txt; cat $OUT/gpu.txt
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_moe_kernels.py tests/gpu/test_kernels.py \
  -k "route or combine or expert or attention or fgemv or float or f16 or f32" > $OUT/pytest-kernels.txt 2>&1
echo "kernel tests rc=$?"; tail -4 $OUT/pytest-kernels.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_gpu.py > $OUT/pytest-moe.txt 2>&1
echo "moe model tests rc=$?"; tail -2 $OUT/pytest-moe.txt
timeout 200 python3 -m bench.gpu_bench --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth \
  --vram-budget 24GB --experts gpu --pp 512 --tg 64 --batch 32 --no-kernels \
  --out $OUT/gpu-bench-30b-a3b-24GB.json > $OUT/gpu-bench-30b-a3b-24GB.txt 2>&1
echo "== 30b-a3b 24GB rc=$?"; grep -i "tok/s\|error" $OUT/gpu-bench-30b-a3b-24GB.txt | head -6
timeout 100 python3 -m bench.pass_profile --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth --vram-budget 24GB \
  --pp 64 --steps 8 --out $OUT/profile-30b-a3b-24GB.json > $OUT/profile-30b-a3b-24GB.txt 2>&1
echo "profile rc=$?"; grep -A16 "^decode" $OUT/profile-30b-a3b-24GB.txt; grep "fp64" $OUT/profile-30b-a3b-24GB.txt | cut -c1-300
timeout $((590 - SECONDS)) python3 -m bench.gpu_bench --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth \
  --vram-budget 8GB --experts auto --pp 512 --tg 64 --no-kernels \
  --out $OUT/gpu-bench-30b-a3b-8GB.json > $OUT/gpu-bench-30b-a3b-8GB.txt 2>&1
echo "== 30b-a3b 8GB rc=$?"; grep -i "tok/s\|error\|experts" $OUT/gpu-bench-30b-a3b-8GB.txt | head -6
echo "elapsed ${SECONDS}s"
