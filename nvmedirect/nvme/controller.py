"""An NVMe controller driven from user space: bring-up, admin commands, I/O queue pairs, recovery.

Typical use::

    with Controller.open("0000:00:04.0") as ctrl:      # IOMMU or no-IOMMU, as its VFIO group is
        ns = ctrl.namespace(1)
        ns.read_into(buffer, byte_offset=12345, nbytes=1000)
"""

from __future__ import annotations

import atexit
import logging
import os
import select
import threading
import weakref
from collections.abc import Callable

from nvmedirect.errors import ControllerError, NvmeDirectError
from nvmedirect.nvme import bringup
from nvmedirect.nvme.identify import ControllerInfo, NamespaceInfo
from nvmedirect.queues.qpair import QueuePair
from nvmedirect.spec import layout
from nvmedirect.spec import status as st
from nvmedirect.spec.layout import AdminOpcode, Cns, FeatureId, Reg
from nvmedirect.vfio.dma import DmaAllocator, allocator_for

log = logging.getLogger(__name__)

DEFAULT_MAX_TRANSFER = 2 << 20  # per command; MDTS may lower it
ADMIN_DEPTH = 32
ADMIN_TIMEOUT_S = 5.0
IO_CQ_MIN_ENTRIES = 256  # 4 KiB of 16-byte CQEs
CAP_TO_UNIT_S = 0.5  # CAP.TO counts 500 ms units


