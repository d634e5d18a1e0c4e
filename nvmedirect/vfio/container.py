"""The VFIO container: one IOMMU context (type1v2) or the unsafe no-IOMMU mode."""

from __future__ import annotations

import contextlib
import errno as errno_mod
import os
import weakref

from nvmedirect.errors import VfioError
from nvmedirect.vfio._ffi import ffi, lib

CONTAINER_PATH = "/dev/vfio/vfio"


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):  # at exit there is nobody left to report to
        os.close(fd)


def fd_finalizer(owner: object, fd: int) -> weakref.finalize:
    """Close `fd` when `owner` is garbage collected or the interpreter exits, whichever comes first
    (finalizers run newest first at exit: device, then group, then container). `close()` detaches it."""
    return weakref.finalize(owner, _close_quietly, fd)


def ioctl_ptr(fd: int, request: int, arg, what: str) -> int:
    """Run an ioctl whose argument is a cffi pointer; raise VfioError naming `what` on failure."""
    rc = lib.nvd_ioctl_ptr(fd, request, ffi.cast("void *", arg))
    if rc < 0:
        raise VfioError(f"{what} failed: {os.strerror(-rc)}", errno=-rc)
    return rc


def ioctl_int(fd: int, request: int, arg: int, what: str) -> int:
    rc = lib.nvd_ioctl_int(fd, request, arg)
    if rc < 0:
        raise VfioError(f"{what} failed: {os.strerror(-rc)}", errno=-rc)
    return rc


class Container:
    """`/dev/vfio/vfio`: groups attach to it, then it takes an IOMMU model.

    The model is chosen explicitly by the caller: type1v2 (the IOMMU translates device addresses)
    or no-IOMMU (device addresses are physical; only when the kernel allows it and the caller asks).
    """

    def __init__(self, noiommu: bool = False):
        self.noiommu = noiommu
        self.iommu_type = lib.VFIO_NOIOMMU_IOMMU if noiommu else lib.VFIO_TYPE1v2_IOMMU
        self._iommu_set = False
        try:
            self.fd = os.open(CONTAINER_PATH, os.O_RDWR | os.O_CLOEXEC)
            self._finalizer = fd_finalizer(self, self.fd)
        except FileNotFoundError:
            raise VfioError(
                f"{CONTAINER_PATH} does not exist: load the vfio modules (`modprobe vfio-pci`)"
            ) from None
        except PermissionError:
            raise VfioError(f"cannot open {CONTAINER_PATH}: run as root") from None
        version = ioctl_int(self.fd, lib.VFIO_GET_API_VERSION, 0, "VFIO_GET_API_VERSION")
        if version != lib.VFIO_API_VERSION:
            self.close()
            raise VfioError(f"unknown VFIO API version {version}")
        if not ioctl_int(self.fd, lib.VFIO_CHECK_EXTENSION, self.iommu_type, "VFIO_CHECK_EXTENSION"):
            self.close()
            mode = "no-IOMMU" if noiommu else "type1v2 IOMMU"
            hint = (
                "load vfio with enable_unsafe_noiommu_mode=1"
                if noiommu
                else "enable the IOMMU (intel_iommu=on / amd_iommu=on) or use no-IOMMU mode"
            )
            raise VfioError(f"the kernel's VFIO does not offer {mode}: {hint}")

    def set_iommu(self) -> None:
        """Select the IOMMU model; VFIO allows this only after a group has joined."""
        if not self._iommu_set:
            ioctl_int(self.fd, lib.VFIO_SET_IOMMU, self.iommu_type, "VFIO_SET_IOMMU")
            self._iommu_set = True

    def close(self) -> None:
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer.detach()
        if getattr(self, "fd", -1) >= 0:
            try:
                os.close(self.fd)
            except OSError as exc:  # already closed elsewhere
                if exc.errno != errno_mod.EBADF:
                    raise
            self.fd = -1

    def __enter__(self) -> Container:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
