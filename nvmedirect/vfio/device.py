"""A PCI device opened through VFIO: regions, BAR mapping, config space, power state, reset."""

from __future__ import annotations

import mmap
import os

from nvmedirect.errors import VfioError
from nvmedirect.vfio._ffi import ffi, lib
from nvmedirect.vfio.container import Container, fd_finalizer, ioctl_int, ioctl_ptr
from nvmedirect.vfio.group import Group, group_number

PCI_COMMAND = 0x04
PCI_COMMAND_MEMORY = 0x2
PCI_COMMAND_MASTER = 0x4
PCI_STATUS = 0x06
PCI_STATUS_CAP_LIST = 0x10
PCI_CAPABILITY_LIST = 0x34
PCI_CAP_ID_PM = 0x01
PCI_PM_CTRL = 4  # PMCSR, relative to the PM capability
PCI_PM_CTRL_STATE_MASK = 0x3


class Region:
    """One VFIO region (a BAR or config space): where it lives in the device fd and what it allows."""

    def __init__(self, index: int, size: int, offset: int, flags: int):
        self.index = index
        self.size = size
        self.offset = offset
        self.flags = flags

    @property
    def mappable(self) -> bool:
        return bool(self.flags & lib.VFIO_REGION_INFO_FLAG_MMAP)


