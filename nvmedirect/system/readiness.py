"""`nvmedirect check` as data: one read-only probe per prerequisite, each ok/warn/fail/unknown with
what to do. Nothing here changes the system (the GPU-MMIO probe runs only when asked for)."""

from __future__ import annotations

import re
import resource
from dataclasses import dataclass

from nvmedirect.system.devices import list_controllers
from nvmedirect.system.patches import NVIDIA_GLOBS, NVIDIA_UNPATCHED, kernel_release, version_tuple
from nvmedirect.system.safety import assess
from nvmedirect.system.state import StateFile
from nvmedirect.system.sysview import SystemView
from nvmedirect.system.usage import UsageIndex

OK, WARN, FAIL, UNKNOWN = "ok", "warn", "fail", "unknown"
NOIOMMU_PARAM = "/sys/module/vfio/parameters/enable_unsafe_noiommu_mode"
SECURE_BOOT_VAR = "/sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c"
CAP_IPC_LOCK = 14
FOUR_GIB = 1 << 32
MEMLOCK_ENOUGH = 1 << 30  # staging buffers of a few hundred MiB plus queues


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""

    def to_dict(self) -> dict:
        return {"name": self.name, "status": self.status, "detail": self.detail, "fix": self.fix}


def check_kernel(view: SystemView) -> Check:
    release = kernel_release(view) or "?"
    if version_tuple(release) >= (5, 4):
        return Check("kernel", OK, release)
    return Check("kernel", WARN, f"{release} is older than 5.4 (untested)", "use a newer kernel")


def _real_groups(view: SystemView) -> list[str]:
    """IOMMU groups made by an IOMMU (no-IOMMU mode makes fake ones named vfio-noiommu)."""
    return [g for g in view.listdir("/sys/kernel/iommu_groups")
            if view.read(f"/sys/kernel/iommu_groups/{g}/name") != "vfio-noiommu"]


def noiommu_mode(view: SystemView) -> str:
    """"on", "off", "unavailable" (vfio loaded, kernel built without it) or "unknown" (vfio absent)."""
    value = view.read(NOIOMMU_PARAM)
    if value is not None:
        return "on" if value.upper().startswith("Y") else "off"
    return "unavailable" if view.exists("/sys/module/vfio") else "unknown"


def check_iommu(view: SystemView) -> list[Check]:
    cmdline = [t for t in (view.read("/proc/cmdline") or "").split() if re.match(r"(intel_iommu|amd_iommu|iommu)=", t)]
    args = f"; cmdline: {' '.join(cmdline)}" if cmdline else "; cmdline: no IOMMU parameters"
    units = view.listdir("/sys/class/iommu")
    groups = _real_groups(view)
    noiommu = noiommu_mode(view)
    if groups:
        mode = " (passthrough for host devices)" if "iommu=pt" in cmdline else ""
        iommu = Check("iommu", OK, f"enabled{mode}: {len(groups)} groups, units {', '.join(units) or '?'}{args}")
    elif noiommu == "on":
        iommu = Check("iommu", WARN, f"no IOMMU; vfio no-IOMMU mode is on: device DMA is unrestricted{args}",
                      "see SAFETY.md; enable VT-d/AMD-Vi and `nvmedirect setup --iommu on` for isolation")
    else:
        why = {"off": "vfio no-IOMMU mode is off", "unavailable": "this kernel has no vfio no-IOMMU mode",
               "unknown": "vfio is not loaded"}[noiommu]
        iommu = Check("iommu", FAIL, f"no IOMMU groups, and {why}{args}",
                      "enable VT-d/AMD-Vi in firmware and run `nvmedirect setup --iommu on`, or "
                      "`nvmedirect setup --unsafe-noiommu` (no DMA protection; see SAFETY.md)")
    detail = {"on": "on (unsafe, taints the kernel)", "off": "off",
              "unavailable": "not built into this kernel (CONFIG_VFIO_NOIOMMU)",
              "unknown": "unknown until vfio is loaded"}[noiommu]
    if noiommu == "unknown":
        status = UNKNOWN  # not ok: nobody can tell until vfio is loaded
    else:
        status = WARN if noiommu == "on" else (OK if groups or noiommu != "unavailable" else FAIL)
    fix = {OK: "", WARN: "only for machines without a usable IOMMU", UNKNOWN: "",
           FAIL: "enable the IOMMU, or use a kernel built with CONFIG_VFIO_NOIOMMU"}[status]
    return [iommu, Check("noiommu", status, detail, fix)]


