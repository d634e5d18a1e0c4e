"""The rig itself, end to end in both VFIO modes: two differently configured controllers at stable
addresses, a pre-filled namespace the guest kernel reads back, and BAR0 through nvmedirect.vfio.
Runs in the boot it shares with the driver and system tests (tests/vm/shared_boot.py: rig_part)."""

from __future__ import annotations

import pytest

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
def test_rig_in_guest(vm_mode, shared_boot):
    boot = shared_boot(vm_mode)
    result = boot.result("rig")
    result.assert_passed()
    passed = {t.nodeid.rsplit("::", 1)[-1] for t in result.passed}
    assert passed >= MUST_PASS, f"guest tests that did not run: {sorted(MUST_PASS - passed)}"
    part = boot.parts["rig"]
    assert part.files["prefilled"].read_bytes() == part.expected["prefilled"], "reading must not change the backing image"
