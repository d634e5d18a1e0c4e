#!/bin/bash
# Lease call (session 27, final): the GPU tests of this session's kernels; ours on the synthetic
# Qwen3-30B-A3B at 24 GB (experts in VRAM) with its profile and at 8 GB (the budget's split); then
# llama-bench on the same file in the same lease (prebuilt here: .peer/llama-bin.tar.xz, CUDA sm_90,
# every CPU variant loaded at run time), all on the GPU and with 32 blocks' experts on the CPU.
set -u
export PYTHONPATH="$PWD"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH="/tmp/site:$PWD"
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt; nproc > $OUT/nproc.txt; lscpu > $OUT/lscpu.txt; cat $OUT/gpu.txt
mkdir -p /tmp/lb && tar xJf .peer/llama-bin.tar.xz -C /tmp/lb
cub=$(dirname "$(find /usr/local /opt /usr/lib -name 'libcublas.so.13*' 2>/dev/null | head -1)")
crt=$(dirname "$(find /usr/local /opt /usr/lib -name 'libcudart.so.13*' 2>/dev/null | head -1)")
export LD_LIBRARY_PATH="/tmp/lb:$cub:$crt:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"; echo "cublas from $cub, cudart from $crt"
/tmp/lb/llama-bench --list-devices 2>&1 | tail -4
timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_moe_kernels.py tests/gpu/test_kernels.py \
  -k "route or combine or expert or attention or fgemv or float or f16 or f32 or rmsnorm or round" > $OUT/pytest-kernels.txt 2>&1
echo "kernel tests rc=$?"; tail -3 $OUT/pytest-kernels.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_gpu.py > $OUT/pytest-moe.txt 2>&1
echo "moe model tests rc=$?"; tail -2 $OUT/pytest-moe.txt
moe=/tmp/nvmedirect-synth/synth-qwen3-30b-a3b-q4_k_m.gguf
timeout 200 python3 -m bench.gpu_bench --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth \
  --vram-budget 24GB --experts gpu --pp 512 --tg 64 --batch 32 --no-kernels \
  --out $OUT/gpu-bench-30b-a3b-24GB.json > $OUT/gpu-bench-30b-a3b-24GB.txt 2>&1
echo "== 30b-a3b 24GB rc=$?"; grep -i "tok/s\|error" $OUT/gpu-bench-30b-a3b-24GB.txt | head -6
/tmp/lb/llama-bench -m $moe -p 512 -n 64 -ngl 99 -fa 1 -r 3 -o json > $OUT/llama-moe-ngl99.json 2> $OUT/llama-moe-ngl99.log
echo "llama ngl99 rc=$?"; tail -2 $OUT/llama-moe-ngl99.log
python3 -c "import json,sys; print([(r['n_prompt'], r['n_gen'], round(r['avg_ts'],2), r['samples_ts']) for r in json.load(open(sys.argv[1]))])" $OUT/llama-moe-ngl99.json
timeout 100 python3 -m bench.pass_profile --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth --vram-budget 24GB \
  --pp 64 --steps 8 --out $OUT/profile-30b-a3b-24GB.json > $OUT/profile-30b-a3b-24GB.txt 2>&1
echo "profile rc=$?"; grep -A15 "^decode" $OUT/profile-30b-a3b-24GB.txt; grep "fp64" $OUT/profile-30b-a3b-24GB.txt | cut -c1-200
timeout 200 python3 -m bench.gpu_bench --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth \
  --vram-budget 8GB --experts auto --pp 512 --tg 64 --no-kernels \
  --out $OUT/gpu-bench-30b-a3b-8GB.json > $OUT/gpu-bench-30b-a3b-8GB.txt 2>&1
echo "== 30b-a3b 8GB rc=$?"; grep -i "tok/s\|error" $OUT/gpu-bench-30b-a3b-8GB.txt | head -4
python3 -c "import json,sys; print(json.load(open(sys.argv[1])).get('experts'))" $OUT/gpu-bench-30b-a3b-8GB.json
timeout 120 /tmp/lb/llama-bench -m $moe -p 512 -n 64 -ngl 99 -ncmoe 32 -t $(nproc) -fa 1 -r 2 -o json > $OUT/llama-moe-ncmoe32.json 2> $OUT/llama-moe-ncmoe32.log &
pid=$!; peak=0
while kill -0 $pid 2>/dev/null; do u=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1); [ $u -gt $peak ] && peak=$u; sleep 0.2; done
wait $pid; echo "llama ncmoe 32 rc=$? peak $peak MiB"
python3 -c "import json,sys; print([(r['n_prompt'], r['n_gen'], round(r['avg_ts'],2), r['samples_ts']) for r in json.load(open(sys.argv[1]))])" $OUT/llama-moe-ncmoe32.json
echo "elapsed ${SECONDS}s"
