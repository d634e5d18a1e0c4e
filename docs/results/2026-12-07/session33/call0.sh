#!/bin/bash
# session 33, call 0: the first piece of the real pair, the wheels into /tmp/site, the HumanEval file
# (carry .whl, .carry, .pieces/p00); calls 1-28 then run `bash scripts/gpu-spec-e2e.sh piece .pieces`
bash scripts/gpu-spec-e2e.sh piece .pieces
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && echo wheels ok
mkdir -p ~/.cache/nvmedirect/humaneval && cp .carry/HumanEval.jsonl.gz ~/.cache/nvmedirect/humaneval/ && echo humaneval ok
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
