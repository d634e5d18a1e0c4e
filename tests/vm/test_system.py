"""The system commands (list, check, bind, restore) against QEMU NVMe controllers in a real kernel,
in both VFIO modes: tests/vm/guest/system/test_system_guest.py runs in the boot each mode shares
with the rig and driver tests (tests/vm/shared_boot.py: system_part configures the controllers)."""

from __future__ import annotations

import pytest


@pytest.mark.vm
@pytest.mark.slow
def test_system_commands_in_guest(vm_mode, shared_boot):
    boot = shared_boot(vm_mode)
    result = boot.result("system")
    result.assert_passed()
    assert len(result.passed) == 14, result.summary()
    assert result.outcome("test_bind_and_restore_wait_for_kernel_events_without_polling") == "passed"
    part = boot.parts["system"]
    assert part.files["free"].read_bytes() == part.expected["free"]  # bind/restore wrote nothing
