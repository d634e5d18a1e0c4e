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
# the host's cost of a streamed decode step, per layer and as one graph: a 24-layer model of small
# matrices, every layer streamed from pinned RAM, so a step's time is mostly its queueing
timeout 90 python3 - <<'PY' 2>&1 | tee "$OUT/host-step.txt"
import os, time
from pathlib import Path
import numpy as np
from infer.synth import Shape, write_model
from tests.gpu import test_streaming as ts
p = Path("/tmp/host-step.gguf")
write_model(p, Shape(n_layers=24, dim=512, ffn_dim=1536, n_heads=8, n_kv_heads=2, vocab_size=2000,
                     context_length=512), "q4_k_m", seed=3)
for on in ("0", "1", "0", "1"):
    os.environ["NVMEDIRECT_STREAM_GRAPH"] = on
    s = ts.open_session(p, 0.0, 1.5, tier_b="pinned")
    m = s.engine.model
    cache = m.new_cache(ts.CTX)
    m.forward(np.arange(3, 13), cache)
    out = [int(np.argmax(m.forward(np.array([20 + t]), cache))) for t in range(5)]
    t0 = time.perf_counter()
    out += [int(np.argmax(m.forward(np.array([30 + t]), cache))) for t in range(40)]
    dt = (time.perf_counter() - t0) / 40
    print(f"NVMEDIRECT_STREAM_GRAPH={on}: {dt * 1e3:.3f} ms a decode step, {len(s.plan.streamed)} streamed tensors, "
          f"tokens {out[-5:]}")
    s.close()
PY
