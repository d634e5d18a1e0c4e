#!/bin/bash
# run 5 (same lease as run 4, right after it): 8 GB with the defaults, then llama.cpp -ncmoe 32
export PYTHONPATH="/tmp/site:$PWD"; export LD_LIBRARY_PATH=/tmp/lb:/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/cuda/lib64
python3 -m bench.gpu_bench --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth --no-kernels --vram-budget 8GB --experts auto --pp 512 --tg 64 --out $OUT/bench-8GB.json
export LD_PRELOAD=$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}')
/tmp/lb/llama-bench -m /tmp/nvmedirect-synth/synth-qwen3-30b-a3b-q4_k_m.gguf -p 512 -n 64 -ngl 99 -ncmoe 32 -t 16 -fa 1 -r 2 -o json > $OUT/llama-ncmoe32.json
