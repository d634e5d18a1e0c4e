#!/bin/bash
# session 33, call D (not run: no device time left; for the next lease, after the pieces): the real
# pair's draft chain and verify passes, then a 4 x 4 loop with and without drafting ahead, each with
# a trace of four passes (the branches' passes on the draft's stream beside the verify)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
OUT="$OUT" bash scripts/gpu-spec-e2e.sh join > "$OUT/join.log" 2>&1 || { cat "$OUT/join.log"; exit 1; }
for ahead in "" "--ahead"; do
    name=profile${ahead:+-ahead}
    timeout 150 python3 -m bench.spec_profile --target /tmp/models/target.gguf --draft /tmp/models/draft.gguf \
        --depth 4 --width 4 --nodes 1,17 --loop 64 $ahead --out "$OUT/$name" > "$OUT/$name.stdout" 2> "$OUT/$name.log"
    echo "$name exit $?"; python3 -c "
import json; r=json.load(open('$OUT/$name/spec-profile.json')); print({k: v for k, v in r.items() if k != 'traces'})" 2>&1 | cut -c1-1500
done
