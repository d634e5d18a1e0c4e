#!/bin/bash
# session 32, call 4 (same warm H100): the GPU tests of the generation loops the lead rows changed
export PYTHONPATH=/tmp/site:$PWD; timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_model.py tests/gpu/test_streaming.py -k "generation or decode or draft or chain or greedy or lone" -x 2>&1 | tail -3
