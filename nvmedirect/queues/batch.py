"""A batch of reads or writes that the native loop keeps in flight on one queue pair.

Python describes the work per *extent* (a contiguous LBA range and where its bytes go); the C
loop (`nvd_run`, native/nvme_queue.c) cuts extents into commands at the transfer limit, builds
their PRPs, writes the SQEs, rings one doorbell per batch of submissions, reaps completions and
copies staged bytes out. So a 128 KiB read on an 8 KiB-MDTS controller costs Python one extent, not
sixteen commands.

- direct: the data moves straight between the device and a `DmaBuffer`;
- staged (reads only): each command reads whole LBAs into a slot of a staging `DmaBuffer` and the
  wanted bytes are copied to any host address (unaligned ranges, memory the device cannot reach).
"""

from __future__ import annotations

from typing import Any

from nvmedirect.errors import NvmeDirectError
from nvmedirect.host_memory import PAGE_SIZE
from nvmedirect.vfio._ffi import ffi
from nvmedirect.vfio.dma import DmaBuffer

MAX_STAGING_SLOTS = 64  # NVD_MAX_SLOTS


class Batch:
    """Extents moved with one opcode on namespace `nsid` (LBAs of `lba_size` bytes, at most
    `max_blocks` per command). `staging` provides the slots staged extents read through."""

    def __init__(self, opcode: int, nsid: int, lba_size: int, max_blocks: int,
                 staging: DmaBuffer | None = None, capacity: int = 8):
        self.opcode = opcode
        self.nsid = nsid
        self.lba_size = lba_size
        self.max_blocks = max_blocks
        self.staging = staging
        self.count = 0
        self.commands = 0  # what the extents will cost, at the transfer limit
        self.extents = ffi.new("struct nvd_extent[]", capacity)
        self._capacity = capacity
        self._keep: list[Any] = []  # what the extents point into stays alive until the run is over
        self._run: Any = None
        self._run_count = 0

    def _next(self) -> Any:
        if self.count == self._capacity:
            grown = ffi.new("struct nvd_extent[]", 2 * self._capacity)
            ffi.memmove(grown, self.extents, ffi.sizeof("struct nvd_extent") * self.count)
            self.extents, self._capacity = grown, 2 * self._capacity
        extent = self.extents[self.count]
        self.count += 1
        return extent

    def _count(self, lba: int, nblocks: int) -> None:
        if nblocks < 1 or lba < 0:
            raise NvmeDirectError(f"extent of {nblocks} blocks at LBA {lba}: need at least one block at LBA >= 0")
        self.commands += -(-nblocks // self.max_blocks)

    def add_direct(self, lba: int, nblocks: int, buffer: DmaBuffer) -> None:
        """`nblocks` LBAs from `lba` straight into (or out of) `buffer`, dword-aligned."""
        nbytes = nblocks * self.lba_size
        if buffer.nbytes < nbytes:
            raise NvmeDirectError(f"buffer of {buffer.nbytes} bytes is too small for {nblocks} blocks")
        if buffer.address % 4:
            raise NvmeDirectError("a direct transfer needs a dword-aligned buffer (PRP1)")
        allocation = buffer._allocation
        if allocation.freed:
            raise NvmeDirectError("DMA buffer used after free")
        self._count(lba, nblocks)
        extent = self._next()
        extent.slba, extent.nblocks = lba, nblocks
        extent.pages, extent.npages = allocation.page_pointer, len(allocation.page_addresses)
        extent.offset = buffer._offset
        extent.copy_to = ffi.NULL
        self._keep.append(buffer)

    def add_staged(self, lba: int, nblocks: int, address: int, skip: int, length: int, keep: Any = None) -> None:
        """Read `nblocks` LBAs from `lba` through staging; copy `length` bytes of them, from byte
        `skip` of the range on, to host address `address` (`keep` is what owns that memory)."""
        if self.staging is None:
            raise NvmeDirectError("a staged read needs a staging buffer")
        if skip < 0 or length < 0 or skip + length > nblocks * self.lba_size:
            raise NvmeDirectError(f"{length} bytes at {skip} lie outside {nblocks} blocks")
        self._count(lba, nblocks)
        extent = self._next()
        extent.slba, extent.nblocks = lba, nblocks
        extent.pages, extent.npages, extent.offset = ffi.NULL, 0, 0
        extent.copy_to = ffi.cast("uint8_t *", address)
        extent.copy_skip, extent.copy_len = skip, length
        self._keep.append(keep)

    def native_run(self) -> Any:
        """The `struct nvd_run` describing this batch, made once and refilled only after extents
        were added (a batch run again with other LBAs, `extents[i].slba = ...`, costs nothing here)."""
        if self._run_count != self.count:
            self._run = ffi.new("struct nvd_run *")
            self._fill_run(self._run)
            self._run_count = self.count
        return self._run

    def _fill_run(self, run: Any) -> None:
        run.extents, run.count = self.extents, self.count
        run.opcode, run.nsid, run.lba_size, run.max_blocks = self.opcode, self.nsid, self.lba_size, self.max_blocks
        staging = self.staging
        if staging is not None:
            slot_bytes = self.max_blocks * self.lba_size
            allocation = staging._allocation
            if staging._offset % PAGE_SIZE:
                raise NvmeDirectError("the staging buffer must start on a page")
            run.staging = ffi.cast("uint8_t *", staging.address)
            run.staging_pages = allocation.page_pointer + staging._offset // PAGE_SIZE
            run.staging_npages = len(allocation.page_addresses) - staging._offset // PAGE_SIZE
            run.slot_bytes = slot_bytes
            run.nslots = min(MAX_STAGING_SLOTS, staging.nbytes // slot_bytes)
        else:
            run.nslots = 0


def staging_slots(slot_bytes: int, budget: int = 32 << 20) -> int:
    """How many staging slots of `slot_bytes` a namespace keeps: enough for a deep queue of small
    commands, at most `budget` bytes of large ones, never fewer than 16."""
    return max(16, min(MAX_STAGING_SLOTS, budget // slot_bytes))
