#!/usr/bin/env bash
# Creates .venv (Python >= 3.11) and installs this project into it, editable, with the cffi
# extension compiled. Idempotent: a second run only re-installs when pyproject/native changed.
# Usage: scripts/bootstrap.sh [extra,...]     e.g. scripts/bootstrap.sh dev,gpu
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
python="${PYTHON:-python3}"
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "bootstrap: Python >= 3.11 is needed ($python is $("$python" --version 2>&1))" >&2
    exit 1
fi
if [ ! -x .venv/bin/python ]; then
    echo "bootstrap: creating .venv"
    "$python" -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
fi
stamp=.venv/.nvmedirect-installed
key="$extras $(cat pyproject.toml setup.py native/* 2>/dev/null | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$key" ]; then
    echo "bootstrap: installing nvmedirect[$extras] into .venv"
    .venv/bin/python -m pip install -q -e ".[$extras]"
    echo "$key" > "$stamp"
fi
