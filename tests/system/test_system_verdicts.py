"""Safety verdicts on fake sysfs/procfs trees: each refusal reason, and the cases that are free."""

from __future__ import annotations

import pytest

from nvmedirect.system import SystemView, UsageIndex, assess, list_controllers, resolve_target
from nvmedirect.system.devices import TargetError
from nvmedirect.system.safety import BOOT, FREE, IN_USE, NO_DRIVER, OTHER_DRIVER, VFIO

A, B = "0000:00:04.0", "0000:00:05.0"


def verdicts(fake) -> dict:
    view = SystemView(fake.root)
    usage = UsageIndex(view)
    return {c.bdf: assess(c, usage) for c in list_controllers(view)}


def test_free_controller_and_its_details(fake):
    fake.nvme(A, "nvme0", {"nvme0n1": ["nvme0n1p1"]})
    fake.pci("0000:00:02.0", pci_class="0x030000", driver=None)  # a GPU: not listed
    [ctrl] = list_controllers(SystemView(fake.root))
    assert (ctrl.bdf, ctrl.name, ctrl.model, ctrl.driver) == (A, "nvme0", "QEMU NVMe Ctrl", "nvme")
    assert ctrl.namespaces[0].name == "nvme0n1"
    assert ctrl.namespaces[0].size_bytes == 2097152 * 512
    assert ctrl.namespaces[0].partitions == ["nvme0n1p1"]
    assert verdicts(fake)[A].state == FREE


@pytest.mark.parametrize("point", ["/", "/boot", "/boot/efi"])
def test_boot_filesystem_is_boot(fake, point):
    fake.nvme(A, "nvme0", {"nvme0n1": ["nvme0n1p1", "nvme0n1p2"]})
    fake.mount("nvme0n1p2", point)
    verdict = verdicts(fake)[A]
    assert verdict.state == BOOT and not verdict.may_bind
    assert any(f"mounted at {point}" in r for r in verdict.reasons)


def test_root_through_dev_root_alias_is_found_by_device_number(fake):
    fake.nvme(A, "nvme0", {"nvme0n1": []})
    fake.mount("nvme0n1", "/", source="/dev/root")
    assert verdicts(fake)[A].state == BOOT


def test_root_named_on_kernel_command_line(fake):
    fake.nvme(A, "nvme0", {"nvme0n1": ["nvme0n1p1"]})
    fake.write("proc/cmdline", "root=/dev/nvme0n1p1 ro\n")
    assert verdicts(fake)[A].state == BOOT


def test_mounted_partition_refuses_only_its_controller(fake):
    fake.nvme(A, "nvme0", {"nvme0n1": ["nvme0n1p1"]})
    fake.nvme(B, "nvme1", {"nvme1n1": []}, serial="fake0002")
    fake.mount("nvme0n1p1", "/data")
    got = verdicts(fake)
    assert got[A].state == IN_USE and "nvme0n1p1: mounted at /data (ext4)" in got[A].reasons
    assert got[B].state == FREE


def test_mount_point_with_space_is_unescaped(fake):
    fake.nvme(A, "nvme0", {"nvme0n1": []})
    fake.mount("nvme0n1", "/my\\040data")
    assert "nvme0n1: mounted at /my data (ext4)" in verdicts(fake)[A].reasons


def test_swap_on_namespace(fake):
    fake.nvme(A, "nvme0", {"nvme0n1": []})
    fake.swap("/dev/nvme0n1")
    assert verdicts(fake)[A].reasons == ["nvme0n1: active swap"]


@pytest.mark.parametrize("uuid,kind", [("LVM-abc", "LVM volume"), ("CRYPT-LUKS2-x", "dm-crypt mapping"),
                                       ("", "device-mapper target")])
def test_device_mapper_holders(fake, uuid, kind):
    fake.nvme(A, "nvme0", {"nvme0n1": ["nvme0n1p1"]})
    fake.dm("dm-0", "vg-data", uuid, over=["nvme0n1p1"])
    verdict = verdicts(fake)[A]
    assert verdict.state == IN_USE
    assert verdict.reasons == [f"nvme0n1p1: held by {kind} vg-data (dm-0)"]


