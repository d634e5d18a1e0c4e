#!/bin/bash
# Lease call (session 28, 4): the MoE GPU tests again (the stream's pages unregistered; fgemv's
# grid), then 24 GB and 8 GB beside llama.cpp in the same lease.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH="/tmp/site:$PWD"
nvidia-smi --query-gpu=name --format=csv,noheader; nproc
mkdir -p /tmp/lb && tar xJf .peer/llama-bin.tar.xz -C /tmp/lb && rm -f /tmp/lb/libggml-cpu-sapphirerapids.so
export LD_LIBRARY_PATH=/tmp/lb:/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/cuda/lib64
(setsid python3 -c "from pathlib import Path; from bench.gpu_bench import synth_path; synth_path('qwen3-30b-a3b:q4_k_m', Path('/tmp/nvmedirect-synth'))" > /tmp/synth.log 2>&1 &)
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_kernels.py tests/gpu/test_moe_gpu.py \
  tests/gpu/test_kernels.py -k "moe or expert or qmm or product or group or combine or route or stream or share or fgemv or float" > $OUT/pytest.txt 2>&1
echo "tests rc=$?"; tail -2 $OUT/pytest.txt; grep -E "^(FAILED|E )" $OUT/pytest.txt | head -10
while pgrep -f "synth_path" > /dev/null; do sleep 2; done
moe=/tmp/nvmedirect-synth/synth-qwen3-30b-a3b-q4_k_m.gguf
b() {  # name, args...
  local name=$1; shift
  timeout 170 python3 -m bench.gpu_bench --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth --no-kernels "$@" \
    --out $OUT/bench-$name.json > /tmp/bench-$name.txt 2>&1
  echo "== $name rc=$?"; grep -i "error\|Traceback" /tmp/bench-$name.txt | head -3
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d.get(k) for k in ('pp_tok_s','pp_canonical_tok_s','tg_tok_s','batch','peak_vram_bytes','expert_stream_bytes')})" $OUT/bench-$name.json
}
b 24GB --vram-budget 24GB --experts gpu --pp 512 --tg 64 --batch 32
[ "${WITH_8GB:-0}" = 1 ] && b 8GB --vram-budget 8GB --experts auto --pp 512 --tg 64
export LD_PRELOAD=$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}')
[ "${WITH_8GB:-0}" = 1 ] && timeout 150 /tmp/lb/llama-bench -m $moe -p 512 -n 64 -ngl 99 -ncmoe 32 -t $(nproc) -fa 1 -r 2 -o json > $OUT/llama-ncmoe32.json 2> /tmp/llama.log
timeout 100 /tmp/lb/llama-bench -m $moe -p 512 -n 64 -ngl 99 -fa 1 -r 2 -o json > $OUT/llama-ngl99.json 2>> /tmp/llama.log
echo "llama ngl99 rc=$?"
python3 -c "import json,sys; print([(r['n_prompt'], r['n_gen'], round(r['avg_ts'],2), r['samples_ts']) for r in json.load(open(sys.argv[1]))])" $OUT/llama-ngl99.json
echo "elapsed ${SECONDS}s"
