"""`nvmedirect check --probe-gpu-mmio BDF`: can GPU threads reach this controller's registers?

The probe maps BAR0 of a controller bound to vfio-pci, registers the mapping with CUDA
(cudaHostRegisterIoMemory: PCI memory, not RAM), has a kernel read CAP and VS through it and
compares them with the CPU's reads. Doorbell writes use the same path, so equal reads mean the GPU
doorbell path can work here; the probe writes nothing to the device.

Each way it can fail has a named blocker, in the order the path meets them: no CuPy or no GPU, no
such controller or not bound to vfio-pci, VFIO refusing the device, CUDA refusing the registration
(the NVIDIA driver's follow_pfn()-based path on kernels >= 6.12, an unsupported driver/GPU), or the
GPU reading something else than the CPU (BAR not reachable from the GPU: the IOMMU translating
peer traffic, ACS, no Above-4G decoding). A probe never raises.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from nvmedirect.system.devices import PCI_DEVICES, is_nvme_function, list_controllers, read_controller
from nvmedirect.system.sysview import SystemView

CUDA_HOST_REGISTER_MAPPED = 0x02
CUDA_HOST_REGISTER_IO_MEMORY = 0x04
ALL_ONES = (0xFFFFFFFFFFFFFFFF, 0xFFFFFFFF)  # what a read that reached no device returns


@dataclass
class ProbeResult:
    bdf: str
    ok: bool
    blocker: str            # "" when ok; else the short name of what stopped the probe
    detail: str             # one line for the user
    cpu_cap: int | None = None
    cpu_vs: int | None = None
    gpu_cap: int | None = None
    gpu_vs: int | None = None

    def line(self) -> str:
        state = "ok" if self.ok else f"blocked ({self.blocker})"
        return f"gpu-mmio {self.bdf}: {state}: {self.detail}"

    def to_dict(self) -> dict:
        return asdict(self)


def gpu_blocker() -> str | None:
    """Why no CUDA GPU can be used here, or None."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA install raising something else
        return f"CuPy is not importable ({type(exc).__name__}): install cupy-cuda13x"
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            return "CUDA sees no GPU"
    except Exception as exc:
        return f"no usable CUDA GPU ({str(exc).splitlines()[0][:160]})"
    return None


def controller_blocker(view: SystemView, bdf: str) -> str | None:
    if not view.exists(f"{PCI_DEVICES}/{bdf}"):
        return f"no PCI device {bdf}, so no vfio-bound NVMe controller there (see `nvmedirect list`)"
    if not is_nvme_function(view, bdf):
        return f"{bdf} is not an NVMe controller (PCI class 01:08:02)"
    driver = read_controller(view, bdf).driver
    if driver != "vfio-pci":
        return f"{bdf} is bound to {driver or 'no driver'}, not vfio-pci: run `nvmedirect bind {bdf}` first"
    return None


def registration_blocker(exc: Exception) -> str:
    text = str(exc)
    if "NotSupported" in text or "not supported" in text.lower():
        return ("the NVIDIA driver refused cudaHostRegisterIoMemory (" + text[:120] + "): on kernels >= 6.12 its "
                "os-mlock.c still calls the removed follow_pfn() (`nvmedirect setup --patch-nvidia`); some "
                "driver/GPU combinations do not support I/O memory registration at all")
    return f"cudaHostRegister(IoMemory) of BAR0 failed: {text[:200]}"


def probe(bdf: str | None, view: SystemView | None = None) -> ProbeResult:
    """Probe controller `bdf` (None: the first one bound to vfio-pci)."""
    view = view or SystemView("/")
    why = gpu_blocker()
    if why:
        return ProbeResult(bdf or "-", False, "no GPU", why)
    if bdf is None:
        bound = [c.bdf for c in list_controllers(view) if c.driver == "vfio-pci"]
        if not bound:
            return ProbeResult("-", False, "no vfio-bound controller",
                               "no NVMe controller is bound to vfio-pci: `nvmedirect bind` one first")
        bdf = bound[0]

    def blocked(blocker: str, detail: str) -> ProbeResult:
        return ProbeResult(bdf, False, blocker, detail)

    why = controller_blocker(view, bdf)
    if why:
        return blocked("no vfio-bound controller", why)
    if not view.is_live:
        return blocked("not a live system", f"--root {view.root} is not the running system: nothing to map")
    try:
        return _probe_bound(bdf)
    except Exception as exc:  # anything unforeseen still becomes one line, never a traceback
        return blocked("probe failed", f"{type(exc).__name__}: {str(exc)[:200]}")


def _probe_bound(bdf: str) -> ProbeResult:
    import cupy

    from nvmedirect.gpu.doorbell import read_registers
    from nvmedirect.vfio import VfioDevice

    try:
        device = VfioDevice.open(bdf)  # in the VFIO mode of its group
    except Exception as exc:
        return ProbeResult(bdf, False, "VFIO refused", f"opening {bdf} through VFIO failed: {str(exc)[:200]}")
    with device:
        bar = device.map_bar(0)
        cpu_cap, cpu_vs = bar.read32(0) | bar.read32(4) << 32, bar.read32(8)
        try:
            cupy.cuda.runtime.hostRegister(bar.address, bar.size, CUDA_HOST_REGISTER_IO_MEMORY | CUDA_HOST_REGISTER_MAPPED)
        except Exception as exc:
            return ProbeResult(bdf, False, "registration refused", registration_blocker(exc), cpu_cap, cpu_vs)
        try:
            pointer = cupy.cuda.runtime.pointerGetAttributes(bar.address).devicePointer or bar.address
            gpu_cap, gpu_vs = read_registers(int(pointer))
        except Exception as exc:
            return ProbeResult(bdf, False, "GPU read failed", f"a kernel reading BAR0 failed: {str(exc)[:200]}",
                               cpu_cap, cpu_vs)
        finally:
            cupy.cuda.runtime.hostUnregister(bar.address)
    reads = {"cpu_cap": cpu_cap, "cpu_vs": cpu_vs, "gpu_cap": gpu_cap, "gpu_vs": gpu_vs}
    if (gpu_cap, gpu_vs) != (cpu_cap, cpu_vs):
        hint = " (all ones: the GPU's reads reached no device)" if (gpu_cap, gpu_vs) == ALL_ONES else ""
        return ProbeResult(bdf, False, "BAR unreachable from the GPU",
                           f"the GPU read CAP {gpu_cap:#018x} VS {gpu_vs:#x}, the CPU CAP {cpu_cap:#018x} VS "
                           f"{cpu_vs:#x}{hint}: check IOMMU passthrough (iommu=pt), ACS/peer-to-peer routing and "
                           "Above 4G Decoding", **reads)
    major, minor = cpu_vs >> 16, cpu_vs >> 8 & 0xFF
    return ProbeResult(bdf, True, "", f"a GPU kernel read CAP {gpu_cap:#018x} and VS {major}.{minor} through "
                                      "cudaHostRegisterIoMemory, equal to the CPU's reads", **reads)
