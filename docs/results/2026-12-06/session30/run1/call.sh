#!/bin/bash
# Session 30, call 1: the fused decode launches (router+norm, gated down, combine+next norm, rope in
# attention): their
# tests and the MoE model tests, 24 GB decode fused vs NVMEDIRECT_DECODE_FUSED=0 (same lease), the
# decode profile; then test_model (0008a19's prepare_kernels) with the time left.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH="/tmp/site:$PWD"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
(setsid python3 -c "from pathlib import Path; from bench.gpu_bench import synth_path; synth_path('qwen3-30b-a3b:q4_k_m', Path('/tmp/nvmedirect-synth'))" > /tmp/synth.log 2>&1 &)
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fused_decode.py tests/gpu/test_moe_kernels.py tests/gpu/test_moe_gpu.py tests/gpu/test_kernels.py -k "not sample" > $OUT/pytest.txt 2>&1
echo "tests rc=$?"; tail -2 $OUT/pytest.txt; grep -E "^(FAILED|E )" $OUT/pytest.txt | head -10
while pgrep -f "synth_path" > /dev/null; do sleep 2; done
B="python3 -m bench.gpu_bench --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth --no-kernels --vram-budget 24GB --experts gpu --pp 512 --tg 64"
timeout 90 $B --out $OUT/bench-24GB.json > /tmp/b.txt 2>&1; echo "== 24GB fused rc=$?"; grep -i "tok/s\|error" /tmp/b.txt | head -3
NVMEDIRECT_DECODE_FUSED=0 timeout 90 $B --out $OUT/bench-24GB-unfused.json > /tmp/b.txt 2>&1; echo "== 24GB unfused rc=$?"; grep -i "tok/s\|error" /tmp/b.txt | head -3
timeout 90 $B --out /tmp/bench-24GB-fused2.json > /tmp/b.txt 2>&1; echo "== 24GB fused again rc=$?"; grep -i "tok/s\|error" /tmp/b.txt | head -3
timeout 80 python3 -m bench.pass_profile --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth --vram-budget 24GB --pp 512 --steps 2 --out /tmp/profile.json > $OUT/profile.txt 2>&1
echo "profile rc=$?"; sed -n '/^decode/,/^prompt:/p' $OUT/profile.txt | head -20
tar czf $OUT/extra.tgz -C /tmp bench-24GB-fused2.json profile.json 2>/dev/null
echo "elapsed ${SECONDS}s"
left=$((570 - SECONDS))
if [ $left -gt 60 ]; then
  timeout $left python3 -m pytest -q -p no:cacheprovider tests/gpu/test_model.py -x > $OUT/pytest-model.txt 2>&1
  echo "test_model rc=$?"; tail -2 $OUT/pytest-model.txt; grep -E "^(FAILED|E )" $OUT/pytest-model.txt | head -10
fi
echo "elapsed ${SECONDS}s"
