"""Tier B: the streamed tensors that live in host RAM, ready for a host-to-device copy each pass.

Two ways to hold them, both copied at full link speed on the H200 (~53 GB/s):
- "pinned": one page-locked arena, allocated once (pinning costs seconds per GiB) and filled from
  the model once; the bytes are then in RAM twice only until the page cache lets go of the file.
- "registered": the file's own memory map, page-locked in place with cudaHostRegister(ReadOnly).
  No copy and no second allocation, but every page of the registered span is faulted in and held,
  so it is chosen only when that span fits the RAM budget.
Without a GPU (the CPU simulation) "pinned" is page-aligned ordinary memory and "registered" the
plain memory map: the same bytes through the same code.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import numpy as np

from infer.gguf_file import GGUFModel
from infer.tiers.plan import Tensor
from nvmedirect.host_memory import PAGE_SIZE, address_of, gpu_present, pinned_empty

CUDA_HOST_REGISTER_READ_ONLY = 8
ARENA_ALIGN = 4096  # every tensor starts page-aligned: full-speed DMA and O_DIRECT-friendly


def choose_mode(tensors: Sequence[Tensor], ram_budget: int, requested: str = "auto") -> str:
    """'pinned' or 'registered'. auto: registered when the file span covering the tier B tensors
    fits the RAM budget (then nothing is copied), else a pinned arena of exactly their bytes."""
    if requested in ("pinned", "registered"):
        return requested
    if requested != "auto":
        raise ValueError(f"unknown tier B mode '{requested}' (auto, pinned, registered)")
    if not tensors:
        return "pinned"
    return "registered" if file_span(tensors)[1] <= ram_budget else "pinned"


def file_span(tensors: Sequence[Tensor]) -> tuple[int, int]:
    """(page-aligned start, length) of the file bytes covering `tensors`."""
    start = min(t.offset for t in tensors) // PAGE_SIZE * PAGE_SIZE
    end = max(t.offset + t.nbytes for t in tensors)
    return start, -(-(end - start) // PAGE_SIZE) * PAGE_SIZE


class HostTier:
    """Host-resident bytes of the tier B tensors: `view(name)` is a uint8 array of the tensor."""

    def __init__(self, model: GGUFModel, tensors: Sequence[Tensor], mode: str) -> None:
        self.mode = mode
        self.pinned = False
        self._views: dict[str, np.ndarray] = {}
        self._registered_ptr: int | None = None
        self._map = None
        self.nbytes = 0
        if not tensors:
            return
        if mode == "registered":
            # a mapping of its own: CUDA refuses a copy from host memory partly inside a registered
            # range, which the model's mapping would become for tensors at the span's edges
            with open(model.path, "rb") as f:
                self._map: mmap.mmap | None = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._register(np.frombuffer(self._map, dtype=np.uint8), tensors)
        elif mode == "pinned":
            self._fill_arena(model.data, tensors)
        else:
            raise ValueError(f"unknown tier B mode '{mode}'")

    def _fill_arena(self, whole: np.ndarray, tensors: Sequence[Tensor]) -> None:
        offsets, at = {}, 0
        for t in tensors:
            offsets[t.name] = at
            at += -(-t.nbytes // ARENA_ALIGN) * ARENA_ALIGN
        self.arena = pinned_empty(at)
        self.pinned = gpu_present()
        self.nbytes = at
        # Filled once in file order from the model's memory map (the arena is written, never read, by the CPU).
        for t in sorted(tensors, key=lambda t: t.offset):
            view = self.arena[offsets[t.name]: offsets[t.name] + t.nbytes]
            view[:] = whole[t.offset: t.offset + t.nbytes]
            self._views[t.name] = view

    def _register(self, whole: np.ndarray, tensors: Sequence[Tensor]) -> None:
        start, length = file_span(tensors)
        span = whole[start: start + length] if start + length <= whole.size else whole[start:]
        self.nbytes = int(span.size)
        if gpu_present():
            import cupy

            ptr = address_of(span)
            cupy.cuda.runtime.hostRegister(ptr, int(span.size), CUDA_HOST_REGISTER_READ_ONLY)
            self._registered_ptr = ptr
            self._unregister = cupy.cuda.runtime.hostUnregister  # kept: close() may run at exit, imports gone
            self.pinned = True
        for t in tensors:
            self._views[t.name] = whole[t.offset: t.offset + t.nbytes]

    def view(self, name: str) -> np.ndarray:
        return self._views[name]

    def __contains__(self, name: str) -> bool:
        return name in self._views

    def close(self) -> None:
        if self._registered_ptr is not None:
            self._unregister(self._registered_ptr)
            self._registered_ptr = None
        self._views = {}
        # the memory map closes once no view refers to it (closing it here would fail while
        # callers still hold arrays)
        self._map = None
