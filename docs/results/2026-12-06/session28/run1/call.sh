#!/bin/bash
# Lease call (session 28, 1): the GPU tests of the grouped expert product, the expert stream and the
# split (and every qmm test: the loader changed), then the synthetic Qwen3-30B-A3B at 24 GB.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH="/tmp/site:$PWD"
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt; nproc >> $OUT/gpu.txt; cat $OUT/gpu.txt
mkdir -p /tmp/lb && tar xJf .peer/llama-bin.tar.xz -C /tmp/lb && rm -f /tmp/lb/libggml-cpu-sapphirerapids.so
(setsid python3 -c "from pathlib import Path; from bench.gpu_bench import synth_path; synth_path('qwen3-30b-a3b:q4_k_m', Path('/tmp/nvmedirect-synth'))" > /tmp/synth.log 2>&1 &)
timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_moe_kernels.py tests/gpu/test_moe_gpu.py \
  tests/gpu/test_kernels.py -k "moe or expert or qmm or product or group or combine or route or stream or share" > $OUT/pytest.txt 2>&1
echo "tests rc=$?"; tail -3 $OUT/pytest.txt; grep -E "^(FAILED|E )" $OUT/pytest.txt | head -20
while pgrep -f "synth_path" > /dev/null; do sleep 2; done; tail -2 /tmp/synth.log
timeout 200 python3 -m bench.gpu_bench --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth \
  --vram-budget 24GB --experts gpu --pp 512 --tg 64 --batch 32 --no-kernels \
  --out $OUT/bench-24GB.json > $OUT/bench-24GB.txt 2>&1
echo "== 24GB rc=$?"; grep -i "tok/s\|error" $OUT/bench-24GB.txt | head -8
echo "elapsed ${SECONDS}s"
