#!/bin/bash
# Session 31, call 6: PDL with resident products loading their first weights before the wait
# (pdl.prefetch_weights, the default now): the PDL test on every model pair, the MoE and streaming
# model tests; 24 GB decode with it and with NVMEDIRECT_PDL=0 beside llama.cpp -ngl 99.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH="/tmp/site:$PWD"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
mkdir -p /tmp/lb && [ -x /tmp/lb/llama-bench ] || { tar xJf .peer/llama-bin.tar.xz -C /tmp/lb && rm -f /tmp/lb/libggml-cpu-sapphirerapids.so; }
export LD_LIBRARY_PATH=/tmp/lb:/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/cuda/lib64
(setsid python3 -c "from pathlib import Path; from bench.gpu_bench import synth_path; synth_path('qwen3-30b-a3b:q4_k_m', Path('/tmp/nvmedirect-synth'))" > /tmp/synth.log 2>&1 &)
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_model.py -k "wait or graph_generation" tests/gpu/test_moe_gpu.py tests/gpu/test_streaming.py > $OUT/pytest.txt 2>&1
echo "tests rc=$?"; tail -2 $OUT/pytest.txt; grep -E "^(FAILED|E )" $OUT/pytest.txt | head -10
while pgrep -f "synth_path" > /dev/null; do sleep 2; done
B="python3 -m bench.gpu_bench --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth --no-kernels --vram-budget 24GB --experts gpu --pp 512 --tg 64"
timeout 80 $B --out $OUT/bench-24GB-pdl.json > /tmp/b.txt 2>&1; echo "== 24GB pdl rc=$?"; grep -i "tok/s\|error\|warn" /tmp/b.txt | head -3
LD_PRELOAD=$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}') timeout 100 /tmp/lb/llama-bench -m /tmp/nvmedirect-synth/synth-qwen3-30b-a3b-q4_k_m.gguf -p 512 -n 64 -fa 1 -ngl 99 -r 3 -o json > $OUT/llama-ngl99.json 2>/dev/null
echo "llama rc=$?"; python3 -c "import json,sys; print([(r['n_prompt'], r['n_gen'], round(r['avg_ts'],2), r['samples_ts']) for r in json.load(open(sys.argv[1]))])" $OUT/llama-ngl99.json
NVMEDIRECT_PDL=0 timeout 80 $B --out $OUT/bench-24GB-plain.json > /tmp/b.txt 2>&1; echo "== 24GB plain rc=$?"; grep -i "tok/s\|error" /tmp/b.txt | head -3
timeout 80 $B --out $OUT/bench-24GB-pdl-b.json > /tmp/b.txt 2>&1; echo "== 24GB pdl rc=$?"; grep -i "tok/s\|error" /tmp/b.txt | head -3
echo "elapsed ${SECONDS}s"
