"""Inside the VM: our driver against QEMU's NVMe controller, in this boot's VFIO mode.

Driven by tests/vm/test_driver.py, which configures the controllers named in conftest.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from driver_setup import BIG_LBA_SERIAL, READ_SERIAL, WRITE_SERIAL, image_bytes

from nvmedirect.errors import LbaOutOfRange
from nvmedirect.nvme.controller import Controller

QEMU_MODEL = "QEMU NVMe Ctrl"
SIZES = [1, 2, 3, 511, 512, 513, 4095, 4096, 4097, 65_537, 300_001, (1 << 20) + 3, 3 << 20, 8 << 20]


def sha(data) -> str:
    return hashlib.sha256(bytes(data)).hexdigest()


def test_identify_returns_qemu_serial_and_model(ctrl):
    assert ctrl.info.serial == READ_SERIAL
    assert ctrl.info.model == QEMU_MODEL
    assert ctrl.info.mdts == 7 and ctrl.max_transfer == 512 << 10
    assert ctrl.version == 0x10400
    assert 1 in ctrl.active_namespaces()


def test_identify_command_line(bound, noiommu):
    """Without --noiommu the mode comes from the device's group, and `identify` names the mode in
    use in text and JSON (issue 29: it printed "(IOMMU)" in a no-IOMMU guest)."""
    bdf = bound(BIG_LBA_SERIAL)
    mode = "no-IOMMU" if noiommu else "IOMMU"
    argv = [os.path.join(os.path.dirname(sys.executable), "nvmedirect"), "identify", bdf]
    text = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert text.returncode == 0, text.stderr
    assert text.stdout.splitlines()[0].endswith(f"({mode})"), text.stdout
    out = subprocess.run(argv + ["--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["mode"] == mode
    assert data["controller"]["serial"] == BIG_LBA_SERIAL and data["controller"]["model"] == QEMU_MODEL
    assert data["namespaces"][0]["lba_size"] == 4096
    assert any(f["data_size"] == 4096 and f["in_use"] for f in data["namespaces"][0]["formats"])


@pytest.mark.parametrize("into", ["bytearray", "dma"])
def test_random_byte_ranges_match_the_image(ctrl, ns, read_image, into):
    rng = random.Random(f"{into}-ranges")
    staging = ctrl.dma.alloc((8 << 20) + 8) if into == "dma" else None
    for size in SIZES:
        offset = rng.randrange(0, len(read_image) - size)
        if into == "dma":
            at = rng.choice([0, 4, 1000, 4092])  # where in the DMA buffer the bytes should land
            dest = staging[at:at + size]
            ns.read_into(dest, offset, size)
            got = dest.view
        else:
            got = bytearray(size)
            ns.read_into(got, offset, size)
        assert sha(got) == sha(read_image[offset:offset + size]), f"{size} bytes at {offset}"
    if staging is not None:
        staging.free()


@pytest.mark.parametrize("in_flight", [1, 2, 8, 32, 64])
def test_queue_depths(ctrl, ns, qpair, read_image, in_flight):
    buf = ctrl.dma.alloc(4 << 20)
    chunk_blocks = 8  # 4 KiB commands: many of them, so the queue really fills
    segments = [(lba, chunk_blocks) for lba in range(0, (4 << 20) // 512, chunk_blocks)]
    rng = random.Random(in_flight)
    rng.shuffle(segments)
    batch = ns.batch()
    for lba, n in segments:
        batch.add_direct(1000 + lba, n, buf[lba * 512:(lba + n) * 512])
    issued = ns.run(batch, qpair=qpair, max_in_flight=in_flight)
    assert issued == len(segments)
    assert sha(buf.view) == sha(read_image[1000 * 512:1000 * 512 + (4 << 20)])
    buf.free()


def test_two_queue_pairs_in_flight_together(ctrl, ns, read_image):
    pairs = [ctrl.create_io_qpair(depth=16) for _ in range(3)]
    assert len({qp.qid for qp in pairs}) == 3
    bufs = [ctrl.dma.alloc(15 * 4096) for _ in pairs]
    commands = []
    for index, (qp, buf) in enumerate(zip(pairs, bufs, strict=True)):
        for slot in range(15):
            lba = 8 * (index * 15 + slot)
            commands.append((ns.submit_read(qp, lba, 8, buf[slot * 4096:(slot + 1) * 4096], ring=False), lba,
                             buf[slot * 4096:(slot + 1) * 4096]))
    for qp in pairs:  # one doorbell per queue for 15 commands each
        qp.ring_doorbell()
    for command, lba, dest in commands:
        command.result()
        assert bytes(dest.view) == read_image[lba * 512:lba * 512 + 4096]
    for qp, buf in zip(pairs, bufs, strict=True):
        buf.free()
        ctrl.delete_io_qpair(qp)


def test_read_beyond_the_namespace_is_lba_out_of_range(ctrl, ns):
    with pytest.raises(LbaOutOfRange, match=r"ERROR status: 00/80 LBA Out of Range"):
        ns.read_into(bytearray(100), ns.size_bytes - 10, 100)
    buf = ctrl.dma.alloc(4096)
    completion = ns.submit_read(ctrl.default_qpair, ns.size_blocks, 1, buf).wait()
    assert completion.status.name == "LBA Out of Range" and not completion.status.is_retryable()
    buf.free()
    ns.read_into(bytearray(10), ns.size_bytes - 10, 10)  # the queue still works afterwards


def test_4096_byte_lbas_and_chained_prp_lists(bound, noiommu):
    image = image_bytes(BIG_LBA_SERIAL)
    # No MDTS limit on this controller, so 3 MiB commands need chained PRP lists (more than 512
    # entries). Not 4 MiB: from an unaligned start that is 1025 pages, above the 1024 scatter
    # entries QEMU maps per command (it answers Internal Error).
    with Controller.open(bound(BIG_LBA_SERIAL), noiommu=noiommu, max_transfer=3 << 20) as ctrl:
        assert ctrl.info.mdts == 0 and ctrl.max_transfer == 3 << 20
        ns = ctrl.namespace(1)
        assert ns.lba_size == 4096 and ns.size_bytes == len(image)
        buf = ctrl.dma.alloc((8 << 20) + 4096)
        dest = buf[4:4 + (8 << 20) - 4096]  # unaligned start: 769 pages per 3 MiB command
        ns.read_into(dest, 4096 - 4 + 4096, dest.nbytes)
        assert sha(dest.view) == sha(image[8188:8188 + dest.nbytes])
        rng = random.Random(4096)
        for size in SIZES:
            offset = rng.randrange(0, len(image) - size)
            got = bytearray(size)
            ns.read_into(got, offset, size)
            assert sha(got) == sha(image[offset:offset + size]), f"{size} bytes at {offset}"
        with pytest.raises(LbaOutOfRange):
            ns.read_into(bytearray(4096), ns.size_bytes, 4096)


def test_controller_reset_fails_in_flight_commands_and_recovers(bound, noiommu):
    """The recovery path a fatal status takes (QEMU never sets CSTS.CFS, so the reset is asked for).

    The reset comes once the device has posted every completion and before the driver reaps one:
    to the driver all eight reads are in flight, and their CQEs sit in the rings it must clear.
    Resetting while QEMU 7.2 still works on a read crashes QEMU itself (a segfault in its NVMe
    model within a few tries under TCG), which no driver can recover from."""
    image = image_bytes(BIG_LBA_SERIAL)
    with Controller.open(bound(BIG_LBA_SERIAL), noiommu=noiommu) as ctrl:
        ns = ctrl.namespace(1)
        pairs = [ctrl.default_qpair, ctrl.create_io_qpair(depth=8)]
        buf = ctrl.dma.alloc(16 * 4096)
        commands = [ns.submit_read(qp, i, 1, buf[i * 4096:(i + 1) * 4096]) for i, qp in enumerate(pairs * 4)]
        deadline = time.monotonic() + 10
        while any(qp.posted_completions < 4 for qp in pairs) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert [qp.posted_completions for qp in pairs] == [4, 4]
        assert not any(c.done for c in commands)
        ctrl.reset()
        assert all(c.done for c in commands)
        assert {type(c.completion.exception()).__name__ for c in commands} == {"ControllerFatal"}
        for qp in pairs:  # the same queue pair objects were re-created on the device
            got = bytearray(5000)
            ns.read_into(got, 12345, len(got), qpair=qp)
            assert got == image[12345:17345]


def test_writes_then_reads_round_trip(bound, noiommu):
    pattern = np.random.default_rng(int(os.environ["NVD_WRITE_SEED"])).integers(0, 256, 3 << 20, dtype=np.uint8)
    with Controller.open(bound(WRITE_SERIAL), noiommu=noiommu) as ctrl:
        ns = ctrl.namespace(1)
        buf = ctrl.dma.alloc(pattern.nbytes)
        buf.view[:] = pattern
        first_lba = int(os.environ["NVD_WRITE_LBA"])
        ns.write(first_lba, pattern.nbytes // ns.lba_size, buf)  # 3 MiB: six 512 KiB commands
        ns.flush()
        back = bytearray(pattern.nbytes - 1001)
        ns.read_into(back, first_lba * ns.lba_size + 1000, len(back))
        assert sha(back) == sha(pattern[1000:1000 + len(back)].tobytes())


def test_close_unmaps_and_the_device_can_be_reopened(bound, noiommu):
    bdf = bound(WRITE_SERIAL)
    for _ in range(2):  # the second open finds the group released by the first close
        ctrl = Controller.open(bdf, noiommu=noiommu)
        dma = ctrl.dma
        ctrl.namespace(1).read_into(bytearray(10), 12345, 10)
        assert dma.live_mappings() > 0
        ctrl.close()
        assert dma.live_mappings() == 0


def test_benchmark_measures_both_drivers(bound, noiommu):
    """bench/nvme_vm.py's measurement, small: both drivers read the same bytes of one controller."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "bench"))
    import nvme_vm

    bdf = bound(WRITE_SERIAL)
    rows = nvme_vm.measure(bdf, noiommu, [128 << 10], 8 << 20, depth=8, repeats=1)
    assert [row["block"] for row in rows] == [128 << 10]
    for path in nvme_vm.PATHS:
        assert rows[0][path]["wall_s"] > 0 and rows[0][path]["cpu_s"] >= 0, (path, rows[0][path])
    print(nvme_vm.describe({"mode": "test", "total_bytes": 8 << 20, "depth": 8, "repeats": 1,
                            "sweep": [{"mdts": 7, "rows": rows}]}))
