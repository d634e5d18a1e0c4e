"""Tier C: streamed tensors read from storage every pass, into host staging.

Three sources behind one call, `read_async(ranges, buffers) -> handle` with `handle.wait()`:
- "file": nvmedirect's reader with its O_DIRECT FileBackend (no page cache, several reads in
  flight): a model larger than RAM streams at the disk's speed.
- "nvme": nvmedirect's reader on a GGUF written to raw LBAs (`nvmedirect write-gguf`), through the
  userspace driver when the device is bound to vfio-pci or the kernel block device otherwise.
- "mmap": the naive baseline — worker threads memcpy from the file's memory map, page faults and
  page cache included. Kept to measure what the other two win.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from infer.errors import StorageUnavailable
from infer.tiers.config import SOURCES
from infer.tiers.plan import Tensor
from nvmedirect.errors import NvmeDirectError


class ReadHandleLike(Protocol):
    def wait(self) -> None: ...


class StorageSource(Protocol):
    name: str
    description: str

    def read_async(self, ranges: Sequence[tuple[int, int]], buffers: Sequence[Any]) -> ReadHandleLike: ...

    def close(self) -> None: ...


class ReaderSource:
    """nvmedirect's reader on a GGUF stored on a device (found by its header, checked to be the
    model being run); `source` is the device, or a backend already open on it."""

    def __init__(self, source: str | os.PathLike | Any, kind: str, tensors: Sequence[Tensor], **options: Any) -> None:
        from nvmedirect.reader import open_model

        self.name = kind
        self.model = open_model(source, **options)
        backend = self.model.backend
        mode = "O_DIRECT" if getattr(backend, "direct", False) else "buffered"
        self.description = f"{kind}: {backend!r} ({mode})"
        self.direct = bool(getattr(backend, "direct", False))
        where = os.fspath(source) if isinstance(source, (str, os.PathLike)) else backend.name  # or a backend
        _check_same_tensors(where, self.model.tensors, tensors)

    def read_async(self, ranges: Sequence[tuple[int, int]], buffers: Sequence[Any]) -> ReadHandleLike:
        return self.model.read_async(ranges, buffers)

    @property
    def failure(self) -> str | None:
        """Why the device can no longer be read (the NVMe reader released it on a hot-unplug request)."""
        return getattr(self.model.backend, "failure", None)

    def close(self) -> None:
        self.model.close()


def _check_same_tensors(source: str, stored: dict[str, Any], tensors: Sequence[Tensor]) -> None:
    """The stored GGUF must be the model being run: same tensors at the same offsets and sizes."""
    for t in tensors:
        info = stored.get(t.name)
        if info is None or info.offset != t.offset or info.nbytes != t.nbytes:
            raise ValueError(f"{source}: the stored model differs from the GGUF being run (tensor {t.name}); "
                             "write this model with `nvmedirect write-gguf` first")


class _Done:
    def __init__(self, futures: list) -> None:
        self._futures = futures

    def wait(self) -> None:
        for f in self._futures:
            f.result()


class MmapSource:
    """The naive baseline: memcpy out of the file's memory map, one tensor at a time on one thread
    (every page fault waits for the disk), as the seed's mmap streaming did."""

    def __init__(self, path: str | os.PathLike, workers: int = 1) -> None:
        self.name = "mmap"
        self.description = f"mmap: {os.fspath(path)} (page cache, memcpy by {workers} threads)"
        self.direct = False
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._data = np.frombuffer(self._map, dtype=np.uint8)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="mmap-copy")
        self._piece = 4 << 20

    def read_async(self, ranges: Sequence[tuple[int, int]], buffers: Sequence[Any]) -> ReadHandleLike:
        futures = []
        for (offset, nbytes), buffer in zip(ranges, buffers, strict=True):
            dest = np.frombuffer(buffer, dtype=np.uint8) if not isinstance(buffer, np.ndarray) else buffer.reshape(-1)
            for at in range(0, nbytes, self._piece):
                n = min(self._piece, nbytes - at)
                futures.append(self._pool.submit(self._copy, offset + at, dest[at: at + n]))
        return _Done(futures)

    def _copy(self, offset: int, dest: np.ndarray) -> None:
        dest[:] = self._data[offset: offset + dest.size]

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._data = None  # type: ignore[assignment]


