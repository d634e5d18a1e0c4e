#!/bin/bash
# next lease (written in session 36, not yet run): small uploads by the SMs (NVMEDIRECT_SM_UPLOADS=1).
#   part 1 (carry .whl, .carry and the two .so):  bash docs/results/2026-12-07/session36/runG.sh tests
#   then the 29 pieces (scripts/gpu-spec-e2e.sh piece), then:  bash docs/results/2026-12-07/session36/runG.sh e2e
# e2e: prose with a ring of 20 slots, SM uploads on and off, and the default ring, then code; the
# question is whether the draft's fixed cost falls back to the 8-slot figure while the verify keeps
# the 20-slot one (session 36: 5.65 / 5.99 ms a pass against 3.59 / 8.72).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
case "${1:-}" in
tests)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
    mkdir -p ~/.cache/nvmedirect/humaneval && cp .carry/HumanEval.jsonl.gz ~/.cache/nvmedirect/humaneval/
    export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
    timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short tests/gpu/test_uploads.py > "$OUT/pytest-uploads.txt" 2>&1
    echo "uploads tests rc=$?"; tail -n 8 "$OUT/pytest-uploads.txt"
    timeout 120 python3 -m bench.upload_bench --out "$OUT/upload.json" 2>&1 | tail -n 14 ;;
e2e)
    for run in "1 20 prose" "0 20 prose" "1 8 prose" "1 20 humaneval"; do
        set -- $run
        SMS=$1 GRAPH=0 SHAPES=auto SETS=$3 SLOTS=$2 EACH=140 OUT=$OUT/sms$1-slots$2 \
            bash docs/results/2026-12-07/session36/runE.sh 2>&1 | grep -v '^{"prompt"' | tail -n 2
    done ;;
*) echo "usage: runG.sh tests|e2e" >&2; exit 2 ;;
esac
