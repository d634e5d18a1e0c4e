"""The NVMe controller emulator (native/nvme_emu.c) driven from the CPU through the shared SQE/PRP
builder (native/nvme_sqe.h): by the reference submitter the GPU kernels mirror, and by the
production queue pair (native/nvme_queue.c). Every byte is compared; malformed commands written
by hand show that each rule the emulator enforces is enforced. No GPU, no VM."""

from __future__ import annotations

import time

import numpy as np
import pytest

from nvmedirect.emulator import EmulatedController, ffi
from nvmedirect.gpu.reference import SQE_DTYPE, reference_sqes
from nvmedirect.gpu.rings import RING_DTYPE, QueueMemory, QueueSpec, host_build, host_drive, random_reads
from nvmedirect.host_memory import PAGE_SIZE

IMAGE_BYTES = 64 << 20
MDTS = 4 << 20  # above 2 MiB: the largest reads need a chained PRP list
MEDIA_ERROR = (2, 0x81)  # SCT media errors, Unrecovered Read Error


def status_word(sct: int, sc: int, dnr: int = 1) -> int:
    """A CQE status without its phase bit, as the submitters report it."""
    return dnr << 15 | sct << 9 | sc << 1


@pytest.fixture(scope="module")
def backing(tmp_path_factory) -> tuple[str, np.ndarray]:
    data = np.random.default_rng(2026).integers(0, 256, IMAGE_BYTES, dtype=np.uint8)
    path = tmp_path_factory.mktemp("emu") / "namespace.img"
    data.tofile(path)
    return str(path), data


@pytest.fixture
def emu(backing):
    with EmulatedController(backing[0], mdts_bytes=MDTS) as controller:
        controller.set_idle_sleep(20e-6)  # share the CI machine's cores with the submitter
        yield controller


def test_registers_read_like_a_controller(emu):
    cap = emu.read_register(0, 8)
    assert cap & 0xFFFF == 1023 and (cap >> 32) & 0xF == 0 and (cap >> 37) & 1 == 1
    assert emu.read_register(8) == 0x10400  # VS 1.4.0
    assert emu.doorbell_offset(3, True) == 0x1000 + 7 * 4


@pytest.mark.parametrize("dstrd", [0, 2])
def test_tens_of_thousands_of_random_reads_every_byte(backing, dstrd):
    """QD 1 to 255 on four queues at once (the emulator polls them all), rings from 2 to 256 entries:
    thousands of wrap-arounds and phase flips, every CID reused many times; then a second drive
    continues the ring indices where the first stopped."""
    path, data = backing
    with EmulatedController(path, mdts_bytes=MDTS, dstrd=dstrd) as emu:
        emu.set_idle_sleep(20e-6)
        work = random_reads(seed=15 + dstrd, count=12000, nsze=emu.nsze, lba_size=512, max_bytes=MDTS)
        specs = [QueueSpec(1, 1, 2), QueueSpec(2, 7, 13), QueueSpec(5, 64, 65), QueueSpec(9, 255, 256)]
        memory = QueueMemory(emu, specs, work, MDTS)
        expected = work.expected(data)
        for _ in range(2):
            memory.dst[:] = 0
            memory.status[:] = 0xFFFF
            assert host_drive(memory) == [q["count"] for q in memory.queues]
            assert not memory.status.any()
            assert np.array_equal(memory.dst, expected), "a byte differs from the backing file"
        counters = emu.counters()
        assert emu.violations == 0, emu.first_violation
        assert counters["completed"] == counters["fetched"] == 2 * work.count
        assert int(memory.state[0][0]) == 0  # depth 2, an even number of commands: back at slot 0
        assert (work.nblocks * 512 > 2 << 20).any(), "the workload has reads with chained PRP lists"