def _module_available(view: SystemView, module: str) -> bool:
    release = kernel_release(view) or ""
    text = (view.read(f"/lib/modules/{release}/modules.dep") or "") + (
        view.read(f"/lib/modules/{release}/modules.builtin") or "")
    return f"/{module}.ko" in text


def check_vfio(view: SystemView) -> Check:
    driver = view.exists("/sys/bus/pci/drivers/vfio-pci")
    node = view.exists("/dev/vfio/vfio")
    if driver and node:
        return Check("vfio", OK, "vfio and vfio-pci loaded, /dev/vfio/vfio present")
    if driver:
        return Check("vfio", FAIL, "vfio-pci loaded but /dev/vfio/vfio is missing", "check udev / devtmpfs")
    if _module_available(view, "vfio-pci"):
        return Check("vfio", WARN, "vfio-pci is not loaded (the module is installed)",
                     "`nvmedirect bind` loads it; `nvmedirect setup` loads it at boot")
    return Check("vfio", WARN, "vfio-pci is not loaded and its module was not found in modules.dep",
                 "`modprobe vfio-pci`; if that fails, install your distribution's full kernel modules")


def check_devices(view: SystemView) -> list[Check]:
    usage, records = UsageIndex(view), StateFile(view).load()
    checks, usable = [], 0
    for ctrl in list_controllers(view):
        verdict = assess(ctrl, usage, records.get(ctrl.bdf))
        label = " ".join(x for x in (ctrl.bdf, ctrl.name, ctrl.model) if x)
        ok = verdict.may_bind or verdict.state == "vfio"
        usable += ok
        checks.append(Check(f"nvme {ctrl.bdf}", OK if ok else WARN, f"{label}: {verdict.summary()}",
                            "" if ok else "not usable: the tool refuses it (see `nvmedirect list`)"))
    if usable:
        checks.append(Check("nvme", OK, f"{usable} controller(s) usable"))
    else:
        checks.append(Check("nvme", FAIL, "no NVMe controller can be used" if checks else "no NVMe controller found",
                            "add a dedicated NVMe drive; the boot drive and drives in use are never taken"))
    return checks


def check_gpu() -> Check:
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA install raising something else
        return Check("gpu", WARN, f"CuPy not importable ({type(exc).__name__})",
                     "pip install cupy-cuda13x (or the build matching your CUDA); NVMe reads to host memory work without it")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
        if count == 0:
            raise RuntimeError("no CUDA device")
        props = cupy.cuda.runtime.getDeviceProperties(0)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        version = cupy.cuda.runtime.runtimeGetVersion()
    except Exception as exc:
        return Check("gpu", WARN, f"no usable CUDA GPU ({exc})", "install the NVIDIA driver; GPU paths are unavailable")
    return Check("gpu", OK, f"{count} GPU(s): {name} (compute {props['major']}.{props['minor']}), "
                            f"CUDA runtime {version // 1000}.{version % 1000 // 10}")


def _bars(view: SystemView, bdf: str) -> list[tuple[int, int, int]]:
    """(index, start, size) of each populated BAR, from the device's `resource` file."""
    out = []
    for index, line in enumerate((view.read(f"/sys/bus/pci/devices/{bdf}/resource") or "").splitlines()[:6]):
        start, end, _flags = (int(x, 16) for x in line.split()[:3])
        if end > start:
            out.append((index, start, end - start + 1))
    return out


def check_bar_placement(view: SystemView) -> Check:
    gpus = [b for b in view.listdir("/sys/bus/pci/devices")
            if (view.read(f"/sys/bus/pci/devices/{b}/class") or "").startswith("0x03")
            and view.read(f"/sys/bus/pci/devices/{b}/vendor") == "0x10de"]
    if not gpus:
        return Check("bar-placement", UNKNOWN, "no NVIDIA GPU on the PCI bus")
    notes, low = [], False
    for bdf in gpus:
        bars = _bars(view, bdf)
        if not bars:
            notes.append(f"{bdf}: BARs unreadable")
            continue
        index, start, size = max(bars, key=lambda bar: bar[2])
        low |= start < FOUR_GIB
        notes.append(f"{bdf} BAR{index} at {start:#x} ({size >> 20} MiB)")
    if low:
        return Check("bar-placement", WARN, "; ".join(notes) + " (below 4 GiB)",
                     "enable 'Above 4G Decoding' (and Resizable BAR) in the firmware setup")
    return Check("bar-placement", OK, "; ".join(notes))


