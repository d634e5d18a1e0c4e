"""Reads through the userspace NVMe driver: one worker thread per I/O queue pair.

Each `read_async` cuts its ranges into pieces of at most `io_size` bytes and deals them round-robin
to the queue pairs; a worker owns its queue pair and its own namespace view (with its own DMA
staging slots), so no lock is shared on the I/O path. A worker hands all its pieces of one call to
the driver's `Namespace.run`, which keeps up to `queue_depth` commands in flight (one doorbell per
batch). The spin-poll runs in C through cffi with the GIL released, so the workers really overlap.

Destinations that are `DmaBuffer`s (from `alloc`) receive the data by DMA directly; any other
writable buffer (e.g. CuPy pinned memory) is filled from the worker's DMA staging slots.
"""

from __future__ import annotations

import itertools
import threading
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from nvmedirect.errors import Notice
from nvmedirect.host_memory import as_byte_array, gpu_present
from nvmedirect.reader.base import ByteRange, ReadError, ReadHandle, StorageBackend

DEFAULT_QUEUE_PAIRS = 2
DEFAULT_QUEUE_DEPTH = 63  # + 1 free entry = 64 SQEs = one 4 KiB ring page (no-IOMMU needs no huge page)
DEFAULT_IO_SIZE = 4 << 20


class FewerQueuePairs(Notice):
    """The controller grants fewer I/O queue pairs than were asked for; the backend uses those."""


