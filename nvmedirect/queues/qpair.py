"""A submission/completion queue pair in DMA memory; the per-command work runs in C.

The life of a command: take a free CID (a stack kept in C; the index is the CID) → build its PRPs
and write the SQE into the ring at the tail → ring the SQ doorbell once per batch → reap the CQ by
phase tag, ring the CQ doorbell once per reap → deliver a Completion (device status, or a host-side
timeout) → the CID goes back on the stack (native/nvme_queue.c).

Two ways in: `submit()` for one command with a Python handle (admin commands, single I/Os), and
`run()` for a `Batch` of extents that C keeps in flight without coming back to Python per command.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from nvmedirect.errors import NvmeDirectError, QueueFull
from nvmedirect.host_memory import PAGE_SIZE
from nvmedirect.queues.batch import Batch
from nvmedirect.queues.command import Command, Completion
from nvmedirect.queues.doorbell import DoorbellStandIn, StandIns
from nvmedirect.queues.prp import list_pages_needed
from nvmedirect.spec import status as st
from nvmedirect.spec.layout import CQE_SIZE, OPCODE_NAMES_ADMIN, OPCODE_NAMES_IO, SQE_SIZE, opcode_name
from nvmedirect.vfio._ffi import ffi, lib
from nvmedirect.vfio.dma import DmaAllocator, DmaBuffer

log = logging.getLogger(__name__)

POLL_BATCH = 64
SPINS_PER_POLL = 256  # empty CQ looks done in C before returning to Python
RUN_SLICE_NS = 20_000_000  # a run comes back to Python this often (signals, Python's own timeouts)
TIMEOUT_CHECK_INTERVAL_S = 0.001
_BUILD_ERRORS = {-1: "transfer outside the DMA buffer", -2: "PRP1 is not dword aligned",
                 -3: "transfer needs more PRP list pages than the command has",
                 lib.NVD_NO_STAGING: "a staged read without staging slots"}
_HOST_STATUSES = {s.sc: s for s in (st.HOST_TIMEOUT, st.HOST_CONTROLLER_RESET, st.HOST_QUEUE_CLOSED)}
_run_start, _DONE = lib.nvd_run_start, lib.NVD_RUN_DONE

Doorbell = int | DoorbellStandIn  # a mapped register's address, or a stand-in (test fakes)


class QueuePair:
    """Queue `qid`'s SQ (`depth` entries) and CQ (`cq_depth`, default the same). `depth - 1`
    commands can be in flight: a full SQ keeps one slot empty so head == tail means empty. A CQ
    larger than the SQ lets the CQ head doorbell wait longer (it is written only when the entries
    are needed, see nvd_push)."""

    def __init__(self, qid: int, depth: int, dma: DmaAllocator, sq_doorbell: Doorbell, cq_doorbell: Doorbell,
                 max_transfer: int, timeout_s: float = 5.0, admin: bool = False, cq_depth: int | None = None):
        cq_depth = depth if cq_depth is None else cq_depth
        if not 2 <= depth <= 65536 or not depth <= cq_depth <= 65536:
            raise NvmeDirectError(f"queue depths must be 2 <= SQ {depth} <= CQ {cq_depth} <= 65536")
        self.qid = qid
        self.depth = depth
        self._usable = depth - 1
        self.cq_depth = cq_depth
        self.admin = admin
        self.timeout_s = timeout_s
        self.max_transfer = max_transfer
        self.closed = False
        self.sq_ring = dma.alloc(depth * SQE_SIZE, contiguous=True)
        try:
            self.cq_ring = dma.alloc(cq_depth * CQE_SIZE, contiguous=True)
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
        usable = depth - 1
        list_pages = list_pages_needed(max_transfer)
        try:
            self._prp_lists = dma.alloc(usable * list_pages * PAGE_SIZE) if list_pages else None
        except BaseException:
            self.sq_ring.free()
            self.cq_ring.free()
            raise
        q = self._native = ffi.new("struct nvd_qpair *")
        # The per-CID arrays C works on; kept here so they live as long as the queue pair.
        self._arrays = [ffi.new(f"{kind}[]", usable) for kind in
                        ("uint16_t", "uint32_t", "uint64_t", "uint8_t *", "uint32_t", "uint32_t", "uint16_t")]
        (q.free_cids, q.tags, q.submitted_ns, q.copy_dst, q.copy_src, q.copy_len, q.slot) = self._arrays
        q.sq = ffi.cast("struct nvd_sqe *", self.sq_ring.address)
        q.cq = ffi.cast("struct nvd_cqe *", self.cq_ring.address)
        q.depth, q.cq_depth = depth, cq_depth
        q.timeout_ns = int(timeout_s * 1e9)
        if self._prp_lists is not None:
            q.prp_list_host = ffi.cast("uint64_t *", self._prp_lists.address)
            q.prp_list_pages = self._prp_lists._allocation.page_pointer
            q.list_pages = list_pages
        self._stand_ins = self._connect_doorbells(sq_doorbell, cq_doorbell)
        lib.nvd_reset(q, 0)
        self._commands: list[Command | None] = [None] * usable
        self._cqes = ffi.new("struct nvd_cqe[]", POLL_BATCH)
        self._cdw = ffi.new("uint32_t[6]")
        self._opcode_names = OPCODE_NAMES_ADMIN if admin else OPCODE_NAMES_IO
        self._late_seen = 0
        self._next_timeout_check = 0.0
        self.on_timeout: Callable[[QueuePair], None] | None = None  # controller health check hook

    def _connect_doorbells(self, sq: Doorbell, cq: Doorbell) -> StandIns | None:
        q = self._native
        if isinstance(sq, int) and isinstance(cq, int):
            q.sq_doorbell = ffi.cast("uint32_t *", sq)
            q.cq_doorbell = ffi.cast("uint32_t *", cq)
            return None
        stand_ins = StandIns(sq, cq)
        self._handle = ffi.new_handle(stand_ins)
        q.sq_doorbell = q.cq_doorbell = ffi.NULL
        q.hook = self._handle
        return stand_ins

    def _check_stand_ins(self) -> None:
        if self._stand_ins is not None:
            self._stand_ins.check()

    # -- state ---------------------------------------------------------------------------------
    @property
    def idle_sleep_s(self) -> float:
        """0: pure polling; else sleep this long whenever a wait finds nothing (Python's polls and
        the native loop alike), so a shared host's other work (a VM's device emulation) gets the core."""
        return self._native.idle_sleep_ns / 1e9

    @idle_sleep_s.setter
    def idle_sleep_s(self, seconds: float) -> None:
        self._native.idle_sleep_ns = int(seconds * 1e9)

    @property
    def outstanding(self) -> int:
        return self.depth - 1 - self._native.nfree - self._native.quarantined

    @property
    def free_slots(self) -> int:
        """Commands that can be submitted now; 0 is the "queue full" signal."""
        return self._native.nfree

    @property
    def doorbell_writes(self) -> tuple[int, int]:
        """(SQ tail, CQ head) doorbell writes so far: each is a VM exit on an emulated controller."""
        return self._native.sq_doorbells, self._native.cq_doorbells

    @property
    def posted_completions(self) -> int:
        """CQEs the device has posted that `poll()` has not reaped yet (read-only: the phase tags
        from the CQ head on, no doorbell written)."""
        q, cq = self._native, self._native.cq
        head, phase, posted = q.cq_head, q.phase, 0
        while posted < self.cq_depth and (cq[head].status & 1) == phase:
            posted += 1
            head += 1
            if head == self.cq_depth:
                head, phase = 0, phase ^ 1
        return posted

    @property
    def sq_tail(self) -> int:
        return self._native.sq_tail

    @property
    def sq_head(self) -> int:
        return self._native.sq_head

    # -- single commands -------------------------------------------------------------------------
    def submit(self, opcode: int, nsid: int = 0, cdw10: int = 0, cdw11: int = 0, cdw12: int = 0,
               cdw13: int = 0, cdw14: int = 0, cdw15: int = 0, data: DmaBuffer | None = None,
               data_len: int | None = None, context=None, callback: Callable[[Command], None] | None = None,
               timeout_s: float | None = None, ring: bool = True, prp1: int | None = None) -> Command:
        """Queue one command moving the first `data_len` bytes (default: all) of `data`. With
        `ring=False` the doorbell waits for `ring_doorbell()`, so a batch costs one MMIO write.
        `prp1` passes a bare address (queue creation) instead of `data`. Raises QueueFull when no
        CID is free; the caller polls and submits again."""
        if self.closed:
            raise NvmeDirectError(f"queue {self.qid} is closed")
        cdw = self._cdw
        cdw[0], cdw[1], cdw[2], cdw[3], cdw[4], cdw[5] = cdw10, cdw11, cdw12, cdw13, cdw14, cdw15
        if data is not None:
            nbytes = data.nbytes if data_len is None else data_len
            if not 0 <= nbytes <= min(data.nbytes, self.max_transfer):
                raise NvmeDirectError(f"{nbytes}-byte transfer: must fit the {data.nbytes}-byte buffer and "
                                      f"this queue's {self.max_transfer}-byte limit (split it)")
            allocation = data._allocation
            if allocation.freed:
                raise NvmeDirectError("DMA buffer used after free")
            cid = lib.nvd_submit(self._native, opcode, nsid, cdw, allocation.page_pointer,
                                 len(allocation.page_addresses), data._offset, nbytes, 0, ring)
        else:
            cid = lib.nvd_submit(self._native, opcode, nsid, cdw, ffi.NULL, 0, 0, 0, prp1 or 0, ring)
        self._check_stand_ins()
        if cid < 0:
            if cid == lib.NVD_QUEUE_FULL:
                raise QueueFull(f"queue {self.qid}: all {self.depth - 1} command slots in flight")
            raise NvmeDirectError(_BUILD_ERRORS.get(cid, f"command build failed ({cid})"))
        now = time.monotonic()
        command = Command(self, cid, self._opcode_names.get(opcode) or opcode_name(opcode, self.admin),
                          context, callback, now + (self.timeout_s if timeout_s is None else timeout_s), now)
        self._commands[cid] = command
        return command

    def ring_doorbell(self) -> None:
        """Announce every SQE written since the last ring with a single tail doorbell write."""
        lib.nvd_ring(self._native)
        self._check_stand_ins()

    def poll(self, max_completions: int = POLL_BATCH, spin: bool = False) -> int:
        """Reap up to `max_completions` CQEs, write the CQ head doorbell once, deliver them; also
        deliver timeouts that fell due. Returns how many commands finished."""
        count = min(max_completions, POLL_BATCH)
        found = lib.nvd_reap(self._native, self._cqes, count, SPINS_PER_POLL if spin else 1)
        self._check_stand_ins()
        if not found and spin and self.idle_sleep_s:
            # Nothing yet: give the CPU away briefly. On a shared host (a TCG guest, a busy box)
            # the device's emulation or the rest of the pipeline may need the core we would spin on.
            time.sleep(self.idle_sleep_s)
        if self._native.late_completions != self._late_seen:
            log.warning("queue %d: %d late completions of timed-out commands; their slots are free again",
                        self.qid, self._native.late_completions - self._late_seen)
            self._late_seen = self._native.late_completions
        finished = 0
        now = time.monotonic()
        for i in range(found):
            cqe = self._cqes[i]
            finished += self._deliver(cqe.cid, st.NvmeStatus.from_cqe_status(cqe.status), cqe.dw0, now)
        if now >= self._next_timeout_check:
            self._next_timeout_check = now + TIMEOUT_CHECK_INTERVAL_S
            finished += self._expire(now)
        return finished

    def _deliver(self, cid: int, status: st.NvmeStatus, dw0: int, now: float) -> int:
        command = self._commands[cid] if cid < len(self._commands) else None
        if command is None:
            log.error("queue %d: completion for idle cid %d ignored (%s)", self.qid, cid, status)
            return 0
        self._commands[cid] = None
        self._complete(command, status, dw0, now)
        return 1

    @staticmethod
    def _complete(command: Command, status: st.NvmeStatus, dw0: int, now: float) -> None:
        command.completion = Completion(command.cid, status, dw0, command.opcode, now - command.submitted_at)
        if command.callback is not None:
            command.callback(command)

    def _expire(self, now: float) -> int:
        expired = [c for c in self._commands if c is not None and c.deadline <= now]
        if not expired:
            return 0
        if self.on_timeout is not None:
            self.on_timeout(self)  # may fail everything (fatal controller) before we get here again
        finished = 0
        for command in expired:
            if self._commands[command.cid] is not command:
                continue  # already failed by the health check
            self._commands[command.cid] = None
            # The device may still write this command's data or post its CQE, so the CID stays out
            # of circulation until it completes late or the queue is rebuilt.
            lib.nvd_quarantine(self._native, command.cid)
            log.error("queue %d: cid %d (%s) timed out after %.3f s", self.qid, command.cid,
                      command.opcode, now - command.submitted_at)
            self._complete(command, st.HOST_TIMEOUT, 0, now)
            finished += 1
        return finished

    # -- batches ---------------------------------------------------------------------------------
    def run(self, batch: Batch, max_in_flight: int | None = None) -> int:
        """Move every extent of `batch`, keeping up to `max_in_flight` commands in flight (default:
        as many as the queue holds). Raises the first failure once nothing is left in flight (so no
        DMA still targets the caller's memory). Returns the number of commands."""
        # Kept short: a caller reading one request at a time pays this per request.
        if self.closed:
            raise NvmeDirectError(f"queue {self.qid} is closed")
        if not batch.count:
            return 0
        run = batch.native_run()
        limit = self._usable if max_in_flight is None or max_in_flight > self._usable else max(1, max_in_flight)
        try:
            outcome = _run_start(self._native, run, limit, RUN_SLICE_NS)
            if outcome != _DONE or self._stand_ins is not None:
                outcome = self._drive(run, outcome)  # not done in one slice, failed, or a test fake
        except BaseException:
            run.stop = 1  # an interruption: nothing new goes out, what is in flight must land first
            self._drive(run, lib.NVD_RUN_AGAIN)
            raise
        if outcome != _DONE:
            if run.error:
                raise NvmeDirectError(_BUILD_ERRORS.get(run.error, f"command build failed ({run.error})"))
            raise self._run_failure(batch, run)
        return batch.commands

    def _drive(self, run, outcome: int) -> int:
        """Go on with a run until it is done or failed; returns that outcome."""
        while True:
            self._check_stand_ins()
            if outcome in (lib.NVD_RUN_DONE, lib.NVD_RUN_FAILED):
                return outcome
            if outcome == lib.NVD_RUN_FOREIGN:
                self.poll()  # completions of single commands submitted before the batch
            elif outcome == lib.NVD_RUN_TIMEOUT:
                if self.on_timeout is not None:
                    self.on_timeout(self)  # a fatal controller is reset: that fails the run as well
                expired = lib.nvd_run_expire(self._native, run, st.SC_HOST_TIMEOUT)
                if expired:
                    log.error("queue %d: %d commands of a batch timed out after %.1f s", self.qid, expired,
                              self.timeout_s)
            elif any(c is not None for c in self._commands):
                self._expire(time.monotonic())
            outcome = lib.nvd_run(self._native, run, RUN_SLICE_NS)

    def _run_failure(self, batch: Batch, run) -> NvmeDirectError:
        status_word = run.failed_status
        if status_word & lib.NVD_HOST_STATUS:
            status = _HOST_STATUSES[status_word & 0xFF]
        else:
            status = st.NvmeStatus.from_cqe_status(status_word)
        extent = batch.extents[run.failed_extent]
        opcode = self._opcode_names.get(batch.opcode) or opcode_name(batch.opcode, self.admin)
        return status.exception(opcode=f"{opcode} of LBAs {extent.slba}+{extent.nblocks}")

    # -- waiting ---------------------------------------------------------------------------------
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

    def fail_all(self, status: st.NvmeStatus) -> int:
        """Complete every command in flight with a host status (after a reset or on close); every
        CID is free again and the ring indices start over."""
        lib.nvd_reset(self._native, status.sc)
        now = time.monotonic()
        failed = 0
        for cid, command in enumerate(self._commands):
            if command is not None:
                self._commands[cid] = None
                self._complete(command, status, 0, now)
                failed += 1
        return failed

    def reset(self) -> None:
        """Forget ring state after a controller reset: in-flight commands fail with a host
        status, indices return to zero, the rings are cleared for the re-created queues."""
        self.fail_all(st.HOST_CONTROLLER_RESET)
        self.sq_ring.view[:] = 0
        self.cq_ring.view[:] = 0

    # -- lifetime --------------------------------------------------------------------------------
    def free(self) -> None:
        """Release the rings and PRP lists (the controller must have deleted the queue or be off).
        Safe to call again."""
        if self.closed:
            return
        self.closed = True
        self.fail_all(st.HOST_QUEUE_CLOSED)
        for buffer in (self.sq_ring, self.cq_ring, self._prp_lists):
            if buffer is not None:
                buffer.free()