def test_injected_status_is_reported_and_moves_no_data(emu, backing):
    work = random_reads(seed=3, count=3000, nsze=emu.nsze, lba_size=512, max_bytes=256 << 10)
    memory = QueueMemory(emu, [QueueSpec(1, 32, 33), QueueSpec(2, 200, 256)], work, 256 << 10)
    emu.inject_status(13, 5, *MEDIA_ERROR)
    failed = work.slba % 13 == 5
    assert failed.any()
    assert host_drive(memory) == [int((~failed[q["first"]:q["first"] + q["count"]]).sum()) for q in memory.queues]
    assert np.array_equal(memory.status != 0, failed)
    assert set(memory.status[failed]) == {status_word(*MEDIA_ERROR)}
    assert np.array_equal(memory.dst, work.expected(backing[1], failed))
    assert emu.counters()["injected_errors"] == failed.sum() and emu.violations == 0


def test_delayed_completions_arrive_out_of_order_and_complete(emu, backing):
    work = random_reads(seed=4, count=2000, nsze=emu.nsze, lba_size=512, max_bytes=64 << 10)
    memory = QueueMemory(emu, [QueueSpec(1, 64, 80)], work, 64 << 10)
    emu.inject_delay(7, 3, 0.002)
    assert host_drive(memory) == [work.count]
    assert np.array_equal(memory.dst, work.expected(backing[1]))
    assert emu.counters()["injected_delays"] == (work.slba % 7 == 3).sum() > 0
    assert emu.violations == 0


def test_a_submitter_that_stops_hearing_back_times_out(emu):
    work = random_reads(seed=5, count=50, nsze=emu.nsze, lba_size=512, max_bytes=8192)
    memory = QueueMemory(emu, [QueueSpec(1, 8, 9)], work, 8192)
    emu.inject_delay(1, 0, 5.0)  # every completion held back far beyond the submitter's patience
    assert host_drive(memory, timeout_s=0.05) == [-110]  # -ETIMEDOUT
    assert (memory.status[:8] == 0x10001).all()  # in flight: HOST_STATUS | HOST_TIMEOUT


