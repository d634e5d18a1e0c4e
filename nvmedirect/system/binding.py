"""`bind` and `restore`: move an NVMe controller between the kernel's nvme driver and vfio-pci.

The order is fixed so that an interruption never leaves the device without a known owner:
1. the device is resolved and its safety verdict checked (`check_bind`; refusals change nothing);
2. the state file records the original driver, override and names (so `restore` can always run);
3. with SIGINT/SIGTERM/SIGHUP/SIGQUIT held back, set driver_override, unbind, probe, and wait for
   the new driver; if it does not appear, put the original driver back before re-raising;
4. the signals are let through only once the device has exactly one driver again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from nvmedirect.system.devices import PCI_DEVICES, Controller, read_controller, resolve_target
from nvmedirect.system.events import KernelEvents
from nvmedirect.system.safety import VFIO, Verdict, assess
from nvmedirect.system.state import StateFile
from nvmedirect.system.sysview import SystemView
from nvmedirect.system.usage import UsageIndex

DEFERRED_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT}
NOIOMMU_PARAM = "/sys/module/vfio/parameters/enable_unsafe_noiommu_mode"
# Tests set this to hold the critical window open long enough to deliver a Ctrl-C inside it.
_PAUSE_ENV = "NVMEDIRECT_TEST_CRITICAL_PAUSE"


class BindRefused(Exception):
    """Refused for safety; nothing was changed."""


class BindFailed(Exception):
    """The kernel did not do what we asked; the message says in which state the device was left."""


@dataclass
class Outcome:
    bdf: str
    driver: str | None
    already: bool = False
    notes: list[str] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"bdf": self.bdf, "driver": self.driver, "already": self.already,
                "namespaces": self.namespaces, "notes": self.notes}


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold back the signals a user sends to stop us, and deliver them once the block is done.

    Two layers, because a process-directed signal goes to any thread that does not block it: the
    calling thread's mask keeps them pending, and (on the main thread) a recording Python handler
    catches any that another thread received. On exit each one is delivered exactly once, to the
    handler that was in place before.
    """
    caught: list[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in DEFERRED_SIGNALS:
            previous[signum] = signal.signal(signum, lambda number, _frame: caught.append(number))
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, DEFERRED_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(caught):
            signal.raise_signal(signum)


def current_driver(view: SystemView, bdf: str) -> str | None:
    return view.link_name(f"{PCI_DEVICES}/{bdf}/driver")


def _ensure_driver_loaded(view: SystemView, driver: str, module: str) -> None:
    if view.exists(f"/sys/bus/pci/drivers/{driver}"):
        return
    if view.is_live:
        subprocess.run(["modprobe", module], check=False, capture_output=True, timeout=60)
    if not view.exists(f"/sys/bus/pci/drivers/{driver}"):
        raise BindFailed(f"the {driver} driver is not loaded and `modprobe {module}` did not load it; "
                         "nothing was changed")


def _switch(view: SystemView, bdf: str, override: str | None, timeout_s: float, want: str) -> bool:
    """Set the override, detach the current driver and let the kernel probe again. Caller holds
    signals back. Returns whether `want` now owns the device."""
    base = f"{PCI_DEVICES}/{bdf}"
    with KernelEvents(view, "pci") as events:  # listening before the kernel can answer
        view.write(f"{base}/driver_override", override if override else "\n")
        if current_driver(view, bdf) is not None:
            view.write(f"{base}/driver/unbind", bdf)
        if pause := float(os.environ.get(_PAUSE_ENV, "0") or 0):
            time.sleep(pause)
        with contextlib.suppress(OSError):  # probe errors (e.g. -ENODEV) surface as "no driver" below
            view.write("/sys/bus/pci/drivers_probe", bdf)
        return events.wait(lambda: current_driver(view, bdf) == want, timeout_s)


@dataclass
class BindCheck:
    """What `bind` would take: the controller, as sysfs shows it now, and its verdict."""

    bdf: str
    ctrl: Controller
    verdict: Verdict

    @property
    def already_bound(self) -> bool:
        return self.verdict.state == VFIO


def check_bind(view: SystemView, target: str) -> BindCheck:
    """Resolve `target` and judge it, changing nothing: TargetError when it names no controller,
    BindRefused when taking it is not safe. `bind` runs this first itself; a caller that asks the
    user for confirmation runs it before asking."""
    state = StateFile(view)
    bdf = resolve_target(view, target, state.remembered_names())
    ctrl = read_controller(view, bdf)
    verdict = assess(ctrl, UsageIndex(view), state.get(bdf))
    if verdict.state != VFIO and not verdict.may_bind:
        raise BindRefused(f"{bdf}: {verdict.summary()}")
    return BindCheck(bdf, ctrl, verdict)


def bind(view: SystemView, target: str, timeout_s: float = 5.0, power_up: bool = True) -> Outcome:
    """Hand the controller named by `target` to vfio-pci, or refuse (BindRefused)."""
    state = StateFile(view)
    checked = check_bind(view, target)
    bdf, ctrl = checked.bdf, checked.ctrl
    if checked.already_bound:
        outcome = Outcome(bdf, "vfio-pci", already=True, notes=["already bound to vfio-pci"])
    else:
        _ensure_driver_loaded(view, "vfio-pci", "vfio-pci")
        _check_iommu_group(view, bdf)
        record = {
            "original_driver": ctrl.driver, "original_override": ctrl.driver_override,
            "name": ctrl.name, "model": ctrl.model, "serial": ctrl.serial,
            "namespaces": [ns.to_dict() for ns in ctrl.namespaces],
        }
        earlier = state.get(bdf)
        if earlier and ctrl.driver is None:
            # An earlier bind was cut short (the device has no driver): what it recorded about the
            # device's original state is the truth, not the half-done state we see now.
            record.update({k: earlier.get(k) for k in record if k in earlier})
        state.put(bdf, {**record, "phase": "binding"})
        with signals_deferred():
            if not _switch(view, bdf, "vfio-pci", timeout_s, "vfio-pci"):
                back = bool(ctrl.driver) and _switch(view, bdf, ctrl.driver_override, timeout_s, ctrl.driver)
                if back:
                    state.remove(bdf)
                else:
                    state.update(bdf, phase="unbound")
                where = f"given back to {ctrl.driver}" if back else "left without a driver: `nvmedirect restore` it"
                raise BindFailed(f"{bdf}: vfio-pci did not take the device (see `dmesg`); {where}")
            state.update(bdf, phase="bound")
        outcome = Outcome(bdf, "vfio-pci", namespaces=ctrl.block_devices)
    if power_up:
        outcome.notes.append(power_up_check(view, bdf))
    return outcome


def _check_iommu_group(view: SystemView, bdf: str) -> None:
    """vfio-pci refuses devices without an IOMMU group unless no-IOMMU mode is on: find out before
    unbinding anything, so the device is not left driverless."""
    if view.exists(f"{PCI_DEVICES}/{bdf}/iommu_group"):
        return
    if (view.read(NOIOMMU_PARAM) or "N").upper().startswith("Y"):
        return
    raise BindFailed(f"{bdf} has no IOMMU group and vfio's no-IOMMU mode is off, so vfio-pci would refuse it; "
                     "enable the IOMMU (see `nvmedirect setup --iommu on`) or load vfio with "
                     "enable_unsafe_noiommu_mode=1 (unsafe: see SAFETY.md); nothing was changed")


def power_up_check(view: SystemView, bdf: str) -> str:
    """Open the device through VFIO, force D0, enable memory decoding and bus mastering, and read
    the controller's CAP register to prove it answers. VFIO clears bus mastering again when the
    last user closes the device, so every user of `nvmedirect.vfio` repeats this at open."""
    if not view.is_live:
        return "power-up check skipped (not the live system)"
    try:
        from nvmedirect.vfio import VfioDevice

        with VfioDevice.open(bdf) as dev:  # in the VFIO mode of its group
            dev.set_d0()
            dev.enable_bus_master()
            power = dev.power_state()
            cap = dev.map_bar(0).read64(0)
    except Exception as exc:  # any failure here is reported, the binding itself stands
        return f"power-up check failed: {exc}"
    if cap == 0xFFFF_FFFF_FFFF_FFFF:
        raise BindFailed(f"{bdf} is bound to vfio-pci but its registers read all-ones (link down?): "
                         f"see SAFETY.md, 'A controller that stops answering'; `nvmedirect restore {bdf}` gives it back")
    state = "D0" if power in (0, None) else f"D{power}"
    return f"controller answers through VFIO: power {state}, CAP={cap:#018x}"


def vfio_users(view: SystemView, bdf: str) -> list[str]:
    """Processes holding the device's /dev/vfio group open (unbinding would block until they exit)."""
    group = view.link_name(f"{PCI_DEVICES}/{bdf}/iommu_group")
    if group is None:
        return []
    nodes = {f"vfio/{group}", f"vfio/noiommu-{group}"}
    users = UsageIndex(view).open_files
    return [who for node in sorted(nodes) for who in users.get(node, [])]


def restore(view: SystemView, target: str, timeout_s: float = 5.0, settle_s: float = 15.0) -> Outcome:
    """Give the controller back to the driver it had before `bind` (the kernel nvme driver)."""
    state = StateFile(view)
    bdf = resolve_target(view, target, state.remembered_names())
    record = state.get(bdf) or {}
    original = record.get("original_driver") or "nvme"
    override = record.get("original_override")
    driver = current_driver(view, bdf)
    if driver == original and (view.read(f"{PCI_DEVICES}/{bdf}/driver_override") or "(null)") in ("(null)", override or "(null)"):
        state.remove(bdf)
        return Outcome(bdf, driver, already=True, notes=[f"already bound to {original}"],
                       namespaces=read_controller(view, bdf).block_devices)
    if driver not in ("vfio-pci", None):
        raise BindRefused(f"{bdf} is bound to {driver}, not vfio-pci: not ours to restore")
    if users := vfio_users(view, bdf):
        raise BindRefused(f"{bdf} is open through VFIO by {', '.join(users)}: stop it first")
    _ensure_driver_loaded(view, original, original)
    with signals_deferred():
        if not _switch(view, bdf, override, timeout_s, original):
            back = _switch(view, bdf, "vfio-pci", timeout_s, "vfio-pci")
            where = "left bound to vfio-pci" if back else "left without a driver"
            state.update(bdf, phase="bound" if back else "unbound")
            raise BindFailed(f"{bdf}: {original} did not take the device back (see `dmesg`); {where}")
    state.remove(bdf)
    outcome = Outcome(bdf, original)
    outcome.namespaces = _wait_namespaces(view, bdf, len(record.get("namespaces", [])), settle_s)
    return outcome


def _wait_namespaces(view: SystemView, bdf: str, expected: int, timeout_s: float) -> list[str]:
    """The nvme driver scans namespaces asynchronously after probe: wait for as many as were
    recorded at bind time (or, with no record, for the controller to show up at all)."""
    def done() -> bool:
        ctrl = read_controller(view, bdf)
        return len(ctrl.block_devices) >= expected if expected else ctrl.name is not None

    with KernelEvents(view, "block") as events:
        events.wait(done, timeout_s)
    return read_controller(view, bdf).block_devices
