"""Commands in flight: the waitable handle a submit returns, and the completion it ends with."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

from nvmedirect.spec.status import NvmeStatus


class Poller(Protocol):
    """What a command needs from the queue it was submitted to (a `QueuePair`)."""

    def wait_for(self, command: Command) -> None: ...


@dataclass
class Completion:
    """How a command ended. Device statuses and host outcomes (timeout, reset) arrive the same way."""

    cid: int
    status: NvmeStatus
    dw0: int = 0
    opcode: str = ""
    latency_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status.ok

    def exception(self):
        return None if self.ok else self.status.exception(opcode=self.opcode, cid=self.cid)

    def raise_for_status(self) -> Completion:
        if not self.ok:
            raise self.exception()
        return self


class Command:
    """Returned by `QueuePair.submit`: poll it, wait for it, or attach a callback.

    `context` is free for the caller (e.g. where to copy staged data when the read completes).
    """

    __slots__ = ("qpair", "cid", "opcode", "context", "callback", "completion", "submitted_at", "deadline")

    def __init__(self, qpair: Poller, cid: int, opcode: str, context: Any, callback, deadline: float,
                 submitted_at: float | None = None):
        self.qpair = qpair
        self.cid = cid
        self.opcode = opcode
        self.context = context
        self.callback = callback
        self.completion: Completion | None = None
        self.submitted_at = time.monotonic() if submitted_at is None else submitted_at
        self.deadline = deadline

    @property
    def done(self) -> bool:
        return self.completion is not None

    def wait(self) -> Completion:
        """Poll the queue pair until this command completes (or times out); return its Completion."""
        self.qpair.wait_for(self)
        return self.completion

    def result(self) -> Completion:
        """Wait, then raise the named exception if the command failed."""
        return self.wait().raise_for_status()
