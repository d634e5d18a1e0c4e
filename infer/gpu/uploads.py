"""Small host-to-device uploads of a pass (its row index, a tree's accepted nodes) that need not
wait behind a streamed model's ring refills.

Why: cudaMemcpyAsync from the host goes through a copy engine, and the ring's refills of the next
pass (up to its slots' worth: 215 MB, about 4.4 ms of the link, with 20 slots of the real pair's
target) are queued on the engine when a speculative round's host work starts. In session 36 (H100,
the real pair, prose) a ring of 20 slots instead of 8 took the verify pass from 8.72 to 5.99 ms
(the link kept busy through the draft) but the draft's fixed cost from about 0.6-1.0 to 1.9-2.6 ms:
the draft's and the cache's small uploads queued behind those refills (our reading of the figures).
With NVMEDIRECT_SM_UPLOADS=1 they are done by a kernel reading the pinned host buffer, mapped into
the device's address space under unified addressing: its reads cross the link beside the bulk
copies instead of after them.

Off unless asked for: written in session 36 after its device time was spent, it has not yet run on
a GPU (tests/gpu/test_uploads.py and docs/results/2026-12-07/session36/runG.sh are ready).
"""

from __future__ import annotations

import os

import cupy
import numpy as np

from infer.gpu import kernels

THREADS = 256
MAX_BLOCKS = 64  # a pass's index is tens of KB: a few thousand threads cover it in one sweep


def by_sms() -> bool:
    """NVMEDIRECT_SM_UPLOADS=1: small uploads by a kernel (module docstring), else by the copy engine."""
    return os.environ.get("NVMEDIRECT_SM_UPLOADS", "0") == "1"


def copy_from_host(dst_ptr: int, host_ptr: int, nbytes: int, stream: cupy.cuda.Stream) -> None:
    """`nbytes` from pinned host memory at host_ptr to device memory at dst_ptr, queued on `stream`
    (the host must not rewrite the source before the stream has run the copy)."""
    if nbytes <= 0:
        return
    if not by_sms():
        cupy.cuda.runtime.memcpyAsync(dst_ptr, host_ptr, nbytes, cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
        return
    if nbytes % 4 or dst_ptr % 4 or host_ptr % 4:
        raise ValueError(f"an upload by the SMs moves whole aligned 4-byte words, not {nbytes} bytes "
                         f"({host_ptr:#x} -> {dst_ptr:#x})")
    words = nbytes // 4
    blocks = min(MAX_BLOCKS, -(-words // THREADS))
    with stream:
        kernels.function("ops", "copy_words_from_host")(
            (blocks,), (THREADS,), (np.uint64(host_ptr), np.uint64(dst_ptr), np.int64(words)))


class HostStage:
    """A pinned host buffer and its device twin for a small array uploaded each pass; the host
    rewrites the buffer only once the last upload from it has run."""

    def __init__(self) -> None:
        self.nbytes = 0
        self._pinned = None
        self._host = np.zeros(0, np.uint8)
        self._device: cupy.ndarray | None = None
        self._done: cupy.cuda.Event | None = None

    def put(self, values: np.ndarray, stream: cupy.cuda.Stream) -> cupy.ndarray:
        """`values` (4- or 8-byte items) on the device, queued on `stream`; the view is valid until
        the next put."""
        data = np.ascontiguousarray(values)
        if data.dtype.itemsize % 4:
            raise ValueError(f"HostStage uploads 4- or 8-byte items, not {data.dtype}")
        if self._done is not None:
            self._done.synchronize()
        if data.nbytes > self.nbytes:
            self.nbytes = max(4096, 2 * self.nbytes, data.nbytes)
            self._pinned = cupy.cuda.alloc_pinned_memory(self.nbytes)
            self._host = np.frombuffer(self._pinned, np.uint8, self.nbytes)
            with stream:
                self._device = cupy.empty(self.nbytes, cupy.uint8)
        assert self._device is not None
        self._host[: data.nbytes] = data.view(np.uint8).reshape(-1)
        copy_from_host(self._device.data.ptr, self._host.ctypes.data, data.nbytes, stream)
        if self._done is None:
            self._done = cupy.cuda.Event(disable_timing=True)
        self._done.record(stream)
        return self._device[: data.nbytes].view(data.dtype)
