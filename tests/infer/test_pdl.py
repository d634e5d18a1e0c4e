"""infer.gpu.pdl without a GPU: which kernels may be launched to wait on the GPU (their sources
checked), the switch, and the kernel arguments as cuLaunchKernelEx takes them."""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest

from infer.gpu import kernels, pdl


def _kernel_bodies(source: str) -> list[tuple[str, str]]:
    """(name, text after the opening brace) of every __global__ kernel of a .cu text, macros too."""
    found = []
    for m in re.finditer(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?([\w#]+)\s*\(", source):
        brace = source.index("{", m.end())
        found.append((m.group(1), source[brace + 1 : brace + 400]))
    return found


def source_of_body(module_name: str, body_name: str) -> str:
    """The text of device function `body_name` of a module, to its closing brace at column 0."""
    text = kernels.source_text(module_name)
    start = text.index(f" {body_name}(")
    return text[start : text.index("\n}\n", start)]


@pytest.mark.parametrize("module_name", kernels.SOURCES)
def test_every_kernel_pdl_may_launch_waits_before_it_touches_memory(module_name: str) -> None:
    """A kernel launched with the attribute starts before its predecessor ends: its first statement
    must be pdl_enter() (infer/kernels/pdl.cuh), or it would read what that kernel still writes."""
    bodies = _kernel_bodies(kernels.source_text(module_name))
    assert bodies, module_name
    launched = [(name, body) for name, body in bodies if pdl.ready(module_name, name.replace("##", ""))]
    for name, body in launched:
        first = re.sub(r"\\\s*\n", "\n", body).lstrip()
        if first.startswith("if (!PDL_PREFETCH) pdl_enter();"):  # or its body waits after its first weight loads
            body_name = re.search(r"(\w+_body)<", first).group(1)
            assert "if (PDL_PREFETCH && " in source_of_body(module_name, body_name), name
            continue
        assert first.startswith("pdl_enter();"), f"{module_name}.{name} launches with PDL but starts: {first[:80]!r}"
    if module_name in pdl.PDL_MODULES:
        assert len(launched) == len(bodies)


def test_which_kernels_are_ready() -> None:
    assert pdl.ready("qmm", "qgemv_k4_v1") and pdl.ready("attention", "rope_rows")
    assert pdl.ready("dequant", "embed_k4") and not pdl.ready("dequant", "dequant_k4")
    assert not pdl.ready("pmm", "pmm_k4_t128") and not pdl.ready("repack", "repack_q4_k")


def test_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NVMEDIRECT_PDL", raising=False)
    assert pdl.requested()
    monkeypatch.setenv("NVMEDIRECT_PDL", "0")
    assert not pdl.requested()
    monkeypatch.setenv("NVMEDIRECT_PDL", "yes")
    with pytest.raises(ValueError, match="NVMEDIRECT_PDL must be 0 or 1"):
        pdl.requested()


class _DeviceArray:  # what the launcher reads of a cupy.ndarray: its device address
    class data:  # noqa: N801
        ptr = 0x7F00_0000_1000


def test_kernel_arguments_are_laid_out_as_cupy_passes_them() -> None:
    args = (_DeviceArray(), np.int32(-5), np.float32(1.5), np.uint64(2**63 + 7), np.int8(-2), 7, 0.25, True)
    values, pointers = pdl.kernel_arguments(args)
    sizes = [ctypes.sizeof(v) for v in values]
    assert sizes == [8, 4, 4, 8, 1, 8, 8, 1]
    assert [v.value for v in values] == [0x7F00_0000_1000, -5, 1.5, 2**63 + 7, -2, 7, 0.25, True]
    assert [pointers[i] for i in range(len(values))] == [ctypes.addressof(v) for v in values]
    with pytest.raises(TypeError, match="no kernel argument of type"):
        pdl.kernel_arguments((None,))
    with pytest.raises(TypeError, match="no kernel argument of NumPy type"):
        pdl.kernel_arguments((np.complex64(1),))


def test_the_wrapped_kernel_keeps_its_attributes() -> None:
    """ops.with_shared raises a kernel's shared-memory limit through the object kernels.function
    returns: it must reach the CuPy function, not stay on the wrapper."""
    class Function:
        max_dynamic_shared_size_bytes = 0

        def __call__(self, grid: object, block: object, args: object, **options: object) -> None:
            self.called = (grid, block, args, options)

    f = Function()
    k = pdl.Kernel(f)
    k.max_dynamic_shared_size_bytes = 99 * 1024
    assert f.max_dynamic_shared_size_bytes == 99 * 1024 and k.max_dynamic_shared_size_bytes == 99 * 1024
    k((2,), (32,), (np.int32(1),), shared_mem=64)  # not capturing: CuPy's own launch, options as given
    assert f.called == ((2,), (32,), (np.int32(1),), {"shared_mem": 64})


def test_only_weights_no_kernel_writes_are_loaded_before_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    class Matrix:
        def __init__(self, streamed: bool) -> None:
            self.streamed = streamed

    monkeypatch.setattr(pdl, "available", lambda: True)
    monkeypatch.delenv("NVMEDIRECT_PDL_PREFETCH", raising=False)
    assert pdl.prefetch_weights([Matrix(False), Matrix(False)])
    assert not pdl.prefetch_weights([Matrix(False), Matrix(True)])  # a streamed layer's: its repack writes them
    assert not pdl.prefetch_weights([object()])  # unknown: wait first
    monkeypatch.setenv("NVMEDIRECT_PDL_PREFETCH", "0")
    assert not pdl.prefetch_weights([Matrix(False)])
    monkeypatch.setenv("NVMEDIRECT_PDL_PREFETCH", "maybe")
    with pytest.raises(ValueError, match="NVMEDIRECT_PDL_PREFETCH must be 0 or 1"):
        pdl.prefetch_weights([Matrix(False)])
    monkeypatch.setenv("NVMEDIRECT_PDL_PREFETCH", "1")
    monkeypatch.setattr(pdl, "available", lambda: False)
    assert not pdl.prefetch_weights([Matrix(False)])
