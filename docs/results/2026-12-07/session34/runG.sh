#!/bin/bash
# session 34, lease 4: the stages' GPU tests (resident, micro-batches, streamed), then the CLI on the
# synthetic 8B Q4_K_M streamed at 4 GB as one stage (--gpus 0) and as the one-GPU engine
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_stages_gpu.py > "$OUT/pytest-stages.txt" 2>&1
tail -n 3 "$OUT/pytest-stages.txt"
M=/tmp/nvmedirect-synth/synth-8b-q4_k_m.gguf
[ -f $M ] || { mkdir -p /tmp/nvmedirect-synth; python3 -m infer.synth --shape 8b --type q4_k_m -o $M > /dev/null 2>&1; }
for f in "--streaming --vram-budget 4GB" "--streaming --gpus 0 --vram-budget 4GB"; do
    echo "== $f" | tee -a "$OUT/cli.txt"
    timeout 150 python3 -c "from infer.cli import main; main()" -m $M -p "w1 w2 w3" -n 32 -t 0 $f > "$OUT/o.txt" 2> "$OUT/e.txt"
    echo "exit $?" | tee -a "$OUT/cli.txt"; head -c 400 "$OUT/o.txt" | tee -a "$OUT/cli.txt"; echo | tee -a "$OUT/cli.txt"
    tr '\r' '\n' < "$OUT/e.txt" | grep -E "stage|tok/s|Error|layers wholly|budget" | head -12 | tee -a "$OUT/cli.txt"
done
