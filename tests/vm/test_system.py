"""The system commands (list, check, bind, restore) against QEMU NVMe controllers in a real kernel,
in both VFIO modes: one boot per mode runs tests/vm/guest/system/test_system_guest.py."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from rig import MIB, NvmeSpec, VmConfig

GUEST_MODULE = "tests/vm/guest/system/test_system_guest.py"


@pytest.mark.vm
@pytest.mark.slow
def test_system_commands_in_guest(vm_mode, guest_pytest, tmp_path):
    for tool in ("mkfs.ext4", "mkswap", "lvm", "mdadm"):
        assert shutil.which(tool), f"{tool} missing on the host (the guest uses it): run scripts/deps/25-system-tools.sh"
    pattern = tmp_path / "free.img"
    pattern.write_bytes(bytes(range(256)) * (32 * MIB // 256))
    ext4 = tmp_path / "ext4.img"
    ext4.write_bytes(bytes(32 * MIB))
    subprocess.run(["mkfs.ext4", "-q", "-F", "-L", "nvd-sys", str(ext4)], check=True, timeout=60)
    # no_timer_check: on a loaded host the TCG guest's early timer test can fail and panic the boot
    # ("timer doesn't work through Interrupts-remapped IO-APIC").
    config = VmConfig(iommu=vm_mode == "iommu", kernel_args=["no_timer_check"], controllers=[
        NvmeSpec("sys-free", image=pattern),
        NvmeSpec("sys-mounted", image=ext4),
        NvmeSpec("sys-swap", size=32 * MIB),
        NvmeSpec("sys-lvm", size=32 * MIB),
        NvmeSpec("sys-md", size=32 * MIB),
    ])
    result = guest_pytest(config, [GUEST_MODULE], timeout=600)
    result.assert_passed()
    assert len(result.passed) == 13, result.summary()
    assert pattern.read_bytes() == bytes(range(256)) * (32 * MIB // 256)  # bind/restore wrote nothing
