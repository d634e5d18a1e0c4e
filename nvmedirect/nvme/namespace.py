"""A namespace: builds Read/Write/Flush commands, splits requests at the transfer limit, and reads
arbitrary byte ranges (GGUF tensors are not LBA aligned).

Single commands: `submit_read` / `submit_write` return `Command`s to poll or wait on. Whole
requests: `read`, `write`, `read_into` describe the work as a `Batch` of extents and let the native
loop keep the queue full (`QueuePair.run`); `read_batch` + `run` do the same for many ranges at
once (the reader's NVMe backend).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nvmedirect.errors import NvmeDirectError
from nvmedirect.host_memory import as_byte_array
from nvmedirect.nvme.identify import NamespaceInfo
from nvmedirect.queues.batch import Batch, staging_slots
from nvmedirect.queues.command import Command
from nvmedirect.queues.qpair import QueuePair
from nvmedirect.spec.layout import IoOpcode
from nvmedirect.vfio.dma import DmaBuffer

MAX_BLOCKS_PER_COMMAND = 1 << 16  # NLB is a 16-bit, 0-based field


class Namespace:
    def __init__(self, ctrl, info: NamespaceInfo):
        self.ctrl = ctrl
        self.info = info
        self.nsid = info.nsid
        self.lba_size = info.lba_size
        self.size_blocks = info.size_blocks
        self.size_bytes = info.size_bytes
        self._staging: DmaBuffer | None = None

    @property
    def max_blocks(self) -> int:
        """LBAs per command: the controller's transfer limit, and NLB's 16 bits."""
        return max(1, min(self.ctrl.max_transfer // self.lba_size, MAX_BLOCKS_PER_COMMAND))

    # -- single commands -----------------------------------------------------------------------
    def submit_read(self, qpair: QueuePair, lba: int, nblocks: int, buffer: DmaBuffer, **kw) -> Command:
        return self._submit_rw(qpair, IoOpcode.READ, lba, nblocks, buffer, **kw)

    def submit_write(self, qpair: QueuePair, lba: int, nblocks: int, buffer: DmaBuffer, **kw) -> Command:
        return self._submit_rw(qpair, IoOpcode.WRITE, lba, nblocks, buffer, **kw)

    def _submit_rw(self, qpair: QueuePair, opcode: int, lba: int, nblocks: int, buffer: DmaBuffer,
                   **kw) -> Command:
        if not 1 <= nblocks <= self.max_blocks:
            raise NvmeDirectError(f"{nblocks} blocks in one command: must be 1..{self.max_blocks}")
        if buffer.nbytes < nblocks * self.lba_size:
            raise NvmeDirectError(f"buffer of {buffer.nbytes} bytes is too small for {nblocks} blocks")
        if lba < 0:
            raise NvmeDirectError(f"negative LBA {lba}")
        # No host-side range check: a read past the end must come back as the device's own
        # "LBA Out of Range" status.
        return qpair.submit(opcode, nsid=self.nsid, cdw10=lba & 0xFFFFFFFF, cdw11=lba >> 32,
                            cdw12=nblocks - 1, data=buffer, data_len=nblocks * self.lba_size, **kw)

    def submit_flush(self, qpair: QueuePair, **kw) -> Command:
        return qpair.submit(IoOpcode.FLUSH, nsid=self.nsid, **kw)

    # -- batches -------------------------------------------------------------------------------
    def batch(self, opcode: int = IoOpcode.READ) -> Batch:
        """An empty batch for this namespace; reads get the namespace's staging slots."""
        staging = self._staging_buffer() if opcode == IoOpcode.READ else None
        return Batch(opcode, self.nsid, self.lba_size, self.max_blocks, staging)

    def run(self, batch: Batch, qpair: QueuePair | None = None, max_in_flight: int | None = None) -> int:
        """Move the batch on `qpair` (default: the controller's), up to `max_in_flight` commands at
        once; raises the first failure once nothing is in flight. Returns the number of commands."""
        return (qpair or self.ctrl.default_qpair).run(batch, max_in_flight)

    def _staging_buffer(self) -> DmaBuffer:
        if self._staging is None or self._staging.freed:
            slot = self.max_blocks * self.lba_size
            self._staging = self.ctrl.dma.alloc(staging_slots(slot) * slot)
        return self._staging

    def release_staging(self) -> None:
        """Free the staging slots (they are made again on the next staged read)."""
        if self._staging is not None and not self._staging.freed:
            self._staging.free()
        self._staging = None

    # -- whole requests ------------------------------------------------------------------------
    def read(self, lba: int, nblocks: int, buffer: DmaBuffer, qpair: QueuePair | None = None) -> None:
        """Read whole blocks into a DMA buffer, split at the transfer limit."""
        self._whole_blocks(IoOpcode.READ, lba, nblocks, buffer, qpair)

    def write(self, lba: int, nblocks: int, buffer: DmaBuffer, qpair: QueuePair | None = None) -> None:
        self._whole_blocks(IoOpcode.WRITE, lba, nblocks, buffer, qpair)

    def _whole_blocks(self, opcode: int, lba: int, nblocks: int, buffer: DmaBuffer, qpair: QueuePair | None) -> None:
        batch = Batch(opcode, self.nsid, self.lba_size, self.max_blocks)
        batch.add_direct(lba, nblocks, buffer)
        self.run(batch, qpair)

    def flush(self, qpair: QueuePair | None = None) -> None:
        self.submit_flush(qpair or self.ctrl.default_qpair).result()

    def read_into(self, buffer: DmaBuffer | np.ndarray | memoryview | bytearray, byte_offset: int,
                  nbytes: int, qpair: QueuePair | None = None) -> int:
        """Read `nbytes` starting at namespace byte `byte_offset` into `buffer`; any alignment.

        Whole LBAs that land on a dword-aligned spot of a DmaBuffer are read straight into it;
        partial head/tail LBAs (and any non-DMA destination) go through staging and are copied.
        """
        if nbytes < 0 or byte_offset < 0:
            raise NvmeDirectError(f"byte range must be non-negative, got offset {byte_offset} size {nbytes}")
        if nbytes == 0:
            return 0
        batch = self.batch(IoOpcode.READ)
        self.read_batch(batch, buffer, byte_offset, nbytes)
        self.run(batch, qpair)
        return nbytes

    def read_batch(self, batch: Batch, buffer: Any, byte_offset: int, nbytes: int) -> None:
        """Add the extents that read namespace bytes [byte_offset, +nbytes) into `buffer` (a
        DmaBuffer, or any writable host buffer: NumPy and CuPy pinned arrays, bytearray, mmap)."""
        if isinstance(buffer, DmaBuffer):
            host, address = buffer.view, buffer.address
        else:
            try:
                host = as_byte_array(buffer)
            except ValueError as exc:
                raise NvmeDirectError(str(exc)) from None
            address = host.__array_interface__["data"][0]
        if len(host) < nbytes:
            raise NvmeDirectError(f"destination holds {len(host)} bytes, {nbytes} requested")
        lba_size = self.lba_size
        end = byte_offset + nbytes
        first_lba, end_lba = byte_offset // lba_size, -(-end // lba_size)
        direct_start = -(-byte_offset // lba_size)  # first LBA fully inside the range
        direct_end = end // lba_size  # one past the last LBA fully inside
        head = direct_start * lba_size - byte_offset  # bytes before the first whole LBA
        if not (isinstance(buffer, DmaBuffer) and direct_end > direct_start and (address + head) % 4 == 0):
            batch.add_staged(first_lba, end_lba - first_lba, address, byte_offset - first_lba * lba_size, nbytes, buffer)
            return
        if direct_start > first_lba:
            batch.add_staged(first_lba, 1, address, byte_offset - first_lba * lba_size, head, buffer)
        batch.add_direct(direct_start, direct_end - direct_start, buffer[head:head + (direct_end - direct_start) * lba_size])
        if end_lba > direct_end:
            tail_at = direct_end * lba_size - byte_offset
            batch.add_staged(direct_end, 1, address + tail_at, 0, nbytes - tail_at, buffer)

