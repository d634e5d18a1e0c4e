#!/bin/bash
# session 35, lease 3: the streamed pass as one CUDA graph (NVMEDIRECT_STREAM_GRAPH=1) against the
# per-layer path on the GPU, the stages after the link moved first, drafting ahead with 4 branches
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
timeout 100 python3 -m pytest -q -p no:cacheprovider --tb=short tests/gpu/test_streaming.py -k one_graph \
    > "$OUT/pytest-stream-graph.txt" 2>&1; echo "stream graph rc=$?"; tail -n 12 "$OUT/pytest-stream-graph.txt"
timeout 90 python3 -m pytest -q -p no:cacheprovider --tb=short tests/gpu/test_stages_gpu.py \
    "tests/gpu/test_speculative_gpu.py::test_drafting_ahead_makes_the_trees_of_drafting_without" \
    > "$OUT/pytest-stages.txt" 2>&1; echo "stages rc=$?"; tail -n 6 "$OUT/pytest-stages.txt"
