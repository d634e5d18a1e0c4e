#!/bin/bash
# next lease (written in session 37, not yet run): a mixture of experts streamed on the GPU with the
# CPU's blocks' experts from the tiered cache (issue 26; infer/tiers/expert_session.py).
#   carry .whl and the two .so:  OUT=$OUT/moe bash docs/results/2026-12-07/session37/runH.sh tests
#   then:                        OUT=$OUT/moe bash docs/results/2026-12-07/session37/runH.sh bench
# tests: the stand-in's checks on the device (tiered logits = resident logits bit for bit, greedy
# speculation = plain text). bench: the synthetic Qwen3-30B-A3B Q4_K_M at --vram-budget 8GB, the CPU's
# blocks' experts from the file's pages (resident, --expert-stream off) against the tiered cache at
# --ram-budget 8GB and 3GB over --tier-c file: decode, the storage roofline of the same run, hit rates.
# The two --benchmark paths differ: the resident one times the device's own decode loop, the tiered
# one (infer/tiers/expert_session.py) host-driven steps fed a random text; compare with that in mind.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 NVMEDIRECT_CACHE=/tmp/nvd-cache
case "${1:-}" in
tests)
    timeout 400 python3 -m pytest -q -p no:cacheprovider --tb=short tests/gpu/test_moe_gpu.py -k "tiered or speculation" \
        > "$OUT/pytest-moe-tiered.txt" 2>&1
    echo "tiered MoE GPU tests rc=$?"; tail -n 8 "$OUT/pytest-moe-tiered.txt" ;;
bench)
    lscpu | grep -E "Model name|^CPU\(s\)" | tee "$OUT/cpu.txt"
    M=/tmp/nvmedirect-synth/synth-qwen3-30b-a3b-q4_k_m.gguf
    [ -f "$M" ] || timeout 500 python3 -c "
from pathlib import Path
from bench.gpu_bench import synth_path
print(synth_path('qwen3-30b-a3b:q4_k_m', Path('/tmp/nvmedirect-synth')))"
    common="-m $M --device gpu --vram-budget 8GB -n 64 --benchmark --json"
    timeout 200 python3 -c "from infer.cli import main; main()" $common --expert-stream off > "$OUT/resident-8GB.json" 2> "$OUT/resident-8GB.err"
    echo "resident rc=$?"; tail -n 3 "$OUT/resident-8GB.err"
    for ram in 8GB 3GB; do
        timeout 200 python3 -c "from infer.cli import main; main()" $common --streaming --ram-budget $ram > "$OUT/tiered-$ram.json" 2> "$OUT/tiered-$ram.err"
        echo "tiered $ram rc=$?"; tail -n 6 "$OUT/tiered-$ram.err"; cat "$OUT/tiered-$ram.json"
    done ;;
*) echo "usage: runH.sh tests|bench" >&2; exit 2 ;;
esac
