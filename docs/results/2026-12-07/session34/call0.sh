#!/bin/bash
# session 34, call 0 (as session 33's): the wheels into /tmp/site and the HumanEval file (carry .whl, .carry); then 29
# calls `bash scripts/gpu-spec-e2e.sh piece .pieces` carrying .pieces/p00 .. p28. (In session 33 this
# call also carried p00; with the server's wheels in .whl, .whl + a piece + the tree pass 64 MiB.)
[ -d .pieces ] && bash scripts/gpu-spec-e2e.sh piece .pieces
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && echo wheels ok
mkdir -p ~/.cache/nvmedirect/humaneval && cp .carry/HumanEval.jsonl.gz ~/.cache/nvmedirect/humaneval/ && echo humaneval ok
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
