"""The ring/phase state machine, trackers and doorbell batching, against the fake controller."""

import pytest

from nvmedirect.errors import CommandTimeout, QueueFull
from nvmedirect.spec.layout import IoOpcode


def test_phase_tag_survives_many_laps(ns, qpair, image):
    buf = ns.ctrl.dma.alloc(4096)
    for i in range(qpair.depth * 5):  # five trips around a 16-entry ring
        ns.submit_read(qpair, i, 1, buf).result()
        assert bytes(buf.view[:512]) == bytes(image[i * 512:(i + 1) * 512])
    assert qpair.outstanding == 0 and qpair.free_slots == qpair.depth - 1


def test_batch_rings_each_doorbell_once(ns, qpair, fake):
    buf = ns.ctrl.dma.alloc(15 * 512)
    fake.hold = True
    before = dict(fake.doorbell_writes)
    commands = [ns.submit_read(qpair, i, 1, buf[i * 512:(i + 1) * 512], ring=False) for i in range(15)]
    qpair.ring_doorbell()
    fake.hold = False
    fake.release()
    assert qpair.poll() == 15
    assert all(c.completion.ok for c in commands)
    assert fake.doorbell_writes["sq"] - before["sq"] == 1
    assert fake.doorbell_writes["cq"] - before["cq"] == 0  # the CQ has room for all: announced later


@pytest.mark.parametrize("cq_depth", [16, 17, 64])
def test_the_cq_head_is_announced_before_the_controller_needs_the_room(ctrl, ns, fake, cq_depth):
    """The fake asserts on a CQ overflow; with lazy CQ doorbells a full queue of commands, lap after
    lap, must never find the CQ full from the controller's side."""
    from nvmedirect.queues.qpair import QueuePair
    from nvmedirect.spec import layout

    qpair = QueuePair(4, 16, ctrl.dma, ctrl.bar.doorbell(layout.sq_doorbell_offset(4, 0)),
                      ctrl.bar.doorbell(layout.cq_doorbell_offset(4, 0)), max_transfer=ctrl.max_transfer,
                      cq_depth=cq_depth)
    ctrl.io_qpairs[4] = qpair
    ctrl._create_io_queues_on_device(qpair)
    buf = ns.ctrl.dma.alloc(15 * 512)
    for _ in range(12):
        fake.hold = True
        commands = [ns.submit_read(qpair, i, 1, buf[i * 512:(i + 1) * 512], ring=False) for i in range(15)]
        qpair.ring_doorbell()
        fake.hold = False
        fake.release()
        qpair.drain()
        assert all(c.completion.ok for c in commands)
    batch = ns.batch()
    for lap in range(40):
        batch.add_direct(lap * 15, 15, buf)
    assert ns.run(batch, qpair) == 40
    assert fake.doorbell_writes["cq"] < 12 * 15 + 40
    ctrl.delete_io_qpair(qpair)


def test_posted_completions_counts_what_poll_has_not_reaped_across_a_lap(ns, qpair, fake):
    buf = ns.ctrl.dma.alloc(4096)
    for i in range(qpair.depth - 3):  # the next five CQEs wrap the ring and flip the phase
        ns.submit_read(qpair, i, 1, buf).result()
    fake.hold = True
    commands = [ns.submit_read(qpair, i, 1, buf) for i in range(5)]
    assert qpair.posted_completions == 0
    fake.hold = False
    fake.release()
    assert qpair.posted_completions == 5 and not any(c.done for c in commands)
    assert qpair.poll() == 5
    assert qpair.posted_completions == 0


def test_queue_full_is_a_clear_signal(ns, qpair, fake):
    buf = ns.ctrl.dma.alloc(4096)
    fake.hold = True
    for i in range(qpair.depth - 1):
        ns.submit_read(qpair, i, 1, buf)
    assert qpair.free_slots == 0
    with pytest.raises(QueueFull, match="in flight"):
        ns.submit_read(qpair, 0, 1, buf)
    fake.hold = False
    fake.release()
    qpair.drain()
    assert qpair.free_slots == qpair.depth - 1


def test_cids_are_unique_while_in_flight(ns, qpair, fake):
    buf = ns.ctrl.dma.alloc(4096)
    fake.hold = True
    cids = {ns.submit_read(qpair, 0, 1, buf).cid for _ in range(10)}
    assert len(cids) == 10
    fake.hold = False
    fake.release()
    qpair.drain()


def test_timeout_arrives_as_a_completion_and_quarantines_the_cid(ns, qpair, fake):
    buf = ns.ctrl.dma.alloc(4096)
    fake.ignore_opcodes.add(IoOpcode.READ)
    command = ns.submit_read(qpair, 0, 1, buf, timeout_s=0.05)
    completion = command.wait()
    assert completion.status.name == "Command Timeout" and completion.latency_s >= 0.05
    with pytest.raises(CommandTimeout, match="Command Timeout"):
        completion.raise_for_status()
    assert qpair.free_slots == qpair.depth - 2  # the timed-out CID is not reused yet
    fake.ignore_opcodes.clear()
    ns.submit_read(qpair, 0, 1, buf).result()


def test_callbacks_run_on_completion(ns, qpair):
    buf = ns.ctrl.dma.alloc(4096)
    seen = []
    ns.submit_read(qpair, 3, 1, buf, callback=lambda c: seen.append((c.cid, c.completion.ok)))
    qpair.drain()
    assert seen and seen[0][1]

