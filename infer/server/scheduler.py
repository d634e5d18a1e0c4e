"""The server's side of the generation loop: infer.scheduler.Scheduler on a thread of its own.

Requests come from the event loop (submit, cancel) and wait in a bounded queue when every KV cache
is taken; past that they are refused (QueueFull: the server answers 503). The thread steps the
scheduler while there is work and sleeps on a condition otherwise. Generated text goes to each
job's asyncio queue from that thread (`loop.call_soon_threadsafe`). When a pass fails, every waiting
client gets the error and `on_error` is told once.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from infer.engine import Model
from infer.request import Event, Request, TokenLogprob, describe
from infer.scheduler import Scheduler as Core
from infer.scheduler import Stats, split_invariant
from infer.tokenizer import Tokenizer

__all__ = ["Event", "Job", "QueueFull", "Scheduler", "Stats", "TokenLogprob", "describe", "split_invariant"]


class QueueFull(Exception):
    """Every slot is busy and the waiting queue is full (the server answers 503)."""


@dataclass(kw_only=True)
class Job(Request):
    """A request whose events go to an asyncio queue of the event loop that made it."""

    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)

    def __post_init__(self) -> None:
        self.deliver = lambda event: self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Scheduler:
    """Steps an infer.scheduler.Scheduler of `max_batch` slots on its own thread."""

    def __init__(self, model: Model, tokenizer: Tokenizer, ctx_size: int, max_batch: int, queue_size: int,
                 prefill_chunk: int = 512, on_pass: Callable[[float, int, int], None] | None = None,
                 on_error: Callable[[BaseException], None] | None = None, prefix_cache: bool | None = None,
                 on_admit: Callable[[int, int], None] | None = None,
                 speculation: Callable[[Any], Any] | None = None) -> None:
        if max_batch < 1 or queue_size < 0:
            raise ValueError(f"max_batch must be >= 1 and queue_size >= 0, not {max_batch} and {queue_size}")
        self.max_batch = max_batch
        self.queue_size = queue_size
        self.on_error = on_error  # told once when a pass fails, after every waiting client got the error
        self._cond = threading.Condition()
        # no device runs: a streaming client gets each token as it comes, not 16 at a time
        self.core = Core(model, ctx_size, max_batch, tokenizer, prefill_chunk, prefix_cache, on_pass, on_admit,
                         lock=self._cond, device_runs=False, speculation=speculation)
        self._stopping = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)
        self._thread.start()

    @property
    def stats(self) -> Stats:
        return self.core.stats

    @property
    def prefix_cache(self) -> bool:
        return self.core.prefix_cache

    # -- the request side (event loop thread) ----------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._cond:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if len(self.core.active) + len(self.core.waiting) >= self.max_batch + self.queue_size:
                raise QueueFull(f"all {self.max_batch} slots are busy and {len(self.core.waiting)} requests wait")
            self.core.submit(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """The client went away: the job's slot is freed before the next pass."""
        with self._cond:
            job.cancelled = True
            self._cond.notify()

    @property
    def busy_slots(self) -> int:
        return len(self.core.active)

    @property
    def queued(self) -> int:
        return len(self.core.waiting)

    def close(self, drain_seconds: float = 0.0) -> None:
        """Stops admitting; waits up to `drain_seconds` for the jobs in flight, then stops the thread."""
        deadline = time.monotonic() + drain_seconds
        with self._cond:
            while not self.core.idle and time.monotonic() < deadline and self.error is None:
                self._cond.wait(0.05)
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=30)

    # -- the model side (scheduler thread) -------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self.core.retire_cancelled()
                    self.core.admit()
                    while not self.core.active and not self._stopping:
                        self._cond.wait()
                        self.core.retire_cancelled()
                        self.core.admit()
                    if self._stopping:
                        break
                self.core.step()
        except BaseException as err:  # the model failed: every waiting client gets the error
            self.error = err
            with self._cond:
                self.core.fail_all(f"{type(err).__name__}: {err}")
            if self.on_error is not None:
                self.on_error(err)
