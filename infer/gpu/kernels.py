"""Loads the CUDA sources of infer/kernels as CuPy RawModules: compiled for the running device on
first use (NVRTC, falling back to nvcc), memoized per device and per set of #defines.

Local `#include "x.cuh"` lines are inlined here so the compilers need no include path; a small
#define header (tuning constants) is prepended.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"
SOURCES = ("gemv", "dequant", "repack", "ops", "attention")
# ATTN_CHUNK: cache positions per decode-attention block; short enough that a short context still
# spreads over several blocks per KV head (their loads in flight at once). GEMV_UNROLL 2 and the
# SwiGLU's 8 were chosen by timing the variants (docs/GPU.md, docs/PERFORMANCE.md).
DEFAULT_DEFINES: dict[str, int] = {"GEMV_WARPS": 4, "GEMV_UNROLL": 2, "ATTN_CHUNK": 64}
# The paired (gate, up) integer GEMV keeps 8 sub-blocks of each row in flight per lane (faster than
# 2 for it; the single-matrix GEMVs gained nothing from it).
SWIGLU_DEFINES: dict[str, int] = {"GEMV_UNROLL": 8}
OPTIONS = ("-std=c++17",)
_INCLUDE = re.compile(r'^#include "([\w.]+)"\s*$', re.MULTILINE)


def source_text(name: str, defines: dict[str, int] | None = None) -> str:
    """The full text compiled for module `name`: the #define header, then the .cu file with its
    local includes inlined (each once)."""
    seen: set[str] = set()

    def inline(match: re.Match[str]) -> str:
        header = match.group(1)
        if header in seen:
            return ""
        seen.add(header)
        return _INCLUDE.sub(inline, (KERNEL_DIR / header).read_text())

    body = _INCLUDE.sub(inline, (KERNEL_DIR / f"{name}.cu").read_text())
    merged = {**DEFAULT_DEFINES, **(defines or {})}
    head = "".join(f"#define {key} {value}\n" for key, value in sorted(merged.items()))
    return head + body


@cache
def _module(name: str, device_id: int, defines: tuple[tuple[str, int], ...]):  # noqa: ANN202
    import cupy

    code = source_text(name, dict(defines))
    with cupy.cuda.Device(device_id):
        try:
            module = cupy.RawModule(code=code, options=OPTIONS)
            module.compile()
        except cupy.cuda.compiler.CompileException:
            module = cupy.RawModule(code=code, options=OPTIONS, backend="nvcc")
            module.compile()
    return module


def module(name: str, defines: dict[str, int] | None = None):  # noqa: ANN201
    """The compiled RawModule `name` for the current device."""
    import cupy

    if name not in SOURCES:
        raise ValueError(f"no kernel source '{name}' (known: {', '.join(SOURCES)})")
    merged = {**DEFAULT_DEFINES, **(defines or {})}
    return _module(name, cupy.cuda.Device().id, tuple(sorted(merged.items())))


def function(module_name: str, kernel: str, defines: dict[str, int] | None = None):  # noqa: ANN201
    """One kernel of a module (cupy.RawKernel-like: call with (grid, block, args))."""
    return module(module_name, defines).get_function(kernel)
