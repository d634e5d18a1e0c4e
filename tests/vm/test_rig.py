"""The rig itself, end to end in both VFIO modes: two differently configured controllers at stable
addresses, a pre-filled namespace the guest kernel reads back, and BAR0 through nvmedirect.vfio."""

from __future__ import annotations

import hashlib
import os

import pytest
from rig import MIB, NvmeSpec, VmConfig

GUEST_MODULE = "tests/vm/guest/test_rig_guest.py"
MUST_PASS = {
    "test_every_controller_at_its_configured_address",
    "test_vfio_modules_match_boot_mode",
    "test_kernel_reads_prefilled_image",
    "test_vfio_bar0_registers[nvd-rig-a]",
    "test_vfio_bar0_registers[nvd-rig-b]",
    "test_vfio_refuses_controller_still_on_nvme[nvd-rig-a]",
    "test_transfer_limit_follows_mdts[nvd-rig-b]",
    "test_io_queue_count_follows_max_ioqpairs[nvd-rig-b]",
    "test_namespace_geometry_follows_spec[nvd-rig-b]",
    "test_each_controller_has_its_own_vfio_group",
    "test_extra_virtio_disk_is_present",
}


@pytest.mark.vm
def test_rig_in_guest(vm_mode, guest_pytest, tmp_path):
    image = tmp_path / "prefilled.img"
    data = os.urandom(4 * MIB)
    image.write_bytes(data)
    extra_disk = tmp_path / "extra.img"
    extra_disk.write_bytes(bytes(3 * MIB))
    config = VmConfig(
        iommu=vm_mode == "iommu",
        controllers=[
            NvmeSpec("nvd-rig-a", image=image),
            NvmeSpec("nvd-rig-b", size=32 * MIB, logical_block_size=4096, mdts=3, max_ioqpairs=1),
        ],
        # A device QEMU places by itself must not move the controllers' addresses.
        qemu_args=["-drive", f"file={extra_disk},if=none,id=extra0,format=raw",
                   "-device", "virtio-blk-pci,drive=extra0,serial=nvd-extra"],
    )
    env = {"NVD_RIG_IMAGE_SHA256": hashlib.sha256(data).hexdigest(), "NVD_RIG_EXTRA_DISK_SIZE": str(3 * MIB)}
    result = guest_pytest(config, [GUEST_MODULE], env=env)
    result.assert_passed()
    passed = {t.nodeid.rsplit("::", 1)[-1] for t in result.passed}
    assert passed >= MUST_PASS, f"guest tests that did not run: {sorted(MUST_PASS - passed)}"
    assert image.read_bytes() == data, "reading must not change the backing image"
