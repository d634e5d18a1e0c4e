#!/usr/bin/env bash
# llama-cpp-python, the reference (oracle) the inference tests compare against. Built from source
# once (about 6 minutes on 2 cores, portable: no -march=native); pip caches the built wheel, so a
# second install takes seconds.
set -euo pipefail
cd "$(dirname "$0")/../.."
if .venv/bin/python -c 'import llama_cpp' 2>/dev/null; then
    exit 0
fi
echo "building llama-cpp-python (first time only; the wheel is cached by pip)"
CMAKE_ARGS="-DGGML_NATIVE=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \
    .venv/bin/pip install -q --no-binary llama-cpp-python llama-cpp-python
.venv/bin/python -c 'import llama_cpp'
