#!/bin/bash
# Session 29, call 2: qgemv with several weight rows a warp (QG_ROWS by row length): its tests, the
# 24 GB decode with the rows by length / 1 / 2 / 4 beside llama.cpp (same lease), the profile, then
# the 8 GB bench beside llama.cpp -ncmoe 32 if time is left.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH="/tmp/site:$PWD"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p /tmp/lb && tar xJf .peer/llama-bin.tar.xz -C /tmp/lb && rm -f /tmp/lb/libggml-cpu-sapphirerapids.so
export LD_LIBRARY_PATH=/tmp/lb:/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/cuda/lib64
(setsid python3 -c "from pathlib import Path; from bench.gpu_bench import synth_path; synth_path('qwen3-30b-a3b:q4_k_m', Path('/tmp/nvmedirect-synth'))" > /tmp/synth.log 2>&1 &)
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels.py tests/gpu/test_moe_kernels.py tests/gpu/test_moe_gpu.py \
  -k "stacked_parts or canonical_sum or exact_sum or nan or moe" > $OUT/pytest.txt 2>&1
echo "tests rc=$?"; tail -2 $OUT/pytest.txt; grep -E "^(FAILED|E )" $OUT/pytest.txt | head -10
while pgrep -f "synth_path" > /dev/null; do sleep 2; done
B="python3 -m bench.gpu_bench --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth --no-kernels --vram-budget 24GB --experts gpu --pp 512 --tg 64"
timeout 90 $B --out $OUT/bench-24GB.json > /tmp/b.txt 2>&1; echo "== 24GB rows by length rc=$?"; grep -i "tok/s\|error" /tmp/b.txt | head -3
NVMEDIRECT_QGEMV_ROWS=1 timeout 90 $B --out /tmp/bench-24GB-rows1.json > /tmp/b.txt 2>&1; echo "== 24GB rows 1 rc=$?"; grep -i "tok/s\|error" /tmp/b.txt | head -3
export LD_PRELOAD=$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}')
timeout 100 /tmp/lb/llama-bench -m /tmp/nvmedirect-synth/synth-qwen3-30b-a3b-q4_k_m.gguf -p 512 -n 64 -ngl 99 -fa 1 -r 2 -o json > $OUT/llama-ngl99.json 2>/dev/null
echo "llama ngl99 rc=$?"
python3 -c "import json,sys; print([(r['n_prompt'], r['n_gen'], round(r['avg_ts'],2), r['samples_ts']) for r in json.load(open(sys.argv[1]))])" $OUT/llama-ngl99.json
unset LD_PRELOAD
for r in 2 4; do NVMEDIRECT_QGEMV_ROWS=$r timeout 90 $B --out /tmp/bench-24GB-rows$r.json > /tmp/b.txt 2>&1; echo "== 24GB rows $r rc=$?"; grep -i "tok/s\|error" /tmp/b.txt | head -3; done
timeout 90 python3 -m bench.pass_profile --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth --vram-budget 24GB --pp 512 --steps 2 --out /tmp/profile.json > /tmp/profile.txt 2>&1
echo "profile rc=$?"; sed -n '/^decode/,/^prompt:/p' /tmp/profile.txt | head -20
tar czf $OUT/extra.tgz -C /tmp bench-24GB-rows1.json bench-24GB-rows2.json bench-24GB-rows4.json profile.json profile.txt 2>/dev/null
echo "elapsed ${SECONDS}s"
if [ $SECONDS -lt 430 ]; then
  timeout 80 python3 -m bench.gpu_bench --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth --no-kernels --vram-budget 8GB --experts auto --pp 512 --tg 64 --out $OUT/bench-8GB.json > /tmp/b8.txt 2>&1
  echo "== 8GB rc=$?"; grep -i "tok/s\|error\|peak" /tmp/b8.txt | head -4
  export LD_PRELOAD=$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}')
  timeout 80 /tmp/lb/llama-bench -m /tmp/nvmedirect-synth/synth-qwen3-30b-a3b-q4_k_m.gguf -p 512 -n 64 -ngl 99 -ncmoe 32 -t 16 -fa 1 -r 1 -o json > $OUT/llama-ncmoe32.json 2>/dev/null
  echo "llama ncmoe32 rc=$?"
  python3 -c "import json,sys; print([(r['n_prompt'], r['n_gen'], round(r['avg_ts'],2)) for r in json.load(open(sys.argv[1]))])" $OUT/llama-ncmoe32.json
fi
echo "elapsed ${SECONDS}s"
