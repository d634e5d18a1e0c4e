"""Exception hierarchy shared by every layer of nvmedirect.

Each class is something a caller can act on; the message always says what to do next.
"""

import contextlib
import sys
import warnings
from collections.abc import Iterator


class Notice(UserWarning):
    """Something the user should know that does not stop the work (fewer queue pairs than asked
    for, no O_DIRECT): a warning to library callers, one `note: ...` line from the command lines."""


@contextlib.contextmanager
def notices_as_lines() -> Iterator[None]:
    """While active, a Notice prints as one `note: ...` line on stderr instead of Python's warning
    format (file, line number and source line); other warnings keep Python's format."""
    with warnings.catch_warnings():
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001, ANN202
            if issubclass(category, Notice):
                print(f"note: {message}", file=sys.stderr, flush=True)
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield


class NvmeDirectError(Exception):
    """Base class of every error this package raises on purpose."""


class VfioError(NvmeDirectError):
    """A VFIO ioctl or file operation failed."""

    def __init__(self, message: str, errno: int | None = None):
        super().__init__(message)
        self.errno = errno


class DeviceNotFound(NvmeDirectError):
    """No PCI device at the given address, or it has no IOMMU group."""


class DmaError(NvmeDirectError):
    """DMA memory could not be allocated, pinned, translated or mapped for the device."""


class MemlockLimit(DmaError):
    """RLIMIT_MEMLOCK is too small for the DMA memory asked for."""


class QueueFull(NvmeDirectError):
    """Every command slot of a queue pair is in use: poll completions, then submit again."""


class ControllerError(NvmeDirectError):
    """Controller bring-up or an admin operation failed (register handshake, bad state)."""


class NvmeStatusError(NvmeDirectError):
    """A command completed with a non-success NVMe status (or a host-side one: timeout, reset).

    The message has one fixed form, `ERROR status: SCT/SC Name (opcode, cid)`, so it can be matched.
    """

    def __init__(self, status, opcode: str = "", cid: int | None = None):
        self.status = status
        self.opcode = opcode
        self.cid = cid
        where = ", ".join(x for x in (opcode, f"cid {cid}" if cid is not None else "") if x)
        super().__init__(f"ERROR status: {status}" + (f" ({where})" if where else ""))

    def is_retryable(self) -> bool:
        return self.status.is_retryable()


class GenericStatusError(NvmeStatusError):
    """Status code type 0: generic command status."""


class CommandSpecificError(NvmeStatusError):
    """Status code type 1: command-specific status."""


class MediaError(NvmeStatusError):
    """Status code type 2: media and data integrity errors."""


class PathError(NvmeStatusError):
    """Status code type 3: path-related status."""


class InvalidOpcode(GenericStatusError):
    """The controller does not implement this opcode."""


class InvalidField(GenericStatusError):
    """A field of the command is invalid (e.g. a length above MDTS, an unknown CNS)."""


class InvalidNamespace(GenericStatusError):
    """The namespace id does not exist or is not usable."""


class DataTransferError(GenericStatusError):
    """The controller could not transfer the data (often a bad DMA address)."""


class InternalDeviceError(GenericStatusError):
    """The controller reports an internal error."""


class LbaOutOfRange(GenericStatusError):
    """The command touches LBAs beyond the namespace's size."""


class UnrecoveredReadError(MediaError):
    """The device could not read the data back."""


class WriteFault(MediaError):
    """The device could not write the data."""


class CommandTimeout(NvmeStatusError):
    """No completion arrived within the command's timeout (host-side status)."""


class ControllerFatal(NvmeStatusError):
    """The command was failed by the host because the controller hit a fatal status or was reset."""


class CommandAborted(NvmeStatusError):
    """The command was aborted (by request, queue deletion or host shutdown)."""
