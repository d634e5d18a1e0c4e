#!/bin/bash
# Session 29, call 3: 32 sequences decoded together at 8 GB (issue 26 bar 1's third part, ours),
# then the streaming and model GPU tests (qgemv's rows a warp under the streamed layers).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH="/tmp/site:$PWD"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
(setsid python3 -c "from pathlib import Path; from bench.gpu_bench import synth_path; synth_path('qwen3-30b-a3b:q4_k_m', Path('/tmp/nvmedirect-synth'))" > /tmp/synth.log 2>&1 &)
sleep 1; while pgrep -f "synth_path" > /dev/null; do sleep 2; done
timeout 200 python3 -m bench.gpu_bench --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth --no-kernels --vram-budget 8GB --experts auto --pp 512 --tg 64 --batch 32 --out $OUT/bench-8GB-batch32.json > $OUT/bench-8GB-batch32.txt 2>&1
echo "== 8GB batch 32 rc=$?"; grep -i "tok/s\|error\|peak\|sequences\|identical" $OUT/bench-8GB-batch32.txt | head -8
timeout 230 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_streaming.py tests/gpu/test_model.py > $OUT/pytest.txt 2>&1
echo "tests rc=$?"; tail -2 $OUT/pytest.txt; grep -E "^(FAILED|E )" $OUT/pytest.txt | head -10
echo "elapsed ${SECONDS}s"
# The batch bench above ran past its 200 s (the check of each sequence alone at 8 GB: 32 x 64
# steps); this run's bench-8GB-batch32.* come from the follow-up command on the same warm machine:
#   timeout 330 python3 -u -m bench.gpu_bench --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth \
#     --no-kernels --vram-budget 8GB --experts auto --pp 512 --tg 64 --batch 32 --batch-new 16 \
#     --out $OUT/bench-8GB-batch32.json
