"""Host memory the device may DMA into: page-aligned anonymous memory (2 MiB huge pages when the
system has them reserved) and CUDA pinned memory from CuPy. Each is locked in RAM.

This module only provides memory and its virtual address; `dma.py` makes it device-visible.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import resource

import numpy as np

from nvmedirect.errors import DmaError, MemlockLimit
from nvmedirect.host_memory import PAGE_SIZE
from nvmedirect.vfio._ffi import ffi

log = logging.getLogger(__name__)

HUGE_PAGE_SIZE = 2 << 20
MAP_HUGETLB = 0x40000  # <linux/mman.h>; Python's mmap module does not export it
CAP_IPC_LOCK = 14

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def has_ipc_lock_capability() -> bool:
    """CAP_IPC_LOCK lifts RLIMIT_MEMLOCK for mlock and for VFIO's page pinning."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
    return False


def check_memlock(already_locked: int, more: int) -> None:
    """Raise MemlockLimit, saying what to do, when locking `more` bytes would exceed the limit."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or has_ipc_lock_capability():
        return
    if already_locked + more > soft:
        raise MemlockLimit(
            f"DMA memory needs {(already_locked + more) >> 20} MiB locked but RLIMIT_MEMLOCK is "
            f"{soft >> 20} MiB: run as root, or raise the limit (`ulimit -l unlimited`, or a "
            "`memlock` line in /etc/security/limits.conf)"
        )


class HostMemory:
    """A locked, page-aligned host allocation: `address`, `nbytes`, `page_size`, a writable buffer."""

    def __init__(self, address: int, nbytes: int, page_size: int, buffer, keepalive, kind: str):
        self.address = address
        self.nbytes = nbytes
        self.page_size = page_size
        self.buffer = buffer  # a writable object supporting the buffer protocol
        self.kind = kind
        self._keepalive = keepalive

    def release(self) -> None:
        if self._keepalive is None:
            return
        if isinstance(self._keepalive, mmap.mmap):
            _libc.munlock(self.address, self.nbytes)
            self.buffer = None
            # A numpy view may still exist; the mapping then goes away with the last reference.
            with contextlib.suppress(BufferError):
                self._keepalive.close()
        self._keepalive = None
        self.buffer = None


def _mmap_anonymous(nbytes: int, huge: bool) -> mmap.mmap:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (MAP_HUGETLB if huge else 0)
    return mmap.mmap(-1, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def anonymous(nbytes: int, hugepages: bool | None = None) -> HostMemory:
    """Locked anonymous memory. `hugepages`: True requires 2 MiB pages, None uses them when the
    system has some reserved (vm.nr_hugepages), False never does."""
    if nbytes <= 0:
        raise DmaError(f"DMA buffer size must be positive, got {nbytes}")
    region = None
    page_size = PAGE_SIZE
    if hugepages or (hugepages is None and nbytes >= HUGE_PAGE_SIZE // 2):
        try:
            region = _mmap_anonymous(round_up(nbytes, HUGE_PAGE_SIZE), huge=True)
            page_size = HUGE_PAGE_SIZE
        except OSError as exc:
            if hugepages:
                raise DmaError(
                    f"no 2 MiB huge pages for {nbytes} bytes ({exc.strerror}): reserve some with "
                    "`echo 64 > /proc/sys/vm/nr_hugepages`"
                ) from None
    if region is None:
        region = _mmap_anonymous(round_up(nbytes, PAGE_SIZE), huge=False)
    size = len(region)
    address = int(ffi.cast("uintptr_t", ffi.from_buffer(region)))
    # Fault every page in before locking so each has a physical frame now, not on first touch.
    region[::PAGE_SIZE] = bytes(len(range(0, size, PAGE_SIZE)))
    if _libc.mlock(address, size) != 0:
        err = ctypes.get_errno()
        region.close()
        if err in (errno.ENOMEM, errno.EPERM):
            check_memlock(0, size)
        raise DmaError(f"mlock of {size} bytes failed: {os.strerror(err)}")
    return HostMemory(address, size, page_size, region, region, "hugetlb" if page_size > PAGE_SIZE else "anon")


def cuda_pinned(nbytes: int) -> HostMemory:
    """CUDA pinned (page-locked) host memory from CuPy: the staging the GPU copies from at full
    PCIe speed. Needs CuPy and a CUDA driver."""
    try:
        import cupy
    except ImportError:
        raise DmaError("CUDA pinned memory needs CuPy: `pip install cupy-cuda13x`") from None
    size = round_up(nbytes, PAGE_SIZE)
    try:
        pinned = cupy.cuda.alloc_pinned_memory(size)
    except Exception as exc:  # CuPy raises its own runtime error types
        raise DmaError(f"cudaHostAlloc of {size} bytes failed: {exc}") from None
    address = int(pinned.ptr)
    if address % PAGE_SIZE:
        raise DmaError(f"CUDA pinned memory at {address:#x} is not page aligned")
    buffer = ffi.buffer(ffi.cast("char *", address), size)
    # Touch every page so each is backed before pagemap (no-IOMMU) or VFIO pinning looks at it.
    np.frombuffer(buffer, dtype=np.uint8)[::PAGE_SIZE] = 0
    return HostMemory(address, size, PAGE_SIZE, buffer, pinned, "cuda-pinned")