class Controller:
    """One controller reached through `bar` (BAR0: read32/write32/read64/write64/doorbell) with DMA
    memory from `dma`. `start()` brings it up; `close()` shuts it down and frees every mapping."""

    def __init__(self, bar, dma: DmaAllocator, *, io_timeout_s: float = 5.0,
                 max_transfer: int = DEFAULT_MAX_TRANSFER, poll_idle_sleep_s: float = 0.0, owner=None):
        self.bar = bar
        self.dma = dma
        self._owner = owner  # the VfioDevice when opened by `open()`; closed last
        self.cap = layout.cap(bar.read64(Reg.CAP))
        if self.cap.raw == 0xFFFFFFFFFFFFFFFF:
            raise ControllerError("CAP reads as all ones: the controller is not responding")
        self.dstrd = int(self.cap.bits.dstrd)
        self.max_queue_entries = int(self.cap.bits.mqes) + 1
        self.ready_timeout_s = max(int(self.cap.bits.to), 1) * CAP_TO_UNIT_S
        self.version = bar.read32(Reg.VS)
        self.io_timeout_s = io_timeout_s
        self.poll_idle_sleep_s = poll_idle_sleep_s
        self._max_transfer_wanted = max_transfer
        self.max_transfer = max_transfer
        self.admin: QueuePair | None = None
        self.io_qpairs: dict[int, QueuePair] = {}
        self.io_queue_limit = 0
        self.info: ControllerInfo | None = None
        self.dead = False
        self.closed = False
        self._namespaces: dict[int, object] = {}
        self._default_qpair: QueuePair | None = None
        # the kernel's request for the device back (VFIO device-request interrupt): set once, and
        # each callback (a reader releasing the device) runs on the watcher thread
        self.removal_requested = False
        self._on_removal: list[Callable[[], None]] = []
        self._watcher: threading.Thread | None = None
        self._watch_stop = threading.Event()
        ref = weakref.ref(self)
        self._at_exit = lambda: ref() is not None and ref().close()
        atexit.register(self._at_exit)

    @classmethod
    def open(cls, bdf: str, noiommu: bool | None = None, io_queues: int = 4, **kwargs) -> Controller:
        """Open a vfio-bound controller, map BAR0, set up DMA for its group's VFIO mode (or the
        one `noiommu` insists on), and start it."""
        from nvmedirect.vfio.device import VfioDevice

        device = VfioDevice.open(bdf, noiommu=noiommu)
        try:
            device.set_d0()
            device.enable_bus_master()
            bar = device.map_bar(0)
            ctrl = cls(bar, allocator_for(device.container), owner=device, **kwargs)
        except BaseException:
            device.close()
            raise
        try:
            ctrl.start(io_queues=io_queues)
            request = device.watch_requests()
            if request is not None:
                ctrl.watch_removal(request)
        except BaseException:
            ctrl.close()
            raise
        return ctrl

    # -- the kernel asking for the device back -------------------------------------------------
    def watch_removal(self, eventfd: int) -> None:
        """Wait on a thread for the kernel's device request on `eventfd` (VfioDevice.watch_requests):
        a hot-unplug or an unbind waits until this process lets go of the device."""
        self._watcher = threading.Thread(target=self._watch, args=(eventfd,), name="nvme-device-request",
                                         daemon=True)
        self._watcher.start()

    def on_removal_request(self, callback: Callable[[], None]) -> None:
        """`callback()` runs on the watcher thread when the kernel asks for the device back: it
        should stop issuing commands, let those in flight end and close the controller."""
        self._on_removal.append(callback)

    def _watch(self, eventfd: int) -> None:
        poller = select.poll()
        poller.register(eventfd, select.POLLIN)
        while not self._watch_stop.is_set():
            if not poller.poll(200):  # a timeout, so close() can stop this thread
                continue
            try:
                os.read(eventfd, 8)
            except BlockingIOError:
                continue
            if self.removal_requested:  # the kernel repeats its request every 10 s until released
                continue
            self.removal_requested = True
            log.info("controller: the kernel asks for the device back (hot-unplug or unbind)")
            for callback in list(self._on_removal):
                try:
                    callback()
                except Exception:  # one reader failing to let go must not keep the others
                    log.exception("controller: releasing the device on the kernel's request failed")

    # -- bring-up ------------------------------------------------------------------------------
    def start(self, io_queues: int = 4) -> None:
        """Disable → admin queue → enable → Identify → Set Features (Number of Queues)."""
        log.info("controller: NVMe %s, CAP %#x (MQES %d, DSTRD %d, TO %.1f s)", layout.version_string(
            self.version), self.cap.raw, self.max_queue_entries, self.dstrd, self.ready_timeout_s)
        if self.admin is None:
            self.admin = self._new_qpair(0, min(ADMIN_DEPTH, self.max_queue_entries), admin=True)
        bringup.enable(self.bar, self.admin.sq_ring.iova, self.admin.cq_ring.iova, self.admin.depth,
                       self.ready_timeout_s)
        self.info = self.identify_controller()
        limit = self.info.max_transfer_bytes(4096 << int(self.cap.bits.mpsmin))
        self.max_transfer = min(self._max_transfer_wanted, limit) if limit else self._max_transfer_wanted
        self.io_queue_limit = self.set_number_of_queues(io_queues)
        log.info("controller: %s serial %s fw %s, max transfer %d KiB, %d I/O queue pairs allowed",
                 self.info.model, self.info.serial, self.info.firmware, self.max_transfer >> 10,
                 self.io_queue_limit)

    def _new_qpair(self, qid: int, depth: int, admin: bool = False) -> QueuePair:
        # An I/O CQ of at least one page (256 entries, still one page in no-IOMMU mode): the CQ head
        # doorbell, an emulated MMIO write in a VM, is then written every few hundred completions.
        cq_depth = depth if admin else min(self.max_queue_entries, max(depth, IO_CQ_MIN_ENTRIES))
        qpair = QueuePair(qid, depth, self.dma,
                          self.bar.doorbell(layout.sq_doorbell_offset(qid, self.dstrd)),
                          self.bar.doorbell(layout.cq_doorbell_offset(qid, self.dstrd)),
                          max_transfer=4096 if admin else self.max_transfer,
                          timeout_s=ADMIN_TIMEOUT_S if admin else self.io_timeout_s, admin=admin, cq_depth=cq_depth)
        qpair.on_timeout = self._health_check
        qpair.idle_sleep_s = 0.0 if admin else self.poll_idle_sleep_s
        return qpair

    # -- admin commands ------------------------------------------------------------------------
    def _admin_data(self, opcode: int, nbytes: int = 4096, **fields) -> bytes:
        with self.dma.alloc(nbytes) as buf:
            buf.view[:] = 0
            self.admin.execute(opcode, data=buf, **fields)
            return bytes(buf.view)

    def identify_controller(self) -> ControllerInfo:
        return ControllerInfo.parse(self._admin_data(AdminOpcode.IDENTIFY, cdw10=Cns.CONTROLLER))

    def identify_namespace(self, nsid: int) -> NamespaceInfo:
        return NamespaceInfo.parse(nsid, self._admin_data(AdminOpcode.IDENTIFY, nsid=nsid, cdw10=Cns.NAMESPACE))

    def active_namespaces(self) -> list[int]:
        import numpy as np

        ids = np.frombuffer(self._admin_data(AdminOpcode.IDENTIFY, cdw10=Cns.ACTIVE_NAMESPACES), "<u4")
        return [int(x) for x in ids if x]

    def set_number_of_queues(self, count: int) -> int:
        """Ask for `count` I/O SQs and CQs; returns how many pairs the controller granted."""
        done = self.admin.execute(AdminOpcode.SET_FEATURES, cdw10=FeatureId.NUMBER_OF_QUEUES,
                                  cdw11=(count - 1) | (count - 1) << 16)
        granted_sq, granted_cq = (done.dw0 & 0xFFFF) + 1, (done.dw0 >> 16) + 1
        return min(granted_sq, granted_cq)

    # -- I/O queue pairs -----------------------------------------------------------------------
    def create_io_qpair(self, depth: int = 64) -> QueuePair:
        """Create an I/O CQ then SQ (the SQ names its CQ) with the lowest free queue id."""
        qid = next((q for q in range(1, self.io_queue_limit + 1) if q not in self.io_qpairs), None)
        if qid is None:
            raise NvmeDirectError(f"all {self.io_queue_limit} I/O queue pairs are in use")
        depth = min(depth, self.max_queue_entries)
        qpair = self._new_qpair(qid, depth)
        try:
            self._create_io_queues_on_device(qpair)
        except BaseException:
            qpair.free()
            raise
        self.io_qpairs[qid] = qpair
        return qpair

    def _create_io_queues_on_device(self, qpair: QueuePair) -> None:
        # CDW10: 0-based size << 16 | queue id. CDW11 bit 0: physically contiguous; interrupts stay
        # off (we poll); the SQ names its CQ.
        self.admin.execute(AdminOpcode.CREATE_IO_CQ, prp1=qpair.cq_ring.iova,
                           cdw10=(qpair.cq_depth - 1) << 16 | qpair.qid, cdw11=1)
        self.admin.execute(AdminOpcode.CREATE_IO_SQ, prp1=qpair.sq_ring.iova,
                           cdw10=(qpair.depth - 1) << 16 | qpair.qid, cdw11=1 | qpair.qid << 16)

    def delete_io_qpair(self, qpair: QueuePair) -> None:
        """Delete the SQ before its CQ (the spec's order), then free the rings."""
        if self.io_qpairs.get(qpair.qid) is not qpair:
            raise NvmeDirectError(f"queue pair {qpair.qid} does not belong to this controller")
        del self.io_qpairs[qpair.qid]
        if self._default_qpair is qpair:
            self._default_qpair = None
        try:
            if not self.dead:
                qpair.drain()
                self.admin.execute(AdminOpcode.DELETE_IO_SQ, cdw10=qpair.qid)
                self.admin.execute(AdminOpcode.DELETE_IO_CQ, cdw10=qpair.qid)
        finally:
            qpair.free()

    @property
    def default_qpair(self) -> QueuePair:
        if self._default_qpair is None or self._default_qpair.closed:
            self._default_qpair = self.create_io_qpair()
        return self._default_qpair

    def namespace(self, nsid: int = 1):
        from nvmedirect.nvme.namespace import Namespace

        if nsid not in self._namespaces:
            self._namespaces[nsid] = Namespace(self, self.identify_namespace(nsid))
        return self._namespaces[nsid]

    # -- faults and recovery -------------------------------------------------------------------
    def _all_qpairs(self) -> list[QueuePair]:
        return ([self.admin] if self.admin else []) + list(self.io_qpairs.values())

    def _health_check(self, _qpair: QueuePair) -> None:
        """Called when a command times out: a fatal or vanished controller fails everything."""
        try:
            if not bringup.fatal(self.bar):
                return
            log.error("controller: fatal status (CSTS.CFS): failing in-flight commands, resetting")
            self.reset()
        except ControllerError as exc:
            log.error("controller: %s; failing every in-flight command", exc)
            self.dead = True
            for qpair in self._all_qpairs():
                qpair.fail_all(st.HOST_CONTROLLER_RESET)

    def reset(self) -> None:
        """Controller reset and re-initialisation: in-flight commands complete with a host
        "Aborted by Controller Reset" status; the same QueuePair objects work afterwards."""
        # Stop the controller before touching the rings: while it is enabled it may still post
        # completions of the old commands into a completion queue we have just cleared.
        bringup.disable(self.bar, self.ready_timeout_s)
        for qpair in self._all_qpairs():
            qpair.reset()
        self.start(io_queues=max(self.io_queue_limit, 1))
        for qpair in self.io_qpairs.values():
            self._create_io_queues_on_device(qpair)
        log.info("controller: reset complete, %d I/O queue pairs re-created", len(self.io_qpairs))

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Delete I/O queues, shut the controller down, unmap all DMA, release the device. A
        second call does nothing."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self._at_exit)
        self._watch_stop.set()  # the watcher polls the eventfd the device closes below
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=2)
        try:
            if not self.dead and self.admin is not None:
                for qpair in list(self.io_qpairs.values()):
                    try:
                        self.delete_io_qpair(qpair)
                    except NvmeDirectError as exc:
                        log.warning("controller: deleting queue %d failed: %s", qpair.qid, exc)
            try:
                bringup.shutdown(self.bar, timeout_s=min(self.ready_timeout_s, 2.0))
                bringup.disable(self.bar, self.ready_timeout_s)
            except ControllerError as exc:  # a removed or hung device: still release our side
                log.warning("controller: %s", exc)
        finally:
            for qpair in list(self.io_qpairs.values()) + ([self.admin] if self.admin else []):
                qpair.free()
            self.io_qpairs.clear()
            self.admin = None
            self.dma.close()
            log.info("controller: closed; %d DMA mappings left", self.dma.live_mappings())
            if self._owner is not None:
                self._owner.close()
                self._owner = None

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
