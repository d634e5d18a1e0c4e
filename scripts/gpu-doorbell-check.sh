#!/bin/bash
# GPU-initiated NVMe I/O on the GPU machine (issue 15): builds the controller emulator (gcc), compiles
# the doorbell kernels for this device, runs the CPU emulator tests, the GPU doorbell tests and the
# GPU-vs-CPU commands/s benchmark. Logs and JSON go under $OUT; a summary is printed last. No section
# aborts the run; the whole script stays under 3 minutes.
#
#   OUT=/path/to/out bash scripts/gpu-doorbell-check.sh
#
# Carry: .whl (cffi and pycparser wheels for the emulator's loader, as for scripts/gpu-check.sh).
# Nothing else: the emulator is compiled here with gcc and loaded through cffi's ABI mode, and these
# tests do not import the VFIO bindings (nvmedirect/_vfio_cffi).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-doorbell-check}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
section() { echo; echo "=== $* ($(date +%T))"; }
export NVMEDIRECT_CACHE="$OUT/cache"  # the emulator library is built afresh and kept with the results

section "environment"
export PYTHONPATH="$PWD"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        > "$OUT/pip.log" 2>&1 && note "wheels: installed $(ls .whl/*.whl | wc -l) into /tmp/site" \
        || note "wheels: install FAILED (see pip.log)"
    export PYTHONPATH="/tmp/site:$PWD"
else
    note "wheels: no .whl/ carried (cffi must already be importable)"
fi
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
uname -r > "$OUT/kernel.txt"
timeout 60 python3 - <<'EOF' 2>&1 | tee "$OUT/env.txt"
import sys, numpy, cffi
print("python", sys.version.split()[0], "numpy", numpy.__version__, "cffi", cffi.__version__)
import cupy
p = cupy.cuda.runtime.getDeviceProperties(0)
print("cupy", cupy.__version__, "device", p["name"].decode(), "sm", p["major"], p["minor"])
EOF

section "build: emulator (gcc) and doorbell kernels (NVRTC, else nvcc)"
timeout 90 python3 - <<'EOF' > "$OUT/build.txt" 2>&1
import time
t = time.perf_counter()
try:
    from nvmedirect.emulator import library, source_hash
    library()
    print(f"emulator: ok in {time.perf_counter() - t:.2f} s (sources {source_hash()})")
except Exception as e:
    print(f"emulator: FAILED {type(e).__name__}: {e}")
t = time.perf_counter()
try:
    from nvmedirect.gpu.doorbell import module
    m = module()
    print(f"kernels: ok in {time.perf_counter() - t:.2f} s (backend {getattr(m, 'backend', '?')})")
except Exception as e:
    print(f"kernels: FAILED {type(e).__name__}: {str(e)[:4000]}")
EOF
cat "$OUT/build.txt"
grep -q FAILED "$OUT/build.txt" && note "build: FAILED (build.txt)" || note "build: emulator and kernels ok"

section "CPU tests of the emulator (no GPU involved)"
# tests/nvme/conftest.py imports the VFIO bindings, which are not carried: load the two files alone.
timeout 60 python3 -m pytest -q -p no:cacheprovider --noconftest --tb=short -o addopts="" \
    tests/nvme/test_emulator.py tests/nvme/test_doorbell_compile.py > "$OUT/pytest-cpu.log" 2>&1
note "cpu emulator tests: exit $?; $(tail -1 "$OUT/pytest-cpu.log")"

section "GPU doorbell tests"
timeout 120 python3 -m pytest -q -s -p no:cacheprovider --tb=short --durations=10 -o addopts="" \
    tests/gpu/test_doorbell_gpu.py --junitxml="$OUT/pytest-gpu.xml" > "$OUT/pytest-gpu.log" 2>&1
rc=$?
grep -E "^(FAILED|ERROR)" "$OUT/pytest-gpu.log" | head -20
tail -15 "$OUT/pytest-gpu.log"
note "gpu doorbell tests: exit $rc; $(tail -1 "$OUT/pytest-gpu.log")"

section "benchmark: GPU-initiated vs CPU-initiated commands/s"
timeout 60 python3 -m bench.doorbell_bench --commands 20000 --out "$OUT/doorbell-bench.json" \
    > "$OUT/bench.txt" 2>&1
note "bench: exit $? (doorbell-bench.json)"
cat "$OUT/bench.txt"
python3 - "$OUT/doorbell-bench.json" <<'EOF' 2>&1 | tee -a "$SUMMARY"
import json, sys
rows = json.load(open(sys.argv[1]))["results"]
for r in rows:
    tail = r.get("error") or f"{r['commands_per_s']:>9} cmd/s  failed {r['failed']}  violations {r['violations']}"
    print(f"bench {r['side']} {r['queues']}x QD{r['queue_depth']:<4} {tail}")
EOF

section "probe: check --probe-gpu-mmio (no NVMe here: the blocker line)"
timeout 30 python3 -c "from nvmedirect.cli import main; main()" check --probe-gpu-mmio > "$OUT/probe.txt" 2>&1
note "probe: exit $? ($(head -1 "$OUT/probe.txt"))"

section "summary"
cat "$SUMMARY"
