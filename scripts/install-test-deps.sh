#!/usr/bin/env bash
# Everything the test suite needs beyond the Python package itself. Each step is cached, so a
# second run takes seconds. Run after scripts/bootstrap.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
for step in scripts/deps/*.sh; do
    echo "== deps: $(basename "$step")"
    bash "$step"
done
