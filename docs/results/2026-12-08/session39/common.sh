# Sourced by each call (carry .whl, .peer/llama-bin.tar.xz, .peer/llama-batched-bench, .devrun/old,
# infer/_cpu_kernels.abi3.so): wheels, llama.cpp's binaries, the 30B-A3B synthetic file.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 NVMEDIRECT_CACHE=/tmp/nvd-cache
if [ ! -x /tmp/lb/llama-batched-bench ]; then
    mkdir -p /tmp/lb && tar xJf .peer/llama-bin.tar.xz -C /tmp/lb && cp .peer/llama-batched-bench /tmp/lb/
fi
export LD_LIBRARY_PATH=/tmp/lb:/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/cuda/lib64
CUDA_PRELOAD=$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}')
M=/tmp/nvmedirect-synth/synth-qwen3-30b-a3b-q4_k_m.gguf
OLD="$PWD/.devrun/old"  # the tree before session 39 (abc135a's infer/ and bench/, its own native library)
