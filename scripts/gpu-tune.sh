#!/bin/bash
# Kernel tuning on the GPU machine: the product and attention kernel tests, bench.kernel_sweep (every
# qmm/qgemv variant on the 8B shapes), then the 8B Q4_K_M inside 8 GB (with 32 sequences) and 6 GB.
# Results under $OUT. Carry .whl (/work/shared/device/fetch-wheels.sh).
export PYTHONUNBUFFERED=1; python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD; S=/tmp/nvmedirect-synth
timeout 200 python3 -m pytest -q -x --timeout 150 -p no:cacheprovider --tb=short tests/gpu/test_kernels.py -k "product or attention or rope" > $OUT/kt.log 2>&1; tail -3 $OUT/kt.log
timeout 330 python3 -m bench.kernel_sweep --out $OUT/sweep.json > $OUT/sweep.txt 2>&1; grep -E "^best|variants|^\{\"kernel" $OUT/sweep.txt | head -90
(python3 -c "from bench.gpu_bench import synth_path; from pathlib import Path; synth_path('8b:q4_k_m', Path('$S'))") 2>&1 | tail -1
timeout 200 python3 -m bench.gpu_bench --synth 8b:q4_k_m --synth-dir $S --vram-budget 8GB --ctx 4096 --batch 32 --out $OUT/b8.json > $OUT/b8.txt 2>&1; head -8 $OUT/b8.txt; grep -A30 qkv $OUT/b8.txt | head -20
timeout 120 python3 -m bench.gpu_bench --synth 8b:q4_k_m --synth-dir $S --vram-budget 6GB --ctx 1024 --no-kernels --out $OUT/b6.json > $OUT/b6.txt 2>&1; head -6 $OUT/b6.txt
