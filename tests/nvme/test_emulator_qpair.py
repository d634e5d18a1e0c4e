"""The production CPU hot path (QueuePair / Batch over native/nvme_queue.c and nvme_run.c, which
build SQEs and PRPs through native/nvme_sqe.h) against the emulated controller: real doorbell words
in the emulator's BAR page, real concurrency with the controller's thread, strict validation."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from nvmedirect.emulator import EmulatedController
from nvmedirect.errors import NvmeDirectError
from nvmedirect.queues.batch import Batch
from nvmedirect.queues.qpair import QueuePair
from nvmedirect.vfio.dma import DmaAllocator, IovaAllocator, _Allocation
from nvmedirect.vfio.memory import PAGE_SIZE

MAX_TRANSFER = 1 << 20
READ = 0x02


class EmulatorDma(DmaAllocator):
    """Each allocation gets an IOVA range of its own, mapped into the emulator (its IOMMU)."""

    def __init__(self, emu: EmulatedController):
        self.emu = emu
        self._iovas = IovaAllocator(base=0x9_0000_0000)
        super().__init__()

    def _unmap_raw(self):
        return lambda allocation: None

    def _map(self, mem):
        iova = self._iovas.allocate(mem.nbytes + PAGE_SIZE)  # plus a guard page nobody maps
        self.emu.map(iova, mem.address, mem.nbytes)
        pages = iova + PAGE_SIZE * np.arange(mem.nbytes // PAGE_SIZE, dtype=np.uint64)
        return _Allocation(self, mem, pages, iova, physical=False)

    def _unmap(self, allocation):
        self.emu.unmap(allocation.iova)
        self._iovas.release(allocation.iova, allocation.memory.nbytes + PAGE_SIZE)


@pytest.fixture
def image(tmp_path) -> tuple[str, np.ndarray]:
    data = np.random.default_rng(5).integers(0, 256, 32 << 20, dtype=np.uint8)
    data.tofile(tmp_path / "ns.img")
    return str(tmp_path / "ns.img"), data


def _queue(emu, dma, qid: int, depth: int) -> QueuePair:
    qp = QueuePair(qid, depth, dma, emu.doorbell(qid, False), emu.doorbell(qid, True), MAX_TRANSFER)
    emu.attach(qid, qp.sq_ring.iova, depth, qp.cq_ring.iova, depth)
    return qp


def _random_batch(rng, nsze: int, buffer, count: int) -> tuple[Batch, list[tuple[int, int, int]]]:
    batch = Batch(READ, 1, 512, MAX_TRANSFER // 512)
    at, extents = 0, []
    for _ in range(count):
        kind = rng.random()
        nblocks = int(rng.integers(1, 9) if kind < 0.7 else rng.integers(9, 257) if kind < 0.98 else rng.integers(257, 4097))
        if at + nblocks * 512 + 4096 > buffer.nbytes:
            break
        at += int(rng.integers(0, 1024)) * 4
        lba = int(rng.integers(0, nsze - nblocks))
        batch.add_direct(lba, nblocks, buffer[at:at + nblocks * 512])
        extents.append((lba, nblocks, at))
        at += nblocks * 512
    return batch, extents


def test_queue_pairs_read_every_byte_through_the_emulator(image):
    path, data = image
    with EmulatedController(path, mdts_bytes=MAX_TRANSFER) as emu:
        emu.set_idle_sleep(20e-6)
        dma = EmulatorDma(emu)
        queues = [_queue(emu, dma, qid, depth) for qid, depth in ((1, 2), (2, 33), (3, 256))]
        errors: list[BaseException] = []

        def drive(qp: QueuePair, seed: int) -> None:
            try:
                rng = np.random.default_rng(seed)
                buffer = dma.alloc(48 << 20)
                for _ in range(3):  # three batches: the rings wrap, CIDs come back
                    buffer.view[:] = 0
                    batch, extents = _random_batch(rng, emu.nsze, buffer, 800)
                    qp.run(batch)
                    for lba, nblocks, at in extents:
                        got = buffer.view[at:at + nblocks * 512]
                        assert np.array_equal(got, data[lba * 512:(lba + nblocks) * 512]), (qp.qid, lba, nblocks)
                buffer.free()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
                errors.append(exc)

        threads = [threading.Thread(target=drive, args=(qp, qp.qid)) for qp in queues]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        assert emu.violations == 0, emu.first_violation
        counters = emu.counters()
        assert counters["fetched"] == counters["completed"] > 6000
        for qp in queues:
            emu.detach(qp.qid)
            qp.free()


def test_an_injected_media_error_fails_the_batch_by_name(image):
    path, _ = image
    with EmulatedController(path, mdts_bytes=MAX_TRANSFER) as emu:
        emu.set_idle_sleep(20e-6)
        dma = EmulatorDma(emu)
        qp = _queue(emu, dma, 1, 16)
        buffer = dma.alloc(1 << 20)
        emu.inject_status(1000, 7, 2, 0x81)
        batch = Batch(READ, 1, 512, MAX_TRANSFER // 512)
        batch.add_direct(1007, 8, buffer[:4096])
        with pytest.raises(NvmeDirectError, match="(?i)unrecovered read error"):
            qp.run(batch)
        assert emu.violations == 0
        emu.detach(1)
        qp.free()
        buffer.free()
