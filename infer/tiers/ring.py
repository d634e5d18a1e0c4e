"""The streaming ring, device-independent: which streamed tensor goes into which slot when, and
the tier C staging that feeds it. The GPU (pipeline.py) and the CPU simulation (cpu_sim.py) supply
a `Transport` with the device half; the ordering logic here is the same for both, so the CPU tests
exercise the exact schedule the GPU runs.

Streamed tensors form a cyclic sequence in pass order (after the last layer of a pass comes the
first streamed tensor of the next), numbered j = 0, 1, 2, ... Piece j lives in slot j % n_slots.
- `issue(j)`: the copy of piece j into its slot is queued behind the release of piece j - n_slots
  (the previous occupant), so a refill never overwrites bytes still in use;
- `acquire(name)`: the consumer's work is queued behind piece j's arrival;
- `release(slot)`: marks the slot free once the consumer's queued work is done, and tops the ring
  up to n_slots pieces in flight.
Nothing here waits for the device: on the GPU each of these only records or waits on events in
streams, so the host queues a whole pass without a synchronisation per layer.

Tier C pieces are first read from storage into host staging. A background thread keeps
`n_staging` reads in flight ahead of the ring; a staging buffer is refilled only after the device
copy out of it has completed (the seed reused its staging buffer while a copy could still be
reading it).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from infer.tiers.plan import Plan, Tensor, Tier
from infer.tiers.tier_b import HostTier
from infer.tiers.tier_c import ReadHandleLike, StorageSource
from nvmedirect.host_memory import pinned_empty


class Transport(Protocol):
    """The device half of the ring."""

    def copy_in(self, slot: int, tensor: Tensor, host: np.ndarray, track: bool = True) -> Any:
        """Queues host -> slot after the slot's last release; returns a token whose `wait()`
        returns once the copy has finished reading `host` (None where `track` is False: memory
        that is never refilled, tier B's)."""

    def wait_arrival(self, slot: int) -> None:
        """Queues the consumer's next work behind the last copy into `slot`."""

    def record_release(self, slot: int) -> None:
        """The consumer's work queued so far is the last use of `slot`'s bytes."""


class StagingReader:
    """Reads tier C pieces, cyclically in pass order, into a ring of host staging buffers."""

    def __init__(self, source: StorageSource, pieces: Sequence[Tensor], n_staging: int) -> None:
        self.source = source
        self.pieces = list(pieces)
        self.n_staging = n_staging
        size = max(t.nbytes for t in self.pieces)
        self.buffers = [pinned_empty(-(-size // 4096) * 4096) for _ in range(n_staging)]
        self._free: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in range(n_staging)]
        self._ready: dict[int, ReadHandleLike] = {}
        self._cond = threading.Condition()
        self._stop = False
        self._error: BaseException | None = None
        self.bytes_read = 0
        self._start()

    def _start(self) -> None:
        for q in self._free:
            q.put(None)  # every buffer starts free
        self._thread = threading.Thread(target=self._run, name="tier-c-staging", daemon=True)
        self._thread.start()

    def restart(self) -> None:
        """Drops the reads made ahead and starts the cycle again at its first piece, numbered 0 (the
        ring restarted its order: StreamRing.select). Every piece taken must have been given back."""
        self.close()
        for q in self._free:  # the copies out of the buffers, then the reads into them, finished
            while not q.empty():
                token = q.get()
                if token is not None:
                    token.wait()
        with self._cond:
            handles, self._ready = list(self._ready.values()), {}
        for handle in handles:
            handle.wait()
        self._stop, self._error = False, None
        self._start()

    def _run(self) -> None:
        j = 0
        try:
            while True:
                k = j % self.n_staging
                token = self._free[k].get()  # the copy out of buffer k (piece j - n_staging) was queued
                if self._stop:
                    return
                if token is not None:
                    token.wait()  # ... and has finished reading it
                t = self.pieces[j % len(self.pieces)]
                handle = self.source.read_async([(t.offset, t.nbytes)], [self.buffers[k][: t.nbytes]])
                with self._cond:
                    self._ready[j] = handle
                    self.bytes_read += t.nbytes
                    self._cond.notify_all()
                j += 1
        except BaseException as err:  # handed to the consumer, which raises it
            with self._cond:
                self._error = err
                self._cond.notify_all()

    def take(self, j: int) -> np.ndarray:
        """The staging buffer holding C piece j, once its read has landed."""
        with self._cond:
            while j not in self._ready and self._error is None:
                self._cond.wait()
            if self._error is not None:
                raise self._error
            handle = self._ready.pop(j)
        handle.wait()
        t = self.pieces[j % len(self.pieces)]
        return self.buffers[j % self.n_staging][: t.nbytes]

    def give_back(self, j: int, token: Any) -> None:
        """Buffer of piece j may be refilled once `token` (the copy out of it) completes."""
        self._free[j % self.n_staging].put(token)

    def close(self) -> None:
        self._stop = True
        for q in self._free:
            q.put(None)
        self._thread.join(timeout=30)


class StreamRing:
    """Schedules the streamed tensors of a plan through `n_slots` device slots."""

    def __init__(self, plan: Plan, transport: Transport, host: HostTier | None,
                 staging: StagingReader | None) -> None:
        self.full_order = plan.streamed
        self.order = self.full_order  # what a pass streams (select: the CPU tier's layers left out)
        self.left_out: frozenset[int] = frozenset()
        self._base = 0  # piece number at which `order` began
        self.tier = {t.name: plan.tier[t.name] for t in self.order}
        self.n_slots = plan.n_slots
        self.transport = transport
        self.host = host
        self.staging = staging
        c_pieces = [t for t in self.order if self.tier[t.name] is Tier.STORAGE]
        self._c_index = {t.name: i for i, t in enumerate(c_pieces)}
        self._c_count = len(c_pieces)
        self.issued = 0  # pieces whose copy is queued
        self.consumed = 0  # pieces acquired by the consumer
        self.released = 0
        self.moved = {Tier.RAM: 0, Tier.STORAGE: 0}  # bytes copied to the device, per source tier
        self.paths: dict[str, str] = {}

    def start(self) -> None:
        self._top_up()

    def _top_up(self) -> None:
        while self.order and self.issued < self.released + self.n_slots:
            self._issue(self.issued)

    def _issue(self, j: int) -> None:
        t = self.order[(j - self._base) % len(self.order)]
        slot = j % self.n_slots
        if self.tier[t.name] is Tier.RAM:
            assert self.host is not None
            self.transport.copy_in(slot, t, self.host.view(t.name), track=False)  # nothing refills tier B
        else:
            assert self.staging is not None
            passes = (j - self._base) // len(self.order)  # the staging cycle restarts with the order
            c_j = passes * self._c_count + self._c_index[t.name]
            buffer = self.staging.take(c_j)
            token = self.transport.copy_in(slot, t, buffer)
            self.staging.give_back(c_j, token)
        self.moved[self.tier[t.name]] += t.nbytes
        self.issued += 1

    def acquire(self, name: str) -> int:
        """The slot that will hold `name` (the next streamed tensor in pass order); the consumer's
        following work waits for its arrival."""
        j = self.consumed
        if not self.order:
            raise RuntimeError(f"{name} is not streamed in this pass (its layer is the CPU's)")
        expected = self.order[(j - self._base) % len(self.order)]
        if name != expected.name:
            raise RuntimeError(f"streamed tensors must be used in pass order: got {name}, expected {expected.name}")
        if self.issued <= j:  # only with n_slots pieces all acquired and none released
            raise RuntimeError(f"ring of {self.n_slots} slots exhausted: release a slot before acquiring {name}")
        slot = j % self.n_slots
        self.transport.wait_arrival(slot)
        self.consumed += 1
        return slot

    def release(self, slot: int) -> None:
        expected = self.released % self.n_slots
        if slot != expected:
            raise RuntimeError(f"slots are released in order: got {slot}, expected {expected}")
        self.transport.record_release(slot)
        self.released += 1
        self._top_up()

    def skip_pass(self) -> None:
        """The ring's count after a pass that a captured graph ran (its copies, waits and releases
        are the graph's): every piece of a pass consumed and released, as many issued, and their
        bytes counted as moved. Only at a pass boundary with the ring full."""
        n = len(self.order)
        if not n or (self.consumed - self._base) % n or self.released != self.consumed \
                or self.issued != self.released + self.n_slots:
            raise RuntimeError("a replayed pass must start at a pass boundary with every slot in flight")
        for t in self.order:
            self.moved[self.tier[t.name]] += t.nbytes
        self.consumed += n
        self.released += n
        self.issued += n

    def select(self, left_out: frozenset[int]) -> None:
        """From the next pass on, stream only the pieces of layers not in `left_out` (the CPU
        computes those: infer.tiers.cpu_tier). Called between passes. A change drops the pieces
        already copied ahead for the next pass (at most n_slots copies wasted) and restarts the
        cycle at the new order's first piece (tier C's staging too: its reads ahead are dropped).
        Every tier C piece stays in the order: the CPU takes no layer with one."""
        if left_out == self.left_out:
            return
        if any(self.tier[t.name] is Tier.STORAGE for t in self.full_order if t.layer in left_out):
            raise RuntimeError("a layer with tensors in tier C cannot be left to the CPU")
        if self.order and (self.consumed - self._base) % len(self.order) or self.released != self.consumed:
            raise RuntimeError("the streamed layers can change only between passes")
        while self.released < self.issued:  # copied ahead for a pass that will not use them
            self.transport.record_release(self.released % self.n_slots)
            self.released += 1
        self.consumed = self._base = self.issued
        self.left_out = left_out
        self.order = [t for t in self.full_order if t.layer not in left_out]
        if self.staging is not None:  # its reads ahead were for the old order's pieces
            self.staging.restart()
        self._top_up()

    def close(self) -> None:
        if self.staging is not None:
            self.staging.close()
