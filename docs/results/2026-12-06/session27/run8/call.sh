#!/bin/bash
# .devrun/cpu_tier_old.py was `git show 5602832:infer/tiers/cpu_tier.py` (the code kept after the revert)
# Same lease as callS/callT: llama-bench (prebuilt; the driver preloaded: the stub it was linked
# against carried no symbols), all on the GPU and -ncmoe 32; then the 8 GB A/B again, old first.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH="/tmp/site:$PWD"
mkdir -p /tmp/lb && tar xJf .peer/llama-bin.tar.xz -C /tmp/lb; rm -f /tmp/lb/libggml-cpu-sapphirerapids.so
export LD_LIBRARY_PATH="/tmp/lb:/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export LD_PRELOAD=$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}'); echo "preload $LD_PRELOAD"
moe=/tmp/nvmedirect-synth/synth-qwen3-30b-a3b-q4_k_m.gguf
timeout 100 /tmp/lb/llama-bench -m $moe -p 512 -n 64 -ngl 99 -fa 1 -r 2 -o json > $OUT/llama-moe-ngl99.json 2> $OUT/llama-moe-ngl99.log
echo "llama ngl99 rc=$?"; grep -i "backend\|device\|error" $OUT/llama-moe-ngl99.log | head -4
python3 -c "import json,sys; print([(r['n_prompt'], r['n_gen'], round(r['avg_ts'],2), r['samples_ts']) for r in json.load(open(sys.argv[1]))])" $OUT/llama-moe-ngl99.json
timeout 100 /tmp/lb/llama-bench -m $moe -p 512 -n 64 -ngl 99 -ncmoe 32 -t $(nproc) -fa 1 -r 2 -o json > $OUT/llama-moe-ncmoe32.json 2> $OUT/llama-moe-ncmoe32.log &
pid=$!; peak=0
while kill -0 $pid 2>/dev/null; do u=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1); [ $u -gt $peak ] && peak=$u; sleep 0.2; done
wait $pid; echo "llama ncmoe 32 rc=$? peak $peak MiB"
python3 -c "import json,sys; print([(r['n_prompt'], r['n_gen'], round(r['avg_ts'],2), r['samples_ts']) for r in json.load(open(sys.argv[1]))])" $OUT/llama-moe-ncmoe32.json
unset LD_PRELOAD
cp infer/tiers/cpu_tier.py /tmp/cpu_tier_new.py
for v in old new; do
  [ $v = old ] && cp .devrun/cpu_tier_old.py infer/tiers/cpu_tier.py || cp /tmp/cpu_tier_new.py infer/tiers/cpu_tier.py
  timeout 110 python3 -m bench.gpu_bench --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth \
    --vram-budget 8GB --experts auto --pp 512 --tg 64 --no-kernels --out $OUT/gpu-bench-8GB-$v.json > $OUT/gpu-bench-8GB-$v.txt 2>&1
  echo "== 8GB $v rc=$?"; grep -i "tok/s\|error" $OUT/gpu-bench-8GB-$v.txt | head -3
done
echo "elapsed ${SECONDS}s"
