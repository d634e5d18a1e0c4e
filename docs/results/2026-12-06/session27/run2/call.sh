#!/bin/bash
# Next lease, call 2 (after callM, llama.cpp built): llama-bench on the 30B-A3B, all on the GPU and
# -ncmoe down to what fits 8 GB (scripts/gpu-check.sh's loop); then the 70B file written for the
# issue 28 comparison (callF.sh / GPU_CHECK_70B_LLAMA_ONLY in a third call).
set -u
export PYTHONPATH="/tmp/site:$PWD"
while [ ! -e /tmp/lc/done ] && [ $SECONDS -lt 420 ]; do sleep 5; done; cat /tmp/lc/done
LLAMA=/tmp/lc/llama.cpp/build/bin/llama-bench; moe=/tmp/nvmedirect-synth/synth-qwen3-30b-a3b-q4_k_m.gguf
timeout 200 $LLAMA -m $moe -p 512 -n 64 -ngl 99 -fa 1 -r 2 -o json > $OUT/llama-moe-ngl99.json 2> $OUT/llama-moe-ngl99.log
echo "ngl99 rc=$?"; python3 -c "import json,sys; print([(r['n_prompt'], r['n_gen'], round(r['avg_ts'],2)) for r in json.load(open(sys.argv[1]))])" $OUT/llama-moe-ngl99.json
for n in 34 32 30; do
  timeout 150 $LLAMA -m $moe -p 512 -n 64 -ngl 99 -ncmoe $n -t $(nproc) -fa 1 -r 1 -o json > $OUT/llama-moe-ncmoe$n.json 2> $OUT/llama-moe-ncmoe$n.log &
  pid=$!; peak=0
  while kill -0 $pid 2>/dev/null; do u=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1); [ $u -gt $peak ] && peak=$u; sleep 0.2; done
  wait $pid; echo "ncmoe $n rc=$? peak $peak MiB"
  python3 -c "import json,sys; print([(r['n_prompt'], r['n_gen'], round(r['avg_ts'],2)) for r in json.load(open(sys.argv[1]))])" $OUT/llama-moe-ncmoe$n.json
  [ $peak -gt 7629 ] && break
done
echo "elapsed ${SECONDS}s"
# Disk: the 30B-A3B file goes; the 70B is written in the background for the next call (callO.sh).
rm -f $moe; mkdir -p /tmp/r70
if [ ! -e /tmp/r70/model.started ]; then
  touch /tmp/r70/model.started
  setsid bash -c "PYTHONPATH=/tmp/site:$PWD python3 -m bench.streaming_bench --out /tmp/r70/model --sections model \
    > /tmp/r70/model.log 2>&1; echo rc=\$? > /tmp/r70/model.done" > /dev/null 2>&1 < /dev/null &
fi
echo "elapsed ${SECONDS}s (70B write started)"
