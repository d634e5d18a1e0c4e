"""A namespace: builds Read/Write/Flush commands, splits requests at the transfer limit, and reads
arbitrary byte ranges (GGUF tensors are not LBA aligned).

Async interface: `submit_read` / `submit_write` return `Command`s to poll or wait on; `Transfer`
keeps a queue pair full for one large request. Blocking interface: `read`, `write`, `flush`,
`read_into`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from nvmedirect.errors import NvmeDirectError, QueueFull
from nvmedirect.nvme.identify import NamespaceInfo
from nvmedirect.queues.command import Command
from nvmedirect.queues.qpair import QueuePair
from nvmedirect.spec.layout import IoOpcode
from nvmedirect.vfio.dma import DmaBuffer

MAX_BLOCKS_PER_COMMAND = 1 << 16  # NLB is a 16-bit, 0-based field
STAGING_SLOTS = 16


@dataclass
class Segment:
    """One command's worth of a request: `nblocks` LBAs at `lba` into `target` (device-visible),
    then, when staged, `copy` moves the wanted bytes out of the staging slot."""

    lba: int
    nblocks: int
    target: DmaBuffer | None
    copy: Callable[[DmaBuffer], None] | None = None


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

    # -- async ---------------------------------------------------------------------------------
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

    def run(self, segments: Iterator[Segment], opcode: int = IoOpcode.READ,
            qpair: QueuePair | None = None, max_in_flight: int | None = None) -> int:
        """Keep the queue full with `segments`: batch submissions (one doorbell per batch), poll,
        copy staged data out as commands finish. Raises the first failure once nothing is left in
        flight (so no DMA still targets the caller's memory). Returns the number of commands."""
        qpair = qpair or self.ctrl.default_qpair
        limit = min(max_in_flight or qpair.free_slots, qpair.free_slots) or 1
        pending = iter(segments)
        failures: list[Exception] = []
        in_flight = 0
        issued = 0
        exhausted = False

        def finished(command: Command) -> None:
            nonlocal in_flight
            in_flight -= 1
            segment, slot = command.context
            if not command.completion.ok:
                failures.append(command.completion.exception())
            elif segment.copy is not None:
                segment.copy(segment.target)
            if slot is not None:
                free_slots.append(slot)

        free_slots = list(range(STAGING_SLOTS))
        staging = self._staging_buffer() if opcode == IoOpcode.READ else None
        while not exhausted or in_flight:
            while not exhausted and not failures and in_flight < limit:
                segment = next(pending, None)
                if segment is None:
                    exhausted = True
                    break
                slot = None
                if segment.target is None:  # staged: borrow a slot of the staging buffer
                    while not free_slots:
                        qpair.poll(spin=True)
                    slot = free_slots.pop()
                    span = self.max_blocks * self.lba_size
                    segment.target = staging[slot * span:(slot + 1) * span]
                try:
                    self._submit_rw(qpair, opcode, segment.lba, segment.nblocks, segment.target,
                                    context=(segment, slot), callback=finished, ring=False)
                except QueueFull:  # another user of this queue pair took the slots
                    if slot is not None:
                        free_slots.append(slot)
                        segment.target = None
                    pending = _prepend(segment, pending)
                    break
                in_flight += 1
                issued += 1
            if failures and not in_flight:
                break
            exhausted = exhausted or bool(failures)
            qpair.poll(spin=True)
        if failures:
            raise failures[0]
        return issued

    def _staging_buffer(self) -> DmaBuffer:
        if self._staging is None or self._staging.freed:
            self._staging = self.ctrl.dma.alloc(STAGING_SLOTS * self.max_blocks * self.lba_size)
        return self._staging

    # -- blocking ------------------------------------------------------------------------------
    def read(self, lba: int, nblocks: int, buffer: DmaBuffer, qpair: QueuePair | None = None) -> None:
        """Read whole blocks into a DMA buffer, split at the transfer limit."""
        self.run(self._split(lba, nblocks, buffer), IoOpcode.READ, qpair)

    def write(self, lba: int, nblocks: int, buffer: DmaBuffer, qpair: QueuePair | None = None) -> None:
        self.run(self._split(lba, nblocks, buffer), IoOpcode.WRITE, qpair)

    def flush(self, qpair: QueuePair | None = None) -> None:
        self.submit_flush(qpair or self.ctrl.default_qpair).result()

    def _split(self, lba: int, nblocks: int, buffer: DmaBuffer) -> Iterator[Segment]:
        if buffer.nbytes < nblocks * self.lba_size:
            raise NvmeDirectError(f"buffer of {buffer.nbytes} bytes is too small for {nblocks} blocks")
        step = self.max_blocks
        for first in range(0, nblocks, step):
            count = min(step, nblocks - first)
            yield Segment(lba + first, count, buffer[first * self.lba_size:(first + count) * self.lba_size])

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
        dest = buffer.view if isinstance(buffer, DmaBuffer) else np.frombuffer(buffer, dtype=np.uint8)
        if len(dest) < nbytes:
            raise NvmeDirectError(f"destination holds {len(dest)} bytes, {nbytes} requested")
        self.run(self._plan_read(buffer, dest, byte_offset, nbytes), IoOpcode.READ, qpair)
        return nbytes

    def _plan_read(self, buffer, dest: np.ndarray, byte_offset: int, nbytes: int) -> Iterator[Segment]:
        lba_size, step = self.lba_size, self.max_blocks
        end = byte_offset + nbytes
        first_lba, last_lba = byte_offset // lba_size, (end - 1) // lba_size
        direct_start = -(-byte_offset // lba_size)  # first LBA fully inside the range
        direct_end = end // lba_size  # one past the last LBA fully inside
        can_direct = (isinstance(buffer, DmaBuffer) and direct_end > direct_start
                      and (direct_start * lba_size - byte_offset) % 4 == 0)
        if not can_direct:
            direct_start = direct_end = last_lba + 1
        # Staged pieces: everything outside [direct_start, direct_end), in transfer-sized chunks.
        staged_ranges = [(first_lba, min(direct_start, last_lba + 1)), (max(direct_end, first_lba), last_lba + 1)]
        for lo, hi in staged_ranges:
            for lba in range(lo, hi, step):
                count = min(step, hi - lba)
                yield Segment(lba, count, None, _copier(dest, byte_offset, end, lba * lba_size, count * lba_size))
        for lba in range(direct_start, direct_end, step):
            count = min(step, direct_end - lba)
            at = lba * lba_size - byte_offset
            yield Segment(lba, count, buffer[at:at + count * lba_size])


def _copier(dest: np.ndarray, want_start: int, want_end: int, got_start: int, got_len: int):
    """Copy the overlap of the wanted byte range and a staged chunk into `dest`."""
    lo, hi = max(want_start, got_start), min(want_end, got_start + got_len)

    def copy(staged: DmaBuffer) -> None:
        dest[lo - want_start:hi - want_start] = staged.view[lo - got_start:hi - got_start]

    return copy


def _prepend(item, rest: Iterator) -> Iterator:
    yield item
    yield from rest