def check_secure_boot(view: SystemView) -> Check:
    lockdown = view.read("/sys/kernel/security/lockdown")
    lock = f"; lockdown {m.group(1)}" if lockdown and (m := re.search(r"\[(\w+)\]", lockdown)) else ""
    if not view.exists("/sys/firmware/efi"):
        return Check("secure-boot", OK, f"legacy BIOS boot: no Secure Boot{lock}")
    raw = view.read_bytes(SECURE_BOOT_VAR)
    if raw is None or len(raw) < 5:
        return Check("secure-boot", UNKNOWN, f"EFI boot, SecureBoot variable unreadable{lock}")
    if raw[4] == 1:
        return Check("secure-boot", WARN, f"enabled{lock}",
                     "patched or rebuilt NVIDIA modules must be signed with an enrolled MOK key; kernel lockdown "
                     "restricts raw PCI access through sysfs")
    return Check("secure-boot", OK, f"disabled{lock}")


def _has_cap(view: SystemView, bit: int) -> bool:
    for line in (view.read("/proc/self/status") or "").splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> bit & 1)
    return False


def check_memlock(view: SystemView) -> Check:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    shown = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft >> 20} MiB"
    if _has_cap(SystemView("/"), CAP_IPC_LOCK):
        return Check("memlock", OK, f"RLIMIT_MEMLOCK {shown}; CAP_IPC_LOCK held (no limit applies)")
    if soft == resource.RLIM_INFINITY or soft >= MEMLOCK_ENOUGH:
        return Check("memlock", OK, f"RLIMIT_MEMLOCK {shown}")
    return Check("memlock", WARN, f"RLIMIT_MEMLOCK {shown}: DMA buffers are pinned against this limit",
                 "raise it (`ulimit -l unlimited`, or memlock in /etc/security/limits.conf) or run as root")


def check_gpu_mmio(view: SystemView, probe: bool) -> Check:
    """Can CUDA map an NVMe BAR (cudaHostRegister with IoMemory) so GPU threads ring doorbells?"""
    if version_tuple(kernel_release(view)) >= (6, 12):
        for pattern in NVIDIA_GLOBS:
            for path in view.root.glob(pattern):
                if NVIDIA_UNPATCHED in path.read_text(errors="replace"):
                    return Check("gpu-mmio", FAIL, f"kernel ≥ 6.12 and {path} still calls follow_pfn()",
                                 "`nvmedirect setup --patch-nvidia --apply`, then rebuild the module with dkms")
    if not probe:
        return Check("gpu-mmio", UNKNOWN, "not probed (needs a GPU and a controller bound to vfio-pci)",
                     "run `nvmedirect check --probe-gpu-mmio` after `nvmedirect bind`")
    return probe_gpu_mmio(view)


def probe_gpu_mmio(view: SystemView) -> Check:
    bound = [c for c in list_controllers(view) if c.driver == "vfio-pci"]
    if not bound or not view.is_live:
        return Check("gpu-mmio", UNKNOWN, "no controller bound to vfio-pci to probe with", "`nvmedirect bind` one first")
    from nvmedirect.gpu.probe import probe

    result = probe(bound[0].bdf, view)
    if result.ok:
        return Check("gpu-mmio", OK, f"{bound[0].bdf}: {result.detail}")
    return Check("gpu-mmio", FAIL, f"{bound[0].bdf}: {result.blocker}: {result.detail}",
                 "see docs/DRIVER.md (GPU-initiated I/O) for what each blocker needs")


def run_checks(view: SystemView, gpu: bool = True, probe_gpu_mmio: bool = False) -> list[Check]:
    checks = [check_kernel(view), *check_iommu(view), check_vfio(view), *check_devices(view)]
    checks.append(check_gpu() if gpu else Check("gpu", UNKNOWN, "skipped (--no-gpu)"))
    checks += [check_bar_placement(view), check_secure_boot(view), check_memlock(view),
               check_gpu_mmio(view, probe_gpu_mmio)]
    return checks


def ready(checks: list[Check]) -> bool:
    return not any(c.status == FAIL for c in checks)


__all__ = ["Check", "FAIL", "OK", "UNKNOWN", "WARN", "ready", "run_checks"]
