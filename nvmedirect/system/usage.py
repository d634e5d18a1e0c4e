"""Who uses a block device: mounts, swap, stacked devices (LVM, MD, dm-crypt), btrfs, open files.

Everything is followed through partitions and holders, so a disk whose partition carries an LVM
volume mounted at `/` is reported as the boot device.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import cached_property

from nvmedirect.system.sysview import SystemView

BOOT_MOUNTS = ("/", "/boot", "/boot/efi")
_DEV_TOKEN = re.compile(r"^/dev/(\S+)$")


@dataclass(frozen=True)
class Use:
    kind: str  # "boot" | "mounted" | "swap" | "holder" | "btrfs" | "open"
    device: str  # the block device carrying it: "nvme1n1p2", "dm-0", ...
    detail: str

    def describe(self) -> str:
        return f"{self.device}: {self.detail}"


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (\\040 ...)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


class UsageIndex:
    """A snapshot of the system's mounts, swaps, device stacks and open device files."""

    def __init__(self, view: SystemView, scan_open_files: bool = True):
        self.view = view
        self.scan_open_files = scan_open_files

    # -- name resolution ----------------------------------------------------------------------
    @cached_property
    def _by_devnum(self) -> dict[str, str]:
        """"259:1" -> "nvme0n1p1" for every block device and partition in /sys/block."""
        table: dict[str, str] = {}
        for disk in self.view.listdir("/sys/block"):
            if num := self.view.read(f"/sys/block/{disk}/dev"):
                table[num] = disk
            for part in self.view.listdir(f"/sys/block/{disk}"):
                if part.startswith(disk) and (num := self.view.read(f"/sys/block/{disk}/{part}/dev")):
                    table[num] = part
        return table

    @cached_property
    def _dm_names(self) -> dict[str, str]:
        """device-mapper name ("vg-root") -> kernel name ("dm-0")."""
        table = {}
        for disk in self.view.listdir("/sys/block"):
            if name := self.view.read(f"/sys/block/{disk}/dm/name"):
                table[name] = disk
        return table

    def device_name(self, path: str) -> str | None:
        """Kernel block device name for a /dev path as mount tables and swap lists write it."""
        match = _DEV_TOKEN.match(path)
        if not match:
            return None
        rest = match.group(1)
        if rest.startswith("mapper/"):
            return self._dm_names.get(rest.removeprefix("mapper/"))
        if "/" not in rest and rest in self._known_names:
            return rest
        if self.view.is_live:  # /dev/disk/by-uuid/..., /dev/vg/lv, /dev/root: ask the device node
            try:
                st = os.stat(path)
            except OSError:
                return None
            return self._by_devnum.get(f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}")
        return None

    @cached_property
    def _known_names(self) -> set[str]:
        return set(self._by_devnum.values()) | set(self.view.listdir("/sys/block"))

    # -- tables -------------------------------------------------------------------------------
    @cached_property
    def mounts(self) -> dict[str, list[tuple[str, str]]]:
        """Block device -> [(mount point, fs type)]."""
        table: dict[str, list[tuple[str, str]]] = {}
        text = self.view.read("/proc/self/mountinfo")
        if text is not None:
            for line in text.splitlines():
                left, _, right = line.partition(" - ")
                fields, tail = left.split(), right.split()
                if len(fields) < 5 or len(tail) < 2:
                    continue
                # btrfs and overlay report an anonymous 0:N number: then the source names the device.
                name = self._by_devnum.get(fields[2]) or self.device_name(tail[1])
                if name:
                    table.setdefault(name, []).append((_unescape(fields[4]), tail[0]))
            return table
        for line in (self.view.read("/proc/mounts") or "").splitlines():
            parts = line.split()
            if len(parts) >= 3 and (name := self.device_name(parts[0])):
                table.setdefault(name, []).append((_unescape(parts[1]), parts[2]))
        return table

    @cached_property
    def swaps(self) -> set[str]:
        names = set()
        for line in (self.view.read("/proc/swaps") or "").splitlines()[1:]:
            parts = line.split()
            if parts and (name := self.device_name(_unescape(parts[0]))):
                names.add(name)
        return names

    @cached_property
    def btrfs_members(self) -> dict[str, str]:
        """Members of mounted btrfs filesystems (a multi-device btrfs mounts only one of them)."""
        table = {}
        for fsid in self.view.listdir("/sys/fs/btrfs"):
            for dev in self.view.listdir(f"/sys/fs/btrfs/{fsid}/devices"):
                table[dev] = fsid
        return table

    @cached_property
    def boot_root_names(self) -> set[str]:
        """The device the kernel command line names as root=, when it names one directly."""
        names = set()
        for token in (self.view.read("/proc/cmdline") or "").split():
            if not token.startswith("root="):
                continue
            spec = token[5:]
            for tag, folder in (("UUID=", "by-uuid"), ("PARTUUID=", "by-partuuid"), ("LABEL=", "by-label")):
                if spec.startswith(tag):
                    spec = f"/dev/disk/{folder}/{spec[len(tag):]}"
            if name := self.device_name(spec):
                names.add(name)
        return names

    @cached_property
    def open_files(self) -> dict[str, list[str]]:
        """/dev entry name -> ["pid 123 (dd)"] for every process holding it open (not us)."""
        table: dict[str, list[str]] = {}
        if not self.scan_open_files:
            return table
        me = str(os.getpid())
        for pid in self.view.listdir("/proc"):
            if not pid.isdigit() or pid == me:
                continue
            for fd in self.view.listdir(f"/proc/{pid}/fd"):
                target = self.view.link_target(f"/proc/{pid}/fd/{fd}") or ""
                if target.startswith("/dev/"):
                    comm = self.view.read(f"/proc/{pid}/comm", "?")
                    who = f"pid {pid} ({comm})"
                    entry = table.setdefault(target.removeprefix("/dev/"), [])
                    if who not in entry:
                        entry.append(who)
        return table

    # -- the answer ---------------------------------------------------------------------------
    def holders(self, name: str, parent: str | None = None) -> list[str]:
        where = f"/sys/block/{parent}/{name}" if parent else f"/sys/block/{name}"
        return self.view.listdir(f"{where}/holders")

    def describe_holder(self, holder: str) -> str:
        if holder.startswith("md"):
            return f"member of MD RAID {holder}"
        uuid = self.view.read(f"/sys/block/{holder}/dm/uuid") or ""
        name = self.view.read(f"/sys/block/{holder}/dm/name") or holder
        kind = {"LVM": "LVM volume", "CRYPT": "dm-crypt mapping", "mpath": "multipath map"}.get(
            uuid.split("-")[0], "device-mapper target")
        return f"held by {kind} {name} ({holder})"

    def direct_uses(self, name: str) -> list[Use]:
        uses = []
        for point, fstype in self.mounts.get(name, []):
            kind = "boot" if point in BOOT_MOUNTS else "mounted"
            uses.append(Use(kind, name, f"mounted at {point} ({fstype})"))
        if name in self.boot_root_names:
            uses.append(Use("boot", name, "named as root= on the kernel command line"))
        if name in self.swaps:
            uses.append(Use("swap", name, "active swap"))
        if name in self.btrfs_members and not self.mounts.get(name):
            uses.append(Use("btrfs", name, f"member of mounted btrfs {self.btrfs_members[name]}"))
        for who in self.open_files.get(name, []):
            uses.append(Use("open", name, f"open by {who}"))
        return uses

    def uses(self, disk: str, _seen: frozenset[str] = frozenset()) -> list[Use]:
        """Every use of a whole disk, its partitions and whatever is stacked on them."""
        if disk in _seen:  # holder graphs are acyclic, but never trust a tree we did not build
            return []
        seen = _seen | {disk}
        found: list[Use] = []
        members = [(disk, None)] + [(p, disk) for p in self.view.listdir(f"/sys/block/{disk}")
                                    if p.startswith(disk) and self.view.exists(f"/sys/block/{disk}/{p}/partition")]
        for name, parent in members:
            found += self.direct_uses(name)
            for holder in self.holders(name, parent):
                found.append(Use("holder", name, self.describe_holder(holder)))
                for inner in self.uses(holder, seen):
                    found.append(Use(inner.kind, name, f"via {holder}: {inner.detail}"))
        return found
