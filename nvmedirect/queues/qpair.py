"""A submission/completion queue pair in DMA memory, with preallocated trackers indexed by CID.

The life of a command: take a free tracker (its index is the CID) → fill its SQE and PRPs → copy
the SQE into the ring at the tail → ring the SQ doorbell once per batch → poll the CQ by phase tag,
ring the CQ doorbell once per poll → deliver a Completion (device status, or a host-side timeout)
to the command's handle and callback → return the tracker to the free list.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from nvmedirect.errors import NvmeDirectError, QueueFull
from nvmedirect.queues.command import Command, Completion
from nvmedirect.queues.doorbell import Doorbell
from nvmedirect.queues.prp import PAGE_SIZE, list_pages_needed
from nvmedirect.spec import status as st
from nvmedirect.spec.layout import CQE_SIZE, OPCODE_NAMES_ADMIN, OPCODE_NAMES_IO, SQE_SIZE, opcode_name
from nvmedirect.vfio._ffi import ffi, lib
from nvmedirect.vfio.dma import DmaAllocator, DmaBuffer

log = logging.getLogger(__name__)

POLL_BATCH = 64
SPINS_PER_POLL = 256  # empty CQ looks done in C before returning to Python
TIMEOUT_CHECK_INTERVAL_S = 0.001
_PRP_ERRORS = {-1: "transfer outside the DMA buffer", -2: "PRP1 is not dword aligned",
               -3: "transfer needs more PRP list pages than the command has"}


class Tracker:
    """Per-CID state allocated once: the SQE being built, the PRP list pages, the live command."""

    __slots__ = ("cid", "prp_list", "prp_entries", "prp_pages", "list_pages", "command")

    def __init__(self, cid: int, prp_list: DmaBuffer | None):
        self.cid = cid
        self.prp_list = prp_list
        if prp_list is not None:
            self.prp_entries = ffi.cast("uint64_t *", prp_list.address)
            self.prp_pages = np.ascontiguousarray(prp_list.page_addresses(), dtype=np.uint64)
            self.list_pages = ffi.cast("uint64_t *", self.prp_pages.ctypes.data)
        else:
            self.prp_entries = self.list_pages = ffi.NULL
            self.prp_pages = np.zeros(0, dtype=np.uint64)
        self.command: Command | None = None


class QueuePair:
    """Queue `qid`'s SQ and CQ (`depth` entries each). `depth - 1` commands can be in flight: a
    full SQ keeps one slot empty so head == tail means empty."""

    def __init__(self, qid: int, depth: int, dma: DmaAllocator, sq_doorbell: Doorbell, cq_doorbell: Doorbell,
                 max_transfer: int, timeout_s: float = 5.0, admin: bool = False):
        if not 2 <= depth <= 65536:
            raise NvmeDirectError(f"queue depth must be 2..65536, got {depth}")
        self.qid = qid
        self.depth = depth
        self.admin = admin
        self.timeout_s = timeout_s
        self.max_transfer = max_transfer
        self._dma = dma
        self._sq_doorbell = sq_doorbell
        self._cq_doorbell = cq_doorbell
        self.sq_ring = dma.alloc(depth * SQE_SIZE, contiguous=True)
        try:
            self.cq_ring = dma.alloc(depth * CQE_SIZE, contiguous=True)
        except BaseException:
            self.sq_ring.free()
            raise
        for ring in (self.sq_ring, self.cq_ring):
            ring.view[:] = 0
            if not ring.contiguous:
                self.sq_ring.free()
                self.cq_ring.free()
                raise NvmeDirectError(
                    f"queue {qid} ring of {ring.nbytes} bytes is not physically contiguous: use a depth "
                    f"of at most {PAGE_SIZE // SQE_SIZE} or reserve huge pages (vm.nr_hugepages)")
        self._sq = ffi.cast("struct nvd_sqe *", self.sq_ring.address)
        self._cq = ffi.cast("struct nvd_cqe *", self.cq_ring.address)
        self._cq_head = ffi.new("uint32_t *", 0)
        self._cq_phase = ffi.new("uint32_t *", 1)  # the controller writes phase 1 on its first pass
        self._cqes = ffi.new("struct nvd_cqe[]", POLL_BATCH)
        self._prps = ffi.new("uint64_t[2]")
        self._opcode_names = OPCODE_NAMES_ADMIN if admin else OPCODE_NAMES_IO
        self.sq_tail = 0
        self.sq_head = 0
        self._unrung = 0  # SQEs copied into the ring but not yet announced by a doorbell
        list_pages = list_pages_needed(max_transfer)
        usable = depth - 1
        self._prp_lists = dma.alloc(max(1, usable * list_pages) * PAGE_SIZE) if list_pages else None
        self._trackers = []
        for cid in range(usable):
            prp = (self._prp_lists[cid * list_pages * PAGE_SIZE:(cid + 1) * list_pages * PAGE_SIZE]
                   if list_pages else None)
            self._trackers.append(Tracker(cid, prp))
        self._free_cids = list(range(usable - 1, -1, -1))  # pop() hands out low CIDs first
        self._quarantined: set[int] = set()  # CIDs timed out: the device may still complete them
        self._next_timeout_check = 0.0
        self.on_timeout: Callable[[QueuePair], None] | None = None  # controller health check hook
        self.idle_sleep_s = 0.0  # 0: pure polling; else sleep this long after an empty spin
        self.closed = False

    # -- state ---------------------------------------------------------------------------------
    @property
    def outstanding(self) -> int:
        return len(self._trackers) - len(self._free_cids) - len(self._quarantined)

    @property
    def free_slots(self) -> int:
        """Commands that can be submitted now; 0 is the "queue full" signal."""
        return len(self._free_cids)

    # -- submit --------------------------------------------------------------------------------
    def submit(self, opcode: int, nsid: int = 0, cdw10: int = 0, cdw11: int = 0, cdw12: int = 0,
               cdw13: int = 0, cdw14: int = 0, cdw15: int = 0, data: DmaBuffer | None = None,
               data_len: int | None = None, context=None, callback: Callable[[Command], None] | None = None,
               timeout_s: float | None = None, ring: bool = True, prp1: int | None = None) -> Command:
        """Queue one command moving the first `data_len` bytes (default: all) of `data`. With
        `ring=False` the doorbell waits for `ring_doorbell()`, so a batch costs one MMIO write.
        `prp1` passes a bare address (queue creation) instead of `data`. Raises QueueFull when no
        tracker is free; the caller polls and submits again."""
        if self.closed:
            raise NvmeDirectError(f"queue {self.qid} is closed")
        if not self._free_cids:
            raise QueueFull(f"queue {self.qid}: all {len(self._trackers)} command slots in flight")
        prps = self._prps
        prps[0] = prps[1] = 0
        if data is not None:
            nbytes = data.nbytes if data_len is None else data_len
            if not 0 <= nbytes <= min(data.nbytes, self.max_transfer):
                raise NvmeDirectError(f"{nbytes}-byte transfer: must fit the {data.nbytes}-byte buffer and "
                                      f"this queue's {self.max_transfer}-byte limit (split it)")
            allocation = data._allocation
            if allocation.freed:
                raise NvmeDirectError("DMA buffer used after free")
        else:
            nbytes = 0
        cid = self._free_cids.pop()
        tracker = self._trackers[cid]
        if nbytes:
            rc = lib.nvd_build_prps(allocation.page_pointer, len(allocation.page_addresses), data._offset,
                                    nbytes, tracker.prp_entries, tracker.list_pages, len(tracker.prp_pages), prps)
            if rc:
                self._free_cids.append(cid)
                raise NvmeDirectError(_PRP_ERRORS.get(rc, f"PRP build failed ({rc})"))
        elif prp1 is not None:
            prps[0] = prp1
        now = time.monotonic()
        command = Command(self, cid, self._opcode_names.get(opcode) or opcode_name(opcode, self.admin),
                          context, callback, now + (self.timeout_s if timeout_s is None else timeout_s), now)
        tracker.command = command
        self.sq_tail = lib.nvd_sq_write(self._sq, self.depth, self.sq_tail, opcode, cid, nsid, prps[0], prps[1],
                                        cdw10, cdw11, cdw12, cdw13, cdw14, cdw15)
        self._unrung += 1
        if ring:
            self.ring_doorbell()
        return command

    def ring_doorbell(self) -> None:
        """Announce every SQE copied since the last ring with a single tail doorbell write."""
        if self._unrung:
            self._sq_doorbell.ring(self.sq_tail)
            self._unrung = 0

    # -- completions ---------------------------------------------------------------------------
    def poll(self, max_completions: int = POLL_BATCH, spin: bool = False) -> int:
        """Reap up to `max_completions` CQEs, write the CQ head doorbell once, deliver them; also
        deliver timeouts that fell due. Returns how many commands finished."""
        self.ring_doorbell()
        count = min(max_completions, POLL_BATCH)
        if spin:
            found = lib.nvd_cq_poll_spin(self._cq, self.depth, self._cq_head, self._cq_phase,
                                         self._cqes, count, SPINS_PER_POLL)
        else:
            found = lib.nvd_cq_poll(self._cq, self.depth, self._cq_head, self._cq_phase, self._cqes, count)
        if found:
            self._cq_doorbell.ring(self._cq_head[0])
        elif spin and self.idle_sleep_s:
            # Nothing yet: give the CPU away briefly. On a shared host (a TCG guest, a busy box)
            # the device's emulation or the rest of the pipeline may need the core we would spin on.
            time.sleep(self.idle_sleep_s)
        finished = 0
        now = time.monotonic()
        for i in range(found):
            cqe = self._cqes[i]
            self.sq_head = cqe.sq_head
            finished += self._deliver(cqe.cid, st.NvmeStatus.from_cqe_status(cqe.status), cqe.dw0, now)
        if now >= self._next_timeout_check:
            self._next_timeout_check = now + TIMEOUT_CHECK_INTERVAL_S
            finished += self._expire(now)
        return finished

    def _deliver(self, cid: int, status: st.NvmeStatus, dw0: int, now: float) -> int:
        if cid in self._quarantined:
            # A command we already reported as timed out finished after all; now the slot is safe.
            log.warning("queue %d: late completion for timed-out cid %d (%s)", self.qid, cid, status)
            self._quarantined.discard(cid)
            self._free_cids.append(cid)
            return 0
        if cid >= len(self._trackers) or self._trackers[cid].command is None:
            log.error("queue %d: completion for idle cid %d ignored (%s)", self.qid, cid, status)
            return 0
        tracker = self._trackers[cid]
        command = tracker.command
        tracker.command = None
        self._free_cids.append(cid)
        self._complete(command, status, dw0, now)
        return 1

    @staticmethod
    def _complete(command: Command, status: st.NvmeStatus, dw0: int, now: float) -> None:
        command.completion = Completion(command.cid, status, dw0, command.opcode, now - command.submitted_at)
        if command.callback is not None:
            command.callback(command)

    def _expire(self, now: float) -> int:
        expired = [t for t in self._trackers if t.command is not None and t.command.deadline <= now]
        if not expired:
            return 0
        if self.on_timeout is not None:
            self.on_timeout(self)  # may fail everything (fatal controller) before we get here again
        finished = 0
        for tracker in expired:
            command = tracker.command
            if command is None:
                continue
            tracker.command = None
            # The device may still write this command's data or post its CQE, so the CID stays out
            # of circulation until it completes late or the queue is rebuilt.
            self._quarantined.add(tracker.cid)
            log.error("queue %d: cid %d (%s) timed out after %.3f s", self.qid, tracker.cid,
                      command.opcode, now - command.submitted_at)
            self._complete(command, st.HOST_TIMEOUT, 0, now)
            finished += 1
        return finished

    def fail_all(self, status: st.NvmeStatus) -> int:
        """Complete every command in flight with a host status (after a reset or on close)."""
        now = time.monotonic()
        failed = 0
        for tracker in getattr(self, "_trackers", []):
            if tracker.command is not None:
                command, tracker.command = tracker.command, None
                self._free_cids.append(tracker.cid)
                self._complete(command, status, 0, now)
                failed += 1
        self._free_cids.extend(self._quarantined)
        self._quarantined.clear()
        return failed

    # -- waiting -------------------------------------------------------------------------------
    def wait_for(self, command: Command) -> None:
        while command.completion is None:
            self.poll(spin=True)

    def drain(self) -> None:
        """Poll until nothing is in flight (each command ends by completion or timeout)."""
        while self.outstanding:
            self.poll(spin=True)

    def execute(self, opcode: int, **fields) -> Completion:
        """Blocking: submit one command, wait, raise the named error if it failed."""
        return self.submit(opcode, **fields).result()

    def reset(self) -> None:
        """Forget ring state after a controller reset: in-flight commands fail with a host
        status, indices return to zero, the rings are cleared for the re-created queues."""
        self.fail_all(st.HOST_CONTROLLER_RESET)
        self.sq_ring.view[:] = 0
        self.cq_ring.view[:] = 0
        self.sq_tail = self.sq_head = self._unrung = 0
        self._cq_head[0] = 0
        self._cq_phase[0] = 1

    # -- lifetime ------------------------------------------------------------------------------
    def free(self) -> None:
        """Release the rings and PRP lists (the controller must have deleted the queue or be off)."""
        self.closed = True
        self.fail_all(st.HOST_QUEUE_CLOSED)
        for buffer in (getattr(self, "sq_ring", None), getattr(self, "cq_ring", None),
                       getattr(self, "_prp_lists", None)):
            if buffer is not None:
                buffer.free()
