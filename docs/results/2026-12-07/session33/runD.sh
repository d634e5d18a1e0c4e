#!/bin/bash
# session 33, call D (after A-C, if device time is left): the real pair's draft chain, verify passes and loop profiled
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
timeout 150 python3 -m bench.spec_profile --target /tmp/models/target.gguf --draft /tmp/models/draft.gguf \
    --depth 16 --nodes 1,17,65 --loop 64 --out "$OUT/profile" > "$OUT/profile.stdout" 2> "$OUT/profile.log"
echo "profile exit $?"; python3 -c "
import json; r=json.load(open('$OUT/profile/spec-profile.json')); print({k: v for k, v in r.items() if k != 'traces'})" 2>&1 | cut -c1-1500
