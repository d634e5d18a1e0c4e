#!/bin/bash
# session 32, call 6 (same warm H100): the draft's chain without and with the resident products'
# weight loads before the PDL wait
export PYTHONPATH=/tmp/site:$PWD; for v in "NVMEDIRECT_PDL_PREFETCH=0" "X=default"; do env $v timeout 60 python3 -m bench.spec_profile --synth --depth 16 --nodes 1 --loop 0 --reps 9 --out $OUT/q-${v%%=*} 2>/dev/null | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print('$v', r['draft_chain_ms'], r['plain_step_ms'])"; done; rm -f $OUT/q-*/trace-*
