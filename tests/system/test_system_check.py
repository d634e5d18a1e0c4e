"""`nvmedirect check` on fake roots: each prerequisite's ok/warn/fail and the exit code."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from nvmedirect.cli import main

A = "0000:00:04.0"


def check(fake, *args) -> tuple[int, dict]:
    result = CliRunner().invoke(main, ["check", "--root", str(fake.root), "--no-gpu", "--json", *args])
    assert result.exit_code in (0, 4), result.output
    data = json.loads(result.output)
    return result.exit_code, {c["name"]: c for c in data["checks"]}


def ready_system(fake, iommu: bool = True):
    fake.write("proc/sys/kernel/osrelease", "6.1.0-57-amd64\n")
    fake.nvme(A, "nvme0", {"nvme0n1": []})
    (fake.root / "sys/bus/pci/drivers/vfio-pci").mkdir(parents=True)
    fake.write("dev/vfio/vfio", "")
    fake.write("sys/module/vfio/parameters/enable_unsafe_noiommu_mode", "N\n")
    if not iommu:
        fake.pci(A, group=None)
        (fake.root / "sys/kernel/iommu_groups/7").rmdir()
    else:
        (fake.root / "sys/class/iommu/dmar0").mkdir(parents=True)
        fake.write("proc/cmdline", "root=/dev/vda1 intel_iommu=on iommu=pt\n")


def test_ready_system_exits_zero(fake):
    ready_system(fake)
    code, checks = check(fake)
    assert code == 0
    assert checks["iommu"]["status"] == "ok" and "passthrough" in checks["iommu"]["detail"]
    assert "intel_iommu=on iommu=pt" in checks["iommu"]["detail"]
    assert checks["vfio"]["status"] == "ok"
    assert checks[f"nvme {A}"]["status"] == "ok" and "free" in checks[f"nvme {A}"]["detail"]
    assert checks["gpu-mmio"]["status"] == "unknown"


def test_no_iommu_and_noiommu_off_is_not_ready(fake):
    ready_system(fake, iommu=False)
    code, checks = check(fake)
    assert code == 4 and checks["iommu"]["status"] == "fail" and "no-IOMMU mode is off" in checks["iommu"]["detail"]


def test_noiommu_mode_on_is_a_warning(fake):
    ready_system(fake, iommu=False)
    fake.write("sys/module/vfio/parameters/enable_unsafe_noiommu_mode", "Y\n")
    fake.pci(A, group="0")
    fake.write("sys/kernel/iommu_groups/0/name", "vfio-noiommu\n")  # the fake group vfio makes
    code, checks = check(fake)
    assert code == 0
    assert checks["iommu"]["status"] == "warn" and "unrestricted" in checks["iommu"]["detail"]
    assert checks["noiommu"]["status"] == "warn"


def test_noiommu_mode_unknown_before_vfio_loads_is_not_ok(fake):
    ready_system(fake)
    shutil.rmtree(fake.root / "sys/module/vfio")
    code, checks = check(fake)
    assert code == 0  # an IOMMU is there: the mode does not matter for readiness
    assert checks["noiommu"]["status"] == "unknown" and "until vfio is loaded" in checks["noiommu"]["detail"]
    text = CliRunner().invoke(main, ["check", "--root", str(fake.root), "--no-gpu"]).output
    assert "[ ?? ] noiommu" in text and "[ ok ] noiommu" not in text


def test_kernel_without_noiommu_support(fake):
    ready_system(fake, iommu=False)
    (fake.root / "sys/module/vfio/parameters/enable_unsafe_noiommu_mode").unlink()
    code, checks = check(fake)
    assert code == 4 and checks["noiommu"]["status"] == "fail" and "CONFIG_VFIO_NOIOMMU" in checks["noiommu"]["detail"]


@pytest.mark.parametrize("installed,word", [(True, "module is installed"), (False, "not found in modules.dep")])
def test_vfio_not_loaded_is_a_warning(fake, installed, word):
    ready_system(fake)
    (fake.root / "sys/bus/pci/drivers/vfio-pci").rmdir()
    if installed:
        fake.write("lib/modules/6.1.0-57-amd64/modules.dep",
                   "kernel/drivers/vfio/pci/vfio-pci.ko: kernel/drivers/vfio/vfio.ko\n")
    code, checks = check(fake)
    assert checks["vfio"]["status"] == "warn" and word in checks["vfio"]["detail"] and code == 0


def test_only_refused_controllers_is_not_ready(fake):
    ready_system(fake)
    fake.mount("nvme0n1", "/")
    code, checks = check(fake)
    assert code == 4
    assert checks[f"nvme {A}"]["status"] == "warn" and "boot" in checks[f"nvme {A}"]["detail"]
    assert checks["nvme"]["status"] == "fail"


def test_vfio_bound_controller_counts_as_usable(fake):
    ready_system(fake)
    fake.pci(A, driver="vfio-pci")
    code, checks = check(fake)
    assert code == 0 and "vfio" in checks[f"nvme {A}"]["detail"]


def test_gpu_bar_placement(fake):
    ready_system(fake)
    fake.pci("0000:01:00.0", pci_class="0x030000", driver=None, group="3")
    fake.write("sys/bus/pci/devices/0000:01:00.0/vendor", "0x10de\n")
    zero = "0x0000000000000000 0x0000000000000000 0x0000000000000000\n"
    fake.write("sys/bus/pci/devices/0000:01:00.0/resource",
               "0x00000000fb000000 0x00000000fbffffff 0x0000000000040200\n"
               "0x00000000d0000000 0x00000000dfffffff 0x000000000014220c\n" + zero * 4)
    _, checks = check(fake)
    assert checks["bar-placement"]["status"] == "warn" and "BAR1 at 0xd0000000 (256 MiB)" in checks["bar-placement"]["detail"]
    fake.write("sys/bus/pci/devices/0000:01:00.0/resource",
               "0x00000000fb000000 0x00000000fbffffff 0x0000000000040200\n"
               "0x0000038000000000 0x00000387ffffffff 0x000000000014220c\n" + zero * 4)
    _, checks = check(fake)
    assert checks["bar-placement"]["status"] == "ok" and "32768 MiB" in checks["bar-placement"]["detail"]


@pytest.mark.parametrize("value,status", [(1, "warn"), (0, "ok")])
def test_secure_boot_from_efivars(fake, value, status):
    ready_system(fake)
    var = fake.root / "sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c"
    var.parent.mkdir(parents=True)
    var.write_bytes(b"\x06\x00\x00\x00" + bytes([value]))
    fake.write("sys/kernel/security/lockdown", "none [integrity] confidentiality\n")
    _, checks = check(fake)
    assert checks["secure-boot"]["status"] == status and "lockdown integrity" in checks["secure-boot"]["detail"]


def test_unpatched_nvidia_source_on_6_12_fails_gpu_mmio(fake):
    ready_system(fake)
    fake.write("proc/sys/kernel/osrelease", "6.12.9\n")
    fake.write("usr/src/nvidia-550.1/nvidia/os-mlock.c",
               "#if defined(NV_UNSAFE_FOLLOW_PFN_PRESENT)\n    return unsafe_follow_pfn(vma, address, pfn);\n"
               "#else\n    return follow_pfn(vma, address, pfn);\n#endif\n")
    code, checks = check(fake)
    assert code == 4 and checks["gpu-mmio"]["status"] == "fail" and "--patch-nvidia" in checks["gpu-mmio"]["fix"]


def test_human_output_has_one_line_per_check(fake):
    ready_system(fake)
    result = CliRunner().invoke(main, ["check", "--root", str(fake.root), "--no-gpu"])
    assert result.exit_code == 0
    assert "[ ok ] kernel" in result.output and result.output.rstrip().endswith("ready")
