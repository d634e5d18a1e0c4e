#!/bin/bash
# Lease call (session 28, 6): fgemv 8 vectors a warp: its tests (bits against NumPy) and the MoE GPU
# tests, then 24 GB beside llama.cpp in the same lease.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH="/tmp/site:$PWD"
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/lb && tar xJf .peer/llama-bin.tar.xz -C /tmp/lb && rm -f /tmp/lb/libggml-cpu-sapphirerapids.so
export LD_LIBRARY_PATH=/tmp/lb:/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/cuda/lib64
(setsid python3 -c "from pathlib import Path; from bench.gpu_bench import synth_path; synth_path('qwen3-30b-a3b:q4_k_m', Path('/tmp/nvmedirect-synth'))" > /tmp/synth.log 2>&1 &)
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels.py tests/gpu/test_moe_gpu.py \
  -k "fgemv or float or f16 or f32 or bf16 or moe" > $OUT/pytest.txt 2>&1
echo "tests rc=$?"; tail -2 $OUT/pytest.txt; grep -E "^(FAILED|E )" $OUT/pytest.txt | head -10
while pgrep -f "synth_path" > /dev/null; do sleep 2; done
timeout 150 python3 -m bench.gpu_bench --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth --no-kernels \
  --vram-budget 24GB --experts gpu --pp 512 --tg 64 --out $OUT/bench-24GB.json > /tmp/b24.txt 2>&1
echo "== 24GB rc=$?"; grep -i "tok/s\|error" /tmp/b24.txt | head -4
export LD_PRELOAD=$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}')
timeout 100 /tmp/lb/llama-bench -m /tmp/nvmedirect-synth/synth-qwen3-30b-a3b-q4_k_m.gguf -p 512 -n 64 -ngl 99 -fa 1 -r 2 -o json > $OUT/llama-ngl99.json 2>/dev/null
echo "llama ngl99 rc=$?"
python3 -c "import json,sys; print([(r['n_prompt'], r['n_gen'], round(r['avg_ts'],2), r['samples_ts']) for r in json.load(open(sys.argv[1]))])" $OUT/llama-ngl99.json
echo "elapsed ${SECONDS}s"
