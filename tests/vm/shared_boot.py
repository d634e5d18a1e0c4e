"""One boot per VFIO mode for the guest modules of the rig, its QMP hooks, the driver, the GGUF
store and the system commands.

A TCG boot plus a guest Python/pytest start costs 15-30 s, so tests/vm/test_rig.py,
test_rig_faults.py (its QMP test), test_driver.py, test_store.py and test_system.py share one VM per
mode: every part below adds its own controllers (distinct serials; the rig takes up to 15) and guest
modules, one guest pytest session runs them all in PARTS order, and each host test inspects only its
own part's guest tests (`SharedBoot.result(part)`) and files, so it still fails when those did not
run or failed.

Order inside the guest matters: the rig module runs first (it checks that every controller the host
configured is on the kernel's nvme driver), the driver and store modules hand every controller they
bind back to nvme after each test or module, and the system module runs last (its last test unloads
vfio for the rest of the boot). Each part binds, resets, throttles or unplugs only its own
controllers.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rig import MIB, NvmeSpec, Vm, VmConfig, controller_id
from rig_pytest import GuestPytestResult, PendingGuestPytest, start_guest_pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 2400  # the five modules' own limits were 600 (rig, faults, system), 900 (driver, store) s


@dataclass
class Part:
    """What one host test module adds to the shared boot, and the files it checks afterwards."""

    name: str
    guest_modules: list[str]
    controllers: list[NvmeSpec]
    env: dict[str, str] = field(default_factory=dict)
    qemu_args: list[str] = field(default_factory=list)
    files: dict[str, Path] = field(default_factory=dict)
    expected: dict[str, bytes] = field(default_factory=dict)
    on_console: list[tuple[str, Callable[[Vm], None]]] = field(default_factory=list)
    record: dict[str, list] = field(default_factory=dict)  # what on_console actions did, for the host test


# -- the rig (tests/vm/test_rig.py) ------------------------------------------------------------------
RIG_EXTRA_DISK_SIZE = 3 * MIB


def rig_part(directory: Path) -> Part:
    image = directory / "prefilled.img"
    data = os.urandom(4 * MIB)
    image.write_bytes(data)
    extra_disk = directory / "extra.img"
    extra_disk.write_bytes(bytes(RIG_EXTRA_DISK_SIZE))
    return Part(
        "rig", ["tests/vm/guest/test_rig_guest.py"],
        controllers=[
            NvmeSpec("nvd-rig-a", image=image),
            NvmeSpec("nvd-rig-b", size=32 * MIB, logical_block_size=4096, mdts=3, max_ioqpairs=1),
        ],
        env={"NVD_RIG_IMAGE_SHA256": hashlib.sha256(data).hexdigest(),
             "NVD_RIG_EXTRA_DISK_SIZE": str(RIG_EXTRA_DISK_SIZE)},
        # A device QEMU places by itself must not move the controllers' addresses.
        qemu_args=["-drive", f"file={extra_disk},if=none,id=extra0,format=raw",
                   "-device", "virtio-blk-pci,drive=extra0,serial=nvd-extra"],
        files={"prefilled": image}, expected={"prefilled": data})


# -- QMP both ways (tests/vm/test_rig_faults.py; no-IOMMU boot only) ---------------------------------
UNPLUG_SERIAL = "nvd-fault-b"
UNPLUG_MARKER = f"NVD-RIG-UNPLUG {UNPLUG_SERIAL}"  # the guest module's own constant


def faults_part(directory: Path) -> Part:
    unplugged: list[str] = []

    def unplug(vm: Vm) -> None:
        ctrl = controller_id(next(i for i, c in enumerate(vm.config.controllers) if c.serial == UNPLUG_SERIAL))
        vm.qmp.execute("device_del", id=ctrl)
        # QEMU confirms once the guest has let go of the device (pciehp: about 5 s later).
        # Its namespace child is deleted first, with an event of its own (no id, only a path).
        vm.qmp.wait_event("DEVICE_DELETED", timeout=120, device=ctrl)
        unplugged.append(UNPLUG_SERIAL)

    return Part("faults", ["tests/vm/guest/test_rig_faults_guest.py"],
                controllers=[NvmeSpec("nvd-fault-a"), NvmeSpec(UNPLUG_SERIAL)],
                on_console=[(UNPLUG_MARKER, unplug)], record={"unplugged": unplugged})


# -- the driver (tests/vm/test_driver.py) ------------------------------------------------------------
WRITE_SEED = 20261130
WRITE_LBA = 2048
WRITE_BYTES = 3 * MIB


def random_image(path: Path, size: int, seed: int) -> Path:
    path.write_bytes(np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes())
    return path


def stored_model_image(directory: Path) -> tuple[Path, Path, Path, int]:
    """A tiny synthetic Llama (4 layers, Q4_K_M) and, after it in the chain, a tiny mixture of experts
    (tiny-moe, Q4_K_M), and an image holding both as `write-gguf` stores them: (model, image, the
    MoE model, the LBA of its header)."""
    import json

    from click.testing import CliRunner

    from infer.synth import SHAPES, Shape, write_model
    from nvmedirect.cli import main as nvmedirect_main

    model = directory / "tiny4-q4_k_m.gguf"
    write_model(model, Shape(**{**SHAPES["tiny"].__dict__, "n_layers": 4}), "q4_k_m", seed=11)
    moe = directory / "tiny-moe-q4_k_m.gguf"
    write_model(moe, SHAPES["tiny-moe"], "q4_k_m", seed=12)
    image = blank(directory / "model.img", 16 * MIB)
    result = CliRunner().invoke(nvmedirect_main, ["write-gguf", str(model), "-d", str(image), "--yes", "--json"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(nvmedirect_main, ["write-gguf", str(moe), "-d", str(image), "--append", "--yes",
                                                  "--json"])
    assert result.exit_code == 0, result.output
    return model, image, moe, int(json.loads(result.stdout)["start_lba"])


def driver_part(directory: Path) -> Part:
    write_image = directory / "write.img"
    write_image.write_bytes(bytes(16 * MIB))
    model, model_image, moe, moe_lba = stored_model_image(directory)
    return Part(
        "driver", ["tests/vm/guest/driver/test_driver_guest.py", "tests/vm/guest/driver/test_driver_fault_guest.py",
                   "tests/vm/guest/driver/test_driver_one_qpair_guest.py",
                   "tests/vm/guest/driver/test_shared_builder_guest.py"],
        controllers=[
            NvmeSpec("nvd-drv-read", image=random_image(directory / "read.img", 64 * MIB, 1)),
            NvmeSpec("nvd-drv-4k", image=random_image(directory / "4k.img", 16 * MIB, 2),
                     logical_block_size=4096, mdts=0),
            NvmeSpec("nvd-drv-write", image=write_image),
            NvmeSpec("nvd-drv-fault", image=random_image(directory / "fault.img", 8 * MIB, 3)),
            # One I/O queue pair, as some controllers grant; it holds two stored models for tier C.
            NvmeSpec("nvd-drv-1qp", image=model_image, max_ioqpairs=1),
        ],
        env={"NVD_WRITE_SEED": str(WRITE_SEED), "NVD_WRITE_LBA": str(WRITE_LBA), "NVD_STORED_MODEL": str(model),
             "NVD_STORED_MOE": str(moe), "NVD_STORED_MOE_LBA": str(moe_lba)},
        files={"write": write_image, "model": model, "model_image": model_image, "moe": moe})


# -- GGUF models on NVMe namespaces (tests/vm/test_store.py) -----------------------------------------
# In the iommu boot by default (the driver's own VM tests cover both VFIO modes);
# NVD_STORE_VM_MODES=iommu,noiommu adds it to the no-IOMMU boot as well.
STORE_MODES = [m.strip() for m in os.environ.get("NVD_STORE_VM_MODES", "iommu").split(",") if m.strip()]
STORE_LBA_SIZES = (512, 4096)


def store_model() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF (scripts/fetch-models.sh caches it)."""
    out = subprocess.run(["bash", str(REPO / "scripts/fetch-models.sh"), "smollm2"], check=True,
                         capture_output=True, text=True, timeout=900)
    return Path(out.stdout.strip().splitlines()[-1])


