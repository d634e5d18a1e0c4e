"""The rig's failure paths and fault hooks: exit codes, timeouts, rig failures, QMP both ways."""

from __future__ import annotations

import os
import signal

import pytest
from rig import Vm, VmConfig, VmError, run_in_vm
from shared_boot import FAULTS_MODES, UNPLUG_SERIAL


@pytest.mark.vm
def test_job_exit_code_and_output_reach_the_host(vm_workdir):
    result = run_in_vm(VmConfig(iommu=False, controllers=[]), "echo rig-says-$((6 * 7)); exit 7",
                       vm_workdir, timeout=180)
    assert result.rc == 7, result.failure
    assert "rig-says-42" in result.console
    with pytest.raises(VmError, match="exited with 7"):
        result.check()


@pytest.mark.vm
def test_timeout_kills_qemu(vm_workdir):
    vm = Vm(VmConfig(controllers=[]), vm_workdir)
    vm.start("sleep 600")
    result = vm.wait(timeout=3)
    assert result.timed_out and result.rc is None
    with pytest.raises(ProcessLookupError):
        os.kill(vm.pid, 0)
    with pytest.raises(VmError, match="timeout"):
        result.check()


@pytest.mark.vm
def test_rig_failure_before_the_job_is_reported(vm_workdir):
    result = run_in_vm(VmConfig(controllers=[], kernel_args=["nvd.mode=bogus"]), "true", vm_workdir,
                       timeout=180)
    assert result.rc is None
    assert "failed before the job started" in result.failure
    assert "unknown nvd.mode=bogus" in result.failure


@pytest.mark.vm
@pytest.mark.parametrize("mode", FAULTS_MODES)
def test_qmp_from_guest_request_and_console_marker(mode, shared_boot):
    """Runs in the no-IOMMU boot the VM tests share (tests/vm/shared_boot.py: faults_part, whose
    console action unplugs nvd-fault-b with device_del and waits for QEMU's DEVICE_DELETED)."""
    boot = shared_boot(mode)
    result = boot.result("faults")
    result.assert_passed()
    assert boot.parts["faults"].record["unplugged"] == [UNPLUG_SERIAL], "no DEVICE_DELETED event for nvd-fault-b"
    assert len(result.passed) == 3


@pytest.mark.vm
def test_guest_kernel_panic_is_reported(vm_workdir):
    result = run_in_vm(VmConfig(iommu=False, controllers=[]), "echo c > /proc/sysrq-trigger; sleep 60",
                       vm_workdir, timeout=180)
    assert result.rc is None and not result.timed_out
    assert "the guest kernel panicked" in result.failure


@pytest.mark.vm
def test_qemu_dying_is_told_apart_from_a_guest_failure(vm_workdir):
    """QEMU 7.2's NVMe model can segfault (see test_controller_reset_fails_in_flight_commands_and_recovers);
    the report names the emulator's signal instead of blaming the guest. SIGKILL stands in for the
    segfault so no core file of the guest's memory is written."""
    result = run_in_vm(VmConfig(iommu=False, controllers=[]), "echo nvd-kill-qemu-now; sleep 60", vm_workdir,
                       timeout=180, on_console=[("nvd-kill-qemu-now", lambda vm: os.kill(vm.pid, signal.SIGKILL))])
    assert result.rc is None and not result.timed_out
    assert result.failure.startswith("QEMU itself died of SIGKILL"), result.failure
    assert result.emulator_signal == signal.SIGKILL
    assert "kernel log" in result.failure, result.failure  # its lines about QEMU, or why there are none
