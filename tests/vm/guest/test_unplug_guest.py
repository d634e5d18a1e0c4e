"""Inside the VM: `ntransformer --streaming --tier-c nvme` reading a model stored on a vfio-bound
controller when the controller is hot-unplugged (device_del) or its drive is removed (drive_del)
partway through. Driven by tests/vm/test_unplug.py (issue 29, defects 9 and 10)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import vmguest

MODEL = Path(os.environ.get("NVD_UNPLUG_MODEL", "/nonexistent"))
HUGE_PAGES = 64  # no-IOMMU: contiguous DMA for the reader's rings and staging


@pytest.fixture(scope="module", autouse=True)
def huge_pages() -> None:
    Path("/proc/sys/vm/nr_hugepages").write_text(str(HUGE_PAGES))


def dmesg() -> str:
    return subprocess.run(["dmesg"], capture_output=True, text=True, timeout=30).stdout


def start_generating(bdf: str) -> subprocess.Popen:
    """ntransformer's benchmark on the streamed model (it decodes -n tokens whatever it draws, so
    the run cannot end early), returned once its plan is printed: it reads tier C from then on."""
    cmd = [sys.executable, "-c", "from infer.cli import main; main()", "-m", str(MODEL), "--streaming",
           "--tier-c", "nvme", "--nvme-device", bdf, "--device", "cpu", "--benchmark", "-n", "4000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    lines: list[str] = []
    seen = threading.Event()

    def read_stderr() -> None:
        for line in proc.stderr:  # type: ignore[union-attr]
            lines.append(line)
            if "staged read (nvme)" in line:
                seen.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    assert seen.wait(300), f"no plan with tier C on the device: {''.join(lines)}"
    time.sleep(3)  # well into the passes
    assert proc.poll() is None, "".join(lines)
    proc.stderr_lines, proc.stderr_reader = lines, reader  # type: ignore[attr-defined]
    return proc


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    began = time.monotonic()
    rc = proc.wait(timeout=timeout)
    proc.stderr_reader.join(timeout=30)  # type: ignore[attr-defined]
    print(f"exited {rc} after {time.monotonic() - began:.1f} s")
    return rc, "".join(proc.stderr_lines)  # type: ignore[attr-defined]


def one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr[-4000:]
    errors = [line for line in stderr.splitlines() if line.startswith("Error")]
    assert len(errors) == 1, stderr[-4000:]
    return errors[0]


def test_a_hot_unplug_while_generating_releases_the_device_and_is_one_line(controllers):
    """device_del: pciehp asks vfio-pci to remove the device, which relays the request to the
    driver's eventfd; the reader stops, releases the controller, the removal completes while the
    process still runs, and the run ends with one line and exit code 1."""
    info = controllers["nvd-unplug-req"]
    bdf, device = info["bdf"], Path("/sys/bus/pci/devices") / info["bdf"]
    qemu_id = next(c["qemu_id"] for c in vmguest.vm_config()["controllers"] if c["serial"] == "nvd-unplug-req")
    vmguest.bind(bdf, "vfio-pci")
    proc = start_generating(bdf)
    try:
        vmguest.qmp_request("device_del", {"id": qemu_id})
        deadline = time.monotonic() + 120  # pciehp waits 5 s after the attention button, then removes
        while device.exists():
            assert time.monotonic() < deadline, f"{bdf} still present 120 s after the request:\n{dmesg()[-3000:]}"
            time.sleep(0.2)
        rc, stderr = finish(proc, 120)
    finally:
        proc.kill()
    line = one_error_line(stderr)
    print(line)
    assert rc == 1, stderr[-3000:]
    assert line == (f"Error: tier C read failed: {bdf} nsid 1: the kernel asked for the device back (hot-unplug "
                    "or unbind): reads stopped and the device was released"), line
    log = dmesg()
    assert "No device request channel registered" not in log, log[-3000:]
    assert "Relaying device request to user" in log, log[-3000:]


def test_a_drive_removed_while_generating_is_one_line_naming_the_lbas(controllers, noiommu):
    """drive_del: the controller stays, its namespace's reads fail (QEMU: Unrecovered Read Error);
    the run ends with one line naming the device and the LBAs, exit code 1, and the controller is
    released: a new owner can open it at once."""
    from nvmedirect.nvme.controller import Controller

    info = controllers["nvd-unplug-drive"]
    bdf = info["bdf"]
    qemu_id = next(c["qemu_id"] for c in vmguest.vm_config()["controllers"] if c["serial"] == "nvd-unplug-drive")
    vmguest.bind(bdf, "vfio-pci")
    proc = start_generating(bdf)
    try:
        vmguest.qmp_request("human-monitor-command", {"command-line": f"drive_del {qemu_id}n1"})
        rc, stderr = finish(proc, 300)
    finally:
        proc.kill()
    line = one_error_line(stderr)
    print(line)
    assert rc == 1, stderr[-3000:]
    assert line.startswith(f"Error: tier C read failed: {bdf} nsid 1: NVMe read of LBAs "), line
    assert "ERROR status: " in line, line
    with Controller.open(bdf, noiommu=noiommu, io_queues=1) as ctrl:  # released: it opens again
        assert ctrl.info.serial == "nvd-unplug-drive"
