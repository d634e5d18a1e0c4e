"""Doorbells: the native hot path writes a mapped doorbell register itself (one aligned 32-bit
store at an address, so a BAR window mapped for the GPU could serve as well). A stand-in without an
address, such as a test fake's doorbell with `ring(value)`, is reached through a callback instead.
"""

from __future__ import annotations

from typing import Protocol

from nvmedirect.vfio._ffi import ffi


class DoorbellStandIn(Protocol):
    def ring(self, value: int) -> None: ...


class StandIns:
    """The SQ tail (which 0) and CQ head (which 1) stand-ins of one queue pair. An exception a
    stand-in raises is kept in `error` (a callback cannot raise through C) and re-raised by the
    queue pair once the native call returns."""

    def __init__(self, sq: DoorbellStandIn, cq: DoorbellStandIn):
        self.doorbells = (sq, cq)
        self.error: BaseException | None = None

    def ring(self, which: int, value: int) -> None:
        try:
            self.doorbells[which].ring(value)
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller, see check()
            self.error = self.error or exc

    def check(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error


@ffi.def_extern()
def nvd_doorbell_hook(hook, which: int, value: int) -> None:
    ffi.from_handle(hook).ring(which, value)
