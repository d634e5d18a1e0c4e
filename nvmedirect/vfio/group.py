"""A VFIO group: the unit of isolation the IOMMU gives us, found from the device's sysfs node."""

from __future__ import annotations

import os
from pathlib import Path

from nvmedirect.errors import DeviceNotFound, VfioError
from nvmedirect.vfio._ffi import ffi, lib
from nvmedirect.vfio.container import Container, fd_finalizer, ioctl_ptr

SYSFS_PCI = Path("/sys/bus/pci/devices")


def group_number(bdf: str, sysfs: Path = SYSFS_PCI) -> str:
    """IOMMU group of a PCI device, as named under /dev/vfio ("7" or "noiommu-0")."""
    dev = sysfs / bdf
    if not dev.exists():
        raise DeviceNotFound(f"no PCI device {bdf} (see `nvmedirect list`)")
    try:  # read, not tested then read: the link can go between the two (an unbind racing us)
        name = os.path.basename(os.readlink(dev / "iommu_group"))
    except FileNotFoundError:
        raise DeviceNotFound(
            f"{bdf} has no IOMMU group: bind it to vfio-pci first (`nvmedirect bind {bdf}`)"
        ) from None
    # In no-IOMMU mode vfio creates a fake group whose /dev node carries a "noiommu-" prefix.
    if not Path(f"/dev/vfio/{name}").exists() and Path(f"/dev/vfio/noiommu-{name}").exists():
        return f"noiommu-{name}"
    return name


class Group:
    """`/dev/vfio/N`: must be viable (all its devices bound to vfio) before use."""

    def __init__(self, number: str, container: Container):
        self.number = number
        self.path = f"/dev/vfio/{number}"
        self.container = container
        if number.startswith("noiommu-") != container.noiommu:
            raise VfioError(
                f"group {number} does not match the container's mode "
                f"({'no-IOMMU' if container.noiommu else 'IOMMU'})"
            )
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
            self._finalizer = fd_finalizer(self, self.fd)
        except FileNotFoundError:
            raise DeviceNotFound(f"{self.path} does not exist: is the device bound to vfio-pci?") from None
        except OSError as exc:
            raise VfioError(f"cannot open {self.path}: {exc.strerror} (is another process using it?)",
                            errno=exc.errno) from None
        status = ffi.new("struct vfio_group_status *")
        status.argsz = ffi.sizeof("struct vfio_group_status")
        ioctl_ptr(self.fd, lib.VFIO_GROUP_GET_STATUS, status, "VFIO_GROUP_GET_STATUS")
        if not status.flags & lib.VFIO_GROUP_FLAGS_VIABLE:
            self.close()
            raise VfioError(
                f"group {number} is not viable: every device in it must be bound to vfio-pci"
            )
        fd_holder = ffi.new("int *", container.fd)
        ioctl_ptr(self.fd, lib.VFIO_GROUP_SET_CONTAINER, fd_holder, "VFIO_GROUP_SET_CONTAINER")
        container.set_iommu()

    def device_fd(self, bdf: str) -> int:
        name = ffi.new("char[]", bdf.encode())
        return ioctl_ptr(self.fd, lib.VFIO_GROUP_GET_DEVICE_FD, name, f"VFIO_GROUP_GET_DEVICE_FD({bdf})")

    def close(self) -> None:
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer.detach()
        if getattr(self, "fd", -1) >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
