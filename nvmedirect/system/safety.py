"""The safety verdict of one NVMe controller: may `bind` take it away from the kernel?

A controller is refused when any of its namespaces, partitions or the devices stacked on them
holds the boot filesystem, is mounted, is swap, has holders (LVM, MD, dm-crypt, any dm) or is
open by a process. The boot refusal has no override anywhere in the tool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nvmedirect.system.devices import Controller
from nvmedirect.system.usage import UsageIndex

FREE = "free"  # kernel nvme driver, nothing uses it: may be bound
IN_USE = "in-use"  # refused: mounted, swap, held or open
BOOT = "boot"  # refused, no override: carries /, /boot or /boot/efi
VFIO = "vfio"  # already bound to vfio-pci
NO_DRIVER = "no-driver"  # no driver at all: contents cannot be inspected
OTHER_DRIVER = "other-driver"  # some other driver owns it: refused


@dataclass
class Verdict:
    state: str
    reasons: list[str] = field(default_factory=list)

    @property
    def may_bind(self) -> bool:
        return self.state in (FREE, NO_DRIVER)

    @property
    def refused(self) -> bool:
        return self.state in (IN_USE, BOOT, OTHER_DRIVER)

    def to_dict(self) -> dict:
        return {"state": self.state, "may_bind": self.may_bind, "reasons": self.reasons}

    def summary(self) -> str:
        return self.state if not self.reasons else f"{self.state}: {'; '.join(self.reasons)}"


def assess(ctrl: Controller, usage: UsageIndex, remembered: dict | None = None) -> Verdict:
    """Verdict for `ctrl`; `remembered` is its state-file record, if any."""
    if ctrl.driver == "vfio-pci":
        held = ", ".join(ns["name"] for ns in (remembered or {}).get("namespaces", []))
        note = f"namespaces hidden from the kernel (held {held} before bind)" if held else (
            "namespaces hidden from the kernel (not bound by this tool: contents unknown)")
        return Verdict(VFIO, [note])
    if ctrl.driver is None:
        if remembered:
            return Verdict(NO_DRIVER, [f"bound to no driver: an earlier bind or restore was cut short "
                                       f"(`nvmedirect restore {ctrl.bdf}` gives it back)"])
        return Verdict(NO_DRIVER, ["bound to no driver: its namespaces cannot be inspected"])
    if ctrl.driver != "nvme":
        return Verdict(OTHER_DRIVER, [f"bound to {ctrl.driver}: unbind it from that driver yourself first"])
    uses = [u for disk in ctrl.block_devices for u in usage.uses(disk)]
    if any(u.kind == "boot" for u in uses):
        return Verdict(BOOT, ["boot device (never bound)"] + _unique(u.describe() for u in uses))
    if uses:
        return Verdict(IN_USE, _unique(u.describe() for u in uses))
    return Verdict(FREE)


def _unique(items) -> list[str]:
    out: list[str] = []
    for item in items:
        if item not in out:
            out.append(item)
    return out
