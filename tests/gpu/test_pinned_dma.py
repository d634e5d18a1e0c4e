"""DMA buffers in CUDA pinned memory: bytes read into a `DmaBuffer` from CuPy's pinned allocator reach
the GPU intact.

On the GPU machine there is no NVMe controller (and no VFIO), so the data source here is a file read
into the pinned DmaBuffer with `preadv`; the NVMe → DmaBuffer half of the path is proven in the VM
tests (tests/vm/test_driver.py). What this test adds is the other half: the DmaBuffer API on
CuPy pinned memory (addresses, slices, physical pages from pagemap when root), and the pinned →
device copy. Run on the H200:

    .venv/bin/python -m pytest -v -s tests/gpu/test_pinned_dma.py
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import numpy as np
import pytest

from nvmedirect.vfio.dma import NoIommuDma

pytestmark = pytest.mark.gpu

CUDA_MEMORY_TYPE_HOST = 1  # cudaMemoryTypeHost


def test_file_bytes_land_in_pinned_dma_buffer_and_on_the_gpu(tmp_path: Path) -> None:
    import cupy

    size = (64 << 20) + 12345
    data = np.random.default_rng(11).integers(0, 256, size, dtype=np.uint8)
    path = tmp_path / "source.bin"
    path.write_bytes(data.tobytes())

    # The allocator the no-IOMMU driver uses; with root it also resolves physical pages.
    dma = NoIommuDma() if os.geteuid() == 0 else None
    if dma is None:
        pytest.skip("reading physical pages of pinned memory needs root")
    buf = dma.alloc(size + 4096, source="cuda-pinned")
    try:
        assert buf.kind == "cuda-pinned"
        attributes = cupy.cuda.runtime.pointerGetAttributes(buf.address)
        assert attributes.type == CUDA_MEMORY_TYPE_HOST, "CuPy does not see the DmaBuffer as pinned"
        pages = buf.page_addresses()
        assert len(pages) == (size + 4096 + 4095) // 4096 and np.all(pages % 4096 == 0) and np.all(pages > 0)

        # A byte range, like a GGUF tensor: unaligned file offset, unaligned place in the buffer.
        file_offset, at, nbytes = 4097, 3, size - 9000
        target = buf[at:at + nbytes]
        fd = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < nbytes:
                done += os.preadv(fd, [target.view[done:]], file_offset + done)
        finally:
            os.close(fd)
        expected = data[file_offset:file_offset + nbytes]
        assert bytes(target.view[:64]) == expected[:64].tobytes()

        device = cupy.empty(nbytes, dtype=cupy.uint8)
        stream = cupy.cuda.Stream(non_blocking=True)
        started = time.perf_counter()
        cupy.cuda.runtime.memcpyAsync(device.data.ptr, target.address, nbytes,
                                      cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
        stream.synchronize()
        seconds = time.perf_counter() - started
        print(f"pinned DmaBuffer -> GPU: {nbytes / seconds / 1e9:.1f} GB/s ({nbytes >> 20} MiB)")
        back = cupy.asnumpy(device)
        assert hashlib.sha256(back.tobytes()).digest() == hashlib.sha256(expected.tobytes()).digest()
        # The same check on the GPU itself: a byte sum computed there equals the host's.
        assert int(device.astype(cupy.uint64).sum()) == int(expected.astype(np.uint64).sum())
    finally:
        buf.free()
        assert dma.live_mappings() == 0