def test_c_builder_bytes_equal_the_numpy_reference(emu):
    """The SQEs and PRP lists of nvme_sqe.h (compiled as C) equal an independent NumPy rendering of
    the spec's rules for the same seed; the GPU test compares the kernel's bytes with these."""
    work = random_reads(seed=77, count=600, nsze=emu.nsze, lba_size=512, max_bytes=MDTS, large_fraction=0.02)
    memory = QueueMemory(emu, [QueueSpec(1, 600, 601)], work, MDTS)
    out, rc = host_build(memory)
    assert rc == 0
    q = memory.queues[0]
    want, lists = reference_sqes(work, 0, work.count, 600, 1, memory.dst_pages, q["list_iovas"], memory.list_pages)
    assert out.tobytes() == want.tobytes()
    entries = q["lists"].view("<u8").reshape(-1, PAGE_SIZE // 8)
    assert any(len(pages) > 1 for pages in lists.values()), "some command chains list pages"
    for k, pages in lists.items():
        for p, content in enumerate(pages):
            row = entries[k * memory.list_pages + p]
            assert list(row[:len(content)]) == content


# -- malformed commands, one rule each -----------------------------------------------------------
def _submit_raw(emu, memory, edit, count: int = 1):
    """Build `count` good reads through the C builder, let `edit(sqes, memory)` break them, write them
    into queue 1's ring, ring its doorbell and return the CQE statuses (phase dropped)."""
    built, rc = host_build(memory)
    assert rc == 0
    sqes = built.view(SQE_DTYPE).copy()
    sqes = sqes[:count]
    edit(sqes, memory)
    q = memory.queues[0]
    q["sq"][:count * 64] = np.frombuffer(sqes.tobytes(), dtype=np.uint8)
    ffi.cast("uint32_t *", emu.doorbell(1, False))[0] = count
    cq = q["cq"].view("<u4").reshape(-1, 4)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and not all(cq[k][3] >> 16 & 1 for k in range(count)):
        time.sleep(0.0005)
    return [int(cq[k][3] >> 16) & ~1 for k in range(count)]


def _one_read(emu, nblocks: int, offset: int = 0, queue_depth: int = 4) -> QueueMemory:
    work = random_reads(seed=9, count=queue_depth, nsze=emu.nsze, lba_size=512, max_bytes=MDTS)
    work.nblocks[:], work.slba[:] = nblocks, 100
    work.dst_offset[:] = offset + np.arange(queue_depth, dtype=np.uint64) * ((nblocks * 512 // PAGE_SIZE + 2) * PAGE_SIZE)
    work.dst_bytes = int(work.dst_offset[-1]) + (nblocks * 512 // PAGE_SIZE + 2) * PAGE_SIZE
    return QueueMemory(emu, [QueueSpec(1, queue_depth, queue_depth + 1)], work, MDTS)


def _set(field, value):
    def edit(sqes, memory):
        sqes[0][field] = value
    return edit


BROKEN = {
    "write opcode": (8, 0, _set("opcode", 0x01), (0, 0x01), "not Read"),
    "namespace 2": (8, 0, _set("nsid", 2), (0, 0x0B), "namespace 2"),
    "fused": (8, 0, _set("flags", 1), (0, 0x02), "reserved"),
    "metadata pointer": (8, 0, _set("mptr", 4096), (0, 0x02), "reserved"),
    "cdw13": (8, 0, _set("cdw13", 7), (0, 0x02), "reserved"),
    "beyond the namespace": (8, 0, _set("cdw10", IMAGE_BYTES // 512 - 4), (0, 0x80), "beyond the namespace"),
    "NLB over MDTS": (8, 0, _set("cdw12", MDTS // 512), (0, 0x02), "exceed MDTS"),
    "PRP1 not dword aligned": (8, 0, lambda s, m: s[0].__setitem__("prp1", int(s[0]["prp1"]) + 2), (0, 0x13), "dword"),
    "unused PRP2 set": (8, 0, _set("prp2", 0x1000), (0, 0x02), "unused PRP2"),
    "second page unaligned": (16, 0, lambda s, m: s[0].__setitem__("prp2", int(s[0]["prp2"]) + 8), (0, 0x13),
                              "second data page"),
    "list pointer unaligned": (64, 0, lambda s, m: s[0].__setitem__("prp2", int(s[0]["prp2"]) + 4), (0, 0x13),
                               "qword"),
    "list entry unaligned": (64, 0, lambda s, m: m.queues[0]["lists"].view("<u8").__setitem__(
        0, int(m.queues[0]["lists"].view("<u8")[0]) + 512), (0, 0x13), "list entry"),
    "guard page": (8, 0, lambda s, m: s[0].__setitem__("prp1", int(m.dst_pages[-1]) + PAGE_SIZE), (0, 0x04),
                   "outside every mapped region"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_every_rule_is_enforced(emu, case):
    nblocks, offset, edit, (sct, sc), message = BROKEN[case]
    memory = _one_read(emu, nblocks, offset)
    assert _submit_raw(emu, memory, edit) == [status_word(sct, sc)]
    assert emu.violations == 1 and message in emu.first_violation, emu.first_violation


def test_a_cid_still_outstanding_is_a_conflict(emu):
    memory = _one_read(emu, 8, queue_depth=2)
    emu.inject_delay(1, 0, 0.05)  # the first command stays outstanding while the second arrives

    def same_cid(sqes, mem):
        sqes[1]["cid"] = sqes[0]["cid"]
    statuses = _submit_raw(emu, memory, same_cid, count=2)
    assert status_word(0, 0x03) in statuses
    assert emu.violations == 1 and "already outstanding" in emu.first_violation


def test_a_tail_doorbell_beyond_the_ring_is_a_violation(emu):
    work = random_reads(seed=1, count=4, nsze=emu.nsze, lba_size=512, max_bytes=8192)
    QueueMemory(emu, [QueueSpec(1, 4, 5)], work, 8192)
    ffi.cast("uint32_t *", emu.doorbell(1, False))[0] = 5
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and not emu.violations:
        time.sleep(0.0005)
    assert "beyond its 5 entries" in emu.first_violation
    assert RING_DTYPE.itemsize == 17 * 8
