"""GPU-initiated NVMe reads against the emulated controller (issue 15, "Verify 1"): kernels of
nvmedirect/gpu/doorbell.cu build SQEs in host-registered rings, write the emulator's doorbell words
through a CUDA mapping of its stand-in BAR0 page, poll phase tags and ring the CQ head. Every byte
is compared with the backing file; injected errors must come back from the kernel; the SQEs the
GPU builds equal the CPU builder's bytes and an independent NumPy rendering of the spec.

No NVMe drive exists on the GPU machine, so `check --probe-gpu-mmio` is tested here for its
"nothing bound" answer. Run there with scripts/gpu-doorbell-check.sh.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from nvmedirect.emulator import EmulatedController
from nvmedirect.gpu.reference import reference_sqes
from nvmedirect.gpu.rings import HOST_STATUS, HOST_TIMEOUT, QueueMemory, QueueSpec, host_build, random_reads
from nvmedirect.host_memory import PAGE_SIZE

pytestmark = pytest.mark.gpu

IMAGE_BYTES = 64 << 20
MDTS = 4 << 20
MEDIA_ERROR = (2, 0x81)
# QD 1 to 256 (CIDs 0..qd-1), rings from 2 entries (a wrap every command) to 300
SPECS = [QueueSpec(1, 1, 2), QueueSpec(2, 2, 3), QueueSpec(3, 16, 17), QueueSpec(4, 33, 50),
         QueueSpec(5, 64, 65), QueueSpec(6, 128, 200), QueueSpec(7, 255, 256), QueueSpec(8, 256, 300)]


def status_word(sct: int, sc: int, dnr: int = 1) -> int:
    return dnr << 15 | sct << 9 | sc << 1


@pytest.fixture(scope="module")
def backing(tmp_path_factory) -> tuple[str, np.ndarray]:
    data = np.random.default_rng(15).integers(0, 256, IMAGE_BYTES, dtype=np.uint8)
    path = tmp_path_factory.mktemp("doorbell") / "namespace.img"
    data.tofile(path)
    return str(path), data


@pytest.fixture
def emu(backing):
    with EmulatedController(backing[0], mdts_bytes=MDTS) as controller:
        yield controller


def _gpu(memory):
    from nvmedirect.gpu.doorbell import GpuQueues

    return GpuQueues(memory)


def test_gpu_threads_read_tens_of_thousands_of_random_ranges_every_byte(emu, backing):
    work = random_reads(seed=1515, count=30000, nsze=emu.nsze, lba_size=512, max_bytes=MDTS)
    memory = QueueMemory(emu, SPECS, work, MDTS)
    expected = work.expected(backing[1])
    with _gpu(memory) as gpu:
        for lap in range(2):  # the second drive goes on from the ring indices the first ended at
            memory.dst[:] = 0
            gpu.status.fill(0xFFFF)
            status = gpu.drive(timeout_s=10.0)
            assert not status.any(), f"lap {lap}: {np.count_nonzero(status)} failed, first {status[status != 0][:4]}"
            assert np.array_equal(memory.dst, expected), f"lap {lap}: a byte differs from the backing file"
        assert not gpu.stray.get().any()
    counters = emu.counters()
    assert emu.violations == 0, emu.first_violation
    assert counters["completed"] == counters["fetched"] == 2 * work.count
    assert counters["sq_doorbells"] < 2 * work.count  # tail doorbells batched per round
    assert (work.nblocks * 512 > 2 << 20).any(), "some reads chain PRP list pages"


def test_injected_statuses_and_delays_are_reported_by_the_kernel(emu, backing):
    work = random_reads(seed=7, count=8000, nsze=emu.nsze, lba_size=512, max_bytes=256 << 10)
    memory = QueueMemory(emu, SPECS[2:6], work, 256 << 10)
    emu.inject_status(97, 5, *MEDIA_ERROR)
    emu.inject_delay(89, 7, 0.002)  # held back 2 ms: completions out of order, CIDs busy longer
    failed = work.slba % 97 == 5
    with _gpu(memory) as gpu:
        status = gpu.drive(timeout_s=10.0)
    assert np.array_equal(status != 0, failed)
    assert set(status[failed].tolist()) == {status_word(*MEDIA_ERROR)}
    assert np.array_equal(memory.dst, work.expected(backing[1], failed))
    counters = emu.counters()
    assert counters["injected_errors"] == failed.sum() and counters["injected_delays"] > 0
    assert emu.violations == 0, emu.first_violation


def test_a_controller_that_never_answers_times_out_in_the_kernel(emu):
    work = random_reads(seed=8, count=64, nsze=emu.nsze, lba_size=512, max_bytes=8192)
    memory = QueueMemory(emu, [QueueSpec(1, 16, 17)], work, 8192)
    emu.inject_delay(1, 0, 30.0)
    with _gpu(memory) as gpu:
        status = gpu.drive(timeout_s=0.2)
    assert (status == HOST_STATUS | HOST_TIMEOUT).all()


def test_gpu_sqe_bytes_equal_the_cpu_builder_and_the_numpy_reference(emu):
    work = random_reads(seed=42, count=512, nsze=emu.nsze, lba_size=512, max_bytes=MDTS, large_fraction=0.02)
    memory = QueueMemory(emu, [QueueSpec(1, 512, 513)], work, MDTS)
    with _gpu(memory) as gpu:
        gpu_bytes, errors = gpu.build_sqes()
    assert errors == 0
    gpu_lists = memory.queues[0]["lists"].copy()
    memory.queues[0]["lists"][:] = 0
    cpu, rc = host_build(memory)
    assert rc == 0
    assert gpu_bytes.tobytes() == cpu.tobytes(), "the GPU's SQEs differ from the CPU builder's"
    assert np.array_equal(gpu_lists, memory.queues[0]["lists"]), "the GPU's PRP lists differ"
    q = memory.queues[0]
    want, lists = reference_sqes(work, 0, work.count, 512, 1, memory.dst_pages, q["list_iovas"], memory.list_pages)
    assert cpu.tobytes() == want.tobytes(), "the CPU builder differs from the NumPy reference"
    entries = gpu_lists.view("<u8").reshape(-1, PAGE_SIZE // 8)
    for k, pages in lists.items():
        for p, content in enumerate(pages):
            assert list(entries[k * memory.list_pages + p][:len(content)]) == content


def test_a_kernel_reads_cap_and_vs_of_the_stand_in_bar(emu):
    """The probe's kernel on the emulator's page (a real BAR0 needs cudaHostRegisterIoMemory)."""
    from nvmedirect.gpu.doorbell import read_registers, register, unregister

    device = register(emu.bar_address, emu.bar_bytes)
    try:
        cap, vs = read_registers(device)
    finally:
        unregister(emu.bar_address)
    assert (cap, vs) == (emu.read_register(0, 8), emu.read_register(8))


def test_probe_gpu_mmio_names_the_missing_controller():
    """A GPU is here, no NVMe is bound to vfio-pci: one line naming that, exit 4, no traceback."""
    out = subprocess.run([sys.executable, "-c", "from nvmedirect.cli import main; main()", "check",
                          "--probe-gpu-mmio", "0000:ff:1f.7"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 4, out.stdout + out.stderr
    text = out.stdout + out.stderr
    assert "Traceback" not in text
    assert "0000:ff:1f.7" in text and "vfio" in text.lower()
