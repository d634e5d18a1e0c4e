"""Reads through the userspace NVMe driver: one worker thread per I/O queue pair.

Each `read_async` cuts its ranges into pieces of at most `io_size` bytes and deals them round-robin
to the queue pairs; a worker owns its queue pair and its own namespace view (with its own DMA
staging slots), so no lock is shared on the I/O path. Inside a piece the driver keeps the queue
full (one doorbell per batch). The spin-poll runs in C through cffi with the GIL released, so the
workers really overlap.

Destinations that are `DmaBuffer`s (from `alloc`) receive the data by DMA directly; any other
writable buffer (e.g. CuPy pinned memory) is filled from the worker's DMA staging slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from nvmedirect.reader.base import ByteRange, OnceLock, ReadError, ReadHandle, StorageBackend
from nvmedirect.reader.host_memory import as_byte_array, gpu_present

DEFAULT_QUEUE_PAIRS = 2
DEFAULT_QUEUE_DEPTH = 64
DEFAULT_IO_SIZE = 4 << 20


class _Worker:
    """A queue pair, the namespace view that stages through it, and the thread that drives both."""

    def __init__(self, ctrl: Any, info: Any, depth: int, index: int):
        from nvmedirect.nvme.namespace import Namespace

        self.qpair = ctrl.create_io_qpair(depth + 1)  # a ring of N entries holds N-1 commands
        self.namespace = Namespace(ctrl, info)
        self.namespace._staging_buffer()  # allocate now, on the opening thread
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"nvme-qp{self.qpair.qid}")

    def read(self, dest: Any, byte_offset: int, nbytes: int) -> None:
        self.namespace.read_into(dest, byte_offset, nbytes, qpair=self.qpair)


class NvmeBackend(StorageBackend):
    """A namespace of a vfio-bound controller, read with several queue pairs in flight."""

    def __init__(self, ctrl: Any, *, nsid: int = 1, queue_pairs: int = DEFAULT_QUEUE_PAIRS,
                 queue_depth: int = DEFAULT_QUEUE_DEPTH, io_size: int = DEFAULT_IO_SIZE,
                 owns_controller: bool = False, name: str | None = None):
        if queue_pairs < 1:
            raise ValueError("at least one queue pair is needed")
        self.ctrl = ctrl
        self._owns = owns_controller
        self.info = ctrl.namespace(nsid).info
        self.name = name or f"nvme nsid {nsid}"
        self.lba_size = self.info.lba_size
        self.size = self.info.size_bytes
        self.direct = True
        self.queue_depth = queue_depth
        self.io_size = max(self.lba_size, io_size - io_size % self.lba_size)
        self._closing = OnceLock()
        self._workers: list[_Worker] = []
        try:
            for index in range(queue_pairs):
                self._workers.append(_Worker(ctrl, self.info, queue_depth, index))
        except BaseException:
            self.close()
            raise
        self._next = 0

    @classmethod
    def open(cls, bdf: str, *, noiommu: bool = False, nsid: int = 1,
             queue_pairs: int = DEFAULT_QUEUE_PAIRS, **options: Any) -> NvmeBackend:
        """Opens and starts the controller at `bdf` (bound to vfio-pci) and reads namespace `nsid`."""
        from nvmedirect.nvme.controller import Controller

        options.pop("lba_size", None)  # the namespace reports its own
        ctrl = Controller.open(bdf, noiommu=noiommu, io_queues=queue_pairs)
        try:
            return cls(ctrl, nsid=nsid, queue_pairs=queue_pairs, owns_controller=True,
                       name=f"{bdf} nsid {nsid}", **options)
        except BaseException:
            ctrl.close()
            raise

    @property
    def queue_pairs(self) -> int:
        return len(self._workers)

    def alloc(self, nbytes: int) -> Any:
        """A DMA buffer the device writes into directly (CUDA-pinned when a GPU is present);
        pass it (or slices of it) as a destination to skip the staging copy. `.view` is its bytes."""
        source = "cuda-pinned" if gpu_present() else "anon"
        return self.ctrl.dma.alloc(nbytes, source=source)

    def read_async(self, ranges: Sequence[ByteRange], buffers: Sequence[Any]) -> ReadHandle:
        from nvmedirect.vfio.dma import DmaBuffer

        if len(ranges) != len(buffers):
            raise ReadError(f"{len(ranges)} ranges but {len(buffers)} destination buffers")
        futures: list[Future] = []
        for (offset, nbytes), buffer in zip(ranges, buffers, strict=True):
            if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
                raise ReadError(f"range [{offset}, {offset + nbytes}) lies outside the namespace "
                                f"({self.size} bytes)")
            if isinstance(buffer, DmaBuffer):
                dest: Any = buffer
                capacity = buffer.nbytes
            else:
                try:
                    dest = as_byte_array(buffer)
                except ValueError as exc:
                    raise ReadError(str(exc)) from None
                capacity = dest.nbytes
            if capacity < nbytes:
                raise ReadError(f"destination of {capacity} bytes cannot hold {nbytes} bytes")
            for start in range(0, nbytes, self.io_size):
                length = min(self.io_size, nbytes - start)
                worker = self._workers[self._next % len(self._workers)]
                self._next += 1
                futures.append(worker.executor.submit(self._read_piece, worker, dest, start,
                                                      offset + start, length))
        return ReadHandle(futures)

    @staticmethod
    def _read_piece(worker: _Worker, dest: Any, dest_start: int, byte_offset: int, nbytes: int) -> None:
        piece = dest[dest_start:dest_start + nbytes]
        try:
            worker.read(piece, byte_offset, nbytes)
        except ReadError:
            raise
        except Exception as exc:  # NVMe status errors, timeouts: one error type for readers
            raise ReadError(f"NVMe read of {nbytes} bytes at byte {byte_offset} failed: {exc}") from exc

    def close(self) -> None:
        if not self._closing.first():
            return
        for worker in self._workers:
            worker.executor.shutdown(wait=True)
        try:
            for worker in self._workers:
                if not self.ctrl.dead:
                    self.ctrl.delete_io_qpair(worker.qpair)
                if worker.namespace._staging is not None:
                    worker.namespace._staging.free()
        finally:
            if self._owns:
                self.ctrl.close()

    def __repr__(self) -> str:
        return f"NvmeBackend({self.name!r}, qpairs={self.queue_pairs}, qd={self.queue_depth}, io={self.io_size})"


def as_numpy(buffer: Any) -> np.ndarray:
    """The bytes of a destination as NumPy (a DmaBuffer's `.view`, else the buffer itself)."""
    view = getattr(buffer, "view", None)
    return view if isinstance(view, np.ndarray) else as_byte_array(buffer)
