"""Queue memory and read workloads shared by every submitter of the doorbell path (the CPU
reference submitter, the GPU kernels): the `struct nvd_ring` / `struct nvd_work` layouts of
native/nvme_ring.h as NumPy dtypes, seeded random reads, and the host memory (rings, PRP list
pages, a destination buffer) laid out for an emulated controller.

Device addresses (IOVAs) are deliberately not the host addresses, and every region is followed by
an unmapped guard page, so a PRP that points one byte too far is caught by the emulator rather
than landing in a neighbour.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from nvmedirect.emulator import EmulatedController
from nvmedirect.host_memory import PAGE_SIZE, address_of, aligned_empty
from nvmedirect.queues.prp import list_pages_needed  # PRP list pages each CID owns

RING_FIELDS = ("sq", "cq", "sq_doorbell", "cq_doorbell", "lists", "list_iovas", "depth", "cq_depth", "queue_depth",
               "list_pages", "nsid", "lba_size", "first", "count", "sq_tail", "cq_head", "cq_phase")
WORK_FIELDS = ("slba", "nblocks", "dst_offset", "dst_pages", "dst_npages", "status")
RING_DTYPE = np.dtype([(name, "<u8") for name in RING_FIELDS])
WORK_DTYPE = np.dtype([(name, "<u8") for name in WORK_FIELDS])
IOVA_BASE = 0x7_0000_0000  # far from any host address on x86-64 user space (those are 0x55.., 0x7f..)

HOST_STATUS, HOST_TIMEOUT, HOST_BUILD_ERROR = 0x10000, 0x01, 0x02  # native/nvme_ring.h


@dataclass
class Workload:
    """Reads: command i reads nblocks[i] LBAs from slba[i] into byte dst_offset[i] of a buffer of
    dst_bytes bytes."""

    slba: np.ndarray
    nblocks: np.ndarray
    dst_offset: np.ndarray
    dst_bytes: int
    lba_size: int

    @property
    def count(self) -> int:
        return len(self.slba)

    def expected(self, backing: np.ndarray, failed: np.ndarray | None = None) -> np.ndarray:
        """The destination buffer after every read that did not fail (`failed`: a bool per command)."""
        out = np.zeros(self.dst_bytes, dtype=np.uint8)
        for i in range(self.count):
            if failed is not None and failed[i]:
                continue
            n = int(self.nblocks[i]) * self.lba_size
            start = int(self.slba[i]) * self.lba_size
            out[int(self.dst_offset[i]):int(self.dst_offset[i]) + n] = backing[start:start + n]
        return out


def random_reads(seed: int, count: int, nsze: int, lba_size: int, max_bytes: int, large_fraction: float = 0.002,
                 ) -> Workload:
    """`count` reads of random sizes (mostly a few LBAs, some up to 64 KiB, a `large_fraction` up to
    `max_bytes`, which with MDTS >= 2 MiB needs chained PRP lists) at random LBAs, packed into the
    destination at dword-aligned random gaps: starts at every offset within a page, some on a page."""
    rng = np.random.default_rng(seed)
    max_blocks = max(1, max_bytes // lba_size)
    kind = rng.random(count)
    small = rng.integers(1, min(8, max_blocks) + 1, count)
    medium = rng.integers(1, min((64 << 10) // lba_size, max_blocks) + 1, count)
    large = rng.integers(max(1, max_blocks // 2), max_blocks + 1, count)
    nblocks = np.where(kind < large_fraction, large, np.where(kind < 0.3, medium, small)).astype(np.uint64)
    slba = (rng.random(count) * (nsze - nblocks + 1)).astype(np.uint64)
    gaps = np.where(rng.random(count) < 0.5, rng.integers(0, PAGE_SIZE // 4, count) * 4, 0).astype(np.uint64)
    sizes = nblocks * np.uint64(lba_size)
    page_starts = rng.random(count) < 0.1  # some reads start on a page: PRP1 without offset
    at, offsets = 0, np.empty(count, dtype=np.uint64)
    for i in range(count):
        at += int(gaps[i])
        if page_starts[i]:
            at = -(-at // PAGE_SIZE) * PAGE_SIZE
        offsets[i] = at
        at += int(sizes[i])
    dst_bytes = -(-max(at, 1) // PAGE_SIZE) * PAGE_SIZE
    return Workload(slba, nblocks, offsets, dst_bytes, lba_size)


@dataclass
class QueueSpec:
    qid: int
    queue_depth: int   # commands in flight at most
    depth: int         # SQ and CQ entries (> queue_depth)


class QueueMemory:
    """Rings, PRP list pages and the destination buffer for `specs`, in page-aligned host memory
    mapped into `emu`, the queues attached, and the workload's commands split among the queues in
    contiguous runs. `allocations` lists every host array (a GPU registers them before use)."""

    def __init__(self, emu: EmulatedController, specs: list[QueueSpec], work: Workload, max_bytes: int):
        self.emu, self.specs, self.work = emu, specs, work
        self.list_pages = list_pages_needed(max_bytes)
        self.allocations: list[np.ndarray] = []
        self._iovas: dict[int, int] = {}  # host address of each mapped array -> its device address
        self._next_iova = getattr(emu, "iova_base", IOVA_BASE)  # a real controller keeps the driver's window
        self.dst = self._mapped(work.dst_bytes)
        self.dst_pages = self._iova(self.dst) + PAGE_SIZE * np.arange(work.dst_bytes // PAGE_SIZE, dtype=np.uint64)
        self.status = np.zeros(work.count, dtype=np.uint32)
        self.queues = []
        bounds = np.linspace(0, work.count, len(specs) + 1).astype(int)
        for spec, first, end in zip(specs, bounds[:-1], bounds[1:], strict=True):
            sq, cq = self._mapped(spec.depth * 64), self._mapped(spec.depth * 16)
            lists = self._mapped(max(1, spec.queue_depth * self.list_pages) * PAGE_SIZE)
            # The device addresses of the list pages: the submitter's table, page-aligned memory of
            # its own (a GPU registers it; two registrations must never share a page).
            nlist = spec.queue_depth * self.list_pages
            list_iovas = aligned_empty(max(8, nlist * 8)).view(np.uint64)
            list_iovas[:nlist] = self._iova(lists) + PAGE_SIZE * np.arange(nlist, dtype=np.uint64)
            self.allocations.append(list_iovas)
            emu.attach(spec.qid, self._iova(sq), spec.depth, self._iova(cq), spec.depth)
            self.queues.append({"spec": spec, "sq": sq, "cq": cq, "lists": lists, "list_iovas": list_iovas,
                                "first": int(first), "count": int(end - first)})
        self.state = np.zeros((len(specs), 3), dtype=np.uint64)  # sq_tail, cq_head, phase per queue
        self.state[:, 2] = 1

    def _mapped(self, nbytes: int) -> np.ndarray:
        array = aligned_empty(-(-nbytes // PAGE_SIZE) * PAGE_SIZE)
        array[:] = 0
        iova = self._next_iova
        self.emu.map(iova, address_of(array), array.nbytes)
        self._next_iova += array.nbytes + PAGE_SIZE  # an unmapped guard page after every region
        self.allocations.append(array)
        self._iovas[address_of(array)] = iova
        return array

    def _iova(self, array: np.ndarray) -> int:
        return self._iovas[address_of(array)]

    def rings(self, view: Callable[[int], int] = int) -> np.ndarray:
        """The `struct nvd_ring` array, addresses as `view` maps host addresses (identity: CPU)."""
        rings = np.zeros(len(self.queues), dtype=RING_DTYPE)
        for k, q in enumerate(self.queues):
            spec = q["spec"]
            r = rings[k]
            r["sq"], r["cq"] = view(address_of(q["sq"])), view(address_of(q["cq"]))
            r["sq_doorbell"] = view(self.emu.doorbell(spec.qid, False))
            r["cq_doorbell"] = view(self.emu.doorbell(spec.qid, True))
            r["lists"], r["list_iovas"] = view(address_of(q["lists"])), view(address_of(q["list_iovas"]))
            r["depth"] = r["cq_depth"] = spec.depth
            r["queue_depth"], r["list_pages"] = spec.queue_depth, self.list_pages
            r["nsid"], r["lba_size"] = 1, self.work.lba_size
            r["first"], r["count"] = q["first"], q["count"]
            r["sq_tail"], r["cq_head"], r["cq_phase"] = self.state[k]
        return rings

    def keep_state(self, rings: np.ndarray) -> None:
        """Carry the ring indices a drive ended with into the next drive (ring wrap across runs)."""
        for k in range(len(self.queues)):
            self.state[k] = rings[k]["sq_tail"], rings[k]["cq_head"], rings[k]["cq_phase"]

    def work_struct(self, slba: int, nblocks: int, dst_offset: int, dst_pages: int, status: int) -> np.ndarray:
        work = np.zeros(1, dtype=WORK_DTYPE)
        work[0] = (slba, nblocks, dst_offset, dst_pages, len(self.dst_pages), status)
        return work

    def host_work(self) -> np.ndarray:
        """`struct nvd_work` with host addresses (the CPU submitter)."""
        w = self.work
        return self.work_struct(address_of(w.slba), address_of(w.nblocks), address_of(w.dst_offset),
                                address_of(self.dst_pages), address_of(self.status))

    def release(self) -> None:
        for spec in self.specs:
            self.emu.detach(spec.qid)
        for iova in self._iovas.values():
            self.emu.unmap(iova)
        self._iovas = {}


def host_drive(memory: QueueMemory, timeout_s: float = 5.0, parallel: bool = False) -> list[int]:
    """Drive every queue of `memory` through its commands from the CPU, one queue after another or
    (`parallel`) one thread per queue; returns each queue's count of successful reads (or a
    negative errno)."""
    from nvmedirect.emulator import ffi, library

    lib = library()
    rings = memory.rings()
    work_struct = memory.host_work()  # alive until the drives are over
    work = ffi.cast("struct nvd_work *", address_of(work_struct))
    results = [0] * len(rings)

    def drive(k: int) -> None:  # cffi releases the GIL for the call: the threads really run at once
        ring = ffi.cast("struct nvd_ring *", address_of(rings) + k * RING_DTYPE.itemsize)
        results[k] = int(lib.nvd_host_drive(ring, work, int(timeout_s * 1e9)))

    if parallel:
        threads = [threading.Thread(target=drive, args=(k,)) for k in range(len(rings))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    else:
        for k in range(len(rings)):
            drive(k)
    memory.keep_state(rings)
    return results


def host_build(memory: QueueMemory, queue: int = 0) -> tuple[np.ndarray, int]:
    """The SQE bytes the CPU builder writes for queue `queue`'s commands (CID k % queue_depth; the
    PRP lists land in that queue's list pages) and its first build error (0: none)."""
    from nvmedirect.emulator import ffi, library

    rings = memory.rings()
    work_struct = memory.host_work()
    out = np.zeros(int(rings[queue]["count"]) * 64, dtype=np.uint8)
    rc = library().nvd_host_build(ffi.cast("struct nvd_ring *", address_of(rings) + queue * RING_DTYPE.itemsize),
                                  ffi.cast("struct nvd_work *", address_of(work_struct)),
                                  ffi.cast("struct nvd_sqe *", address_of(out)))
    return out, int(rc)
