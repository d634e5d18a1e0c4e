"""DMA buffers: host memory plus the addresses the device uses to reach it.

Two ways to make memory device-visible, chosen by the container's mode:
- IOMMU (type1v2): map the buffer at an IOVA we pick with `VFIO_IOMMU_MAP_DMA`; unmap on free.
- no-IOMMU: the device sees physical addresses, read from `/proc/self/pagemap` for each page of
  locked memory (contiguous only within a page, or within a 2 MiB huge page).
Every `DmaBuffer` knows the device address of each 4 KiB page, which is all PRPs need.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref

import numpy as np

from nvmedirect.errors import DmaError, MemlockLimit
from nvmedirect.vfio import memory as host_memory
from nvmedirect.vfio._ffi import ffi, lib
from nvmedirect.vfio.container import Container, ioctl_ptr
from nvmedirect.vfio.memory import PAGE_SIZE, HostMemory, round_up

log = logging.getLogger(__name__)

IOVA_BASE = 1 << 32  # above the 32-bit MSI window and anything firmware reserves low
PAGEMAP_PRESENT = 1 << 63
PAGEMAP_PFN_MASK = (1 << 55) - 1


class DmaBuffer:
    """Locked host memory with device addresses. Slicing gives a view sharing the mapping.

    `iova` is the device address of byte 0 (an IOVA with an IOMMU, a physical address without);
    `phys` is the physical address when known (no-IOMMU mode), else None; `view` is a numpy uint8
    array over the bytes.
    """

    __slots__ = ("_allocation", "_offset", "nbytes", "_view")

    def __init__(self, allocation: _Allocation, offset: int, nbytes: int):
        self._allocation = allocation
        self._offset = offset
        self.nbytes = nbytes
        self._view: np.ndarray | None = None  # built on first use: slicing stays cheap on the I/O path

    @property
    def view(self) -> np.ndarray:
        if self._view is None:
            self._view = np.frombuffer(self._allocation.memory.buffer, dtype=np.uint8, count=self.nbytes,
                                       offset=self._offset)
        return self._view

    @property
    def address(self) -> int:
        """Host virtual address of byte 0."""
        return self._allocation.memory.address + self._offset

    @property
    def iova(self) -> int:
        return self.device_address(0)

    @property
    def phys(self) -> int | None:
        return self.iova if self._allocation.physical else None

    @property
    def kind(self) -> str:
        return self._allocation.memory.kind

    @property
    def freed(self) -> bool:
        return self._allocation.freed

    def device_address(self, offset: int) -> int:
        """Device address of byte `offset` of this buffer."""
        if not 0 <= offset < max(self.nbytes, 1):
            raise DmaError(f"offset {offset} outside a {self.nbytes}-byte DMA buffer")
        if self._allocation.freed:
            raise DmaError("DMA buffer used after free")
        absolute = self._offset + offset
        page, within = divmod(absolute, PAGE_SIZE)
        return int(self._allocation.page_addresses[page]) + within

    def page_addresses(self) -> np.ndarray:
        """Device addresses of the 4 KiB pages this buffer touches (first one may be offset)."""
        first = self._offset // PAGE_SIZE
        last = (self._offset + self.nbytes - 1) // PAGE_SIZE
        return self._allocation.page_addresses[first:last + 1]

    @property
    def contiguous(self) -> bool:
        """True when the device sees this buffer as one contiguous range (needed for queues)."""
        pages = self.page_addresses().astype(np.int64)
        return bool(np.all(np.diff(pages) == PAGE_SIZE))

    def __len__(self) -> int:
        return self.nbytes

    def __getitem__(self, key: slice) -> DmaBuffer:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("DmaBuffer supports only contiguous slices (buf[a:b])")
        start, stop, _ = key.indices(self.nbytes)
        return DmaBuffer(self._allocation, self._offset + start, max(0, stop - start))

    def dump(self, offset: int = 0, nbytes: int = 256) -> str:
        """Hexdump: device address, 16 bytes in hex, printable ASCII."""
        data = bytes(self.view[offset:offset + nbytes])
        lines = []
        for at in range(0, len(data), 16):
            chunk = data[at:at + 16]
            hexpart = " ".join(f"{b:02x}" for b in chunk)
            text = "".join(chr(b) if 32 <= b < 127 else "." for b in chunk)
            lines.append(f"{self.device_address(offset + at):016x}  {hexpart:<47}  {text}")
        return "\n".join(lines)

    def free(self) -> None:
        """Unmap and release the whole allocation this buffer (or slice) belongs to."""
        self._allocation.allocator.free(self._allocation)

    def __enter__(self) -> DmaBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    def __repr__(self) -> str:
        return f"DmaBuffer({self.nbytes} bytes at iova {self.iova:#x}, {self.kind})"


class _Allocation:
    def __init__(self, allocator: DmaAllocator, memory: HostMemory, page_addresses: np.ndarray,
                 iova: int | None, physical: bool):
        self.allocator = allocator
        self.memory = memory
        self.page_addresses = np.ascontiguousarray(page_addresses, dtype=np.uint64)
        self.page_pointer = ffi.cast("uint64_t *", self.page_addresses.ctypes.data)  # for native PRP building
        self.iova = iova  # start of the IOMMU mapping, None without one
        self.physical = physical
        self.freed = False


class DmaAllocator:
    """Hands out `DmaBuffer`s and tracks every live mapping so none leaks. Subclasses decide how
    memory becomes device-visible (`_map` / `_unmap`)."""

    physical = False

    def __init__(self) -> None:
        self._live: set[_Allocation] = set()
        self._lock = threading.Lock()
        self.locked_bytes = 0
        # At interpreter exit, unmap what the caller forgot; the device must not keep a window
        # into memory that is about to be reused.
        self._finalizer = weakref.finalize(self, DmaAllocator._release_all, self._live, self._unmap_raw())

    def alloc(self, nbytes: int, source: str = "anon", hugepages: bool | None = None,
              contiguous: bool = False) -> DmaBuffer:
        """A device-visible buffer of at least `nbytes`. `source`: "anon" (page-aligned anonymous
        memory) or "cuda-pinned" (CuPy pinned host memory). `contiguous`: the device must see one
        unbroken range (queue rings); without an IOMMU that takes a huge page beyond 4 KiB."""
        if contiguous and self.physical and nbytes > PAGE_SIZE:
            if nbytes > host_memory.HUGE_PAGE_SIZE:
                raise DmaError(f"{nbytes} contiguous bytes exceed a 2 MiB huge page in no-IOMMU mode")
            hugepages = True
        host_memory.check_memlock(self.locked_bytes, round_up(nbytes, PAGE_SIZE))
        if source == "anon":
            mem = host_memory.anonymous(nbytes, hugepages=hugepages)
        elif source == "cuda-pinned":
            mem = host_memory.cuda_pinned(nbytes)
        else:
            raise DmaError(f"unknown DMA memory source {source!r} (use 'anon' or 'cuda-pinned')")
        try:
            allocation = self._map(mem)
        except BaseException:
            mem.release()
            raise
        with self._lock:
            self._live.add(allocation)
            self.locked_bytes += mem.nbytes
        return DmaBuffer(allocation, 0, nbytes)

    def free(self, allocation: _Allocation) -> None:
        with self._lock:
            if allocation.freed:
                return
            allocation.freed = True
            self._live.discard(allocation)
            self.locked_bytes -= allocation.memory.nbytes
        self._unmap(allocation)
        allocation.memory.release()

    def live_mappings(self) -> int:
        return len(self._live)

    def close(self) -> None:
        for allocation in list(self._live):
            self.free(allocation)

    # -- subclass interface ------------------------------------------------------------------
    def _map(self, mem: HostMemory) -> _Allocation:
        raise NotImplementedError

    def _unmap(self, allocation: _Allocation) -> None:
        raise NotImplementedError

    def _unmap_raw(self):
        """A callable(allocation) that unmaps without referencing self (for the exit finalizer)."""
        return lambda allocation: None

    @staticmethod
    def _release_all(live: set, unmap) -> None:
        for allocation in list(live):
            try:
                unmap(allocation)
            except Exception as exc:  # at exit there is nobody left to raise to
                log.warning("could not unmap DMA at exit: %s", exc)
            allocation.freed = True
        live.clear()


class IovaAllocator:
    """First-fit allocator over IOVA space: sorted free ranges, merged on free."""

    def __init__(self, base: int = IOVA_BASE, size: int = 1 << 38):
        self._free: list[tuple[int, int]] = [(base, size)]

    def allocate(self, nbytes: int, alignment: int = PAGE_SIZE) -> int:
        for i, (start, size) in enumerate(self._free):
            aligned = round_up(start, alignment)
            if aligned + nbytes <= start + size:
                pieces = [(start, aligned - start), (aligned + nbytes, start + size - aligned - nbytes)]
                self._free[i:i + 1] = [p for p in pieces if p[1] > 0]
                return aligned
        raise DmaError(f"IOVA space exhausted allocating {nbytes} bytes")

    def release(self, iova: int, nbytes: int) -> None:
        self._free.append((iova, nbytes))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for start, size in self._free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((start, size))
        self._free = merged


def _vfio_unmap(container_fd: int, iova: int, nbytes: int) -> None:
    unmap = ffi.new("struct vfio_iommu_type1_dma_unmap *")
    unmap.argsz = ffi.sizeof("struct vfio_iommu_type1_dma_unmap")
    unmap.iova = iova
    unmap.size = nbytes
    ioctl_ptr(container_fd, lib.VFIO_IOMMU_UNMAP_DMA, unmap, "VFIO_IOMMU_UNMAP_DMA")


class IommuDma(DmaAllocator):
    """Type1v2 IOMMU: each allocation gets its own IOVA range, mapped read/write for the device."""

    def __init__(self, container: Container):
        if container.noiommu:
            raise DmaError("IommuDma needs a type1v2 container; use NoIommuDma in no-IOMMU mode")
        self.container = container
        self._iovas = IovaAllocator()
        super().__init__()

    def _unmap_raw(self):
        fd_holder = self.container
        return lambda a: _vfio_unmap(fd_holder.fd, a.iova, a.memory.nbytes) if fd_holder.fd >= 0 else None

    def _map(self, mem: HostMemory) -> _Allocation:
        iova = self._iovas.allocate(mem.nbytes, alignment=min(mem.page_size, 2 << 20))
        dma_map = ffi.new("struct vfio_iommu_type1_dma_map *")
        dma_map.argsz = ffi.sizeof("struct vfio_iommu_type1_dma_map")
        dma_map.flags = lib.VFIO_DMA_MAP_FLAG_READ | lib.VFIO_DMA_MAP_FLAG_WRITE
        dma_map.vaddr = mem.address
        dma_map.iova = iova
        dma_map.size = mem.nbytes
        try:
            ioctl_ptr(self.container.fd, lib.VFIO_IOMMU_MAP_DMA, dma_map, "VFIO_IOMMU_MAP_DMA")
        except Exception as exc:
            self._iovas.release(iova, mem.nbytes)
            if getattr(exc, "errno", None) == 12:  # ENOMEM: VFIO's pinning hit RLIMIT_MEMLOCK
                raise MemlockLimit(f"{exc}: raise RLIMIT_MEMLOCK (`ulimit -l unlimited`) or run as root") from None
            raise
        pages = iova + PAGE_SIZE * np.arange(mem.nbytes // PAGE_SIZE, dtype=np.uint64)
        log.debug("dma: mapped %d bytes (%s) at iova %#x", mem.nbytes, mem.kind, iova)
        return _Allocation(self, mem, pages, iova, physical=False)

    def _unmap(self, allocation: _Allocation) -> None:
        if self.container.fd >= 0:
            _vfio_unmap(self.container.fd, allocation.iova, allocation.memory.nbytes)
        self._iovas.release(allocation.iova, allocation.memory.nbytes)
        log.debug("dma: unmapped iova %#x", allocation.iova)


def physical_page_addresses(address: int, nbytes: int) -> np.ndarray:
    """Physical address of each 4 KiB page of locked memory, from /proc/self/pagemap (root only)."""
    first = address // PAGE_SIZE
    count = nbytes // PAGE_SIZE
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    except PermissionError:
        raise DmaError("cannot read /proc/self/pagemap: no-IOMMU DMA needs root") from None
    try:
        raw = os.pread(fd, 8 * count, 8 * first)
    finally:
        os.close(fd)
    entries = np.frombuffer(raw, dtype=np.uint64)
    if len(entries) != count or not np.all(entries & np.uint64(PAGEMAP_PRESENT)):
        raise DmaError("pagemap shows DMA pages that are not present: was the memory locked?")
    pfns = entries & np.uint64(PAGEMAP_PFN_MASK)
    if not np.all(pfns):
        raise DmaError("pagemap hides physical frame numbers: no-IOMMU DMA needs CAP_SYS_ADMIN (root)")
    return pfns * np.uint64(PAGE_SIZE)


class NoIommuDma(DmaAllocator):
    """No IOMMU: the device uses physical addresses, so memory stays locked while mapped. Nothing
    protects the rest of RAM from a wrong address: this mode exists for machines without an IOMMU."""

    physical = True

    def _map(self, mem: HostMemory) -> _Allocation:
        pages = physical_page_addresses(mem.address, mem.nbytes)
        return _Allocation(self, mem, pages, None, physical=True)

    def _unmap(self, allocation: _Allocation) -> None:
        pass  # nothing is mapped; releasing the memory unlocks it


def allocator_for(container: Container) -> DmaAllocator:
    """The DMA allocator matching the container's IOMMU mode."""
    return NoIommuDma() if container.noiommu else IommuDma(container)
