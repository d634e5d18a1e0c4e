#!/bin/bash
# session 32, call 7 (a fresh machine): the head-split tests and the attention sweep again, after the
# split kernels of head size 64 got __launch_bounds__(128, 1) (they spilled before)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels.py -k "head_split or forced_rows" 2>&1 | tail -1
timeout 60 python3 -m bench.kernel_sweep --skip-products --out $OUT/sweep-others.json > $OUT/sweep-others.txt 2>&1
grep -h '"splits"' $OUT/sweep-others.txt | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line); print(r['kernel'][10:60], r['case'], r['splits'], r['default'], r['us'])" | grep -v 30B
