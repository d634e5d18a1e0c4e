#!/bin/bash
# Lease call 4: where the 30B-A3B's decode step goes, kernel by kernel (experts in VRAM at 24 GB).
set -u
export PYTHONPATH="/tmp/site:$PWD"
rm -f /tmp/nvmd-bench/synth-llama70b-*.gguf
python3 -c "import torch; print(torch.__version__)"
timeout 400 python3 -m bench.pass_profile --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth --vram-budget 24GB \
  --pp 64 --steps 8 --out $OUT/profile-30b-a3b-24GB.json > $OUT/profile-30b-a3b-24GB.txt 2>&1
echo "profile rc=$?"; tail -60 $OUT/profile-30b-a3b-24GB.txt
echo "elapsed ${SECONDS}s"
