"""The steps of `nvmedirect setup`: each says what it changes, why, the risk, and how to undo it.

A step computes the exact new bytes of the files it would write; when they equal what is already
there, the step is done and applying the plan again changes nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from nvmedirect.system.journal import FileEdit
from nvmedirect.system.sysview import SystemView

TODO, DONE, SKIPPED, REFUSED = "todo", "done", "skipped", "refused"

GRUB_DEFAULTS = "/etc/default/grub"
MODULES_LOAD = "/etc/modules-load.d/nvmedirect.conf"
MODPROBE_OPTIONS = "/etc/modprobe.d/nvmedirect.conf"
IOMMU_MODES = ("on", "passthrough", "off")
_IOMMU_PARAM = re.compile(r"^(intel_iommu|amd_iommu|iommu)=")


@dataclass
class Step:
    key: str
    what: str
    why: str
    risk: str
    undo: str
    status: str = TODO
    note: str = ""
    edits: list[FileEdit] = field(default_factory=list)
    after: list[str] = field(default_factory=list)  # commands the user must run afterwards
    action: dict | None = None  # a runtime change (load modules, bind) instead of file edits

    def to_dict(self) -> dict:
        return {"key": self.key, "status": self.status, "what": self.what, "why": self.why, "risk": self.risk,
                "undo": self.undo, "note": self.note, "files": [e.path for e in self.edits],
                "after": self.after, "action": self.action}


def _changes(view: SystemView, step: Step, edits: list[FileEdit]) -> Step:
    """Keep only edits that change something; a step with none left is done."""
    step.edits = [e for e in edits if view.read_bytes(e.path) != e.new]
    if not step.edits:
        step.status, step.note = DONE, step.note or "already in place"
    return step


def cpu_vendor(view: SystemView) -> str | None:
    text = view.read("/proc/cpuinfo") or ""
    if "GenuineIntel" in text:
        return "intel"
    if "AuthenticAMD" in text:
        return "amd"
    return None


def iommu_params(mode: str, vendor: str | None) -> list[str]:
    """Kernel parameters for an IOMMU mode. AMD's IOMMU is on by default when the firmware exposes
    it (there is no amd_iommu=on); Intel's needs intel_iommu=on on many distributions' kernels."""
    intel, amd = vendor in ("intel", None), vendor in ("amd", None)
    if mode == "on":
        return ["intel_iommu=on"] if intel else []
    if mode == "passthrough":
        return (["intel_iommu=on"] if intel else []) + ["iommu=pt"]
    return (["intel_iommu=off"] if intel else []) + (["amd_iommu=off"] if amd else [])


_GRUB_LINE = re.compile(r"""^(\s*GRUB_CMDLINE_LINUX_DEFAULT=)(?:"([^"$`\\]*)"|'([^']*)'|([^\s"'$`\\]*))\s*$""")


def grub_step(view: SystemView, mode: str) -> Step:
    vendor = cpu_vendor(view)
    params = iommu_params(mode, vendor)
    step = Step(
        key="grub-cmdline",
        what=f"set the IOMMU mode '{mode}' on the kernel command line in {GRUB_DEFAULTS} "
             f"({' '.join(params) or 'no parameter: the default'}; other IOMMU parameters removed)",
        why={"on": "VFIO then isolates the NVMe controller: it can only reach memory the driver maps for it",
             "passthrough": "VFIO isolation for the NVMe controller, identity mapping (no cost) for other devices",
             "off": "what the seed did (amd_iommu=off) so consumer GPUs and NVMe could DMA by physical address; "
                    "needs vfio's unsafe no-IOMMU mode"}[mode],
        risk="a wrong kernel command line can stop the system from booting; "
             + ("without an IOMMU any device can write anywhere in memory" if mode == "off" else
                "some firmware has broken IOMMU tables (boot hangs or devices fail; pick 'passthrough' or 'off')"),
        undo=f"`nvmedirect setup --rollback`, then update-grub; or edit {GRUB_DEFAULTS} by hand and run update-grub; "
             "at the GRUB menu press e to edit the command line for one boot",
        after=["update-grub  (Debian/Ubuntu; elsewhere grub2-mkconfig -o /boot/grub2/grub.cfg)", "reboot"],
    )
    original = view.read_bytes(GRUB_DEFAULTS)
    if original is None:
        step.status = SKIPPED
        step.note = (f"no {GRUB_DEFAULTS} (not GRUB?): add `{' '.join(params)}` to your boot loader's kernel "
                     "command line by hand")
        return step
    lines = original.decode(errors="surrogateescape").splitlines(keepends=True)
    indexes = [i for i, line in enumerate(lines) if line.lstrip().startswith("GRUB_CMDLINE_LINUX_DEFAULT=")]
    if not indexes:
        lines.append(f'GRUB_CMDLINE_LINUX_DEFAULT="{" ".join(params)}"\n')
    else:
        last = indexes[-1]  # the shell keeps the last assignment
        match = _GRUB_LINE.match(lines[last].rstrip("\n"))
        if not match:
            step.status = REFUSED
            step.note = (f"{GRUB_DEFAULTS}: GRUB_CMDLINE_LINUX_DEFAULT uses shell expansion or quoting we do not "
                         "rewrite safely; edit it by hand")
            return step
        value = match.group(2) or match.group(3) or match.group(4) or ""
        wanted = [t for t in value.split() if not _IOMMU_PARAM.match(t)] + params
        if wanted != value.split():  # otherwise leave the line byte for byte as it is
            lines[last] = f'{match.group(1)}"{" ".join(wanted)}"\n'
    new = "".join(lines).encode(errors="surrogateescape")
    return _changes(view, step, [FileEdit(GRUB_DEFAULTS, new)])


def modules_step(view: SystemView) -> Step:
    text = ("# Written by `nvmedirect setup`: load VFIO at boot so an NVMe controller can be handed to\n"
            "# vfio-pci with `nvmedirect bind`. No device is bound automatically.\n"
            "vfio\nvfio-pci\n")
    step = Step(
        key="vfio-at-boot",
        what=f"load vfio and vfio-pci at boot ({MODULES_LOAD})",
        why="`nvmedirect bind` needs the vfio-pci driver; loading it does not take any device",
        risk="none known: the modules only claim devices whose driver_override names vfio-pci",
        undo=f"`nvmedirect setup --rollback`, or delete {MODULES_LOAD}",
    )
    return _changes(view, step, [FileEdit(MODULES_LOAD, text.encode())])


def modprobe_step(view: SystemView, unsafe_noiommu: bool) -> Step:
    text = ("# Written by `nvmedirect setup`.\n"
            "# vfio-pci puts idle devices into D3hot; some NVMe controllers do not wake from it\n"
            "# (the link stays down until a power cycle), so keep them in D0.\n"
            "options vfio-pci disable_idle_d3=1\n")
    if unsafe_noiommu:
        text += ("# Asked for with --unsafe-noiommu: VFIO without an IOMMU. The device can then DMA to any\n"
                 "# physical address; a bug in the driver can corrupt any memory. See SAFETY.md.\n"
                 "options vfio enable_unsafe_noiommu_mode=1\n")
    step = Step(
        key="vfio-options",
        what=f"vfio module options in {MODPROBE_OPTIONS}: disable_idle_d3=1"
             + (", enable_unsafe_noiommu_mode=1" if unsafe_noiommu else ""),
        why="keeps bound controllers powered (D0)"
            + ("; no-IOMMU mode lets VFIO work where there is no usable IOMMU" if unsafe_noiommu else ""),
        risk=("no-IOMMU mode removes all DMA protection and taints the kernel" if unsafe_noiommu
              else "slightly higher idle power for bound devices"),
        undo=f"`nvmedirect setup --rollback`, or delete {MODPROBE_OPTIONS}; then reload vfio or reboot",
        after=["update-initramfs -u  (only if your initramfs loads vfio)"],
    )
    return _changes(view, step, [FileEdit(MODPROBE_OPTIONS, text.encode())])