class _Worker:
    """A queue pair, the namespace view that stages through it, and the thread that drives both."""

    def __init__(self, ctrl: Any, info: Any, depth: int):
        from nvmedirect.nvme.namespace import Namespace

        self.depth = depth
        self.qpair = ctrl.create_io_qpair(depth + 1)  # a ring of N entries holds N-1 commands
        self.namespace = Namespace(ctrl, info)  # its own staging slots: nothing shared between workers
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"nvme-qp{self.qpair.qid}")

    def read_pieces(self, pieces: list[tuple[Any, int, int]]) -> None:
        """All (destination, byte offset, nbytes) pieces in one batch that the driver keeps in
        flight: straight into `dest` where it is DMA memory and the bytes cover whole LBAs at a
        dword-aligned address, otherwise through the staging slots and a copy (done in C)."""
        batch = self.namespace.batch()
        for dest, offset, nbytes in pieces:
            self.namespace.read_batch(batch, dest, offset, nbytes)
        self.namespace.run(batch, self.qpair, max_in_flight=self.depth)

    def close(self, ctrl: Any) -> None:
        self.executor.shutdown(wait=True)
        if not ctrl.dead:
            ctrl.delete_io_qpair(self.qpair)
        self.namespace.release_staging()


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
        self._close_lock = threading.Lock()  # a second close() waits until the first has finished
        self._closed = False
        self.failure: str | None = None  # why reads stopped (the kernel took the device back)
        self._workers: list[_Worker] = []
        free = ctrl.io_queue_limit - len(ctrl.io_qpairs)
        if free < 1:
            raise ReadError(f"{self.name}: all {ctrl.io_queue_limit} I/O queue pairs of the controller are in use")
        if free < queue_pairs:
            warnings.warn(FewerQueuePairs(f"{self.name}: the controller grants {free} I/O queue pair(s), "
                                          f"{queue_pairs} were asked for: reading with {free}"), stacklevel=2)
            queue_pairs = free
        try:
            for _ in range(queue_pairs):
                self._workers.append(_Worker(ctrl, self.info, queue_depth))
        except BaseException:
            self.close()
            raise
        self._deal = itertools.count()  # round-robin position; next() on it is atomic in CPython
        on_removal = getattr(ctrl, "on_removal_request", None)
        if on_removal is not None:
            on_removal(self._removal_requested)

    def _removal_requested(self) -> None:
        """The kernel wants the device back (a hot-unplug, an unbind; on the controller's watcher
        thread): new reads are refused, the batches in flight end, and the queues, the controller
        and the device are released, so the removal goes on while this process runs."""
        self.failure = (f"{self.name}: the kernel asked for the device back (hot-unplug or unbind): reads "
                        "stopped and the device was released")
        self.close()

    @classmethod
    def open(cls, bdf: str, *, noiommu: bool | None = None, nsid: int = 1,
             queue_pairs: int = DEFAULT_QUEUE_PAIRS, **options: Any) -> NvmeBackend:
        """Opens and starts the controller at `bdf` (bound to vfio-pci) and reads namespace `nsid`."""
        from nvmedirect.nvme.controller import Controller

        options.pop("lba_size", None)  # the namespace reports its own
        ctrl = Controller.open(bdf, noiommu=noiommu, io_queues=queue_pairs)
        try:
            return cls(ctrl, nsid=nsid, queue_pairs=queue_pairs, owns_controller=True,
                       name=f"{bdf} nsid {nsid}", **options)
        except BaseException:
            ctrl.close()  # a backend that failed half-way closed it already: closing again is a no-op
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

        if self.failure is not None:
            raise ReadError(self.failure)
        if len(ranges) != len(buffers):
            raise ReadError(f"{len(ranges)} ranges but {len(buffers)} destination buffers")
        dealt: list[list[tuple[Any, int, int]]] = [[] for _ in self._workers]
        for (offset, nbytes), buffer in zip(ranges, buffers, strict=True):
            if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
                raise ReadError(f"range [{offset}, {offset + nbytes}) lies outside the namespace "
                                f"({self.size} bytes)")
            if isinstance(buffer, DmaBuffer):
                dest: Any = buffer
            else:
                try:
                    dest = as_byte_array(buffer)
                except ValueError as exc:
                    raise ReadError(str(exc)) from None
            if dest.nbytes < nbytes:
                raise ReadError(f"destination of {dest.nbytes} bytes cannot hold {nbytes} bytes")
            # Pieces end on io_size boundaries of the device, so all but a range's first and last
            # are LBA-aligned (and can go straight into DMA memory).
            position, end = offset, offset + nbytes
            while position < end:
                piece_end = min(end, position - position % self.io_size + self.io_size)
                at = position - offset
                worker = next(self._deal) % len(self._workers)
                dealt[worker].append((dest[at:at + piece_end - position], position, piece_end - position))
                position = piece_end
        try:
            futures = [worker.executor.submit(self._run, worker, pieces)
                       for worker, pieces in zip(self._workers, dealt, strict=True) if pieces]
        except RuntimeError:  # the executors shut down meanwhile: the backend was closed
            raise ReadError(self.failure or f"{self.name}: the reader is closed") from None
        return ReadHandle(futures)

    def _run(self, worker: _Worker, pieces: list[tuple[Any, int, int]]) -> None:
        if self.failure is not None:  # queued before the kernel's request: never issued
            raise ReadError(self.failure)
        try:
            worker.read_pieces(pieces)
        except ReadError:
            raise
        except Exception as exc:  # NVMe status errors, timeouts: one error type for readers
            if self.failure is not None:
                raise ReadError(self.failure) from exc
            # the device and the LBAs, so the line alone says where the drive failed
            start, end = min(p[1] for p in pieces), max(p[1] + p[2] for p in pieces)
            lbas = f"LBAs {start // self.lba_size}..{(end - 1) // self.lba_size}"
            raise ReadError(f"{self.name}: NVMe read of {lbas} (bytes {start}..{end}) failed: {exc}") from exc

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            try:
                for worker in self._workers:
                    worker.close(self.ctrl)
            finally:
                if self._owns:
                    self.ctrl.close()

    def __repr__(self) -> str:
        return f"NvmeBackend({self.name!r}, qpairs={self.queue_pairs}, qd={self.queue_depth}, io={self.io_size})"

