#!/bin/bash
# run 7 (same lease as run 6, right after it): where the 24 GB prompt pass goes
export PYTHONPATH="/tmp/site:$PWD"
python3 -m bench.pass_profile --synth qwen3-30b-a3b:q4_k_m --synth-dir /tmp/nvmedirect-synth --vram-budget 24GB --pp 512 --steps 2 --out $OUT/profile-pp512.json
