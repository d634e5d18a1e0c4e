"""The interface every storage backend offers, so inference code does not care where bytes live.

A backend addresses raw bytes of one file or device (0 .. size). `read_async` takes byte ranges and
one destination buffer per range and returns a `ReadHandle`; the reads run concurrently (several
requests in flight) and `handle.wait()` returns when all have landed, raising the first failure.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from nvmedirect.errors import NvmeDirectError
from nvmedirect.host_memory import as_byte_array

ByteRange = tuple[int, int]  # (byte offset, nbytes)


class ReadError(NvmeDirectError):
    """A read failed or a range lies outside the source."""


class ReadHandle:
    """Completion of one `read_async` call: `wait()` blocks until every piece landed."""

    def __init__(self, futures: Sequence[Future], on_wait: Callable[[], None] | None = None):
        self._futures = list(futures)
        self._on_wait = on_wait

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self, timeout: float | None = None) -> None:
        if self._on_wait is not None:
            self._on_wait()  # backends that poll completions drive them here
        errors = []
        for future in self._futures:
            exc = future.exception(timeout)
            if exc is not None:
                errors.append(exc)
        if errors:
            first = errors[0]
            if isinstance(first, ReadError):
                raise first
            raise ReadError(f"read failed: {first}") from first


def prepare_destinations(ranges: Sequence[ByteRange], buffers: Sequence[Any],
                         size: int) -> list[np.ndarray]:
    """Checks ranges against the source size and returns a uint8 view per destination, cut to nbytes."""
    if len(ranges) != len(buffers):
        raise ReadError(f"{len(ranges)} ranges but {len(buffers)} destination buffers")
    views = []
    for (offset, nbytes), buffer in zip(ranges, buffers, strict=True):
        if offset < 0 or nbytes < 0 or offset + nbytes > size:
            raise ReadError(f"range [{offset}, {offset + nbytes}) lies outside the source (size {size})")
        try:
            view = as_byte_array(buffer)
        except ValueError as exc:
            raise ReadError(str(exc)) from None
        if view.nbytes < nbytes:
            raise ReadError(f"destination of {view.nbytes} bytes cannot hold {nbytes} bytes")
        views.append(view[:nbytes])
    return views


class StorageBackend(ABC):
    """Raw byte access to one file or device."""

    name: str
    size: int  # bytes addressable
    lba_size: int  # the device's logical block size (512 for plain files unless told otherwise)
    direct: bool  # True when reads bypass the kernel page cache

    @abstractmethod
    def read_async(self, ranges: Sequence[ByteRange], buffers: Sequence[Any]) -> ReadHandle:
        """Starts reading each range into its buffer; returns at once."""

    def read_into(self, ranges: Sequence[ByteRange], buffers: Sequence[Any]) -> None:
        self.read_async(ranges, buffers).wait()

    def read_bytes(self, offset: int, nbytes: int) -> bytes:
        """Convenience for small metadata reads (headers): a fresh `bytes`."""
        out = np.empty(nbytes, dtype=np.uint8)
        self.read_into([(offset, nbytes)], [out])
        return out.tobytes()

    def close(self) -> None:  # noqa: B027 - optional for backends without resources
        pass

    def __enter__(self) -> StorageBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class OnceLock:
    """A tiny helper for backends that must close exactly once from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = False

    def first(self) -> bool:
        with self._lock:
            if self._done:
                return False
            self._done = True
            return True
