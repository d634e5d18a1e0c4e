#!/usr/bin/env bash
# The whole test suite: installs what the tests need (Debian packages for QEMU, the VM kernel and
# initramfs, llama-cpp-python built once and cached, the test models), then runs ruff and pytest.
# VM, oracle and browser tests are required here: a missing prerequisite fails the run instead of skipping.
# Extra arguments go to pytest (e.g. scripts/test.sh -k gguf -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh dev
bash scripts/install-test-deps.sh
export PATH="$PWD/.venv/bin:$PATH"
export NVMEDIRECT_REQUIRE="${NVMEDIRECT_REQUIRE:-vm,oracle,browser}"
# One BLAS thread: on a 2-core machine shared with other work, OpenBLAS's two spinning threads made
# the CPU engine's tests 2-4x slower (qwen05b perplexity 118 s vs 43 s at load 4); quiet, one
# thread costs about 30 s over the whole suite. Set OPENBLAS_NUM_THREADS yourself to override.
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
echo "== ruff"
ruff check .
echo "== pytest"
exec python -m pytest -p no:cacheprovider --durations=15 "$@"
