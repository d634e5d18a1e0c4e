"""Test assets: where the cached models and text live, and requantizing SmolLM2 with llama.cpp.

`python -m tests.oracle.assets requantize` writes the SmolLM2 variants next to the original
(idempotent: existing files are kept). scripts/deps/40-models.sh runs it.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

SMOLLM2_ORIGINAL = "SmolLM2-135M-Instruct.Q4_1.gguf"
QWEN05B = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN15B = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
GEMMA3 = "gemma-3-270m-q4_k_m.gguf"
# variant name -> llama.cpp file type it is requantized to
SMOLLM2_VARIANTS = ("F16", "Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K")


def cache_dir() -> Path:
    return Path(os.environ.get("NVMEDIRECT_CACHE", Path.home() / ".cache" / "nvmedirect"))


def models_dir() -> Path:
    return cache_dir() / "models"


def smollm2_path(variant: str = "Q4_1") -> Path:
    if variant == "Q4_1":
        return models_dir() / SMOLLM2_ORIGINAL
    return models_dir() / f"SmolLM2-135M-Instruct.{variant}.gguf"


def qwen05b_path() -> Path:
    return models_dir() / QWEN05B


def qwen15b_path() -> Path:
    return models_dir() / QWEN15B


def gemma3_path() -> Path:
    return models_dir() / GEMMA3


def botchan_path() -> Path:
    return cache_dir() / "text" / "botchan.txt"


def requantize(source: Path, target: Path, variant: str) -> None:
    """Requantize `source` to `variant` with llama.cpp's own quantizer (writes atomically)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{variant}")
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    partial = target.with_suffix(".tmp")
    status = llama_cpp.llama_model_quantize(
        str(source).encode(), str(partial).encode(), ctypes.byref(params)
    )
    if status != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize {source} -> {variant} failed with status {status}")
    partial.replace(target)


def requantize_smollm2() -> None:
    source = smollm2_path()
    if not source.is_file():
        raise SystemExit(f"{source}: missing; run scripts/fetch-models.sh smollm2 first")
    for variant in SMOLLM2_VARIANTS:
        target = smollm2_path(variant)
        if not target.is_file():
            requantize(source, target, variant)
        print(target)


if __name__ == "__main__":
    if sys.argv[1:] != ["requantize"]:
        raise SystemExit("usage: python -m tests.oracle.assets requantize")
    requantize_smollm2()