class MappedBar:
    """A BAR mapped into our address space. Accesses are single aligned 32/64-bit loads and stores
    through cffi pointers, which is what MMIO registers require (no byte-wise memcpy)."""

    def __init__(self, fd: int, region: Region):
        if not region.mappable:
            raise VfioError(f"BAR{region.index} cannot be mmapped")
        self.size = region.size
        self._mmap = mmap.mmap(fd, region.size, mmap.MAP_SHARED,
                               mmap.PROT_READ | mmap.PROT_WRITE, offset=region.offset)
        self._base = ffi.from_buffer(self._mmap)
        self.address = int(ffi.cast("uintptr_t", self._base))
        self._u32 = ffi.cast("uint32_t *", self._base)
        self._u64 = ffi.cast("uint64_t *", self._base)

    def _check(self, offset: int, width: int) -> None:
        if offset < 0 or offset + width > self.size or offset % width:
            raise VfioError(f"register offset {offset:#x} (width {width}) outside or misaligned in BAR")

    def read32(self, offset: int) -> int:
        self._check(offset, 4)
        return self._u32[offset // 4]

    def write32(self, offset: int, value: int) -> None:
        self._check(offset, 4)
        self._u32[offset // 4] = value

    def read64(self, offset: int) -> int:
        self._check(offset, 8)
        return self._u64[offset // 8]

    def write64(self, offset: int, value: int) -> None:
        self._check(offset, 8)
        self._u64[offset // 8] = value

    def doorbell(self, offset: int) -> int:
        """The address of a doorbell register of this BAR: the native hot path writes it directly
        (the BAR must stay mapped while a queue pair uses it)."""
        self._check(offset, 4)
        return self.address + offset

    def close(self) -> None:
        if self._mmap is not None:
            self._u32 = self._u64 = None
            self._base = None
            self._mmap.close()
            self._mmap = None


class VfioDevice:
    """A PCI device owned through VFIO. Use as a context manager; `open()` builds the container
    and group too, and everything is released in reverse order on close."""

    def __init__(self, bdf: str, group: Group, owns: tuple = ()):
        self.bdf = bdf
        self.group = group
        self._owns = owns  # objects to close after the device (group, container)
        self.fd = group.device_fd(bdf)
        self._finalizer = fd_finalizer(self, self.fd)
        info = ffi.new("struct vfio_device_info *")
        info.argsz = ffi.sizeof("struct vfio_device_info")
        ioctl_ptr(self.fd, lib.VFIO_DEVICE_GET_INFO, info, "VFIO_DEVICE_GET_INFO")
        if not info.flags & lib.VFIO_DEVICE_FLAGS_PCI:
            self.close()
            raise VfioError(f"{bdf} is not a PCI device")
        self.num_regions = info.num_regions
        self.can_reset = bool(info.flags & lib.VFIO_DEVICE_FLAGS_RESET)
        self._config = self.region(lib.VFIO_PCI_CONFIG_REGION_INDEX)
        self._bars: dict[int, MappedBar] = {}
        self.request_fd = -1  # the eventfd of the device-request interrupt, once registered

    @classmethod
    def open(cls, bdf: str, noiommu: bool | None = None) -> VfioDevice:
        """Open `bdf` (e.g. "0000:00:04.0") in a fresh container of the IOMMU mode its group has
        (`/dev/vfio/N` or `/dev/vfio/noiommu-N`), or of the mode `noiommu` insists on."""
        number = group_number(bdf)
        container = Container(noiommu=number.startswith("noiommu-") if noiommu is None else noiommu)
        try:
            group = Group(number, container)
        except Exception:
            container.close()
            raise
        try:
            return cls(bdf, group, owns=(group, container))
        except Exception:
            group.close()
            container.close()
            raise

    @property
    def container(self) -> Container:
        return self.group.container

    def region(self, index: int) -> Region:
        info = ffi.new("struct vfio_region_info *")
        info.argsz = ffi.sizeof("struct vfio_region_info")
        info.index = index
        ioctl_ptr(self.fd, lib.VFIO_DEVICE_GET_REGION_INFO, info, f"VFIO_DEVICE_GET_REGION_INFO({index})")
        return Region(index, int(info.size), int(info.offset), int(info.flags))

    def map_bar(self, index: int = 0) -> MappedBar:
        if index not in self._bars:
            self._bars[index] = MappedBar(self.fd, self.region(index))
        return self._bars[index]

    # -- config space -------------------------------------------------------------------------
    def config_read(self, offset: int, width: int) -> int:
        data = os.pread(self.fd, width, self._config.offset + offset)
        if len(data) != width:
            raise VfioError(f"short config-space read at {offset:#x}")
        return int.from_bytes(data, "little")

    def config_write(self, offset: int, width: int, value: int) -> None:
        written = os.pwrite(self.fd, value.to_bytes(width, "little"), self._config.offset + offset)
        if written != width:
            raise VfioError(f"short config-space write at {offset:#x}")

    def find_capability(self, cap_id: int) -> int | None:
        if not self.config_read(PCI_STATUS, 2) & PCI_STATUS_CAP_LIST:
            return None
        pos = self.config_read(PCI_CAPABILITY_LIST, 1) & ~3
        for _ in range(48):  # the list is at most 48 entries long in 256 bytes; guards against loops
            if pos == 0:
                return None
            if self.config_read(pos, 1) == cap_id:
                return pos
            pos = self.config_read(pos + 1, 1) & ~3
        return None

    def power_state(self) -> int | None:
        pm = self.find_capability(PCI_CAP_ID_PM)
        if pm is None:
            return None
        return self.config_read(pm + PCI_PM_CTRL, 2) & PCI_PM_CTRL_STATE_MASK

    def set_d0(self) -> None:
        """Force power state D0 (the seed had to do this after unbinding the kernel driver)."""
        pm = self.find_capability(PCI_CAP_ID_PM)
        if pm is None:
            return
        ctrl = self.config_read(pm + PCI_PM_CTRL, 2)
        if ctrl & PCI_PM_CTRL_STATE_MASK:
            self.config_write(pm + PCI_PM_CTRL, 2, ctrl & ~PCI_PM_CTRL_STATE_MASK)

    def enable_bus_master(self) -> None:
        cmd = self.config_read(PCI_COMMAND, 2)
        want = cmd | PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER
        if want != cmd:
            self.config_write(PCI_COMMAND, 2, want)

    def watch_requests(self) -> int | None:
        """Registers an eventfd as the trigger of VFIO's device-request interrupt and returns it:
        the kernel signals it when it wants the device back (a hot-unplug, an unbind of vfio-pci),
        and waits until every user lets go. Without it the kernel only logs "No device request
        channel registered, blocked until released by user". None where the device has none."""
        if self.request_fd >= 0:
            return self.request_fd
        if lib.nvd_irq_count(self.fd, lib.VFIO_PCI_REQ_IRQ_INDEX) < 1:
            return None
        fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        rc = lib.nvd_irq_eventfd(self.fd, lib.VFIO_PCI_REQ_IRQ_INDEX, fd)
        if rc < 0:
            os.close(fd)
            raise VfioError(f"VFIO_DEVICE_SET_IRQS (device request) failed: {os.strerror(-rc)}", errno=-rc)
        self.request_fd = fd
        return fd

    def reset(self) -> None:
        if not self.can_reset:
            raise VfioError(f"{self.bdf} does not support a VFIO device reset")
        ioctl_int(self.fd, lib.VFIO_DEVICE_RESET, 0, "VFIO_DEVICE_RESET")

    # -- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        for bar in self._bars.values():
            bar.close()
        self._bars = {}
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer.detach()
        if getattr(self, "request_fd", -1) >= 0:  # unregister before closing: no signal into a closed fd
            if getattr(self, "fd", -1) >= 0:
                lib.nvd_irq_eventfd(self.fd, lib.VFIO_PCI_REQ_IRQ_INDEX, -1)
            os.close(self.request_fd)
            self.request_fd = -1
        if getattr(self, "fd", -1) >= 0:
            os.close(self.fd)
            self.fd = -1
        for owned in self._owns:
            owned.close()
        self._owns = ()

    def __enter__(self) -> VfioDevice:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

