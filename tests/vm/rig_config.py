"""What a test VM is made of: its NVMe controllers (with their namespaces) and the machine around them.

Controller i always sits alone behind its own PCIe root port at 00:(0x10+i).0, so its address in
the guest is 0000:(i+1):00.0 and it can be hot-unplugged with `device_del nvme<i>`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

MIB = 1 << 20
FIRST_ROOT_PORT_SLOT = 0x10
MAX_CONTROLLERS = 15  # slot 0x1f is q35's ICH9 LPC bridge


@dataclass
class NamespaceSpec:
    """One namespace: a fresh sparse image of `size` bytes, or an existing `image` (used in place,
    so the guest's writes land in it)."""

    size: int = 64 * MIB
    image: Path | None = None
    logical_block_size: int = 512

    def __post_init__(self) -> None:
        if self.logical_block_size not in (512, 4096):
            raise ValueError(f"logical_block_size must be 512 or 4096, not {self.logical_block_size}")
        if self.image is not None:
            self.image = Path(self.image)
            if not self.image.is_file():
                raise ValueError(f"namespace image {self.image} does not exist")
            self.size = self.image.stat().st_size
        if self.size <= 0 or self.size % self.logical_block_size:
            raise ValueError(f"namespace size {self.size} is not a positive multiple of "
                             f"{self.logical_block_size}")


@dataclass
class NvmeSpec:
    """One emulated NVMe controller. The first namespace comes from size/image/logical_block_size;
    `extra_namespaces` add nsid 2, 3, ...; `options` passes any other `-device nvme` property.
    QEMU 7.2's controller has no model property: Identify always reports "QEMU NVMe Ctrl"."""

    serial: str
    size: int = 64 * MIB
    image: Path | None = None
    logical_block_size: int = 512
    mdts: int | None = None
    max_ioqpairs: int | None = None
    extra_namespaces: list[NamespaceSpec] = field(default_factory=list)
    options: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.serial or any(c in self.serial for c in ',"\n '):
            raise ValueError(f"NVMe serial {self.serial!r} must be non-empty without commas, quotes or spaces")
        if len(self.serial) > 20:
            raise ValueError(f"NVMe serial {self.serial!r} is longer than the 20 bytes NVMe allows")
        first = NamespaceSpec(self.size, self.image, self.logical_block_size)  # validates them now
        self.image, self.size = first.image, first.size

    @property
    def namespaces(self) -> list[NamespaceSpec]:
        first = NamespaceSpec(self.size, self.image, self.logical_block_size)
        return [first, *self.extra_namespaces]


@dataclass
class VmConfig:
    """What to boot. `iommu` selects an emulated Intel IOMMU (VFIO type1) or none (VFIO no-IOMMU)."""

    iommu: bool = True
    controllers: list[NvmeSpec] = field(default_factory=lambda: [NvmeSpec("nvd-rig-0")])
    memory: str = "2G"
    cpus: int = 2
    kernel_args: list[str] = field(default_factory=list)
    qemu_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        serials = [c.serial for c in self.controllers]
        if len(set(serials)) != len(serials):
            raise ValueError(f"controller serials must be unique, got {serials}")
        if len(self.controllers) > MAX_CONTROLLERS:
            raise ValueError(f"at most {MAX_CONTROLLERS} NVMe controllers (one root port each, slots "
                             f"{FIRST_ROOT_PORT_SLOT:#x}-{FIRST_ROOT_PORT_SLOT + MAX_CONTROLLERS - 1:#x})")

    @property
    def mode(self) -> str:
        return "iommu" if self.iommu else "noiommu"


def controller_bdf(index: int) -> str:
    """Guest PCI address of controller `index`: the firmware numbers root port i's bus i+1."""
    return f"0000:{index + 1:02x}:00.0"


def controller_id(index: int) -> str:
    """QEMU device id of controller `index` (for QMP `device_del`)."""
    return f"nvme{index}"
