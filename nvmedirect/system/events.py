"""Waiting for the kernel: a driver bound or unbound, a namespace's block device added.

On the live system the wait listens to the kernel's uevents through pyudev's netlink `Monitor`
(the "bind"/"unbind" and "add" events; no udev daemon is needed with the kernel as the source), so it
ends when the event arrives instead of on the next tick of a polling loop. Every event only
prompts a fresh look at sysfs, which stays the one source of truth: an event that came before the
monitor started is seen by that look, one that never comes ends in the timeout. A fake root (the
pure-logic tests), or a process that may not open the netlink socket, is polled instead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from nvmedirect.system.sysview import SystemView

log = logging.getLogger(__name__)

POLL_S = 0.05  # only where no monitor can be had
MAX_SILENCE_S = 1.0  # look again at least this often, events or not


class KernelEvents:
    """Uevents of one subsystem ("pci", "block"), listened to from construction until `close()`.
    Start it before the action whose outcome you wait for."""

    def __init__(self, view: SystemView, subsystem: str):
        self.monitor = None
        if not view.is_live:
            return
        try:
            import pyudev

            monitor = pyudev.Monitor.from_netlink(pyudev.Context(), source="kernel")
            monitor.filter_by(subsystem)
            monitor.start()
        except (ImportError, OSError, ValueError) as exc:  # no libudev, or no right to the socket
            log.info("kernel events unavailable (%s): polling sysfs instead", exc)
            return
        self.monitor = monitor

    def wait(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Until `done()` holds (checked now, then after each event) or `timeout_s` passed."""
        deadline = time.monotonic() + timeout_s
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if self.monitor is not None:
                self.monitor.poll(timeout=min(remaining, MAX_SILENCE_S))
            else:
                time.sleep(min(remaining, POLL_S))
        return True

    def close(self) -> None:
        self.monitor = None  # pyudev closes the socket when the monitor is collected

    def __enter__(self) -> KernelEvents:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
