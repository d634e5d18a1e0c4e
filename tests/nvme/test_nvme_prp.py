"""PRP1/PRP2 and PRP lists as the native builder writes them into SQEs, checked by walking them
the way a controller does."""

import numpy as np
import pytest
from fake_nvme import FakeNvme, IdentityDma

from nvmedirect.errors import NvmeDirectError
from nvmedirect.host_memory import PAGE_SIZE
from nvmedirect.queues.prp import list_pages_needed
from nvmedirect.queues.qpair import QueuePair
from nvmedirect.spec.layout import IoOpcode
from nvmedirect.vfio._ffi import ffi

MAX_TRANSFER = 4 << 20


@pytest.fixture
def dma():
    allocator = IdentityDma()
    yield allocator
    allocator.close()


@pytest.fixture
def qpair(dma):
    doorbells = np.zeros(2, dtype=np.uint32)  # plain memory standing in for the two registers
    qp = QueuePair(1, 4, dma, doorbells.ctypes.data, doorbells.ctypes.data + 4, max_transfer=MAX_TRANSFER)
    qp.doorbells = doorbells
    yield qp
    qp.free()


def submitted_prps(qpair, data, nbytes):
    command = qpair.submit(IoOpcode.READ, nsid=1, data=data, data_len=nbytes)
    sqe = ffi.cast("struct nvd_sqe *", qpair.sq_ring.address)[(qpair.sq_tail - 1) % qpair.depth]
    assert sqe.cid == command.cid and sqe.opcode == IoOpcode.READ
    return sqe.prp1, sqe.prp2


def walk(nbytes, prp1, prp2):
    return FakeNvme(bytearray(4096)).prp_segments(prp1, prp2, nbytes)


@pytest.mark.parametrize("offset,nbytes", [(0, 512), (0, 4096), (4, 4096), (0, 8192), (100, 8000),
                                           (0, 12288), (4092, 9000), (0, 2 << 20), (512, 2 << 20),
                                           (0, 4 << 20), (512, 3 << 20), (8, 3 << 20)])
def test_prps_cover_exactly_the_buffer(dma, qpair, offset, nbytes):
    data = dma.alloc(offset + nbytes + PAGE_SIZE)
    view = data[offset:offset + nbytes]
    prp1, prp2 = submitted_prps(qpair, view, nbytes)
    segments = walk(nbytes, prp1, prp2)
    assert sum(n for _, n in segments) == nbytes
    expected = view.iova
    for address, length in segments:
        assert address == expected
        expected += length
    if offset + nbytes <= PAGE_SIZE:
        assert prp2 == 0


def test_each_command_slot_has_its_own_list_pages(dma, qpair):
    data = dma.alloc(2 * (1 << 20))
    first = walk(1 << 20, *submitted_prps(qpair, data[:1 << 20], 1 << 20))
    second = walk(1 << 20, *submitted_prps(qpair, data[1 << 20:], 1 << 20))
    assert first[0][0] == data.iova and second[0][0] == data.iova + (1 << 20)  # the first list still holds


def test_the_tail_doorbell_is_one_word_at_its_address(dma, qpair):
    data = dma.alloc(4096)
    qpair.submit(IoOpcode.READ, nsid=1, data=data, ring=False)
    qpair.submit(IoOpcode.READ, nsid=1, data=data, ring=False)
    assert qpair.doorbells.tolist() == [0, 0]
    qpair.ring_doorbell()
    assert qpair.doorbells.tolist() == [2, 0]


def test_list_pages_needed_counts_chain_pointers():
    assert list_pages_needed(4096) == 0  # PRP1 and PRP2 suffice
    assert list_pages_needed(2 << 20) == 1  # 512 entries (unaligned start) fill one list page
    assert list_pages_needed(4 << 20) == 3  # 1024 entries: 511 + pointer, 511 + pointer, 2


def test_misaligned_prp1_is_refused_and_the_slot_stays_free(dma, qpair):
    data = dma.alloc(8192)
    with pytest.raises(NvmeDirectError, match="dword"):
        qpair.submit(IoOpcode.READ, nsid=1, data=data[2:102])
    assert qpair.free_slots == qpair.depth - 1
