"""Builds fake sysfs/procfs trees shaped like the kernel's, for testing discovery and verdicts.

Only what the code reads is created: PCI functions with class/driver/iommu_group links, nvme
class entries, /sys/block disks with partitions and holders, mountinfo, swaps and cmdline.
"""

from __future__ import annotations

import os
from pathlib import Path


class FakeSystem:
    def __init__(self, root: Path):
        self.root = root
        self._mounts: list[str] = []
        self._swaps: list[str] = []
        self._next_minor = 0
        self._mount_id = 20
        for folder in ("sys/bus/pci/devices", "sys/bus/pci/drivers/nvme", "sys/class/nvme", "sys/block",
                       "proc/self", "sys/kernel/iommu_groups", "dev"):
            (root / folder).mkdir(parents=True, exist_ok=True)
        self.write("proc/cmdline", "BOOT_IMAGE=/vmlinuz root=/dev/vda1 ro quiet\n")
        self.write("sys/bus/pci/drivers_probe", "")
        self._flush()

    def write(self, rel: str, text: str) -> Path:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    def link(self, rel: str, target: str) -> None:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink():
            path.unlink()
        os.symlink(target, path)

    # -- devices ------------------------------------------------------------------------------
    def _devnum(self, major: int = 259) -> str:
        self._next_minor += 1
        return f"{major}:{self._next_minor}"

    def pci(self, bdf: str, pci_class: str = "0x010802", driver: str | None = "nvme",
            group: str | None = "7") -> None:
        base = f"sys/bus/pci/devices/{bdf}"
        self.write(f"{base}/class", pci_class + "\n")
        self.write(f"{base}/vendor", "0x1b36\n")
        self.write(f"{base}/device", "0x0010\n")
        self.write(f"{base}/driver_override", "(null)\n")
        if driver:
            (self.root / f"sys/bus/pci/drivers/{driver}").mkdir(parents=True, exist_ok=True)
            self.write(f"sys/bus/pci/drivers/{driver}/unbind", "")
            self.link(f"{base}/driver", f"../../../../bus/pci/drivers/{driver}")
        if group is None and (self.root / base / "iommu_group").is_symlink():
            (self.root / base / "iommu_group").unlink()
        if group is not None:
            (self.root / f"sys/kernel/iommu_groups/{group}").mkdir(parents=True, exist_ok=True)
            self.link(f"{base}/iommu_group", f"../../../../kernel/iommu_groups/{group}")

    def nvme(self, bdf: str, ctrl: str, namespaces: dict[str, list[str]], driver: str = "nvme",
             model: str = "QEMU NVMe Ctrl", serial: str = "fake0001", multipath: bool = False) -> None:
        """A controller bound to `driver`; `namespaces` maps "nvme0n1" -> ["nvme0n1p1", ...]."""
        self.pci(bdf, driver=driver)
        if driver != "nvme":
            return
        (self.root / f"sys/bus/pci/devices/{bdf}/nvme/{ctrl}").mkdir(parents=True, exist_ok=True)
        where = f"sys/class/nvme/{ctrl}"
        self.write(f"{where}/model", model + "\n")
        self.write(f"{where}/serial", serial + "\n")
        self.write(f"{where}/firmware_rev", "1.0\n")
        self.link(f"{where}/device", f"../../../bus/pci/devices/{bdf}")
        for ns, parts in namespaces.items():
            entry = ns
            if multipath:  # hidden path disk nvme<subsys>c<ctrl>n<ns>
                sub, nsid = ns[4:].split("n")
                entry = f"nvme{sub}c{ctrl[4:]}n{nsid}"
            (self.root / where / entry).mkdir(parents=True, exist_ok=True)
            self.disk(ns, parts)

    def disk(self, name: str, parts: list[str] = (), size_sectors: int = 2097152, major: int = 259) -> None:
        base = f"sys/block/{name}"
        self.write(f"{base}/dev", self._devnum(major) + "\n")
        self.write(f"{base}/size", f"{size_sectors}\n")
        (self.root / base / "holders").mkdir(parents=True, exist_ok=True)
        for i, part in enumerate(parts, 1):
            self.write(f"{base}/{part}/partition", f"{i}\n")
            self.write(f"{base}/{part}/dev", self._devnum(major) + "\n")
            self.write(f"{base}/{part}/size", f"{size_sectors // 4}\n")
            (self.root / base / part / "holders").mkdir(parents=True, exist_ok=True)

    def _holders_dir(self, dev: str) -> Path:
        for disk in os.listdir(self.root / "sys/block"):
            if disk == dev:
                return self.root / "sys/block" / disk / "holders"
            if (self.root / "sys/block" / disk / dev).is_dir():
                return self.root / "sys/block" / disk / dev / "holders"
        raise KeyError(dev)

    def dm(self, name: str, dm_name: str, uuid: str, over: list[str]) -> None:
        """A device-mapper device stacked on `over` (uuid prefix LVM-/CRYPT-/... sets its kind)."""
        self.disk(name, major=253)
        self.write(f"sys/block/{name}/dm/name", dm_name + "\n")
        self.write(f"sys/block/{name}/dm/uuid", uuid + "\n")
        for dev in over:
            (self._holders_dir(dev) / name).mkdir()

    def md(self, name: str, over: list[str]) -> None:
        self.disk(name, major=9)
        for dev in over:
            (self._holders_dir(dev) / name).mkdir()

    def devnum_of(self, dev: str) -> str:
        return (self._holders_dir(dev).parent / "dev").read_text().strip()

    # -- usage --------------------------------------------------------------------------------
    def mount(self, dev: str, point: str, fstype: str = "ext4", source: str | None = None) -> None:
        self._mount_id += 1
        src = source or f"/dev/{dev}"
        self._mounts.append(f"{self._mount_id} 1 {self.devnum_of(dev)} / {point} rw,relatime shared:1 - "
                            f"{fstype} {src} rw")
        self._flush()

    def swap(self, path: str) -> None:
        self._swaps.append(f"{path}  partition\t1048572\t0\t-2")
        self._flush()

    def open_by(self, pid: int, comm: str, dev_path: str) -> None:
        self.write(f"proc/{pid}/comm", comm + "\n")
        self.link(f"proc/{pid}/fd/3", dev_path)

    def _flush(self) -> None:
        base = ["1 0 0:22 / / rw - 9p host rw"]  # the root itself: not a block device
        self.write("proc/self/mountinfo", "\n".join(base + self._mounts) + "\n")
        self.write("proc/swaps", "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n"
                   + "".join(s + "\n" for s in self._swaps))
