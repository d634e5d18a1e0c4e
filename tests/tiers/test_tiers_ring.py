"""The ring's schedule on its own: pass order enforced, slots released in order, refills never
overwrite a slot in use, and tier C staging is refilled only after the copy out of it finished
(the seed's staging-buffer race), checked with a transport whose copies land late."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from infer.tiers.cpu_sim import CpuTransport
from infer.tiers.plan import Plan, Tensor, Tier
from infer.tiers.ring import StagingReader, StreamRing
from infer.tiers.tier_c import MmapSource, open_source
from nvmedirect.reader import FileBackend


def tensors_and_file(tmp_path: Path, n: int = 9, size: int = 10_000) -> tuple[list[Tensor], Path, np.ndarray]:
    data = np.random.default_rng(1).integers(0, 256, n * size + 123, dtype=np.uint8)
    path = tmp_path / "weights.bin"
    data.tofile(path)
    tensors = [Tensor(f"blk.{i}.ffn_up.weight", 123 + i * size, size - 7 * i, 0, (1, size - 7 * i), size - 7 * i)
               for i in range(n)]
    return tensors, path, data


def c_plan(tensors: list[Tensor], slots: int) -> Plan:
    return Plan(tensors, {t.name: Tier.STORAGE for t in tensors}, len(tensors), slots,
                max(t.nbytes for t in tensors), 0, 0, 0)


class LateCopies:
    """Copies read the host buffer only `delay` seconds after being queued, as a DMA engine
    behind a busy stream would; tokens complete when the copy has read its source."""

    def __init__(self, n_slots: int, slot_nbytes: int, delay: float) -> None:
        self.slots = [np.zeros(slot_nbytes, np.uint8) for _ in range(n_slots)]
        self.done = [threading.Event() for _ in range(n_slots)]
        self.delay = delay

    def copy_in(self, slot: int, tensor: Tensor, host: np.ndarray, track: bool = True) -> threading.Event:
        finished = threading.Event()
        self.done[slot].clear()

        def later() -> None:
            time.sleep(self.delay)
            self.slots[slot][: tensor.nbytes] = host[: tensor.nbytes]
            finished.set()
            self.done[slot].set()

        threading.Thread(target=later, daemon=True).start()

        class Token:
            def wait(self) -> None:
                finished.wait()

        return Token()  # type: ignore[return-value]

    def wait_arrival(self, slot: int) -> None:
        self.done[slot].wait()

    def record_release(self, slot: int) -> None:
        pass


@pytest.mark.parametrize("source_kind", ["file", "mmap"])
def test_staging_is_not_refilled_while_a_copy_still_reads_it(tmp_path: Path, source_kind: str) -> None:
    tensors, path, data = tensors_and_file(tmp_path)
    # the reader's O_DIRECT backend on a plain data file, or the mmap baseline
    source = FileBackend(path, queue_depth=4) if source_kind == "file" else open_source("mmap", path, tensors)
    transport = LateCopies(3, max(t.nbytes for t in tensors), delay=0.01)
    staging = StagingReader(source, tensors, n_staging=2)
    ring = StreamRing(c_plan(tensors, 3), transport, None, staging)
    ring.start()
    try:
        for _ in range(3):  # three passes: the sequence wraps around
            for t in tensors:
                slot = ring.acquire(t.name)
                got = transport.slots[slot][: t.nbytes]
                np.testing.assert_array_equal(got, data[t.offset: t.offset + t.nbytes], err_msg=t.name)
                ring.release(slot)
        assert ring.moved[Tier.STORAGE] >= 3 * sum(t.nbytes for t in tensors)
    finally:
        ring.close()
        source.close()


def test_pass_order_and_release_order_are_enforced(tmp_path: Path) -> None:
    tensors, path, _ = tensors_and_file(tmp_path, n=4)
    source = MmapSource(path)
    transport = CpuTransport(2, max(t.nbytes for t in tensors))
    ring = StreamRing(c_plan(tensors, 2), transport, None, StagingReader(source, tensors, 2))
    ring.start()
    try:
        with pytest.raises(RuntimeError, match="pass order"):
            ring.acquire(tensors[1].name)
        first = ring.acquire(tensors[0].name)
        second = ring.acquire(tensors[1].name)
        with pytest.raises(RuntimeError, match="exhausted"):
            ring.acquire(tensors[2].name)
        with pytest.raises(RuntimeError, match="released in order"):
            ring.release(second)
        ring.release(first)
        ring.release(second)
        assert ring.issued == 4
    finally:
        ring.close()
        transport.close()
        source.close()


def test_cpu_transport_refuses_to_refill_an_unreleased_slot() -> None:
    transport = CpuTransport(2, 16)
    t = Tensor("blk.0.ffn_up.weight", 0, 16, 0, (1, 16), 16)
    transport.copy_in(0, t, np.ones(16, np.uint8))
    with pytest.raises(RuntimeError, match="before its previous tensor was released"):
        transport.copy_in(0, t, np.ones(16, np.uint8))
    transport.record_release(0)
    transport.copy_in(0, t, np.full(16, 7, np.uint8)).wait()
    transport.wait_arrival(0)
    assert (transport.slots[0] == 7).all()
    transport.close()


def test_only_tier_c_copies_are_tracked(tmp_path: Path) -> None:
    """A copy's token serves only the staging buffer it read (tier C): tier B's bytes are never
    refilled, so its copies are queued untracked (no event made and recorded for each)."""
    tensors, path, data = tensors_and_file(tmp_path, n=4)
    tiers = {t.name: (Tier.RAM if i % 2 else Tier.STORAGE) for i, t in enumerate(tensors)}
    plan = Plan(tensors, tiers, len(tensors), 2, max(t.nbytes for t in tensors), 0, 0, 0)

    class Host:  # tier B as the ring reads it
        def view(self, name: str) -> np.ndarray:
            t = next(t for t in tensors if t.name == name)
            return data[t.offset : t.offset + t.nbytes]

    tracked: list[tuple[str, bool]] = []

    class Logging(CpuTransport):
        def copy_in(self, slot: int, tensor: Tensor, host: np.ndarray, track: bool = True):  # noqa: ANN201
            tracked.append((tensor.name, track))
            return super().copy_in(slot, tensor, host, track)

    source = MmapSource(path)
    c_pieces = [t for t in tensors if tiers[t.name] is Tier.STORAGE]
    transport = Logging(2, max(t.nbytes for t in tensors))
    ring = StreamRing(plan, transport, Host(), StagingReader(source, c_pieces, 2))  # type: ignore[arg-type]
    ring.start()
    try:
        for t in tensors:
            slot = ring.acquire(t.name)
            assert np.array_equal(transport.slots[slot][: t.nbytes], data[t.offset : t.offset + t.nbytes])
            ring.release(slot)
    finally:
        ring.close()
        transport.close()
        source.close()
    assert tracked[:4] == [(t.name, tiers[t.name] is Tier.STORAGE) for t in tensors]
