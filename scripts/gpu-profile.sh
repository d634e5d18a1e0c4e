#!/bin/bash
# One device call: where the 8B's decode step and 512-row prompt spend their time (bench.pass_profile,
# kernel by kernel), the FP64 count of a pass, and the streamed-batch budget test under the CuPy
# allocation tracer (scripts/alloc_trace). Everything lands in $OUT/profile.tgz (the device tool
# brings back few files).
#   OUT=/path bash scripts/gpu-profile.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-profile}
R=/tmp/profile-results
mkdir -p "$OUT" "$R"
GPU_CHECK_SKIP_TESTS=1 GPU_CHECK_SKIP_BENCH=1 GPU_CHECK_SKIP_COMPILE=1 OUT=$R bash scripts/gpu-check.sh > "$R/setup.log" 2>&1
export PYTHONPATH="/tmp/site:$PWD"
if [ -n "${PROFILE_TESTS:-}" ]; then  # e.g. PROFILE_TESTS="tests/gpu/test_kernels.py"
    # shellcheck disable=SC2086
    timeout "${PROFILE_TESTS_SECONDS:-240}" python3 -m pytest -q -p no:cacheprovider --tb=short $PROFILE_TESTS \
        > "$R/tests.log" 2>&1
    echo "tests exit $?"; grep -E "^(FAILED|ERROR)" "$R/tests.log" | head -20; tail -2 "$R/tests.log"
fi
timeout 240 python3 -m bench.pass_profile --synth 8b:q4_k_m --vram-budget 8GB --pp 512 --position 64 --steps 8 \
    --out "$R/profile-8b.json" --trace "$R/trace" > "$R/profile-8b.txt" 2>&1
echo "profile exit $?"; head -70 "$R/profile-8b.txt"
for group in ${PROFILE_ATTN_GROUPS:-}; do  # attention timings with blocks of `group` rows
    NVMEDIRECT_ATTN_GROUP=$group timeout 120 python3 -m bench.kernel_sweep --skip-products \
        --out "$R/sweep-attn-group$group.json" > "$R/sweep-attn-group$group.txt" 2>&1
    echo "attention, group $group:"; grep attention "$R/sweep-attn-group$group.txt" | cut -c1-220
done
if [ -n "${PROFILE_QMM_SWEEP:-}" ]; then  # the products at 64 and 512 rows: the tuned kernels, then variants
    for variant in "default||" "2stages-3blocks|8:4,2;4:4,2|3"; do
        IFS='|' read -r label tuning blocks <<< "$variant"
        NVMEDIRECT_QMM_TUNING=$tuning NVMEDIRECT_QMM_MIN_BLOCKS=$blocks timeout 150 python3 -m bench.kernel_sweep \
            --skip-others --rows 64,512 --default-only --out "$R/sweep-qmm-$label.json" > "$R/sweep-qmm-$label.txt" 2>&1
        echo "qmm $label: exit $?"; grep '"matrix"' "$R/sweep-qmm-$label.txt" | cut -c1-170
    done
fi
if [ -n "${PROFILE_NCU:-}" ]; then  # e.g. PROFILE_NCU="gate_up:qmm_k4_n8"
    matrix=${PROFILE_NCU%%:*}; kernel=${PROFILE_NCU##*:}
    timeout 240 ncu --clock-control none --set full -k "regex:$kernel" -c 1 python3 -m bench.kernel_sweep --skip-others \
        --matrices "$matrix" --rows 512 --default-only > "$R/ncu-$kernel.txt" 2>&1
    echo "ncu exit $?"; grep -E "Duration|Throughput|Warp Cycles|Issue|Stall|Occupancy|Registers|Shared Memory|Bank|Eligible|Active Warps|L1|Executed Ipc|Pipe" "$R/ncu-$kernel.txt" | head -60
fi
if [ -z "${PROFILE_SKIP_BUDGET:-}" ]; then
    mkdir -p "$R/alloc"
    ALLOC_TRACE_OUT="$R/alloc" PYTHONPATH="$PWD/scripts/alloc_trace:$PYTHONPATH" timeout 200 python3 -m pytest -q -s \
        -p no:cacheprovider --tb=short tests/gpu/test_budget.py -k "batch_of_sequences" > "$R/budget.log" 2>&1
    echo "budget test exit $?"; tail -5 "$R/budget.log"
    for f in "$R"/alloc/*.txt; do [ -f "$f" ] && { echo "== $f"; head -25 "$f"; }; done
fi
rm -f "$R"/trace.*.json.gz
gzip -f "$R"/trace.*.json 2>/dev/null
tar czf "$OUT/profile.tgz" -C "$R" .
