#!/bin/bash
# Session 31, call 6 (a new lease, short of device time): the GPU tests of PDL, the MoE and the
# streamed models with NVMEDIRECT_PDL_PREFETCH=1 (resident products load their first weights
# before the wait; streamed ones must not).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH="/tmp/site:$PWD"
nvidia-smi --query-gpu=name --format=csv,noheader
NVMEDIRECT_PDL_PREFETCH=1 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_model.py -k "wait or graph_generation" tests/gpu/test_moe_gpu.py tests/gpu/test_streaming.py > $OUT/pytest-prefetch.txt 2>&1
echo "tests rc=$?"; tail -2 $OUT/pytest-prefetch.txt; grep -E "^(FAILED|E )" $OUT/pytest-prefetch.txt | head -10
echo "elapsed ${SECONDS}s"
