#!/bin/bash
# Lease call 2: the 70B at --vram-budget 24GB, plain decode with the CPU tier's split (auto) and without (off).
set -u
export PYTHONPATH="/tmp/site:$PWD"
for i in $(seq 1 200); do [ -e /tmp/r70/model.done ] && break; sleep 1; done
echo "model: $(cat /tmp/r70/model.done 2>/dev/null)"; tail -2 /tmp/r70/model.log; cp -a /tmp/r70/model $OUT/ 2>/dev/null
for mode in ${MODES:-auto off}; do
  timeout ${STREAM_TIMEOUT:-200} python3 -m bench.streaming_bench --out $OUT/70b-$mode --sections h2d,stream --vram-budget 24GB \
    --cpu-tier $mode --deadline ${STREAM_DEADLINE:-190} > $OUT/70b-$mode.txt 2>&1
  echo "== 70b $mode rc=$?"; grep -i "cpu tier" $OUT/70b-$mode.txt | head -2
  python3 -c "
import json,sys; r=json.load(open('$OUT/70b-$mode/results.json')).get('stream',{})
print({k: r.get(k) for k in ('decode_tok_s','roofline_tok_s','decode_fraction_of_roofline','pp512_tok_s','batch32_aggregate_tok_s','peak_vram_bytes','peak_within_budget','error')})"
done
echo "llama: $(cat /tmp/lc/done 2>/dev/null)"; tail -2 /tmp/lc/build.log 2>/dev/null
