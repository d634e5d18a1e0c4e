"""Where write-gguf writes: whole LBAs of a kernel block device or an image file, with O_DIRECT.

A target moves whole logical blocks between page-aligned host memory and the device. The userspace
NVMe target (`nvme_target.NvmeTarget`) offers the same methods through the driver.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
from typing import Protocol

import numpy as np

from nvmedirect.errors import NvmeDirectError
from nvmedirect.host_memory import aligned_empty

BLKSSZGET = 0x1268  # logical block size of a block device (int)
BLKGETSIZE64 = 0x80081272  # size of a block device in bytes (u64)


class TargetError(NvmeDirectError):
    """The target cannot be opened or an I/O on it failed."""


class TargetBusy(TargetError):
    """The kernel refused an exclusive open: something mounted, stacked or open holds the device."""


class BlockTarget(Protocol):
    name: str
    via: str  # "userspace driver", "kernel block device" or "image file"
    lba_size: int
    capacity_bytes: int | None  # None: unknown

    def write_blocks(self, byte_offset: int, data: np.ndarray) -> None:
        """Writes `data` (page-aligned, a whole number of LBAs) at `byte_offset` (LBA-aligned)."""

    def read_blocks(self, byte_offset: int, nbytes: int) -> np.ndarray:
        """Reads whole LBAs into fresh page-aligned memory."""

    def flush(self) -> None: ...

    def close(self) -> None: ...


def block_device_geometry(fd: int) -> tuple[int, int]:
    """(size in bytes, logical block size) of a block device."""
    size = struct.unpack("Q", fcntl.ioctl(fd, BLKGETSIZE64, b"\0" * 8))[0]
    lba = struct.unpack("i", fcntl.ioctl(fd, BLKSSZGET, b"\0" * 4))[0]
    return size, lba


class KernelBlockTarget:
    """A block device (opened exclusively, so the kernel refuses if it is mounted or held) or a
    regular file used as a device image."""

    def __init__(self, path: str, *, lba_size: int | None = None, writable: bool = True):
        self.name = path
        try:
            mode = os.stat(path).st_mode
        except OSError as exc:
            raise TargetError(f"cannot open {path}: {exc.strerror}") from None
        self.is_block_device = stat.S_ISBLK(mode)
        if not (self.is_block_device or stat.S_ISREG(mode)):
            raise TargetError(f"{path} is neither a block device nor a regular file")
        self.via = "kernel block device" if self.is_block_device else "image file"
        flags = (os.O_RDWR | (os.O_EXCL if self.is_block_device else 0)) if writable else os.O_RDONLY
        flags |= os.O_CLOEXEC
        try:
            self._fd = os.open(path, flags | os.O_DIRECT)
            self.direct = True
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                raise TargetBusy(f"{path} is in use (mounted, held by another device, or open "
                                  "exclusively)") from None
            if exc.errno != errno.EINVAL or self.is_block_device:
                raise TargetError(f"cannot open {path}: {exc.strerror}") from None
            self._fd = os.open(path, flags)  # tmpfs image file: buffered, then fsync
            self.direct = False
        if self.is_block_device:
            self.capacity_bytes, device_lba = block_device_geometry(self._fd)
            if lba_size not in (None, device_lba):
                raise TargetError(f"{path} has {device_lba}-byte LBAs, not {lba_size}")
            self.lba_size = device_lba
        else:  # an image stands in for a device of its current size (make it with `truncate -s`)
            self.lba_size = lba_size or 512
            self.capacity_bytes = os.fstat(self._fd).st_size // self.lba_size * self.lba_size

    def _check(self, byte_offset: int, nbytes: int) -> None:
        if byte_offset % self.lba_size or nbytes % self.lba_size:
            raise TargetError(f"I/O at {byte_offset}+{nbytes} is not LBA-aligned ({self.lba_size})")
        if self.capacity_bytes is not None and byte_offset + nbytes > self.capacity_bytes:
            raise TargetError(f"I/O at byte {byte_offset}+{nbytes} is beyond the end of {self.name} "
                              f"({self.capacity_bytes} bytes)")

    def write_blocks(self, byte_offset: int, data: np.ndarray) -> None:
        self._check(byte_offset, data.nbytes)
        done = 0
        while done < data.nbytes:
            try:
                done += os.pwritev(self._fd, [data[done:]], byte_offset + done)
            except OSError as exc:
                raise TargetError(f"{self.name}: write at byte {byte_offset + done} failed: "
                                  f"{exc.strerror}") from None

    def read_blocks(self, byte_offset: int, nbytes: int) -> np.ndarray:
        self._check(byte_offset, nbytes)
        out = aligned_empty(nbytes)
        done = 0
        while done < nbytes:
            try:
                got = os.preadv(self._fd, [out[done:]], byte_offset + done)
            except OSError as exc:
                raise TargetError(f"{self.name}: read at byte {byte_offset + done} failed: "
                                  f"{exc.strerror}") from None
            if got == 0:  # past the end of an image file: reads as zeros, like a fresh device
                out[done:] = 0
                break
            done += got
        return out

    def flush(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> KernelBlockTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
