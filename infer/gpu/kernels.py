"""Loads the CUDA sources of infer/kernels as CuPy RawModules: compiled for the running device on
first use (NVRTC, falling back to nvcc), memoized per device and per set of #defines.

Local `#include "x.cuh"` lines are inlined here so the compilers need no include path; a small
#define header (tuning constants) is prepended.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from infer.gpu import pdl

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"
SOURCES = ("qmm", "pmm", "dequant", "repack", "ops", "attention", "prompt_attention", "moe")
# QG_WARPS / QG_UNROLL: the small-N product kernels' rows per block and loads in flight (qmm.cu).
DEFAULT_DEFINES: dict[str, int] = {"QG_WARPS": 4, "QG_UNROLL": 2}
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
    _compiled[(name, device_id, defines)] = module
    return module


_compiled: dict[tuple, object] = {}  # every module compiled so far, by (name, device, defines)


def compiled() -> list[tuple[str, tuple[tuple[str, int], ...], object]]:
    """(name, defines, module) of every module compiled in this process (diagnostics)."""
    return [(name, defines, module) for (name, _device, defines), module in _compiled.items()]


def module(name: str, defines: dict[str, int] | None = None):  # noqa: ANN201
    """The compiled RawModule `name` for the current device."""
    import cupy

    if name not in SOURCES:
        raise ValueError(f"no kernel source '{name}' (known: {', '.join(SOURCES)})")
    merged = {**DEFAULT_DEFINES, **(defines or {})}
    return _module(name, cupy.cuda.Device().id, tuple(sorted(merged.items())))


_recording: list[set[tuple[str, str, tuple]]] = []


def record_launches() -> set[tuple[str, str, tuple]]:
    """From now on, the (module, kernel, defines) of every kernel looked up goes into the returned
    set (the benchmark's list of a pass's kernels, recorded while the pass is captured)."""
    seen: set[tuple[str, str, tuple]] = set()
    _recording[:] = [seen]
    return seen


def stop_recording() -> None:
    _recording.clear()


def function(module_name: str, kernel: str, defines: dict[str, int] | None = None):  # noqa: ANN201
    """One kernel of a module (cupy.RawKernel-like: call with (grid, block, args))."""
    if _recording:
        _recording[0].add((module_name, kernel, tuple(sorted((defines or {}).items()))))
    found = module(module_name, defines).get_function(kernel)
    return pdl.Kernel(found) if pdl.ready(module_name, kernel) else found
