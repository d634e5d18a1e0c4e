"""Runs the GPU engine's Python (infer.gpu, the streaming pipeline) on the CPU, against the NumPy
stand-in for CuPy in tests/gpu/numpy_cupy (its kernels emulated from infer.quants / infer.model).
It proves the orchestration (budget accounting, buffers, graph segments, the ring, repacking) and
the test logic, not the CUDA code: tests/gpu/ run that on a real GPU."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

FAKE_DIR = Path(__file__).resolve().parent / "gpu" / "numpy_cupy"
# modules that bind `cupy` when imported: imported afresh against the stand-in, dropped afterwards
GPU_MODULES = ("infer.gpu.model", "infer.gpu.front", "infer.gpu.stages", "infer.gpu.tree", "infer.gpu.activations", "infer.gpu.ops", "infer.gpu.products",
               "infer.gpu.weights",
               "infer.gpu.memory", "infer.gpu.cache", "infer.gpu.uploads", "infer.gpu.attention", "infer.gpu.passes", "infer.gpu.graphs",
               "infer.gpu.benchmark", "infer.gpu.experts", "infer.gpu.expert_stream", "infer.gpu.expert_split",
               "infer.tiers.pipeline")


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, FAKE_DIR / name / "__init__.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The stand-in CuPy as `cupy` for one test (its MEM_INFO sets the device memory it reports)."""
    from infer.gpu import kernels

    cupy = _load("cupy")
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupyx", _load("cupyx"))
    for name in GPU_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
        _forget_attribute(name)
    kernels._module.cache_clear()
    yield cupy
    kernels._module.cache_clear()
    for name in GPU_MODULES:  # bound to the stand-in: never seen by a later test
        sys.modules.pop(name, None)
        _forget_attribute(name)


def _forget_attribute(name: str) -> None:
    """Drops a submodule from its package's attributes too: `from infer.gpu import ops` would
    otherwise find the module a previous test imported against another stand-in."""
    package, _, attr = name.rpartition(".")
    parent = sys.modules.get(package)
    if parent is not None and attr in vars(parent):
        delattr(parent, attr)
