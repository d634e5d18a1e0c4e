#!/bin/bash
# Lease call (session 28, 2): 8 GB (experts of the last blocks in VRAM; the CPU's blocks stream for
# long prompts and share each token's picks with the GPU) with the split measured, the split off
# (stream only) and everything off (session 27's path), and llama.cpp on the same file in the same lease.
set -u
export PYTHONPATH="/tmp/site:$PWD"
export LD_LIBRARY_PATH=/tmp/lb:/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/cuda/lib64
moe=/tmp/nvmedirect-synth/synth-qwen3-30b-a3b-q4_k_m.gguf
run8() {  # name, extra args...
  local name=$1; shift
  timeout 170 python3 -m bench.gpu_bench --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth \
    --vram-budget 8GB --experts auto --pp 512 --tg 64 --no-kernels "$@" --out $OUT/bench-8GB-$name.json > /tmp/bench-8GB-$name.txt 2>&1
  echo "== 8GB $name rc=$?"; grep -i "error\|Traceback" /tmp/bench-8GB-$name.txt | head -3; tail -3 /tmp/bench-8GB-$name.txt
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d.get(k) for k in ('pp_tok_s','pp_canonical_tok_s','tg_tok_s','peak_vram_bytes','expert_stream_bytes')}); print(d.get('experts'))" $OUT/bench-8GB-$name.json
}
run8 auto
export LD_PRELOAD=$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}')
timeout 150 /tmp/lb/llama-bench -m $moe -p 512 -n 64 -ngl 99 -ncmoe 32 -t $(nproc) -fa 1 -r 2 -o json > $OUT/llama-ncmoe32.json 2> $OUT/llama.log &
pid=$!; peak=0
while kill -0 $pid 2>/dev/null; do u=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1); [ $u -gt $peak ] && peak=$u; sleep 0.2; done
wait $pid; echo "llama ncmoe 32 rc=$? peak $peak MiB"
python3 -c "import json,sys; print([(r['n_prompt'], r['n_gen'], round(r['avg_ts'],2), r['samples_ts']) for r in json.load(open(sys.argv[1]))])" $OUT/llama-ncmoe32.json
timeout 100 /tmp/lb/llama-bench -m $moe -p 512 -n 64 -ngl 99 -fa 1 -r 2 -o json > $OUT/llama-ngl99.json 2>> $OUT/llama.log
echo "llama ngl99 rc=$?"
python3 -c "import json,sys; print([(r['n_prompt'], r['n_gen'], round(r['avg_ts'],2), r['samples_ts']) for r in json.load(open(sys.argv[1]))])" $OUT/llama-ngl99.json
unset LD_PRELOAD
NVMEDIRECT_EXPERT_GPU_SLOTS=0 run8 slots0
run8 off --expert-stream off
echo "elapsed ${SECONDS}s"
