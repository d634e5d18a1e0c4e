"""Exception hierarchy shared by every layer of nvmedirect.

Each class is something a caller can act on; the message always says what to do next.
"""


class NvmeDirectError(Exception):
    """Base class of every error this package raises on purpose."""


class VfioError(NvmeDirectError):
    """A VFIO ioctl or file operation failed."""

    def __init__(self, message: str, errno: int | None = None):
        super().__init__(message)
        self.errno = errno


class DeviceNotFound(NvmeDirectError):
    """No PCI device at the given address, or it has no IOMMU group."""


class WrongDriver(NvmeDirectError):
    """The device is bound to a driver other than the one the operation needs."""
