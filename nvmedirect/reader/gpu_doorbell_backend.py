"""Reads whose NVMe commands GPU threads issue (`--tier-c nvme --gpu-doorbells`).

Each `read_async` call becomes a workload of whole-LBA reads of at most `io_size` bytes; one queue
pair's rings, PRP lists and a destination (page-aligned host memory the controller reaches by DMA
and the GPU through cudaHostRegister) are laid out by `nvmedirect.gpu.rings.QueueMemory`, and the
`GpuQueues` kernel builds the SQEs, rings the SQ tail doorbell, polls the phase tags and rings the
CQ head. The bytes are then copied from the destination into the caller's buffers (ranges rarely
start on an LBA, as NvmeBackend's staging path does too).

`controller` is whatever QueueMemory drives: the test-suite emulator (`EmulatedController`: a host
page standing in for BAR0, its own DMA translation table) or, on hardware, `VfioDoorbells`
(nvmedirect/gpu/vfio_doorbells.py: the real BAR0, registered with cudaHostRegisterIoMemory, and
VFIO DMA mappings). The code between them is the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from nvmedirect.host_memory import PAGE_SIZE
from nvmedirect.reader.base import (
    ByteRange,
    OnceLock,
    ReadError,
    ReadHandle,
    StorageBackend,
    prepare_destinations,
)

DEFAULT_QUEUE_DEPTH = 63      # commands in flight: one 64-entry ring, as the CPU backend
DEFAULT_IO_SIZE = 1 << 20     # bytes per command (PRP lists of one page each)
DEFAULT_BATCH_BYTES = 64 << 20  # destination bytes per drive: bounds the pinned memory of one call
HOST_STATUS, HOST_TIMEOUT = 0x10000, 0x01  # native/nvme_ring.h


def describe_status(word: int) -> str:
    """The kernel's status word in the CPU path's one fixed form (`ERROR status: SCT/SC Name`)."""
    from nvmedirect.spec.status import HOST_TIMEOUT as TIMEOUT
    from nvmedirect.spec.status import NvmeStatus

    if word & HOST_STATUS:
        status = TIMEOUT if word & 0xFFFF == HOST_TIMEOUT else f"host code {word & 0xFFFF:#x} (SQE build refused)"
        return f"ERROR status: {status}"
    return f"ERROR status: {NvmeStatus.from_cqe_status(word)}"


def gpu_drive(memory: Any, timeout_s: float) -> np.ndarray:
    """The commands of `memory` issued by GPU threads (GpuQueues); one status word per command."""
    from nvmedirect.gpu.doorbell import GpuQueues

    with GpuQueues(memory) as gpu:
        return gpu.drive(timeout_s)


def cpu_drive(memory: Any, timeout_s: float) -> np.ndarray:
    """The same commands from the CPU reference submitter (the same builder, native/nvme_emu_host.c):
    tests check the backend's workloads without a GPU."""
    from nvmedirect.gpu.rings import host_drive

    host_drive(memory, timeout_s)
    return memory.status


