"""Loads nvmedirect/gpu/doorbell.cu through CuPy and drives queue pairs from the GPU: the rings,
PRP lists and destination of a `QueueMemory` are registered with CUDA as mapped host memory, the
doorbell page (the emulator's stand-in, or a real BAR0) as well, and one block per queue pair
submits, rings and reaps (see the .cu file for the ordering argument).

CuPy is imported inside functions: this module imports on a machine without a GPU.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from nvmedirect.gpu.rings import RING_DTYPE, QueueMemory
from nvmedirect.host_memory import PAGE_SIZE, address_of

KERNEL = Path(__file__).resolve().parent / "doorbell.cu"
NATIVE = Path(__file__).resolve().parents[2] / "native"
OPTIONS = ("-std=c++17",)
_INCLUDE = re.compile(r'^#include "([\w.]+)"\s*$', re.MULTILINE)
HOST_REGISTER_MAPPED = 0x02      # cudaHostRegisterMapped
HOST_REGISTER_IO_MEMORY = 0x04   # cudaHostRegisterIoMemory: a PCI BAR, not RAM


def source_text() -> str:
    """doorbell.cu with the shared headers of native/ inlined (each once), so NVRTC needs no path."""
    seen: set[str] = set()

    def inline(match: re.Match[str]) -> str:
        name = match.group(1)
        if name in seen:
            return ""
        seen.add(name)
        return _INCLUDE.sub(inline, (NATIVE / name).read_text())

    return _INCLUDE.sub(inline, KERNEL.read_text())


@cache
def module(device_id: int = 0) -> Any:
    import cupy

    with cupy.cuda.Device(device_id):
        try:
            compiled = cupy.RawModule(code=source_text(), options=OPTIONS)
            compiled.compile()
        except cupy.cuda.compiler.CompileException:
            compiled = cupy.RawModule(code=source_text(), options=OPTIONS, backend="nvcc")
            compiled.compile()
    return compiled


def register(address: int, nbytes: int, flags: int = HOST_REGISTER_MAPPED) -> int:
    """Register host memory with CUDA; returns the device pointer kernels use for it."""
    import cupy

    cupy.cuda.runtime.hostRegister(address, nbytes, flags)
    # cudaHostGetDevicePointer's answer, as CuPy exposes it; with unified addressing (every 64-bit
    # CUDA platform) it is the host address itself.
    device = cupy.cuda.runtime.pointerGetAttributes(address).devicePointer
    return int(device) if device else address


def unregister(address: int) -> None:
    import cupy

    cupy.cuda.runtime.hostUnregister(address)


class GpuQueues:
    """The GPU's side of a `QueueMemory`: registered memory, device copies of the ring and work
    structs, and the kernels. Close it (or use it as a context manager) to unregister."""

    def __init__(self, memory: QueueMemory):
        import cupy

        self.memory = memory
        self._blocks: list[tuple[int, int, int]] = []  # (host address, bytes, device pointer) registered
        try:
            for array in memory.allocations:
                self._register(address_of(array), -(-array.nbytes // PAGE_SIZE) * PAGE_SIZE)
            # the emulator's stand-in page is RAM; a real BAR0 says IoMemory (VfioDoorbells)
            flags = getattr(memory.emu, "bar_register_flags", HOST_REGISTER_MAPPED)
            self._register(memory.emu.bar_address, memory.emu.bar_bytes, flags)
        except BaseException:
            self.close()  # registrations outlive the process's use of them otherwise
            raise
        work = memory.work
        self.slba = cupy.asarray(work.slba)
        self.nblocks = cupy.asarray(work.nblocks)
        self.dst_offset = cupy.asarray(work.dst_offset)
        self.dst_pages = cupy.asarray(memory.dst_pages)
        self.status = cupy.zeros(work.count, dtype=cupy.uint32)
        self.work = cupy.asarray(memory.work_struct(self.slba.data.ptr, self.nblocks.data.ptr,
                                                    self.dst_offset.data.ptr, self.dst_pages.data.ptr,
                                                    self.status.data.ptr).view(np.uint8))
        self.stray = cupy.zeros(len(memory.queues), dtype=cupy.uint32)
        self.module = module(cupy.cuda.Device().id)

    def _register(self, address: int, nbytes: int, flags: int = HOST_REGISTER_MAPPED) -> None:
        self._blocks.append((address, nbytes, register(address, nbytes, flags)))

    def view(self, host_address: int) -> int:
        """The device pointer of a host address inside a registered block."""
        for base, nbytes, device in self._blocks:
            if base <= host_address < base + nbytes:
                return device + (host_address - base)
        raise KeyError(f"{host_address:#x} is not in memory registered for the GPU")

    def rings(self) -> Any:
        import cupy

        return cupy.asarray(self.memory.rings(self.view).view(np.uint8))

    def drive(self, timeout_s: float = 5.0) -> np.ndarray:
        """Every queue's commands from the GPU, one block per queue; returns the statuses (and keeps
        the ring indices for the next drive)."""
        import cupy

        rings = self.rings()
        block = max(32, -(-max(q["spec"].queue_depth for q in self.memory.queues) // 32) * 32)
        kernel = self.module.get_function("nvd_drive_queues")
        kernel((len(self.memory.queues),), (block,), (rings, self.work, np.uint64(int(timeout_s * 1e9)), self.stray))
        cupy.cuda.Device().synchronize()
        self.memory.keep_state(cupy.asnumpy(rings).view(RING_DTYPE))
        return cupy.asnumpy(self.status)

    def build_sqes(self, queue: int = 0) -> tuple[np.ndarray, int]:
        """The SQE bytes the GPU builds for queue `queue`'s commands (CID k % queue_depth) and the
        number of build errors; the PRP lists land in that queue's list pages."""
        import cupy

        rings = cupy.asarray(self.memory.rings(self.view)[queue:queue + 1].view(np.uint8))
        count = self.memory.queues[queue]["count"]
        out = cupy.zeros(count * 64, dtype=cupy.uint8)
        errors = cupy.zeros(1, dtype=cupy.int32)
        kernel = self.module.get_function("nvd_build_sqes")
        kernel((-(-count // 128),), (128,), (rings, self.work, out, errors))
        cupy.cuda.Device().synchronize()
        return cupy.asnumpy(out), int(errors.get()[0])

    def close(self) -> None:
        for address, _, _ in self._blocks:
            unregister(address)
        self._blocks = []

    def __enter__(self) -> GpuQueues:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_registers(bar_device_pointer: int) -> tuple[int, int]:
    """(CAP, VS) of a BAR0 mapped for the GPU, read by a kernel."""
    import cupy

    out = cupy.zeros(3, dtype=cupy.uint32)
    module(cupy.cuda.Device().id).get_function("nvd_read_registers")((1,), (32,), (np.uint64(bar_device_pointer), out))
    cupy.cuda.Device().synchronize()
    low, high, vs = (int(x) for x in out.get())
    return low | high << 32, vs
