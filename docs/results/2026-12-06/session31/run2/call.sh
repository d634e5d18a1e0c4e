#!/bin/bash
# Session 31, call 2 (issue 26 bar 1, where the 8 GB decode's CPU time goes): on this machine's 16
# cores, our CPU engine against llama.cpp's CPU backend on an 8-block Qwen3-30B-A3B-shaped file with a
# 1024-token vocabulary (the experts' reads dominate: 24 MB a block and token); one block's routed
# experts (qdot_moe_row) at 1-16 threads, in chunks of 8, 2 or 1 per thread (NVMEDIRECT_CPU_CHUNKS); then the 8 GB hybrid run of ours and llama.cpp -ncmoe 32.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH="/tmp/site:$PWD"
lscpu | grep -E "Model name|^CPU\(s\)|Thread|NUMA node\(s\)|L3"
mkdir -p /tmp/lb && tar xJf .peer/llama-bin.tar.xz -C /tmp/lb 2>/dev/null && rm -f /tmp/lb/libggml-cpu-sapphirerapids.so
export LD_LIBRARY_PATH=/tmp/lb:/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/cuda/lib64
python3 -c "
import dataclasses
from infer.synth import SHAPES, write_model
write_model('/tmp/moe8v.gguf', dataclasses.replace(SHAPES['qwen3-30b-a3b'], n_layers=8, vocab_size=1024), 'q4_k_m', seed=1)"
NVMEDIRECT_CPU_THREADS=16 timeout 100 python3 -m bench.cpu_decode --model /tmp/moe8v.gguf --engines native --pp 32 --tg 32 --threads 16 --repeat 2 --out $OUT/cpu-native-16.json 2>&1 | tail -2 | cut -c1-300
CUDA_VISIBLE_DEVICES= timeout 100 /tmp/lb/llama-bench -m /tmp/moe8v.gguf -p 32 -n 32 -ngl 0 -t 16 -r 2 -o json > $OUT/cpu-llama-16.json 2>/tmp/lc.err
echo "llama cpu rc=$?"; tail -2 /tmp/lc.err
python3 -c "import json,sys; print([(r['n_prompt'], r['n_gen'], round(r['avg_ts'],2), r['samples_ts']) for r in json.load(open(sys.argv[1]))])" $OUT/cpu-llama-16.json
cat > /tmp/moerow.py <<'PY'
import os, time, numpy as np
from infer.gguf_file import GGUFModel
from infer.model import load_transformer
model = load_transformer(GGUFModel('/tmp/moe8v.gguf'), packed=True)
rows = [model.weights._experts(i).row_experts for i in range(8)]
rng = np.random.default_rng(0)
x = rng.standard_normal(2048).astype(np.float32)
for th in (1, 4, 8, 16):
    ts = []
    for rep in range(80):
        o = rows[rep % 8]; o.threads = th
        ids = rng.choice(128, 8, replace=False)
        t = time.perf_counter(); o(x, ids); ts.append(time.perf_counter() - t)
    ms = float(np.median(ts[16:])) * 1e3
    print(f"chunks {os.environ.get('NVMEDIRECT_CPU_CHUNKS', 8)} threads {th}: {ms:.3f} ms a block's 8 experts, {24.5e-3 / ms:.1f} GB/s")
PY
for c in 8 2 1; do NVMEDIRECT_CPU_CHUNKS=$c timeout 60 python3 /tmp/moerow.py 2>&1 | grep -v "huge pages" >> $OUT/moe-row-threads.txt; done
cat $OUT/moe-row-threads.txt | grep threads
ls /tmp/nvmedirect-synth/ 2>/dev/null
if [ -f /tmp/nvmedirect-synth/synth-qwen3-30b-a3b-q4_k_m.gguf ]; then
  timeout 150 python3 -m bench.gpu_bench --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth --no-kernels --vram-budget 8GB --experts auto --pp 512 --tg 64 --out $OUT/bench-8GB.json > /tmp/b.txt 2>&1; echo "== 8GB rc=$?"; grep -i "tok/s\|error" /tmp/b.txt | head -3
  LD_PRELOAD=$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}') timeout 120 /tmp/lb/llama-bench -m /tmp/nvmedirect-synth/synth-qwen3-30b-a3b-q4_k_m.gguf -p 512 -n 64 -fa 1 -ngl 99 -ncmoe 32 -t 16 -r 2 -o json > $OUT/llama-ncmoe32.json 2>/dev/null
  echo "llama ncmoe rc=$?"; python3 -c "import json,sys; print([(r['n_prompt'], r['n_gen'], round(r['avg_ts'],2), r['samples_ts']) for r in json.load(open(sys.argv[1]))])" $OUT/llama-ncmoe32.json
  [ $SECONDS -lt 430 ] && { NVMEDIRECT_CPU_CHUNKS=2 timeout 150 python3 -m bench.gpu_bench --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth --no-kernels --vram-budget 8GB --experts auto --pp 512 --tg 64 --out $OUT/bench-8GB-chunks2.json > /tmp/b.txt 2>&1; echo "== 8GB chunks 2 rc=$?"; grep -i "tok/s\|error" /tmp/b.txt | head -3; }
fi
echo "elapsed ${SECONDS}s"
