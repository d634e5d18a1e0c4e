#!/bin/bash
# session 32, call 5 (same warm H100): attention and friends of bench.kernel_sweep, the head splits
# of the 30B-A3B and of the Qwen2.5-Coder pair's shapes among them
export PYTHONPATH=/tmp/site:$PWD; timeout 150 python3 -m bench.kernel_sweep --skip-products --out $OUT/sweep-others.json > $OUT/sweep-others.txt 2>&1
