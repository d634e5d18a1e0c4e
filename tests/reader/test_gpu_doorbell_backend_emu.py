"""GpuDoorbellBackend's own logic (ranges -> whole-LBA commands of at most io_size, page-aligned
pieces in the destination, batches, the copy out, status errors in the CPU path's form) against the
emulated controller, its commands issued by the CPU reference submitter of the same SQE builder
(`cpu_drive`): no GPU needed. tests/gpu/test_doorbell_reader_gpu.py runs the same with GPU threads."""

from __future__ import annotations

import numpy as np
import pytest

from nvmedirect.emulator import EmulatedController
from nvmedirect.reader.base import ReadError
from nvmedirect.reader.gpu_doorbell_backend import GpuDoorbellBackend, cpu_drive, describe_status

IMAGE_BYTES = 8 << 20


@pytest.fixture
def image(tmp_path) -> tuple[str, np.ndarray]:
    data = np.random.default_rng(16).integers(0, 256, IMAGE_BYTES, dtype=np.uint8)
    data.tofile(tmp_path / "ns.img")
    return str(tmp_path / "ns.img"), data


def _backend(emu: EmulatedController, **options) -> GpuDoorbellBackend:
    return GpuDoorbellBackend(emu, size_bytes=emu.nsze * emu.lba_size, lba_size=emu.lba_size, drive=cpu_drive,
                              **options)


def test_unaligned_ranges_and_batches_read_every_byte(image) -> None:
    path, data = image
    rng = np.random.default_rng(3)
    with EmulatedController(path, mdts_bytes=256 << 10) as emu, \
            _backend(emu, queue_depth=8, io_size=64 << 10, batch_bytes=512 << 10) as backend:
        emu.set_idle_sleep(0.0001)
        ranges = [(0, 1), (511, 2), (IMAGE_BYTES - 3, 3), (4096, 4096), (12345, 1 << 20)]
        ranges += [(int(o), int(n)) for o, n in zip(rng.integers(0, IMAGE_BYTES - (300 << 10), 40),
                                                    rng.integers(1, 300 << 10, 40), strict=True)]
        buffers = [np.zeros(n, np.uint8) for _, n in ranges]
        backend.read_into(ranges, buffers)
        for (offset, nbytes), got in zip(ranges, buffers, strict=True):
            assert np.array_equal(got, data[offset:offset + nbytes]), (offset, nbytes)
        counters = emu.counters()
        assert emu.violations == 0, emu.first_violation
        assert counters["completed"] == counters["fetched"] > len(ranges)  # large ranges cut into commands
    with pytest.raises(ReadError, match="outside"):
        backend.read_into([(IMAGE_BYTES - 1, 2)], [np.zeros(2, np.uint8)])


def test_a_failed_command_is_one_read_error_in_the_cpu_paths_form(image) -> None:
    path, _ = image
    with EmulatedController(path) as emu, _backend(emu) as backend:
        emu.inject_status(1, 0, 2, 0x81)  # every read: Unrecovered Read Error
        with pytest.raises(ReadError, match=r"NVMe read of bytes 0\.\.1024 failed: ERROR status: 02/81"):
            backend.read_into([(100, 600)], [np.zeros(600, np.uint8)])
    assert describe_status(0x10001).startswith("ERROR status: ") and "DNR" in describe_status(0x10001)
