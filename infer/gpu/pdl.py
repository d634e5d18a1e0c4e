"""Programmatic dependent launch (PDL) of the kernels a captured pass replays, on sm_90 and later.

A pass is a chain of a few hundred kernels, most of them a few microseconds long; between two of
them the GPU sits idle while the next launch is set up and its blocks are placed (~0.5 us each, about
8% of a Qwen3-30B-A3B decode step on an H200). A kernel launched with the programmatic-serialization
attribute may start as soon as every block of the kernel before it has begun; its blocks then wait in
`griddepcontrol.wait` (infer/kernels/pdl.cuh `pdl_enter`) until that kernel has finished and its
writes are visible. So the wait replaces the idle gap, and nothing reads or writes any earlier.

Only kernels whose every load and store comes after `pdl_enter()` may be launched so
(`ready`: the modules whose every kernel does; a test reads the sources), but for one exception:
the products of resident weights, which no kernel writes, load their first weights before it
(`prefetch_weights`, qmm.cu PDL_PREFETCH; NVMEDIRECT_PDL_PREFETCH=0 makes them wait first), so that
trip to memory overlaps the previous kernel too. The launch goes through the driver's cuLaunchKernelEx (cuda-python's
bindings), and only while a graph is being captured (`capturing`): a replay costs nothing per
launch, while an eager launch would pay the Python here.
Cards below sm_90 (the RTX 3090 and 4090 among them) launch as before; so does every card with
NVMEDIRECT_PDL=0 (for timing), or where the bindings are missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import warnings
from collections.abc import Iterator, Sequence
from functools import cache
from typing import Any

import numpy as np

# every kernel of these modules calls pdl_enter() before touching memory; of dequant.cu, the lookups
PDL_MODULES = frozenset({"qmm", "ops", "moe", "attention"})
PDL_PREFIXES = {"dequant": ("embed_",)}

_CTYPES = {np.dtype(np.int8): ctypes.c_int8, np.dtype(np.uint8): ctypes.c_uint8,
           np.dtype(np.int16): ctypes.c_int16, np.dtype(np.uint16): ctypes.c_uint16,
           np.dtype(np.int32): ctypes.c_int32, np.dtype(np.uint32): ctypes.c_uint32,
           np.dtype(np.int64): ctypes.c_int64, np.dtype(np.uint64): ctypes.c_uint64,
           np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double,
           np.dtype(np.bool_): ctypes.c_bool}

_capturing = 0
_broken: list[str] = []  # why launching with the attribute failed in this process (then it is not tried again)


def ready(module_name: str, kernel: str) -> bool:
    """Whether `kernel` of `module_name` waits for the kernel before it (pdl_enter) before it reads."""
    return module_name in PDL_MODULES or kernel.startswith(PDL_PREFIXES.get(module_name, ("\0",)))


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """While a graph is captured: the ready kernels launched meanwhile get the attribute."""
    global _capturing
    _capturing += 1
    try:
        yield
    finally:
        _capturing -= 1


def requested() -> bool:
    """NVMEDIRECT_PDL: unset or 1 (the default) uses PDL where the card and bindings allow; 0 never."""
    value = os.environ.get("NVMEDIRECT_PDL", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"NVMEDIRECT_PDL must be 0 or 1, not {value!r}")
    return value == "1"


@cache
def _driver(device_id: int) -> Any | None:
    """cuda-python's driver bindings where device `device_id` can take PDL (sm_90+), else None."""
    import cupy

    try:
        if int(cupy.cuda.Device(device_id).compute_capability) < 90:
            return None
    except (AttributeError, ValueError, TypeError):  # not a CUDA device (the NumPy stand-in of the tests)
        return None
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # cuda-python before 12.6
        except ImportError:
            return None
    return driver


def available() -> bool:
    """Whether launches on the current device use PDL while a graph is captured."""
    import cupy

    return requested() and not _broken and _driver(cupy.cuda.Device().id) is not None


def prefetch_weights(matrices: Sequence[Any]) -> bool:
    """Whether a product of these matrices loads its first weights before the PDL wait (qmm.cu
    PDL_PREFETCH): under PDL, unless NVMEDIRECT_PDL_PREFETCH=0, and only weights no kernel writes,
    those of resident layers (a streamed layer's are repacked into its scratch by a kernel that may
    still run: infer.tiers.pipeline). Session 31: 404 against 385 tok/s waiting first."""
    return prefetch_enabled() and not any(getattr(m, "streamed", True) for m in matrices)


