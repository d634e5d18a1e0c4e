"""PRP1/PRP2 and PRP lists, checked by walking them the way a controller does."""

import numpy as np
import pytest
from fake_nvme import FakeNvme, IdentityDma

from nvmedirect.errors import DmaError
from nvmedirect.queues.prp import PAGE_SIZE, build_prps, list_pages_needed


@pytest.fixture
def dma():
    allocator = IdentityDma()
    yield allocator
    allocator.close()


def walk(first, nbytes, prp1, prp2):
    return FakeNvme(bytearray(4096)).prp_segments(prp1, prp2, nbytes)


@pytest.mark.parametrize("offset,nbytes", [(0, 512), (0, 4096), (4, 4096), (0, 8192), (100, 8000),
                                           (0, 12288), (4092, 9000), (0, 2 << 20), (512, 2 << 20),
                                           (0, 4 << 20), (512, 4 << 20)])
def test_prps_cover_exactly_the_buffer(dma, offset, nbytes):
    data = dma.alloc(offset + nbytes + PAGE_SIZE)
    lists = dma.alloc(list_pages_needed(4 << 20) * PAGE_SIZE)
    view = data[offset:offset + nbytes]
    prp1, prp2 = build_prps(view.iova, view.page_addresses(), nbytes, lists.view.view(np.uint64),
                            lists.page_addresses())
    segments = walk(view.iova, nbytes, prp1, prp2)
    assert sum(n for _, n in segments) == nbytes
    expected = view.iova
    for address, length in segments:
        assert address == expected
        expected += length
    if offset + nbytes <= PAGE_SIZE:
        assert prp2 == 0


def test_list_pages_needed_counts_chain_pointers():
    assert list_pages_needed(4096) == 0  # PRP1 and PRP2 suffice
    assert list_pages_needed(2 << 20) == 1  # 512 entries (unaligned start) fill one list page
    assert list_pages_needed(4 << 20) == 3  # 1024 entries: 511 + pointer, 511 + pointer, 2


def test_misaligned_prp1_is_refused(dma):
    data = dma.alloc(8192)
    with pytest.raises(DmaError, match="dword"):
        build_prps(data.iova + 2, data.page_addresses(), 100, None, None)


def test_transfer_needing_a_list_without_one_is_refused(dma):
    data = dma.alloc(3 * PAGE_SIZE)
    with pytest.raises(DmaError, match="PRP list"):
        build_prps(data.iova, data.page_addresses(), 3 * PAGE_SIZE, None, None)


@pytest.mark.parametrize("offset,nbytes", [(0, 512), (4, 4096), (100, 8000), (4092, 9000), (512, 2 << 20),
                                           (8, 3 << 20), (0, 4 << 20)])
def test_native_prp_builder_matches_the_python_one(dma, offset, nbytes):
    from nvmedirect.vfio._ffi import ffi, lib

    data = dma.alloc(offset + nbytes + PAGE_SIZE)
    pages = list_pages_needed(4 << 20)
    python_lists, native_lists = dma.alloc(pages * PAGE_SIZE), dma.alloc(pages * PAGE_SIZE)
    view = data[offset:offset + nbytes]
    expected = build_prps(view.iova, view.page_addresses(), nbytes, python_lists.view.view(np.uint64),
                          python_lists.page_addresses())
    native_pages = np.ascontiguousarray(native_lists.page_addresses())
    prps = ffi.new("uint64_t[2]")
    all_pages = np.ascontiguousarray(data.page_addresses())
    rc = lib.nvd_build_prps(ffi.cast("uint64_t *", all_pages.ctypes.data), len(all_pages), offset, nbytes,
                            ffi.cast("uint64_t *", native_lists.address),
                            ffi.cast("uint64_t *", native_pages.ctypes.data), pages, prps)
    assert rc == 0
    # Same data pointers; list pointers differ only because each builder has its own list pages.
    assert prps[0] == expected[0]
    segments = walk(view.iova, nbytes, prps[0], prps[1])
    assert segments == walk(view.iova, nbytes, *expected)
