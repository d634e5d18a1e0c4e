"""Reads from a file or a kernel block device with O_DIRECT, several requests in flight.

Each range is cut into pieces of at most `io_size` bytes on aligned boundaries; a pool of
`queue_depth` threads issues one `preadv` per piece (the GIL is released during the system call, so
the pieces really are in flight together). A piece whose file offset, length and destination address
are all aligned is read straight into the destination; any other piece is read into a page-aligned
staging buffer covering its aligned span and the wanted bytes copied out, which is how unaligned
GGUF tensors are served under O_DIRECT's alignment rules.

Where O_DIRECT is refused (tmpfs, some network filesystems) the backend warns once and reads
through the page cache instead; `direct` says which mode is in use.
"""

from __future__ import annotations

import errno
import os
import queue
import stat
import warnings
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from nvmedirect.errors import Notice
from nvmedirect.host_memory import PAGE_SIZE, address_of, aligned_empty
from nvmedirect.reader.base import (
    ByteRange,
    OnceLock,
    ReadError,
    ReadHandle,
    StorageBackend,
    prepare_destinations,
)
from nvmedirect.store.targets import block_device_geometry

DEFAULT_QUEUE_DEPTH = 8
DEFAULT_IO_SIZE = 4 << 20


class DirectIOUnsupported(Notice):
    """O_DIRECT was refused; reads go through the page cache."""


def _align_down(value: int, alignment: int) -> int:
    return value - value % alignment


def _align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


class FileBackend(StorageBackend):
    """O_DIRECT reads of a regular file (or, through the subclass, a block device)."""

    def __init__(self, path: str | os.PathLike, *, queue_depth: int = DEFAULT_QUEUE_DEPTH,
                 io_size: int = DEFAULT_IO_SIZE, direct: bool = True, lba_size: int | None = None):
        if queue_depth < 1:
            raise ValueError("queue depth must be at least 1")
        self.name = os.fspath(path)
        self.queue_depth = queue_depth
        self._fd = self._open(direct)
        st = os.fstat(self._fd)
        if stat.S_ISBLK(st.st_mode):
            self.size, device_lba = block_device_geometry(self._fd)
            self.lba_size = lba_size or device_lba
        else:
            self.size = st.st_size
            self.lba_size = lba_size or 512
        # O_DIRECT needs offsets, lengths and addresses aligned to the logical block size; a page
        # covers every block size up to 4096 and makes staging buffers mmap-friendly.
        self.alignment = max(PAGE_SIZE, self.lba_size)
        if self.direct and not self._probe_direct():
            os.close(self._fd)
            self._fd = self._open(False)
        self.io_size = max(self.alignment, _align_down(io_size, self.alignment))
        self._staging: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        for _ in range(queue_depth):
            self._staging.put(aligned_empty(self.io_size + 2 * self.alignment))
        self._pool = ThreadPoolExecutor(queue_depth, thread_name_prefix="nvmedirect-read")
        self._closing = OnceLock()

    def _open(self, direct: bool) -> int:
        flags = os.O_RDONLY | os.O_CLOEXEC
        try:
            fd = os.open(self.name, flags | (os.O_DIRECT if direct else 0))
        except OSError as exc:
            if direct and exc.errno == errno.EINVAL:
                self._warn_buffered()
                return self._open(False)
            raise ReadError(f"cannot open {self.name}: {exc.strerror}") from None
        self.direct = direct
        return fd

    def _warn_buffered(self) -> None:
        warnings.warn(f"{self.name}: O_DIRECT is not supported here; reading through the page cache",
                      DirectIOUnsupported, stacklevel=4)
        self.direct = False

    def _probe_direct(self) -> bool:
        """Some filesystems accept O_DIRECT at open and refuse it at read time."""
        if self.size == 0:
            return True
        probe = aligned_empty(self.alignment)
        try:
            os.preadv(self._fd, [probe], 0)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise ReadError(f"cannot read {self.name}: {exc.strerror}") from None
            self._warn_buffered()
            return False
        return True

    # -- reads ------------------------------------------------------------------------------------

    def read_async(self, ranges: Sequence[ByteRange], buffers: Sequence[Any]) -> ReadHandle:
        views = prepare_destinations(ranges, buffers, self.size)
        futures: list[Future] = []
        for (offset, nbytes), view in zip(ranges, views, strict=True):
            for piece_offset, piece_len, dest_start in self._pieces(offset, nbytes):
                dest = view[dest_start:dest_start + piece_len]
                futures.append(self._pool.submit(self._read_piece, piece_offset, dest))
        return ReadHandle(futures)

    def _pieces(self, offset: int, nbytes: int) -> list[tuple[int, int, int]]:
        """(file offset, length, offset in destination) for each piece; inner boundaries aligned."""
        pieces = []
        position, end = offset, offset + nbytes
        while position < end:
            boundary = _align_down(position, self.alignment) + self.io_size
            piece_end = min(end, boundary)
            pieces.append((position, piece_end - position, position - offset))
            position = piece_end
        return pieces

    def _read_piece(self, offset: int, dest: np.ndarray) -> None:
        length = dest.nbytes
        if not self.direct:
            self._pread_fully(offset, dest, length)
            return
        a = self.alignment
        if offset % a == 0 and length % a == 0 and address_of(dest) % a == 0:
            self._pread_fully(offset, dest, length)
            return
        span_start = _align_down(offset, a)
        span_len = _align_up(offset + length, a) - span_start
        staging = self._staging.get()
        try:
            # A span that runs past the end of the file comes back short; that is fine as long as
            # the wanted bytes arrived, which `_pread_fully` checks.
            self._pread_fully(span_start, staging[:span_len], offset + length - span_start)
            skip = offset - span_start
            dest[:] = staging[skip:skip + length]
        finally:
            self._staging.put(staging)

    def _pread_fully(self, offset: int, dest: np.ndarray, need: int) -> None:
        done = 0
        while done < need:
            try:
                got = os.preadv(self._fd, [dest[done:]], offset + done)
            except OSError as exc:
                raise ReadError(f"{self.name}: read of {dest.nbytes - done} bytes at {offset + done} "
                                f"failed: {exc.strerror}") from None
            if got == 0:
                raise ReadError(f"{self.name}: unexpected end of data at byte {offset + done}")
            done += got

    def close(self) -> None:
        if self._closing.first():
            self._pool.shutdown(wait=True)
            os.close(self._fd)

    def __repr__(self) -> str:
        mode = "O_DIRECT" if self.direct else "buffered"
        return f"{type(self).__name__}({self.name!r}, {mode}, qd={self.queue_depth}, io={self.io_size})"


class BlockDeviceBackend(FileBackend):
    """A kernel block device (/dev/nvme0n1, /dev/loop0): the same O_DIRECT code as a file, with the
    size and logical block size taken from the device."""

    def __init__(self, path: str | os.PathLike, **kwargs: Any):
        mode = os.stat(path).st_mode
        if not stat.S_ISBLK(mode):
            raise ReadError(f"{os.fspath(path)} is not a block device")
        super().__init__(path, **kwargs)
