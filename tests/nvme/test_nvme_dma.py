"""DMA buffers on real locked memory: page addresses, slicing, hexdump, memlock advice, pagemap."""

import os
import resource

import numpy as np
import pytest
from fake_nvme import IdentityDma

from nvmedirect.errors import DmaError, MemlockLimit
from nvmedirect.vfio import memory
from nvmedirect.vfio.dma import IovaAllocator, physical_page_addresses


@pytest.fixture
def dma():
    allocator = IdentityDma()
    yield allocator
    allocator.close()
    assert allocator.live_mappings() == 0


def test_buffer_slices_share_memory_and_addresses(dma):
    buf = dma.alloc(3 * 4096)
    buf.view[:] = np.arange(len(buf.view), dtype=np.uint8)
    part = buf[5000:5100]
    assert part.nbytes == 100 and part.iova == buf.iova + 5000
    assert bytes(part.view[:3]) == bytes([5000 % 256, 5001 % 256, 5002 % 256])
    part.view[0] = 0xAB
    assert buf.view[5000] == 0xAB
    assert len(part.page_addresses()) == 1


def test_dump_shows_address_hex_and_text(dma):
    buf = dma.alloc(4096)
    buf.view[:5] = np.frombuffer(b"GGUF\x03", dtype=np.uint8)
    line = buf.dump(0, 16).splitlines()[0]
    assert line.startswith(f"{buf.iova:016x}  47 47 55 46 03") and line.endswith("GGUF............")


def test_free_unmaps_and_use_after_free_is_refused(dma):
    buf = dma.alloc(4096)
    assert dma.live_mappings() == 1
    buf.free()
    assert dma.live_mappings() == 0
    with pytest.raises(DmaError, match="after free"):
        buf.device_address(0)


def test_iova_allocator_reuses_and_merges():
    iovas = IovaAllocator(base=1 << 32, size=1 << 24)
    a = iovas.allocate(8192)
    b = iovas.allocate(2 << 20, alignment=2 << 20)
    assert b % (2 << 20) == 0 and b >= a + 8192
    iovas.release(a, 8192)
    iovas.release(b, 2 << 20)
    assert iovas.allocate(1 << 24) == 1 << 32  # everything merged back into one range


def test_memlock_limit_says_what_to_do(monkeypatch):
    monkeypatch.setattr(resource, "getrlimit", lambda _: (8 << 20, 8 << 20))
    monkeypatch.setattr(memory, "has_ipc_lock_capability", lambda: False)
    with pytest.raises(MemlockLimit, match="ulimit -l unlimited"):
        memory.check_memlock(4 << 20, 16 << 20)
    memory.check_memlock(0, 4 << 20)  # under the limit: fine


@pytest.mark.skipif(os.geteuid() != 0, reason="pagemap hides frame numbers from non-root")
def test_pagemap_gives_physical_pages_of_locked_memory():
    mem = memory.anonymous(4 * 4096, hugepages=False)
    try:
        pages = physical_page_addresses(mem.address, mem.nbytes)
        assert len(pages) == 4 and all(p % 4096 == 0 and p > 0 for p in pages)
        assert len(set(pages.tolist())) == 4
    finally:
        mem.release()
