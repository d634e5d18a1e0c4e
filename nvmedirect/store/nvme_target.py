"""write-gguf through the userspace driver: whole LBAs of a namespace of a vfio-bound controller."""

from __future__ import annotations

from typing import Any

import numpy as np

from nvmedirect.errors import NvmeDirectError
from nvmedirect.host_memory import aligned_empty
from nvmedirect.store.targets import TargetError

BOUNCE_BYTES = 8 << 20  # one DMA buffer, reused for every chunk


class NvmeTarget:
    """Same methods as `KernelBlockTarget`, on the driver's `Namespace.write/read/flush`."""

    via = "userspace driver"

    def __init__(self, ctrl: Any, nsid: int = 1, owns_controller: bool = False, name: str | None = None):
        self.ctrl = ctrl
        self._owns = owns_controller
        self.namespace = ctrl.namespace(nsid)
        self.name = name or f"nsid {nsid}"
        self.lba_size = self.namespace.lba_size
        self.capacity_bytes: int | None = self.namespace.size_bytes
        self._bounce = ctrl.dma.alloc(BOUNCE_BYTES)

    @classmethod
    def open(cls, bdf: str, *, noiommu: bool | None = None, nsid: int = 1) -> NvmeTarget:
        from nvmedirect.nvme.controller import Controller

        ctrl = Controller.open(bdf, noiommu=noiommu, io_queues=1)
        try:
            return cls(ctrl, nsid, owns_controller=True, name=bdf)
        except BaseException:
            ctrl.close()
            raise

    def _check(self, byte_offset: int, nbytes: int) -> None:
        if byte_offset % self.lba_size or nbytes % self.lba_size:
            raise TargetError(f"I/O at {byte_offset}+{nbytes} is not LBA-aligned ({self.lba_size})")
        if byte_offset + nbytes > self.capacity_bytes:
            raise TargetError(f"I/O at byte {byte_offset}+{nbytes} is beyond the end of the namespace "
                              f"({self.capacity_bytes} bytes)")

    def write_blocks(self, byte_offset: int, data: np.ndarray) -> None:
        self._check(byte_offset, data.nbytes)
        for start in range(0, data.nbytes, BOUNCE_BYTES):
            chunk = data[start:start + BOUNCE_BYTES]
            self._bounce.view[:chunk.nbytes] = chunk
            try:
                self.namespace.write((byte_offset + start) // self.lba_size, chunk.nbytes // self.lba_size,
                                     self._bounce)
            except NvmeDirectError as exc:
                raise TargetError(f"{self.name}: write at byte {byte_offset + start} failed: {exc}") from None

    def read_blocks(self, byte_offset: int, nbytes: int) -> np.ndarray:
        self._check(byte_offset, nbytes)
        out = aligned_empty(nbytes)
        for start in range(0, nbytes, BOUNCE_BYTES):
            length = min(BOUNCE_BYTES, nbytes - start)
            try:
                self.namespace.read((byte_offset + start) // self.lba_size, length // self.lba_size,
                                    self._bounce)
            except NvmeDirectError as exc:
                raise TargetError(f"{self.name}: read at byte {byte_offset + start} failed: {exc}") from None
            out[start:start + length] = self._bounce.view[:length]
        return out

    def flush(self) -> None:
        self.namespace.flush()

    def close(self) -> None:
        if self._bounce is not None:
            self._bounce.free()
            self._bounce = None
        if self._owns:
            self.ctrl.close()

    def __enter__(self) -> NvmeTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
