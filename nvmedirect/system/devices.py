"""NVMe controllers and their namespaces, read from sysfs (PCI class 01:08:02).

A controller bound to the kernel's nvme driver shows its namespaces as block devices; one bound to
vfio-pci shows none (the kernel no longer knows them), which is why `bind` records them in the
state file before handing the controller over.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from nvmedirect.system.sysview import SystemView

PCI_DEVICES = "/sys/bus/pci/devices"
NVME_CLASS = 0x010802  # mass storage / non-volatile memory / NVM Express
SECTOR = 512  # /sys/block/*/size counts 512-byte sectors whatever the LBA size

BDF_FULL = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
BDF_SHORT = re.compile(r"^[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
CTRL_NAME = re.compile(r"^nvme\d+$")
# Namespace entries under /sys/class/nvme/nvmeX: "nvme0n1" directly, or with native multipath the
# hidden per-path disk "nvme0c0n1" whose visible head disk is "nvme0n1" (subsystem 0, namespace 1).
NS_DIRECT = re.compile(r"^nvme\d+n\d+$")
NS_PATH = re.compile(r"^nvme(\d+)c\d+n(\d+)$")
BLOCK_NAME = re.compile(r"^nvme\d+n\d+(p\d+)?$")


@dataclass
class Namespace:
    name: str  # block device, e.g. "nvme0n1"
    size_bytes: int
    partitions: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"name": self.name, "size_bytes": self.size_bytes, "partitions": self.partitions}


@dataclass
class Controller:
    bdf: str
    vendor_id: str
    device_id: str
    driver: str | None  # "nvme", "vfio-pci", another driver, or None when unbound
    driver_override: str | None
    iommu_group: str | None
    name: str | None = None  # "nvme0" while the kernel driver owns it
    model: str | None = None
    serial: str | None = None
    firmware: str | None = None
    namespaces: list[Namespace] = field(default_factory=list)

    @property
    def block_devices(self) -> list[str]:
        return [ns.name for ns in self.namespaces]

    def to_dict(self) -> dict:
        return {
            "bdf": self.bdf, "vendor_id": self.vendor_id, "device_id": self.device_id,
            "driver": self.driver, "driver_override": self.driver_override,
            "iommu_group": self.iommu_group, "name": self.name, "model": self.model,
            "serial": self.serial, "firmware": self.firmware,
            "namespaces": [ns.to_dict() for ns in self.namespaces],
        }


def _int(text: str | None, base: int = 10) -> int | None:
    try:
        return int(text, base) if text is not None else None
    except ValueError:
        return None


def block_size_bytes(view: SystemView, name: str, parent: str | None = None) -> int:
    where = f"/sys/block/{parent}/{name}" if parent else f"/sys/block/{name}"
    return (_int(view.read(f"{where}/size")) or 0) * SECTOR


def partitions_of(view: SystemView, disk: str) -> list[str]:
    """Partition block devices of a whole disk (subdirectories carrying a `partition` file)."""
    return [e for e in view.listdir(f"/sys/block/{disk}")
            if e.startswith(disk) and view.exists(f"/sys/block/{disk}/{e}/partition")]


def namespace_names(view: SystemView, ctrl_name: str) -> list[str]:
    names: set[str] = set()
    for entry in view.listdir(f"/sys/class/nvme/{ctrl_name}"):
        if NS_DIRECT.match(entry):
            names.add(entry)
        elif match := NS_PATH.match(entry):
            names.add(f"nvme{match.group(1)}n{match.group(2)}")
    return sorted(n for n in names if view.exists(f"/sys/block/{n}"))


def is_nvme_function(view: SystemView, bdf: str) -> bool:
    return _int(view.read(f"{PCI_DEVICES}/{bdf}/class"), 16) == NVME_CLASS


def read_controller(view: SystemView, bdf: str) -> Controller:
    base = f"{PCI_DEVICES}/{bdf}"
    override = view.read(f"{base}/driver_override")
    ctrl = Controller(
        bdf=bdf,
        vendor_id=view.read(f"{base}/vendor", "?") or "?",
        device_id=view.read(f"{base}/device", "?") or "?",
        driver=view.link_name(f"{base}/driver"),
        driver_override=None if override in (None, "", "(null)") else override,
        iommu_group=view.link_name(f"{base}/iommu_group"),
    )
    names = [n for n in view.listdir(f"{base}/nvme") if CTRL_NAME.match(n)]
    if names:
        ctrl.name = names[0]
        where = f"/sys/class/nvme/{ctrl.name}"
        ctrl.model = view.read(f"{where}/model")
        ctrl.serial = view.read(f"{where}/serial")
        ctrl.firmware = view.read(f"{where}/firmware_rev")
        ctrl.namespaces = [
            Namespace(n, block_size_bytes(view, n), partitions_of(view, n))
            for n in namespace_names(view, ctrl.name)
        ]
    return ctrl


def list_controllers(view: SystemView) -> list[Controller]:
    """Every NVMe PCI function, whatever driver (if any) it is bound to, in address order."""
    return [read_controller(view, bdf) for bdf in view.listdir(PCI_DEVICES) if is_nvme_function(view, bdf)]


class TargetError(ValueError):
    """The user's device argument names nothing we can act on; the message says why."""


def resolve_target(view: SystemView, text: str, remembered: dict[str, list[str]] | None = None) -> str:
    """PCI address of the controller named by a BDF ("0000:01:00.0" or "01:00.0"), a controller
    ("nvme0", "/dev/nvme0") or a namespace/partition ("/dev/nvme0n1", "nvme0n1p2").

    `remembered` maps BDF -> names the state file recorded, so a controller already handed to
    vfio-pci (its names gone from sysfs) can still be named the way the user knew it.
    """
    name = text.strip().lower()
    if BDF_SHORT.match(name):
        name = f"0000:{name}"
    if BDF_FULL.match(name):
        if not view.exists(f"{PCI_DEVICES}/{name}"):
            raise TargetError(f"no PCI device {name} (see `nvmedirect list`)")
        if not is_nvme_function(view, name):
            raise TargetError(f"{name} is not an NVMe controller (PCI class 01:08:02)")
        return name
    name = name.removeprefix("/dev/")
    if CTRL_NAME.match(name) and view.exists(f"/sys/class/nvme/{name}"):
        bdf = view.link_name(f"/sys/class/nvme/{name}/device")
        if bdf and BDF_FULL.match(bdf):
            return bdf
    if not (CTRL_NAME.match(name) or BLOCK_NAME.match(name)):
        raise TargetError(f"{text!r} is neither a PCI address (0000:01:00.0) nor an NVMe device (/dev/nvme0n1)")
    disk = re.sub(r"p\d+$", "", name)
    found = {c.bdf for c in list_controllers(view) if name == c.name or disk in c.block_devices}
    for bdf, names in (remembered or {}).items():
        if name in names or disk in names:
            found.add(bdf)
    if not found:
        raise TargetError(f"no NVMe controller owns {text!r} (see `nvmedirect list`)")
    if len(found) > 1:
        raise TargetError(f"{text!r} is reachable through several controllers ({', '.join(sorted(found))}): "
                          "name one by PCI address")
    return found.pop()
