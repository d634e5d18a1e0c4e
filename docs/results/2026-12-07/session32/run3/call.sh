#!/bin/bash
# session 32, call 3 (the same warm H100 as run 2; the synthetic pair already written there): the
# draft's chain with the head splits off, with PDL off, and as it is (the last one's files were left
# behind by the device tool's file count; its line is in output.txt)
export PYTHONPATH=/tmp/site:$PWD; for v in "NVMEDIRECT_ATTN_SPLITS=1" "NVMEDIRECT_PDL=0" "X=default"; do env $v timeout 60 python3 -m bench.spec_profile --synth --depth 16 --nodes 1 --loop 0 --reps 9 --out $OUT/p-${v%%=*} 2>/dev/null | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print('$v', r['draft_chain_ms'], r['plain_step_ms'])"; done
# (then a per-kernel sum of p-X/trace-draft-chain-16.json.gz, in output.txt)
