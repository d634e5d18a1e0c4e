#!/bin/bash
# Next lease, call 1 (session 26's code): llama.cpp building and the 30B-A3B file in the background;
# the MoE kernel and model tests on the GPU (experts in VRAM: never run on a GPU before); then the
# 30B-A3B at 24 GB with every expert in VRAM, and at 8 GB with the budget's split.
set -u
export PYTHONPATH="$PWD"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH="/tmp/site:$PWD"
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt; nproc > $OUT/nproc.txt
free -g > $OUT/free.txt; df -h /tmp > $OUT/df.txt; cat $OUT/gpu.txt $OUT/nproc.txt
mkdir -p /tmp/lc
if [ ! -e /tmp/lc/started ]; then
  touch /tmp/lc/started
  setsid nice -n 19 bash -c "tar xzf .peer/llama.cpp.tgz -C /tmp/lc && cd /tmp/lc/llama.cpp &&
    cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF > /tmp/lc/cmake.log 2>&1 &&
    cmake --build build -j 12 --target llama-bench > /tmp/lc/build.log 2>&1; echo rc=\$? > /tmp/lc/done" \
    > /dev/null 2>&1 < /dev/null &
fi
timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_moe_kernels.py > $OUT/pytest-moe-kernels.log 2>&1
echo "moe kernels rc=$?"; tail -3 $OUT/pytest-moe-kernels.log
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_gpu.py > $OUT/pytest-moe.log 2>&1
echo "moe model tests rc=$?"; tail -3 $OUT/pytest-moe.log
for budget in 24GB 8GB; do
  experts=$([ $budget = 24GB ] && echo gpu || echo auto)
  timeout $((590 - SECONDS)) python3 -m bench.gpu_bench --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth \
    --vram-budget $budget --experts $experts --pp 512 --tg 64 --batch 32 --no-kernels \
    --out $OUT/gpu-bench-30b-a3b-$budget.json > $OUT/gpu-bench-30b-a3b-$budget.txt 2>&1
  echo "== 30b-a3b $budget rc=$?"; grep -i "tok/s\|error\|experts" $OUT/gpu-bench-30b-a3b-$budget.txt | head -8
done
echo "elapsed ${SECONDS}s"
