#!/bin/bash
# .devrun/cpu_tier_old.py was `git show 5602832:infer/tiers/cpu_tier.py` (the code kept after the revert)
# A/B of the CPU experts' crossing (pinned buffer, one wait; against the two-wait version) at 8 GB, and
# why the prebuilt llama-bench found no CUDA device.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH="/tmp/site:$PWD"
mkdir -p /tmp/lb && tar xJf .peer/llama-bin.tar.xz -C /tmp/lb; rm -f /tmp/lb/libggml-cpu-sapphirerapids.so
export LD_LIBRARY_PATH="/tmp/lb:/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
python3 -c "import ctypes; ctypes.CDLL('/tmp/lb/libggml-cuda.so')" 2>&1 | tail -2
ldd /tmp/lb/libggml-cuda.so | grep -i "not found\|cuda\|cublas"
GGML_LOG_LEVEL=0 /tmp/lb/llama-bench --list-devices 2>&1 | tail -5
for v in new old; do
  [ $v = old ] && cp .devrun/cpu_tier_old.py infer/tiers/cpu_tier.py
  timeout 150 python3 -m bench.gpu_bench --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth \
    --vram-budget 8GB --experts auto --pp 512 --tg 64 --no-kernels --out $OUT/gpu-bench-8GB-$v.json > $OUT/gpu-bench-8GB-$v.txt 2>&1
  echo "== 8GB $v rc=$?"; grep -i "tok/s\|error" $OUT/gpu-bench-8GB-$v.txt | head -3
done
echo "elapsed ${SECONDS}s"
