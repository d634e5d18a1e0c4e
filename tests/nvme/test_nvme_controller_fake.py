"""Controller bring-up, admin commands, namespace I/O and recovery, against the fake controller.

The same behaviour is proven against QEMU's NVMe in tests/vm/test_driver*.py; this file keeps the
logic testable without a VM.
"""

import logging
import random

import numpy as np
import pytest
from fake_nvme import FakeBar, FakeNvme, IdentityDma

from nvmedirect.errors import ControllerFatal, InvalidNamespace, LbaOutOfRange
from nvmedirect.nvme.controller import Controller
from nvmedirect.spec.layout import IoOpcode


def test_bring_up_logs_each_state(fake, caplog):
    caplog.set_level(logging.INFO, logger="nvmedirect.nvme")
    ctrl = Controller(FakeBar(fake), IdentityDma())
    ctrl.start()
    states = [r.getMessage().split("→ ")[1].split()[0] for r in caplog.records if "state →" in r.getMessage()]
    assert states == ["DISABLE", "WAIT_NOT_READY", "CONFIGURE_ADMIN", "ENABLE", "WAIT_READY", "READY"]
    assert ctrl.info.serial == "FAKE0001" and ctrl.info.model == "nvmedirect fake"
    assert ctrl.max_transfer == 128 << 10  # MDTS 5
    ctrl.close()
    assert ctrl.dma.live_mappings() == 0


def test_read_into_random_unaligned_ranges(ns, image):
    rng = random.Random(3)
    for size in [1, 3, 511, 512, 513, 4095, 4097, 100_000, 300_000, 1 << 20]:
        offset = rng.randrange(0, len(image) - size)
        dest = bytearray(size)
        ns.read_into(dest, offset, size)
        assert dest == image[offset:offset + size], (offset, size)


def test_read_into_dma_buffer_reads_middle_directly(ns, image, fake):
    buf = ns.ctrl.dma.alloc(700_000)
    offset, size = 1000, 600_004  # dword-aligned distance to the first whole LBA
    fake.commands_seen.clear()
    ns.read_into(buf, offset, size)
    assert bytes(buf.view[:size]) == bytes(image[offset:offset + size])
    # 128 KiB transfer limit: LBAs 2..1172 (1171 whole ones) go direct in 5 commands; the partial
    # head and tail LBAs are staged.
    assert sorted(n for _, _, n in fake.commands_seen) == [1, 1, 147, 256, 256, 256, 256]


def test_write_then_read_round_trip(ns, image):
    buf = ns.ctrl.dma.alloc(64 << 10)
    payload = np.frombuffer(bytes(range(256)) * 256, dtype=np.uint8)
    buf.view[:] = payload
    ns.write(100, 128, buf)
    ns.flush()
    assert bytes(image[100 * 512:228 * 512]) == payload.tobytes()
    back = ns.ctrl.dma.alloc(64 << 10)
    ns.read(100, 128, back)
    assert bytes(back.view) == payload.tobytes()


def test_large_read_is_split_at_mdts(ns, fake, image):
    buf = ns.ctrl.dma.alloc(1 << 20)
    fake.commands_seen.clear()
    ns.read(0, 2048, buf)
    assert [n for _, _, n in fake.commands_seen] == [256] * 8
    assert bytes(buf.view) == bytes(image[:1 << 20])


def test_read_beyond_the_end_is_lba_out_of_range(ns):
    dest = bytearray(100)
    with pytest.raises(LbaOutOfRange, match="ERROR status: 00/80 LBA Out of Range"):
        ns.read_into(dest, ns.size_bytes - 50, 100)


def test_unknown_namespace_is_named(ctrl):
    with pytest.raises(InvalidNamespace):
        ctrl.namespace(9)


def test_several_queue_pairs_and_depths(ctrl, ns, image):
    pairs = [ctrl.create_io_qpair(depth=d) for d in (2, 8, 64)]
    assert sorted(ctrl.io_qpairs) == [1, 2, 3]
    for qp in pairs:
        dest = bytearray(200_000)
        ns.read_into(dest, 777, len(dest), qpair=qp)
        assert dest == image[777:777 + len(dest)]
    for qp in pairs:
        ctrl.delete_io_qpair(qp)


def test_4096_byte_lbas():
    image = bytearray(np.random.default_rng(1).integers(0, 256, 2 << 20, dtype=np.uint8).tobytes())
    with Controller(FakeBar(FakeNvme(image, lba_size=4096)), IdentityDma()) as ctrl:
        ctrl.start()
        ns = ctrl.namespace(1)
        assert ns.lba_size == 4096 and ns.size_blocks == 512
        dest = bytearray(10_000)
        ns.read_into(dest, 4095, 10_000)
        assert dest == image[4095:14095]


def test_fatal_status_fails_in_flight_and_recovers(ctrl, ns, qpair, fake, image):
    buf = ns.ctrl.dma.alloc(4096)
    fake.ignore_opcodes.add(IoOpcode.READ)
    command = ns.submit_read(qpair, 0, 1, buf, timeout_s=0.05)
    fake.set_fatal()
    completion = command.wait()
    assert isinstance(completion.exception(), ControllerFatal)
    fake.ignore_opcodes.clear()
    # The controller was reset and the same queue pair object works again.
    ns.submit_read(qpair, 2, 1, buf).result()
    assert bytes(buf.view[:512]) == bytes(image[1024:1536])


def test_removed_device_fails_commands_and_close_still_unmaps(fake, image):
    ctrl = Controller(FakeBar(fake), IdentityDma())
    ctrl.start()
    ns = ctrl.namespace(1)
    qp = ctrl.create_io_qpair(depth=4)
    buf = ctrl.dma.alloc(4096)
    fake.ignore_opcodes.add(IoOpcode.READ)
    command = ns.submit_read(qp, 0, 1, buf, timeout_s=0.05)
    fake.removed = True
    assert isinstance(command.wait().exception(), ControllerFatal)
    assert ctrl.dead
    ctrl.close()
    assert ctrl.dma.live_mappings() == 0