def test_md_member(fake):
    fake.nvme(A, "nvme0", {"nvme0n1": []})
    fake.md("md0", over=["nvme0n1"])
    assert verdicts(fake)[A].reasons == ["nvme0n1: member of MD RAID md0"]


def test_root_on_lvm_on_nvme_is_boot(fake):
    fake.nvme(A, "nvme0", {"nvme0n1": ["nvme0n1p1", "nvme0n1p2"]})
    fake.dm("dm-0", "vg-root", "LVM-xyz", over=["nvme0n1p2"])
    fake.mount("dm-0", "/", source="/dev/mapper/vg-root")
    verdict = verdicts(fake)[A]
    assert verdict.state == BOOT
    assert "nvme0n1p2: via dm-0: mounted at / (ext4)" in verdict.reasons


def test_swap_on_dm_crypt_named_by_mapper_path(fake):
    fake.nvme(A, "nvme0", {"nvme0n1": []})
    fake.dm("dm-1", "cryptswap", "CRYPT-PLAIN-z", over=["nvme0n1"])
    fake.swap("/dev/mapper/cryptswap")
    assert "nvme0n1: via dm-1: active swap" in verdicts(fake)[A].reasons


def test_btrfs_member_not_named_in_mount_table(fake):
    fake.nvme(A, "nvme0", {"nvme0n1": []})
    (fake.root / "sys/fs/btrfs/1234-uuid/devices/nvme0n1").mkdir(parents=True)
    assert verdicts(fake)[A].reasons == ["nvme0n1: member of mounted btrfs 1234-uuid"]


def test_open_by_process(fake):
    fake.nvme(A, "nvme0", {"nvme0n1": []})
    fake.open_by(4242, "dd", "/dev/nvme0n1")
    assert verdicts(fake)[A].reasons == ["nvme0n1: open by pid 4242 (dd)"]


def test_multipath_head_disk_is_found(fake):
    fake.nvme(A, "nvme0", {"nvme0n1": []}, multipath=True)
    fake.mount("nvme0n1", "/srv")
    [ctrl] = list_controllers(SystemView(fake.root))
    assert ctrl.block_devices == ["nvme0n1"]
    assert verdicts(fake)[A].state == IN_USE


def test_driver_states(fake):
    fake.nvme(A, "nvme0", {}, driver="vfio-pci")
    fake.pci(B, driver=None)
    fake.pci("0000:00:06.0", driver="uio_pci_generic")
    got = verdicts(fake)
    assert got[A].state == VFIO and got[A].may_bind is False and not got[A].refused
    assert got[B].state == NO_DRIVER and got[B].may_bind
    assert got["0000:00:06.0"].state == OTHER_DRIVER and got["0000:00:06.0"].refused


def test_resolve_target_forms(fake):
    fake.nvme(A, "nvme0", {"nvme0n1": ["nvme0n1p1"]})
    view = SystemView(fake.root)
    for text in (A, "00:04.0", "nvme0", "/dev/nvme0", "/dev/nvme0n1", "nvme0n1p1"):
        assert resolve_target(view, text) == A, text
    assert resolve_target(view, "/dev/nvme3n1", remembered={B: ["nvme3", "nvme3n1"]}) == B
    with pytest.raises(TargetError, match="no PCI device"):
        resolve_target(view, "0000:09:00.0")
    with pytest.raises(TargetError, match="neither a PCI address"):
        resolve_target(view, "/dev/sda")
    with pytest.raises(TargetError, match="no NVMe controller owns"):
        resolve_target(view, "/dev/nvme7n1")
    fake.pci("0000:00:02.0", pci_class="0x030000", driver=None)
    with pytest.raises(TargetError, match="not an NVMe controller"):
        resolve_target(view, "0000:00:02.0")
