#!/bin/bash
# The one script to run on the GPU machine (H200): sets up carried wheels, compiles the kernels,
# runs the GPU tests, then benchmarks synthetic 8B models (Q4_K_M, Q8_0). Logs and JSON results go
# under $OUT; a summary table is printed last. No section aborts the run.
#
#   OUT=/path/to/out bash scripts/gpu-check.sh            # tests + 8B benchmarks (~6-9 min)
#   GPU_CHECK_SKIP_BENCH=1 bash scripts/gpu-check.sh      # call 1: compile + GPU tests (~3-5 min)
#   GPU_CHECK_SKIP_TESTS=1 bash scripts/gpu-check.sh      # call 2: 8B Q4_K_M and Q8_0 benchmarks (~4-6 min)
#   GPU_CHECK_70B=1 GPU_CHECK_SKIP_TESTS=1 ...            # also the 70B Q4_K_M (writes ~42 GB to disk)
#   NVMEDIRECT_GPU_MODELS=a.gguf:b.gguf                   # real models for tests/gpu/test_model.py
#   GPU_CHECK_ALL_GPU_TESTS=1                             # also `pytest -m gpu tests/` (every area)
#
# Carry: .whl (gguf, cffi, pycparser, pyudev wheels from /work/shared/device/fetch-wheels.sh), and
# for GPU_CHECK_ALL_GPU_TESTS also nvmedirect/_vfio_cffi.abi3.so (built here by scripts/bootstrap.sh;
# without it the pinned-DMA and reader tests fail to import).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
SYNTH_DIR=${SYNTH_DIR:-/tmp/nvmedirect-synth}
mkdir -p "$OUT" "$SYNTH_DIR"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
section() { echo; echo "=== $* ($(date +%T))"; }

section "environment"
export PYTHONPATH="$PWD"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        > "$OUT/pip.log" 2>&1 && note "wheels: installed $(ls .whl/*.whl | wc -l) into /tmp/site" \
        || note "wheels: install FAILED (see pip.log)"
    export PYTHONPATH="/tmp/site:$PWD"
fi
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python3 - <<'EOF' 2>&1 | tee "$OUT/env.txt"
import sys, numpy, cupy
print("python", sys.version.split()[0], "numpy", numpy.__version__, "cupy", cupy.__version__)
p = cupy.cuda.runtime.getDeviceProperties(0)
print("device", p["name"].decode(), "sm", p["major"], p["minor"], "SMs", p["multiProcessorCount"],
      "L2", p["l2CacheSize"] // 2**20, "MiB")
import gguf; print("gguf", getattr(gguf, "__version__", "?"))
EOF

section "kernel compile (RawModule, this device)"
timeout 90 python3 - <<'EOF' 2>&1 | tee "$OUT/compile.txt"
import time
from infer.gpu import kernels
for name in kernels.SOURCES:
    t = time.perf_counter()
    try:
        m = kernels.module(name)
        print(f"{name}: ok in {time.perf_counter() - t:.2f} s (backend {getattr(m, 'backend', '?')})")
    except Exception as e:
        print(f"{name}: FAILED {type(e).__name__}: {str(e)[:3000]}")
EOF
grep -q FAILED "$OUT/compile.txt" && note "compile: FAILED (compile.txt)" || note "compile: all modules ok"

if [ -z "${GPU_CHECK_SKIP_TESTS:-}" ]; then
    section "GPU tests"
    timeout 300 python3 -m pytest -q --timeout 150 -p no:cacheprovider --tb=short --durations=10 \
        tests/gpu/test_kernels.py tests/gpu/test_model.py tests/gpu/test_cli_gpu.py tests/infer/test_gpu_layout.py \
        tests/infer/test_synth.py tests/infer/test_kernels_compile.py \
        --junitxml="$OUT/pytest.xml" > "$OUT/pytest.log" 2>&1
    rc=$?
    grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -40
    tail -3 "$OUT/pytest.log"
    note "tests: exit $rc; $(tail -1 "$OUT/pytest.log")"
    if [ -n "${GPU_CHECK_ALL_GPU_TESTS:-}" ]; then  # every gpu-marked test of the project (other areas too)
        timeout 300 python3 -m pytest -q -m gpu --timeout 150 -p no:cacheprovider --tb=short \
            --continue-on-collection-errors tests/ > "$OUT/pytest-all-gpu.log" 2>&1
        note "all gpu-marked tests: exit $?; $(tail -1 "$OUT/pytest-all-gpu.log")"
    fi
fi

bench() {  # spec, timeout
    local spec=$1 limit=$2 name=${1/:/-}
    section "benchmark $spec"
    timeout "$limit" python3 -m bench.gpu_bench --synth "$spec" --synth-dir "$SYNTH_DIR" --pp 512 --tg 128 \
        --out "$OUT/bench-$name.json" > "$OUT/bench-$name.txt" 2>&1
    local rc=$?
    cat "$OUT/bench-$name.txt"
    if [ $rc -ne 0 ]; then note "bench $spec: FAILED (exit $rc, bench-$name.txt)"; return; fi
    python3 - "$OUT/bench-$name.json" "$spec" <<'EOF' | tee -a "$SUMMARY"
import json, sys
r = json.load(open(sys.argv[1]))
print(f"bench {sys.argv[2]:<10} pp512 {r['pp_tok_s']:>8} tok/s  tg128 {r['tg_tok_s']:>7} tok/s "
      f"(float {r['tg_float_tok_s']}, int8 {r['tg_int8_tok_s']})  "
      f"{r['achieved_GBps']} GB/s ({r['fraction_of_copy']:.0%} of copy {r['copy_GBps']})  "
      f"VRAM {r['vram_used_bytes'] / 2**30:.1f} GiB  step {r['step_us']} us (kernels {r.get('kernel_sum_us')} us)")
EOF
    rm -f "$SYNTH_DIR"/*.part
}

if [ -z "${GPU_CHECK_SKIP_BENCH:-}" ]; then
    bench 8b:q4_k_m 200
    bench 8b:q8_0 200
    if [ -n "${GPU_CHECK_70B:-}" ]; then
        rm -f "$SYNTH_DIR"/synth-8b-*.gguf  # disk: 64 GB in all
        bench 70b:q4_k_m 500
    fi
fi

section "summary"
cat "$SUMMARY"
