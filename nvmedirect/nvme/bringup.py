"""Controller enable/disable as a small state machine: each state has one action, one condition to
wait for, a timeout derived from CAP.TO, and a log line when it is entered.

    DISABLE → WAIT_NOT_READY → CONFIGURE_ADMIN → ENABLE → WAIT_READY → READY
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from nvmedirect.errors import ControllerError
from nvmedirect.spec import layout
from nvmedirect.spec.layout import Reg

log = logging.getLogger(__name__)

ALL_ONES = 0xFFFFFFFF
IOSQES = 6  # 2^6 = 64-byte submission entries
IOCQES = 4  # 2^4 = 16-byte completion entries


@dataclass
class State:
    name: str
    action: Callable[[], None] | None
    until: Callable[[], bool] | None
    timeout_s: float


def read_csts(bar) -> int:
    value = bar.read32(Reg.CSTS)
    if value == ALL_ONES:
        raise ControllerError("controller registers read as all ones: the device was removed or is dead")
    return value


def ready(bar) -> bool:
    return bool(layout.csts(read_csts(bar)).bits.rdy)


def fatal(bar) -> bool:
    return bool(layout.csts(read_csts(bar)).bits.cfs)


def run_states(states: list[State], bar, fail_on_fatal: set[str]) -> None:
    for state in states:
        log.info("controller: state → %s (timeout %d ms)", state.name, state.timeout_s * 1000)
        if state.action is not None:
            state.action()
        if state.until is None:
            continue
        deadline = time.monotonic() + state.timeout_s
        while not state.until():
            if state.name in fail_on_fatal and fatal(bar):
                raise ControllerError(f"controller reported fatal status (CSTS.CFS) in {state.name}: "
                                      "reset or power-cycle the device")
            if time.monotonic() > deadline:
                raise ControllerError(f"controller stuck in {state.name} for {state.timeout_s:.1f} s "
                                      f"(CSTS {read_csts(bar):#x})")
            time.sleep(0.0005)


def disable(bar, timeout_s: float) -> None:
    """Clear CC.EN and wait for CSTS.RDY to drop (also clears a fatal status)."""
    def clear_enable() -> None:
        value = bar.read32(Reg.CC)
        if value & 1:
            bar.write32(Reg.CC, value & ~1)

    run_states([State("DISABLE", clear_enable, None, 0),
                State("WAIT_NOT_READY", None, lambda: not ready(bar), timeout_s)], bar, set())


def shutdown(bar, timeout_s: float) -> bool:
    """Normal shutdown (CC.SHN=01, wait CSTS.SHST=10) so a volatile write cache is flushed."""
    if bar.read32(Reg.CSTS) == ALL_ONES or not bar.read32(Reg.CC) & 1:
        return False
    cc = layout.cc(bar.read32(Reg.CC))
    cc.bits.shn = 1
    bar.write32(Reg.CC, cc.raw)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if layout.csts(read_csts(bar)).bits.shst == 2:
            log.info("controller: shutdown complete")
            return True
        time.sleep(0.0005)
    log.warning("controller: shutdown did not complete within %.1f s", timeout_s)
    return False


def enable(bar, admin_sq_iova: int, admin_cq_iova: int, admin_depth: int, timeout_s: float) -> None:
    """Full bring-up from any state: disable, program the admin queue, enable, wait for ready."""
    def configure_admin() -> None:
        aqa = layout.aqa()
        aqa.bits.asqs = admin_depth - 1  # sizes are 0-based
        aqa.bits.acqs = admin_depth - 1
        bar.write32(Reg.AQA, aqa.raw)
        bar.write64(Reg.ASQ, admin_sq_iova)
        bar.write64(Reg.ACQ, admin_cq_iova)

    def set_enable() -> None:
        cc = layout.cc()
        cc.bits.css = 0  # NVM command set
        cc.bits.mps = 0  # 4 KiB memory pages (2^(12+0))
        cc.bits.ams = 0  # round robin
        cc.bits.iosqes = IOSQES
        cc.bits.iocqes = IOCQES
        cc.bits.en = 1
        bar.write32(Reg.CC, cc.raw)

    disable(bar, timeout_s)
    run_states([State("CONFIGURE_ADMIN", configure_admin, None, 0),
                State("ENABLE", set_enable, None, 0),
                State("WAIT_READY", None, lambda: ready(bar), timeout_s),
                State("READY", None, None, 0)], bar, fail_on_fatal={"WAIT_READY"})
