"""Inside the VM: QMP reaches the host both ways (a guest request, a console marker). Driven by
tests/vm/test_rig_faults.py; tests/vm/shared_boot.py (faults_part) attaches the unplug action to
UNPLUG_MARKER. Runs right after the rig's module, while every controller is still on nvme."""

from __future__ import annotations

import time
from pathlib import Path

from vmguest import qmp_request, vm_config

UNPLUG_MARKER = "NVD-RIG-UNPLUG nvd-fault-b"


def test_guest_pauses_itself_through_the_host():
    assert qmp_request("query-status")["status"] == "running"
    before = time.time()
    assert qmp_request("stop", resume_after=1.0) == {}
    assert qmp_request("query-status")["status"] == "running"
    assert time.time() - before < 60


def test_guest_sees_qmp_errors():
    try:
        qmp_request("device_del", {"id": "no-such-device"})
    except RuntimeError as exc:
        assert "no-such-device" in str(exc)
    else:
        raise AssertionError("device_del of a missing device succeeded")


def test_host_unplugs_controller_on_console_marker(controllers):
    device = Path("/sys/bus/pci/devices") / controllers["nvd-fault-b"]["bdf"]
    assert device.exists()
    with open("/dev/console", "w") as console:
        console.write(UNPLUG_MARKER + "\n")
    deadline = time.monotonic() + 90  # pciehp waits 5 s after the attention button, then removes
    while device.exists():
        assert time.monotonic() < deadline, f"{device.name} still present 90 s after the unplug request"
        time.sleep(0.2)
    serials = {p.read_text().strip() for p in Path("/sys/class/nvme").glob("nvme*/serial")}
    assert "nvd-fault-a" in serials
    assert serials == {c["serial"] for c in vm_config()["controllers"]} - {"nvd-fault-b"}
