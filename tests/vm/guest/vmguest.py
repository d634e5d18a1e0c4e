"""Guest-side helpers: what the rig tells the guest, driver rebinding, and QMP requests to the host.

Runs inside the VM only (as root, the host's root mounted read-only, /run/vm/results writable).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

SYSFS_PCI = Path("/sys/bus/pci")


def results_dir() -> Path:
    return Path(os.environ["NVMEDIRECT_VM_RESULTS"])


def vm_config() -> dict[str, Any]:
    """The host's description of this VM (mode, each controller's options and expected BDF)."""
    return json.loads(Path(os.environ["NVMEDIRECT_VM_CONFIG"]).read_text())


def controllers() -> dict[str, dict[str, Any]]:
    """serial -> {bdf, controller, model, namespaces}, as the guest kernel found them at boot."""
    return json.loads(Path(os.environ["NVMEDIRECT_VM_CONTROLLERS"]).read_text())


def vm_mode() -> str:
    return os.environ["NVMEDIRECT_VM_MODE"]


def current_driver(bdf: str) -> str | None:
    """The driver bound to `bdf` now. The link can vanish between looking and reading (an unbind
    racing this call), so a missing link at either moment means no driver."""
    try:
        return os.path.basename(os.readlink(SYSFS_PCI / "devices" / bdf / "driver"))
    except FileNotFoundError:
        return None


def bind(bdf: str, driver: str, timeout: float = 10.0) -> None:
    """Move `bdf` to `driver` (unbind, driver_override, drivers_probe); wait until it is bound."""
    device = SYSFS_PCI / "devices" / bdf
    if current_driver(bdf) == driver:
        return
    if current_driver(bdf) is not None:
        (device / "driver" / "unbind").write_text(bdf)
    (device / "driver_override").write_text(driver)
    (SYSFS_PCI / "drivers_probe").write_text(bdf)
    deadline = time.monotonic() + timeout
    while current_driver(bdf) != driver:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{bdf} did not bind to {driver} within {timeout} s "
                               f"(bound to {current_driver(bdf)})")
        time.sleep(0.05)


def restore_kernel_driver(bdf: str, timeout: float = 30.0) -> None:
    """Give `bdf` back to the kernel's nvme driver (clears the override) and wait until the
    controller is live again, so the next test finds it as the boot left it."""
    device = SYSFS_PCI / "devices" / bdf
    if current_driver(bdf) not in (None, "nvme"):
        (device / "driver" / "unbind").write_text(bdf)
    (device / "driver_override").write_text("\n")
    if current_driver(bdf) is None:
        (SYSFS_PCI / "drivers_probe").write_text(bdf)
    deadline = time.monotonic() + timeout
    while not any(state.read_text().strip() == "live" for state in device.glob("nvme/nvme*/state")):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{bdf} did not come back live under nvme within {timeout} s")
        time.sleep(0.05)


def qmp_request(command: str, arguments: dict[str, Any] | None = None, resume_after: float | None = None,
                timeout: float = 60.0) -> Any:
    """Ask the host to run a QMP command on this VM; return its result or raise RuntimeError.

    With `resume_after`, the host sends `cont` that many seconds after the command (for `stop`)."""
    requests = results_dir() / "qmp-requests"
    name = uuid.uuid4().hex
    message: dict[str, Any] = {"execute": command, "arguments": arguments or {}}
    if resume_after is not None:
        message["resume_after"] = resume_after
    tmp = requests / f"{name}.tmp"
    tmp.write_text(json.dumps(message))
    tmp.rename(requests / f"{name}.json")
    reply_path = requests / f"{name}.reply.json"
    deadline = time.monotonic() + timeout
    while not reply_path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the host did not answer QMP request {command} within {timeout} s")
        time.sleep(0.05)
    reply = json.loads(reply_path.read_text())
    if "error" in reply:
        raise RuntimeError(f"QMP {command} failed on the host: {reply['error']}")
    return reply["return"]
