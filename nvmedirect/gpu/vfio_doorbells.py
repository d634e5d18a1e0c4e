"""GPU doorbells on a real controller: the probe for the device tier C reads from, and the adapter
that gives `QueueMemory` (nvmedirect/gpu/rings.py) a vfio-bound controller where the tests give it
the emulator.

NOT RUN ANYWHERE: no machine here has both a GPU and an NVMe drive. The emulator stands in for
everything below in tests/gpu/test_doorbell_reader_gpu.py; what differs here is only the real
BAR0 (registered with cudaHostRegisterIoMemory), VFIO DMA maps at IOVAs QueueMemory picks, and the
admin commands that create and delete the queue pair.
"""

from __future__ import annotations

import os
from typing import Any

from nvmedirect.errors import NvmeDirectError
from nvmedirect.gpu.probe import CUDA_HOST_REGISTER_IO_MEMORY, CUDA_HOST_REGISTER_MAPPED, ProbeResult
from nvmedirect.reader.base import StorageBackend

NO_CONTROLLER = "no vfio-bound controller"


def probe_device(device: str) -> ProbeResult:
    """`check --probe-gpu-mmio` for the controller behind `device` (a BDF, or a namespace whose
    controller is bound to vfio-pci); files and kernel block devices have no BAR0 to ring."""
    from nvmedirect.gpu.probe import gpu_blocker, probe
    from nvmedirect.store.routing import NVME, RouteError, route_device

    why = gpu_blocker()
    if why:
        return ProbeResult(device, False, "no GPU", why)
    if os.path.exists(device):
        return ProbeResult(device, False, NO_CONTROLLER, f"{device} is read through the kernel, not through a "
                                                         "controller bound to vfio-pci")
    try:
        route = route_device(device, 1)
    except RouteError as exc:
        return ProbeResult(device, False, NO_CONTROLLER, str(exc))
    if route.kind != NVME:
        return ProbeResult(device, False, NO_CONTROLLER, f"{device} is served by the kernel ({route.path})")
    return probe(route.path)


class VfioDoorbells:
    """The emulator's interface (map/unmap, attach/detach, doorbell, bar_address/bar_bytes) on a
    started `Controller` in the VFIO IOMMU mode."""

    bar_register_flags = CUDA_HOST_REGISTER_IO_MEMORY | CUDA_HOST_REGISTER_MAPPED  # PCI memory, not RAM

    def __init__(self, ctrl: Any):
        from nvmedirect.vfio.dma import IOVA_BASE, IommuDma

        if not isinstance(ctrl.dma, IommuDma):
            # no-IOMMU DMA addresses are physical: QueueMemory's chosen IOVAs would not exist
            raise NvmeDirectError("GPU doorbells need the VFIO IOMMU mode (the controller is in no-IOMMU mode)")
        self.ctrl = ctrl
        self.bar_address, self.bar_bytes = ctrl.bar.address, ctrl.bar.size
        self.iova_base = IOVA_BASE + (1 << 38)  # past the driver's own IOVA window (IovaAllocator)
        self._mapped: dict[int, int] = {}

    def map(self, iova: int, host_address: int, nbytes: int) -> None:
        from nvmedirect.vfio._ffi import ffi, lib
        from nvmedirect.vfio.container import ioctl_ptr

        dma_map = ffi.new("struct vfio_iommu_type1_dma_map *")
        dma_map.argsz = ffi.sizeof("struct vfio_iommu_type1_dma_map")
        dma_map.flags = lib.VFIO_DMA_MAP_FLAG_READ | lib.VFIO_DMA_MAP_FLAG_WRITE
        dma_map.vaddr, dma_map.iova, dma_map.size = host_address, iova, nbytes
        ioctl_ptr(self.ctrl.dma.container.fd, lib.VFIO_IOMMU_MAP_DMA, dma_map, "VFIO_IOMMU_MAP_DMA")
        self._mapped[iova] = nbytes

    def unmap(self, iova: int) -> None:
        from nvmedirect.vfio.dma import _vfio_unmap

        _vfio_unmap(self.ctrl.dma.container.fd, iova, self._mapped.pop(iova))

    def attach(self, qid: int, sq_iova: int, sq_size: int, cq_iova: int, cq_size: int) -> None:
        """Create I/O CQ then SQ `qid` on rings at those IOVAs (as Controller.create_io_qpair)."""
        from nvmedirect.spec.layout import AdminOpcode

        if qid in self.ctrl.io_qpairs or qid > self.ctrl.io_queue_limit:
            raise NvmeDirectError(f"I/O queue {qid} is taken or beyond the {self.ctrl.io_queue_limit} granted")
        admin = self.ctrl.admin
        admin.execute(AdminOpcode.CREATE_IO_CQ, prp1=cq_iova, cdw10=(cq_size - 1) << 16 | qid, cdw11=1)
        admin.execute(AdminOpcode.CREATE_IO_SQ, prp1=sq_iova, cdw10=(sq_size - 1) << 16 | qid, cdw11=1 | qid << 16)

    def detach(self, qid: int) -> None:
        from nvmedirect.spec.layout import AdminOpcode

        if not self.ctrl.dead:
            self.ctrl.admin.execute(AdminOpcode.DELETE_IO_SQ, cdw10=qid)
            self.ctrl.admin.execute(AdminOpcode.DELETE_IO_CQ, cdw10=qid)

    def doorbell(self, qid: int, is_cq: bool) -> int:
        from nvmedirect.spec import layout

        offset = (layout.cq_doorbell_offset if is_cq else layout.sq_doorbell_offset)(qid, self.ctrl.dstrd)
        return self.bar_address + offset

    def close(self) -> None:
        self.ctrl.close()


def open_backend(bdf: str, *, nsid: int = 1, noiommu: bool | None = None, **options: Any) -> StorageBackend:
    """A GpuDoorbellBackend on namespace `nsid` of the controller at `bdf`, queue pair 1 owned by
    the GPU (the controller is opened with one I/O queue pair and the CPU driver creates none)."""
    from nvmedirect.nvme.controller import Controller
    from nvmedirect.reader.gpu_doorbell_backend import GpuDoorbellBackend

    if nsid != 1:
        raise NvmeDirectError("GPU doorbells read namespace 1 only (the rings' NSID)")
    options.pop("lba_size", None)
    ctrl = Controller.open(bdf, noiommu=noiommu, io_queues=1)
    try:
        info = ctrl.identify_namespace(nsid)  # no CPU staging slots: the GPU path has its own
        options["io_size"] = min(options.get("io_size", 1 << 20), ctrl.max_transfer)
        return GpuDoorbellBackend(VfioDoorbells(ctrl), size_bytes=info.size_bytes, lba_size=info.lba_size,
                                  name=f"{bdf} nsid {nsid} (GPU doorbells)", owns_controller=True, **options)
    except BaseException:
        ctrl.close()
        raise
