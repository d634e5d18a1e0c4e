"""Host buffers reads and writes use: page-aligned, and CUDA-pinned when a GPU is there.

The store, the reader and the VFIO layer all build on this module (it imports none of them).
Every destination is handled as a 1-D writable `numpy.uint8` array; `as_byte_array` turns what callers
pass (bytearray, memoryview, mmap, NumPy arrays of any dtype, CuPy pinned arrays) into that view
without copying.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

# The one page size of this package: the granularity of DMA mappings and PRP entries, the NVMe
# memory page size programmed into CC.MPS, and the alignment O_DIRECT buffers get.
PAGE_SIZE = 4096


def as_byte_array(buffer: Any) -> np.ndarray:
    """A writable uint8 view of `buffer` (no copy); raises ValueError if it is read-only."""
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise ValueError("destination array must be C-contiguous")
        view = buffer.reshape(-1).view(np.uint8)
    else:
        view = np.frombuffer(buffer, dtype=np.uint8)
    if not view.flags.writeable:
        raise ValueError("destination buffer is read-only")
    return view


def address_of(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def aligned_empty(nbytes: int) -> np.ndarray:
    """Page-aligned host memory (an anonymous mapping), not pinned for CUDA."""
    region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(region, dtype=np.uint8, count=nbytes)


def gpu_present() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device: all mean "no GPU" here
        return False


def pinned_empty(nbytes: int) -> np.ndarray:
    """CUDA-pinned, page-aligned host memory when a GPU is present, else page-aligned memory.

    Pinning is slow (seconds per GiB): allocate once and reuse.
    """
    if gpu_present():
        import cupyx

        # CuPy's pinned pool hands out 512-byte-aligned chunks: over-allocate and cut at a page.
        array = cupyx.empty_pinned((nbytes + PAGE_SIZE,), dtype=np.uint8)
        skip = -address_of(array) % PAGE_SIZE
        return array[skip:skip + nbytes]
    return aligned_empty(nbytes)


def is_pinned(array: np.ndarray) -> bool:
    """Whether CUDA knows `array` as pinned host memory (False without a GPU)."""
    if not gpu_present():
        return False
    import cupy

    try:
        attrs = cupy.cuda.runtime.pointerGetAttributes(address_of(array))
    except Exception:  # unregistered pageable memory raises on some CUDA versions
        return False
    return attrs.type == cupy.cuda.runtime.memoryTypeHost