def prefetch_enabled() -> bool:
    """Where PDL is available, unless NVMEDIRECT_PDL_PREFETCH=0."""
    value = os.environ.get("NVMEDIRECT_PDL_PREFETCH", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"NVMEDIRECT_PDL_PREFETCH must be 0 or 1, not {value!r}")
    return value == "1" and available()


def kernel_arguments(args: Sequence[object]) -> tuple[list[object], ctypes.Array]:
    """The ctypes values of a RawKernel argument tuple, as CuPy passes them (arrays as their device
    address, NumPy scalars at their own width, Python int / float / bool as int64 / double / bool),
    and the void* array of their addresses that cuLaunchKernelEx takes."""
    values: list[object] = []
    for a in args:
        device_address = getattr(getattr(a, "data", None), "ptr", None)  # a cupy.ndarray's
        if device_address is not None:
            values.append(ctypes.c_void_p(device_address))
        elif isinstance(a, np.generic):
            kind = _CTYPES.get(a.dtype)
            if kind is None:
                raise TypeError(f"no kernel argument of NumPy type {a.dtype}")
            values.append(kind(a.item()))
        elif isinstance(a, bool):
            values.append(ctypes.c_bool(a))
        elif isinstance(a, int):
            values.append(ctypes.c_int64(a))
        elif isinstance(a, float):
            values.append(ctypes.c_double(a))
        else:
            raise TypeError(f"no kernel argument of type {type(a).__name__}")
    pointers = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])  # type: ignore[arg-type]
    return values, pointers


def _dims(d: int | Sequence[int]) -> tuple[int, int, int]:
    d = (d,) if isinstance(d, int) else tuple(d)
    return (tuple(int(x) for x in d) + (1, 1, 1))[:3]  # type: ignore[return-value]


class Kernel:
    """A RawKernel-like callable: launched with the PDL attribute while a graph is captured on a card
    that takes it, else by CuPy as before."""

    def __init__(self, function: Any) -> None:
        object.__setattr__(self, "function", function)

    # attributes (max_dynamic_shared_size_bytes, ...) are the kernel's, read and set
    def __getattr__(self, name: str) -> Any:
        return getattr(self.function, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.function, name, value)

    def __call__(self, grid: int | Sequence[int], block: int | Sequence[int], args: Sequence[object],
                 **options: Any) -> None:
        if not _capturing or not available():
            self.function(grid, block, args, **options)
            return
        import cupy

        unknown = set(options) - {"shared_mem", "stream"}
        if unknown:
            raise TypeError(f"no launch option {', '.join(sorted(unknown))}")
        driver = _driver(cupy.cuda.Device().id)
        stream = options.get("stream") or cupy.cuda.get_current_stream()
        _values, pointers = kernel_arguments(args)
        try:  # the bindings' structures, before anything reaches the driver
            attr = driver.CUlaunchAttribute()
            attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            config = driver.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = _dims(grid)
            config.blockDimX, config.blockDimY, config.blockDimZ = _dims(block)
            config.sharedMemBytes = int(options.get("shared_mem", 0))
            config.hStream = driver.CUstream(stream.ptr)
            config.attrs = [attr]
            config.numAttrs = 1
            handle = getattr(self.function, "ptr", None)  # a cupy.cuda.function.Function's
            if handle is None:  # a RawKernel (CuPy 14's RawModule.get_function): its Function
                handle = self.function.kernel.ptr
            function = driver.CUfunction(handle)
        except (AttributeError, TypeError) as err:  # bindings of another shape: launch as before from now on
            _broken.append(f"{type(err).__name__}: {err}")
            warnings.warn(f"programmatic dependent launch is off: cuda-python's bindings refused it ({_broken[0]})",
                          RuntimeWarning, stacklevel=2)
            self.function(grid, block, args, **options)
            return
        (err,) = driver.cuLaunchKernelEx(config, function, ctypes.addressof(pointers), 0)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuLaunchKernelEx failed: {err}")