def blank(path: Path, size: int) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def store_part(directory: Path) -> Part:
    assert shutil.which("mkfs.ext4"), "mkfs.ext4 is needed to make the filesystem the refusal tests use"
    model = store_model()
    images = {512: blank(directory / "ns512.img", 384 * MIB), 4096: blank(directory / "ns4k.img", 384 * MIB)}
    fs_image = blank(directory / "fs.img", 256 * MIB)  # the model would fit: only the filesystem refuses
    subprocess.run(["mkfs.ext4", "-q", "-F", str(fs_image)], check=True, capture_output=True)
    return Part(
        "store", ["tests/vm/guest/store/test_store_guest.py"],
        controllers=[
            NvmeSpec("nvd-store-512", image=images[512]),
            NvmeSpec("nvd-store-4k", image=images[4096], logical_block_size=4096),
            NvmeSpec("nvd-store-fs", image=fs_image),
        ],
        env={"NVD_STORE_MODEL": str(model)},
        files={"model": model, "ns512": images[512], "ns4k": images[4096], "fs": fs_image})


# -- the system commands (tests/vm/test_system.py) ---------------------------------------------------
SYSTEM_TOOLS = ("mkfs.ext4", "mkswap", "lvm", "mdadm")


def system_pattern() -> bytes:
    return bytes(range(256)) * (32 * MIB // 256)


def system_part(directory: Path) -> Part:
    for tool in SYSTEM_TOOLS:
        assert shutil.which(tool), f"{tool} missing on the host (the guest uses it): run scripts/deps/25-system-tools.sh"
    pattern = directory / "free.img"
    pattern.write_bytes(system_pattern())
    ext4 = directory / "ext4.img"
    ext4.write_bytes(bytes(32 * MIB))
    subprocess.run(["mkfs.ext4", "-q", "-F", "-L", "nvd-sys", str(ext4)], check=True, timeout=60)
    return Part(
        "system", ["tests/vm/guest/system/test_system_guest.py"],
        controllers=[
            NvmeSpec("sys-free", image=pattern),
            NvmeSpec("sys-mounted", image=ext4),
            NvmeSpec("sys-swap", size=32 * MIB),
            NvmeSpec("sys-lvm", size=32 * MIB),
            NvmeSpec("sys-md", size=32 * MIB),
        ],
        files={"free": pattern}, expected={"free": system_pattern()})


# Guest run order: the rig first (every controller still on nvme), the unplug next (so every other
# controller is still on nvme when it counts them), the system module last (it unloads vfio).
PARTS: list[Callable[[Path], Part]] = [rig_part, faults_part, driver_part, store_part, system_part]
# Others join both modes. The unplug runs in the no-IOMMU boot: the iommu one carries the store's
# controllers, and q35 has room for 15 (rig_config.MAX_CONTROLLERS).
FAULTS_MODES = ["noiommu"]
PART_MODES = {"faults": FAULTS_MODES, "store": STORE_MODES}


def part_name(make: Callable[[Path], Part]) -> str:
    return make.__name__.removesuffix("_part")


# -- the boot ----------------------------------------------------------------------------------------
def guest_module_name(path: str) -> str:
    """The JUnit classname pytest gives tests of `path` (relative to the repository root)."""
    return path.removesuffix(".py").replace("/", ".")


@dataclass
class SharedBoot:
    mode: str
    parts: dict[str, Part]
    whole: GuestPytestResult

    def result(self, part: str) -> GuestPytestResult:
        """The guest tests of one part only (its modules), for that part's host test to assert on."""
        if part not in self.parts:
            raise AssertionError(f"the {self.mode} boot has no {part} part (PART_MODES)")
        return self.whole.select(guest_module_name(m) for m in self.parts[part].guest_modules)


class EmulatorCrashed(UserWarning):
    """QEMU itself died of a signal during a shared boot, which was booted again from fresh images."""


@dataclass
class PendingSharedBoot:
    mode: str
    parts: dict[str, Part]
    pending: PendingGuestPytest
    # Boots this mode again from fresh images after an emulator crash; None once that was done.
    boot_again: Callable[[], PendingSharedBoot] | None = None

    def finish(self) -> SharedBoot:
        """Wait for the guest session (the VM powers off) and return its result.

        QEMU 7.2 segfaults now and then (docs/TESTING.md: seen on a controller reset with a read in
        flight, and once in CI's iommu boot with no trigger found here). One crash costs
        every guest test of the boot, so the boot runs once more from fresh images, with a warning
        that names the crash in pytest's summary; a second crash fails the host tests as any failure
        does. A guest test failing, a guest kernel panic or a timeout is never retried."""
        whole = self.pending.result()
        print(f"shared guest pytest ({self.mode}): {whole.summary()}")
        if whole.vm.emulator_signal is not None and self.boot_again is not None:
            warnings.warn(EmulatorCrashed(
                f"the {self.mode} shared boot is booted again: {whole.vm.failure} after "
                f"{len(whole.tests)} guest tests reported (run dir {whole.vm.run_dir}); console tail:\n"
                f"{whole.vm.console_tail(15)}"), stacklevel=2)
            return self.boot_again().finish()
        return SharedBoot(self.mode, self.parts, whole)

    def abandon(self) -> None:
        self.pending.abandon()


def start(mode: str, workdir: Path, boot_again_on_crash: bool = True) -> PendingSharedBoot:
    """Build every part's images under `workdir` and boot `mode`, running all its parts' guest
    modules; returns while the VM runs. After an emulator crash `finish` boots it once more, under
    `workdir`/again."""
    parts = {}
    for make in PARTS:
        if mode not in PART_MODES.get(part_name(make), ["iommu", "noiommu"]):
            continue
        directory = workdir / part_name(make)
        directory.mkdir()
        part = make(directory)
        parts[part.name] = part
    env: dict[str, str] = {}
    for part in parts.values():
        clash = env.keys() & part.env.keys()
        assert not clash, f"parts set the same guest variables: {sorted(clash)}"
        env.update(part.env)
    config = VmConfig(iommu=mode == "iommu",
                      controllers=[c for p in parts.values() for c in p.controllers],
                      qemu_args=[a for p in parts.values() for a in p.qemu_args])
    run_dir = workdir / "vm"
    run_dir.mkdir()
    modules = [m for p in parts.values() for m in p.guest_modules]
    on_console = [watch for p in parts.values() for watch in p.on_console]
    pending = start_guest_pytest(config, modules, run_dir, timeout=TIMEOUT_S, env=env, on_console=on_console)

    def boot_again() -> PendingSharedBoot:
        (workdir / "again").mkdir()
        return start(mode, workdir / "again", boot_again_on_crash=False)

    return PendingSharedBoot(mode, parts, pending, boot_again if boot_again_on_crash else None)


def boot(mode: str, workdir: Path) -> SharedBoot:
    """`start` and wait."""
    return start(mode, workdir).finish()