class GpuDoorbellBackend(StorageBackend):
    """Namespace 1 of `controller` (size_bytes, lba_size), read by GPU-initiated commands on I/O
    queue `qid`. Calls run one at a time on one thread (one block drives the queue pair)."""

    def __init__(self, controller: Any, *, size_bytes: int, lba_size: int, qid: int = 1,
                 queue_depth: int = DEFAULT_QUEUE_DEPTH, io_size: int = DEFAULT_IO_SIZE,
                 batch_bytes: int = DEFAULT_BATCH_BYTES, timeout_s: float = 5.0, name: str | None = None,
                 owns_controller: bool = False, drive: Callable[[Any, float], np.ndarray] = gpu_drive):
        if not 1 <= queue_depth <= 256:  # one CID per thread of one block; 256 is what the GPU tests cover
            raise ValueError(f"queue depth {queue_depth}: 1 to 256 commands for GPU doorbells")
        self.controller, self.qid, self.queue_depth = controller, qid, queue_depth
        self.size, self.lba_size, self.direct = size_bytes, lba_size, True
        self.io_size = max(lba_size, io_size - io_size % lba_size)
        self.batch_bytes = max(self.io_size, batch_bytes)
        self.timeout_s, self._drive_commands = timeout_s, drive
        self.name = name or f"nvme (GPU doorbells) qid {qid}"
        self._owns = owns_controller
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="nvme-gpu-doorbells")
        self._closing = OnceLock()

    def read_async(self, ranges: Sequence[ByteRange], buffers: Sequence[Any]) -> ReadHandle:
        views = prepare_destinations(ranges, buffers, self.size)
        return ReadHandle([self._executor.submit(self._read, list(ranges), views)])

    def _read(self, ranges: list[ByteRange], views: list[np.ndarray]) -> None:
        batch: list[tuple[int, int, np.ndarray]] = []  # (byte offset, nbytes, destination view)
        covered = 0
        for (offset, nbytes), view in zip(ranges, views, strict=True):
            for at in range(0, nbytes, self.batch_bytes):  # a large range over several drives
                n = min(self.batch_bytes, nbytes - at)
                span = self._lbas(offset + at, n)[1] * self.lba_size
                if batch and covered + span > self.batch_bytes:
                    self._drive(batch)
                    batch, covered = [], 0
                batch.append((offset + at, n, view[at:at + n]))
                covered += -(-span // PAGE_SIZE) * PAGE_SIZE
        if batch:
            self._drive(batch)

    def _lbas(self, offset: int, nbytes: int) -> tuple[int, int]:
        """(first LBA, LBA count) covering bytes [offset, offset + nbytes)."""
        first = offset // self.lba_size
        return first, max(1, -(-(offset + nbytes) // self.lba_size) - first)

    def _drive(self, pieces: list[tuple[int, int, np.ndarray]]) -> None:
        from nvmedirect.gpu.rings import QueueMemory, QueueSpec, Workload

        per_command = self.io_size // self.lba_size
        slba, nblocks, dst_offset, copies = [], [], [], []
        at = 0
        for offset, nbytes, view in pieces:
            first, count = self._lbas(offset, nbytes)
            copies.append((view, at + offset - first * self.lba_size, nbytes))
            for lba in range(first, first + count, per_command):
                n = min(per_command, first + count - lba)
                slba.append(lba)
                nblocks.append(n)
                dst_offset.append(at)
                at += n * self.lba_size
            at = -(-at // PAGE_SIZE) * PAGE_SIZE  # each piece on its own pages: PRP1 without offset
        work = Workload(np.array(slba, np.uint64), np.array(nblocks, np.uint64), np.array(dst_offset, np.uint64),
                        max(at, PAGE_SIZE), self.lba_size)
        qd = min(self.queue_depth, work.count)
        memory = QueueMemory(self.controller, [QueueSpec(self.qid, qd, qd + 1)], work, self.io_size)
        try:
            status = self._drive_commands(memory, self.timeout_s)
            bad = np.flatnonzero(status)
            if bad.size:  # the first failure, as the CPU path raises the first status error
                i = int(bad[0])
                lba, n = int(work.slba[i]), int(work.nblocks[i])
                raise ReadError(f"NVMe read of bytes {lba * self.lba_size}..{(lba + n) * self.lba_size} failed: "
                                f"{describe_status(int(status[i]))} (read, GPU doorbells; {bad.size} of "
                                f"{work.count} commands failed)")
            for view, start, nbytes in copies:
                view[:] = memory.dst[start:start + nbytes]
        finally:
            memory.release()

    def close(self) -> None:
        if not self._closing.first():
            return
        self._executor.shutdown(wait=True)
        if self._owns:
            self.controller.close()

    def __repr__(self) -> str:
        return f"GpuDoorbellBackend({self.name!r}, qd={self.queue_depth}, io={self.io_size})"
