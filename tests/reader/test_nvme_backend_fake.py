"""NvmeBackend and NvmeTarget over the driver's pure-Python fake controller (tests/nvme/fake_nvme.py):
the piece/segment planning, staging copies, DMA destinations and queue-pair dealing, without a VM.
The VM tests (tests/vm/test_store.py) run the same code against QEMU's NVMe."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "nvme"))
from fake_nvme import FakeBar, FakeNvme, IdentityDma  # noqa: E402

from nvmedirect.nvme.controller import Controller  # noqa: E402
from nvmedirect.reader import ReadError, open_model  # noqa: E402
from nvmedirect.reader.nvme_backend import NvmeBackend  # noqa: E402
from nvmedirect.store.nvme_target import NvmeTarget  # noqa: E402
from nvmedirect.store.writer import plan_write, sha256_file, verify_model, write_model  # noqa: E402

IMAGE_BYTES = 8 << 20


@pytest.fixture(params=[512, 4096], ids=["lba512", "lba4096"])
def fake(request: pytest.FixtureRequest) -> FakeNvme:
    return FakeNvme(bytearray(os.urandom(IMAGE_BYTES)), lba_size=request.param)


@pytest.fixture
def ctrl(fake: FakeNvme):
    controller = Controller(FakeBar(fake), IdentityDma(), io_timeout_s=2.0)
    controller.start(io_queues=4)
    yield controller
    controller.close()
    assert controller.dma.live_mappings() == 0, "a DMA mapping leaked"


@pytest.mark.parametrize(("queue_pairs", "queue_depth", "io_size"), [(1, 1, 4096), (2, 8, 64 << 10), (3, 32, 1 << 20)])
def test_random_ranges_into_host_memory(ctrl, fake: FakeNvme, queue_pairs: int, queue_depth: int,
                                        io_size: int) -> None:
    image = np.frombuffer(fake.image, dtype=np.uint8)
    rng = np.random.default_rng(queue_pairs)
    ranges = []
    for _ in range(60):
        nbytes = int(rng.choice([1, 3, 511, 512, 4096, 5000, 200_000, 1 << 20]))
        ranges.append((int(rng.integers(0, IMAGE_BYTES - nbytes)), nbytes))
    outs = [np.zeros(n + 5, dtype=np.uint8)[5:] for _, n in ranges]  # odd destination addresses
    rung: dict[int, int] = {}  # SQ doorbell writes per queue id
    ring = fake.doorbell_written

    def counting(offset: int, value: int) -> None:
        qid, is_cq = divmod((offset - 0x1000) // 4, 2)
        if not is_cq:
            rung[qid] = rung.get(qid, 0) + 1
        ring(offset, value)

    fake.doorbell_written = counting
    with NvmeBackend(ctrl, queue_pairs=queue_pairs, queue_depth=queue_depth, io_size=io_size) as backend:
        assert backend.size == IMAGE_BYTES and backend.lba_size == fake.lba_size
        rung.clear()
        backend.read_async(ranges, outs).wait()
    assert len([q for q in rung if q]) == queue_pairs, f"every queue pair should carry reads: {rung}"
    for (offset, nbytes), out in zip(ranges, outs, strict=True):
        assert np.array_equal(out, image[offset:offset + nbytes]), (offset, nbytes)


def test_dma_destinations_are_filled_directly(ctrl, fake: FakeNvme) -> None:
    image = np.frombuffer(fake.image, dtype=np.uint8)
    with NvmeBackend(ctrl, queue_pairs=2, queue_depth=16, io_size=256 << 10) as backend:
        dest = backend.alloc(3 << 20)
        try:
            backend.read_into([(1 << 20, 3 << 20)], [dest])  # LBA-aligned: no staging
            assert np.array_equal(dest.view, image[1 << 20:4 << 20])
            backend.read_into([(12345, 100_000)], [dest])  # unaligned: staged, then copied
            assert np.array_equal(dest.view[:100_000], image[12345:112345])
        finally:
            dest.free()


def test_bad_requests(ctrl) -> None:
    with NvmeBackend(ctrl, queue_pairs=1) as backend:
        with pytest.raises(ReadError, match="outside the namespace"):
            backend.read_async([(IMAGE_BYTES - 10, 20)], [bytearray(20)])
        with pytest.raises(ReadError, match="cannot hold"):
            backend.read_async([(0, 20)], [bytearray(10)])


def test_failed_command_is_a_read_error(ctrl, fake: FakeNvme) -> None:
    from nvmedirect.spec.layout import IoOpcode

    fake.ignore_opcodes.add(IoOpcode.READ)  # never completed: the driver times out
    with NvmeBackend(ctrl, queue_pairs=1, queue_depth=4) as backend, pytest.raises(ReadError, match="failed"):
        backend.read_into([(0, 8192)], [bytearray(8192)])


def test_write_gguf_through_the_target_then_read_tensors(ctrl, tmp_path: Path) -> None:
    from gguf import GGUFWriter

    path = tmp_path / "m.gguf"
    writer = GGUFWriter(str(path), "llama")
    for i in range(6):
        writer.add_tensor(f"t{i}", np.random.default_rng(i).standard_normal((i + 5, 33)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    raw = path.read_bytes()
    target = NvmeTarget(ctrl)
    try:
        plan = plan_write(target, path, lba=7, sha256=sha256_file(path), name="fake")
        write_model(target, path, plan.header)
        verify_model(target, plan.header)
    finally:
        target.close()
    with NvmeBackend(ctrl, queue_pairs=2, queue_depth=8, io_size=8192) as backend, \
            open_model(backend, lba=7) as model:
        assert model.stored.model_name == "fake"
        for info in model.tensors.values():
            assert model.read_tensor(info.name).tobytes() == raw[info.offset:info.offset + info.nbytes]
        model.verify()


def test_fewer_queue_pairs_than_asked_are_used_with_one_warning() -> None:
    fake = FakeNvme(bytearray(os.urandom(IMAGE_BYTES)), max_io_queues=1)
    controller = Controller(FakeBar(fake), IdentityDma(), io_timeout_s=2.0)
    controller.start(io_queues=2)
    assert controller.io_queue_limit == 1
    with pytest.warns(UserWarning, match="grants 1 I/O queue pair"):
        backend = NvmeBackend(controller, queue_pairs=2)
    with backend:
        assert backend.queue_pairs == 1
        out = np.empty(300_001, dtype=np.uint8)
        backend.read_into([(12345, out.nbytes)], [out])
        assert out.tobytes() == bytes(fake.image[12345:12345 + out.nbytes])
    controller.close()
    controller.close()  # a second close is a no-op, not a shutdown of an unmapped BAR
    assert controller.dma.live_mappings() == 0


def test_a_media_error_names_the_device_and_the_lbas(ctrl, fake: FakeNvme) -> None:
    """A read that fails on the drive (issue 29: a QEMU drive removed under the reader) is one
    ReadError line naming the device, the LBAs and the NVMe status."""
    bad = 3 * (1 << 20) // fake.lba_size + 1
    fake.bad_lbas = {bad}
    with NvmeBackend(ctrl, queue_pairs=1, name="0000:01:00.0 nsid 1") as backend:
        out = np.zeros(1 << 20, dtype=np.uint8)
        backend.read_into([(0, 1 << 20)], [out])  # the good LBAs still read
        with pytest.raises(ReadError) as info:
            backend.read_into([(3 << 20, 1 << 20)], [out])
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("0000:01:00.0 nsid 1: NVMe read of LBAs ")
    first, last = (int(x) for x in message.split("LBAs ")[1].split(" ")[0].split(".."))
    assert first <= bad <= last
    assert "ERROR status: 02/81 Unrecovered Read Error" in message


def test_a_device_request_stops_the_reads_and_releases_the_controller(fake: FakeNvme) -> None:
    """Issue 29, defect 10: the kernel's device request (VFIO's REQ interrupt, here its eventfd
    signalled by hand) lets the read in flight finish, refuses new reads with one line, and closes
    the queues and the controller on the watcher thread, while nobody reads."""
    import time

    ctrl = Controller(FakeBar(fake), IdentityDma(), io_timeout_s=5.0)
    ctrl.start(io_queues=4)
    request = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
    try:
        ctrl.watch_removal(request)
        backend = NvmeBackend(ctrl, queue_pairs=2, owns_controller=True, name="0000:01:00.0 nsid 1")
        image = np.frombuffer(fake.image, dtype=np.uint8)
        out = np.zeros(1 << 20, dtype=np.uint8)
        fake.hold = True  # the device keeps the next commands until release(): a read in flight
        handle = backend.read_async([(4096, 1 << 20)], [out])
        deadline = time.monotonic() + 10
        while not fake.held:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.eventfd_write(request, 1)  # the kernel asks for the device back
        while backend.failure is None:
            assert time.monotonic() < deadline, "the request was not seen"
            time.sleep(0.01)
        assert not ctrl.closed  # it waits for the commands in flight
        fake.hold = False
        fake.release()
        handle.wait()  # the read in flight finished, with the right bytes
        assert np.array_equal(out, image[4096:4096 + (1 << 20)])
        ctrl._watcher.join(10)  # the watcher thread released everything, then ended
        assert not ctrl._watcher.is_alive(), "the controller was not released"
        assert ctrl.closed and ctrl.dma.live_mappings() == 0 and ctrl.io_qpairs == {}
        assert ctrl.removal_requested
        with pytest.raises(ReadError) as info:
            backend.read_async([(0, 4096)], [out])
        assert str(info.value) == ("0000:01:00.0 nsid 1: the kernel asked for the device back (hot-unplug or "
                                   "unbind): reads stopped and the device was released")
        backend.close()  # a second close is a no-op
    finally:
        ctrl.close()
        os.close(request)