class FileSource:
    """The model's own file read with O_DIRECT by nvmedirect's FileBackend (the GGUF is already
    parsed: offsets are the planner's)."""

    def __init__(self, path: str | os.PathLike, **options: Any) -> None:
        from nvmedirect.reader.file_backend import FileBackend

        self.name = "file"
        self.backend = FileBackend(path, **options)
        self.direct = bool(self.backend.direct)
        self.description = f"file: {self.backend!r} ({'O_DIRECT' if self.direct else 'buffered'})"

    def read_async(self, ranges: Sequence[tuple[int, int]], buffers: Sequence[Any]) -> ReadHandleLike:
        return self.backend.read_async(ranges, buffers)

    def close(self) -> None:
        self.backend.close()


def open_source(kind: str, model_path: str | os.PathLike, tensors: Sequence[Tensor],
                device: str | None = None, gpu_doorbells: bool = False, notes: list[str] | None = None,
                **options: Any) -> StorageSource:
    """The tier C source `kind` for the model at `model_path` (`device`: where nvme reads from).
    gpu_doorbells (nvme): GPU threads issue the reads when the probe passes; otherwise one line
    saying why goes to `notes` and the CPU-doorbell reader is used."""
    if kind == "file":
        return FileSource(model_path, **options)
    if kind == "nvme":
        if not device:
            raise ValueError("--tier-c nvme needs the device holding the model (--nvme-device BDF or /dev/nvmeXnY)")
        try:
            return _open_nvme(device, tensors, gpu_doorbells, notes, options)
        except NvmeDirectError as err:  # the driver's own errors say what to do; one line of them
            raise StorageUnavailable(f"--tier-c nvme: {str(err).splitlines()[0]}") from None
    if kind == "mmap":
        return MmapSource(model_path)
    raise ValueError(f"unknown tier C source '{kind}' (known: {', '.join(SOURCES)})")


def _open_nvme(device: str, tensors: Sequence[Tensor], gpu_doorbells: bool, notes: list[str] | None,
               options: dict[str, Any]) -> StorageSource:
    if gpu_doorbells:
        backend = gpu_doorbell_backend(device, notes if notes is not None else [], options)
        if backend is not None:
            try:
                return ReaderSource(backend, "nvme", tensors, lba=options.get("lba"))
            except BaseException:
                backend.close()  # open_model closes only the backends it opened itself
                raise
    return ReaderSource(device, "nvme", tensors, **options)


def gpu_doorbell_backend(device: str, notes: list[str], options: dict[str, Any]) -> Any:
    """The GPU-doorbell reader for `device` if `check --probe-gpu-mmio` passes on its controller,
    else None with the fallback said once in `notes`."""
    from nvmedirect.gpu.vfio_doorbells import open_backend, probe_device

    def fallback(blocker: str) -> None:
        notes.append(f"GPU doorbells unavailable ({blocker}): tier C reads with CPU doorbells")

    result = probe_device(device)
    if not result.ok:
        return fallback(f"{result.blocker}: {result.detail}")
    kept = {k: v for k, v in options.items() if k in ("queue_depth", "io_size", "noiommu")}
    try:
        backend = open_backend(result.bdf, **kept)
    except NvmeDirectError as exc:  # e.g. the no-IOMMU mode; the CPU reader may still work there
        return fallback(f"opening {result.bdf} failed: {str(exc).splitlines()[0][:200]}")
    notes.append(f"tier C reads by GPU-initiated commands on {result.bdf} ({result.detail})")
    return backend
