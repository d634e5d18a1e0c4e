"""`nvmedirect list/check/bind/restore` against real QEMU NVMe controllers in the guest kernel.

One boot runs this whole module, in order: stacks are built on the controllers first (a mounted
ext4, swap, LVM, MD RAID), then every command is checked against them, and the last test unloads
vfio to see `check` and `bind` without it, so this module runs last in a boot it shares with other
guest modules (tests/vm/shared_boot.py); it touches only its own controllers (serials sys-*).
Runs inside the VM only (tests/vm/test_system.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from vmguest import current_driver as driver

from nvmedirect.cli import main

SAMPLE = 4 << 20  # bytes compared before bind and after restore
MOUNT_POINT = "/tmp/nvd-sys-mnt"
STATE = Path("/run/nvmedirect/bound.json")
# No udev in the guest: LVM and device-mapper must make their own device nodes; /etc is read-only
# (the host's root over 9p), so LVM must not write its metadata backups there.
LVM_CONFIG = ("activation { udev_sync = 0 udev_rules = 0 } devices { obtain_device_list_from_udev = 0 "
              "use_devicesfile = 0 } backup { backup = 0 archive = 0 }")
ENV = {**os.environ, "DM_DISABLE_UDEV": "1", "MDADM_NO_UDEV": "1"}


def sh(*argv: str, ok: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=ENV)
    if ok and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stdout}{proc.stderr}")
    return proc


def cli(*args: str) -> subprocess.CompletedProcess:
    """Run a command in this process (a Python start costs seconds in a TCG guest)."""
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)


def cli_process(*args: str) -> subprocess.CompletedProcess:
    """Run the installed `nvmedirect` as its own process (signals, other processes' open files)."""
    return subprocess.run(["nvmedirect", *args], capture_output=True, text=True, timeout=180, env=ENV)


def digest(path: str, size: int = SAMPLE) -> str:
    with open(path, "rb", buffering=0) as dev:
        return hashlib.sha256(dev.read(size)).hexdigest()


def namespace_of(bdf: str) -> str | None:
    """The block device the kernel shows for controller `bdf` now (names can change on re-probe)."""
    if driver(bdf) != "nvme":
        return None
    for ctrl in os.listdir(f"/sys/bus/pci/devices/{bdf}/nvme"):
        for entry in sorted(os.listdir(f"/sys/class/nvme/{ctrl}")):
            path_disk = re.fullmatch(r"nvme(\d+)c\d+n(\d+)", entry)  # native multipath: head disk
            name = f"nvme{path_disk[1]}n{path_disk[2]}" if path_disk else entry
            if re.fullmatch(r"nvme\d+n\d+", name) and os.path.exists(f"/sys/block/{name}"):
                return name
    return None


def wait_for(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def dev(controllers) -> dict[str, dict]:
    """role -> {bdf, ns} for the five controllers the host configured (serials sys-<role>)."""
    return {serial.removeprefix("sys-"): {"bdf": c["bdf"], "ns": c["namespaces"][0]}
            for serial, c in controllers.items() if serial.startswith("sys-")}


@pytest.fixture(scope="module")
def stacks(dev):
    """Put each controller to use the way a real system would."""
    os.makedirs(MOUNT_POINT, exist_ok=True)
    os.makedirs("/run/lock/lvm", exist_ok=True)
    sh("mount", "-t", "ext4", f"/dev/{dev['mounted']['ns']}", MOUNT_POINT)
    sh("mkswap", "-f", f"/dev/{dev['swap']['ns']}")
    sh("swapon", f"/dev/{dev['swap']['ns']}")
    lvm = ["--config", LVM_CONFIG]
    sh("lvm", "pvcreate", "-ff", "-y", *lvm, f"/dev/{dev['lvm']['ns']}")
    sh("lvm", "vgcreate", *lvm, "nvdvg", f"/dev/{dev['lvm']['ns']}")
    sh("lvm", "lvcreate", *lvm, "-y", "-Zn", "-L", "8M", "-n", "lv", "nvdvg")
    sh("mdadm", "--create", "/dev/md0", "--run", "--force", "--level=1", "--raid-devices=2",
       "--metadata=1.2", f"/dev/{dev['md']['ns']}", "missing")
    yield
    sh("mdadm", "--stop", "/dev/md0", ok=False)
    sh("lvm", "vgchange", *lvm, "-an", "nvdvg", ok=False)
    sh("swapoff", f"/dev/{dev['swap']['ns']}", ok=False)
    sh("umount", MOUNT_POINT, ok=False)


def listing() -> dict[str, dict]:
    proc = cli("list", "--json")
    assert proc.returncode == 0, proc.stderr
    return {row["bdf"]: row for row in json.loads(proc.stdout)}


def test_list_verdicts(dev, stacks):
    rows = listing()
    assert rows[dev["free"]["bdf"]]["verdict"]["state"] == "free"
    assert rows[dev["free"]["bdf"]]["model"] == "QEMU NVMe Ctrl"
    assert rows[dev["free"]["bdf"]]["serial"] == "sys-free"
    expected = {
        "mounted": f"{dev['mounted']['ns']}: mounted at {MOUNT_POINT} (ext4)",
        "swap": f"{dev['swap']['ns']}: active swap",
        "lvm": f"{dev['lvm']['ns']}: held by LVM volume nvdvg-lv",
        "md": f"{dev['md']['ns']}: member of MD RAID md0",
    }
    for role, reason in expected.items():
        verdict = rows[dev[role]["bdf"]]["verdict"]
        assert verdict["state"] == "in-use", (role, verdict)
        assert any(r.startswith(reason) for r in verdict["reasons"]), (role, verdict["reasons"])
    human = cli_process("list").stdout  # the installed command, once
    assert "sys-free" in human and f"mounted at {MOUNT_POINT}" in human


@pytest.mark.parametrize("role,word", [("mounted", "mounted at"), ("swap", "active swap"),
                                       ("lvm", "LVM volume nvdvg-lv"), ("md", "MD RAID md0")])
def test_bind_refuses_controllers_in_use(dev, stacks, role, word):
    for target in (dev[role]["bdf"], f"/dev/{dev[role]['ns']}"):
        proc = cli("bind", "--yes", target)
        assert proc.returncode == 3, proc.stdout + proc.stderr
        assert "refused:" in proc.stderr and word in proc.stderr
    asked = cli("bind", dev[role]["bdf"])  # without --yes: refused before any question (no input here)
    assert asked.returncode == 3 and "Take" not in asked.stdout + asked.stderr and word in asked.stderr
    assert driver(dev[role]["bdf"]) == "nvme"
    assert dev[role]["bdf"] not in (json.loads(STATE.read_text()) if STATE.exists() else {})


def test_bind_refuses_the_boot_device(dev, stacks):
    sh("mount", "-t", "ext4", f"/dev/{dev['mounted']['ns']}", "/boot")
    try:
        proc = cli("bind", "--yes", f"/dev/{dev['mounted']['ns']}")
        assert proc.returncode == 3 and "boot device (never bound)" in proc.stderr, proc.stderr
        assert listing()[dev["mounted"]["bdf"]]["verdict"]["state"] == "boot"
    finally:
        sh("umount", "/boot")
    assert driver(dev["mounted"]["bdf"]) == "nvme"


def test_check_with_vfio_loaded(dev, stacks, vm_mode):
    proc = cli("check", "--no-gpu", "--json")
    assert proc.returncode == 0, proc.stdout
    checks = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}
    assert checks["vfio"]["status"] == "ok"
    if vm_mode == "iommu":
        assert checks["iommu"]["status"] == "ok" and "intel_iommu=on" in checks["iommu"]["detail"]
        assert checks["noiommu"]["detail"] in ("off", "not built into this kernel (CONFIG_VFIO_NOIOMMU)")
    else:
        assert checks["iommu"]["status"] == "warn" and "no-IOMMU mode is on" in checks["iommu"]["detail"]
        assert checks["noiommu"]["status"] == "warn"
    assert checks[f"nvme {dev['free']['bdf']}"]["status"] == "ok"
    for role in ("mounted", "swap", "lvm", "md"):
        assert checks[f"nvme {dev[role]['bdf']}"]["status"] == "warn", (role, checks[f"nvme {dev[role]['bdf']}"])
    # Controllers of the other guest modules sharing this boot are counted by their own verdicts.
    ours = {d["bdf"] for d in dev.values()}
    usable_others = sum(c["status"] == "ok" for name, c in checks.items()
                        if re.fullmatch(r"nvme \S+", name) and name.split()[1] not in ours)
    assert checks["nvme"]["detail"] == f"{1 + usable_others} controller(s) usable"


def test_bind_then_restore_round_trips(dev, stacks, vm_config):
    bdf, ns = dev["free"]["bdf"], dev["free"]["ns"]
    before = digest(f"/dev/{ns}")
    image = next(c["image"] for c in vm_config["controllers"] if c["serial"] == "sys-free")
    assert before == digest(image)  # the kernel reads the host's image

    proc = cli("bind", "--yes", "--json", f"/dev/{ns}")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["bdf"] == bdf and out["driver"] == "vfio-pci" and out["namespaces"] == [ns]
    assert any(n.startswith("controller answers through VFIO: power D0") for n in out["notes"]), out["notes"]
    assert driver(bdf) == "vfio-pci" and not os.path.exists(f"/sys/block/{ns}")
    assert json.loads(STATE.read_text())[bdf]["phase"] == "bound"

    row = listing()[bdf]
    assert row["verdict"]["state"] == "vfio" and row["remembered"]["namespaces"][0]["name"] == ns
    again = cli("bind", "--yes", "--json", bdf)
    assert again.returncode == 0 and json.loads(again.stdout)["already"] is True

    proc = cli("restore", "--json", f"/dev/{ns}")  # the old name still works, through the state file
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["driver"] == "nvme" and len(out["namespaces"]) == 1
    assert driver(bdf) == "nvme"
    assert Path(f"/sys/bus/pci/devices/{bdf}/driver_override").read_text().strip() == "(null)"
    assert digest(f"/dev/{out['namespaces'][0]}") == before
    assert bdf not in json.loads(STATE.read_text())


def test_bind_and_restore_wait_for_kernel_events_without_polling(dev, stacks, monkeypatch):
    """The waits for vfio-pci, for nvme's asynchronous probe and for the namespace to reappear end
    on the kernel's uevents (pyudev's Monitor), not in a sleep loop."""
    bdf = dev["free"]["bdf"]
    slept = []
    monkeypatch.setattr(time, "sleep", lambda seconds: slept.append(seconds))
    assert cli("bind", "--yes", bdf).returncode == 0 and driver(bdf) == "vfio-pci"
    proc = cli("restore", "--json", bdf)
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["namespaces"]) == 1 and driver(bdf) == "nvme"
    monkeypatch.undo()
    assert slept == []


def _start_bind_paused(bdf: str, pause: float) -> subprocess.Popen:
    proc = subprocess.Popen(["nvmedirect", "bind", "--yes", bdf], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**ENV, "NVMEDIRECT_TEST_CRITICAL_PAUSE": str(pause)})
    # unbound from nvme, not yet probed: the middle of the critical window
    wait_for(lambda: driver(bdf) is None, what="the unbind inside the critical window")
    return proc


def _back_on_nvme(bdf: str, proc: subprocess.Popen) -> None:
    """Whatever a failed test left behind, the next test starts from the kernel driver."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)
    if driver(bdf) != "nvme":
        cli("restore", bdf)


def test_ctrl_c_inside_the_window_still_ends_with_one_driver(dev, stacks):
    bdf = dev["free"]["bdf"]
    proc = _start_bind_paused(bdf, 2.0)
    try:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        err = proc.stderr.read()
        assert proc.returncode == 1 and "Aborted!" in err, err  # click's answer to the deferred Ctrl-C
        assert driver(bdf) == "vfio-pci"
        assert json.loads(STATE.read_text())[bdf]["phase"] == "bound"
        assert cli("restore", bdf).returncode == 0 and driver(bdf) == "nvme"
    finally:
        _back_on_nvme(bdf, proc)


def test_restore_recovers_after_the_tool_is_killed_mid_bind(dev, stacks):
    bdf = dev["free"]["bdf"]
    before = digest(f"/dev/{namespace_of(bdf)}")
    proc = _start_bind_paused(bdf, 5.0)
    try:
        proc.kill()  # SIGKILL cannot be held back: the device is left with no driver
        proc.wait(timeout=30)
        assert driver(bdf) is None
        assert json.loads(STATE.read_text())[bdf]["phase"] == "binding"
        assert listing()[bdf]["verdict"]["state"] == "no-driver"
        restored = cli("restore", "--json", bdf)
        assert restored.returncode == 0, restored.stderr
        assert driver(bdf) == "nvme" and digest(f"/dev/{namespace_of(bdf)}") == before
    finally:
        _back_on_nvme(bdf, proc)


def test_restore_is_refused_while_the_device_is_open_through_vfio(dev, stacks, noiommu):
    from nvmedirect.vfio import VfioDevice

    bdf = dev["free"]["bdf"]
    assert cli("bind", "--yes", bdf).returncode == 0
    with VfioDevice.open(bdf, noiommu=noiommu):
        proc = cli_process("restore", bdf)  # our own open files are not counted: another process
        assert proc.returncode == 3 and f"open through VFIO by pid {os.getpid()}" in proc.stderr, proc.stderr
        assert driver(bdf) == "vfio-pci"
    assert cli("restore", bdf).returncode == 0 and driver(bdf) == "nvme"


def test_setup_nvme_only_binds_and_rollback_restores(dev, stacks):
    """setup's runtime steps on the live system; its journal goes to /var/lib, which is the host's
    read-only root here, so a tmpfs covers /var/lib for this test."""
    sh("mount", "-t", "tmpfs", "tmpfs", "/var/lib")
    try:
        bdf = dev["free"]["bdf"]
        refused = cli("setup", "--nvme-only", "--bind", bdf, "--bind", dev["swap"]["bdf"], "--apply", "--yes")
        assert refused.returncode == 3 and "active swap" in refused.stderr and driver(bdf) == "nvme"
        plan = json.loads(cli("setup", "--nvme-only", "--bind", bdf, "--json").stdout)
        assert [(s["key"], s["status"]) for s in plan["steps"]] == [("load-vfio-now", "done"), ("bind", "todo")]
        applied = cli("setup", "--nvme-only", "--bind", bdf, "--apply", "--yes")
        assert applied.returncode == 0, applied.stderr
        assert driver(bdf) == "vfio-pci" and f"bound {bdf} to vfio-pci" in applied.stdout
        again = cli("setup", "--nvme-only", "--bind", bdf, "--apply", "--yes")
        assert again.returncode == 0 and "nothing to do" in again.stdout
        back = cli("setup", "--rollback", "--yes")
        assert back.returncode == 0 and f"restored {bdf} to nvme" in back.stdout, back.stdout + back.stderr
        assert driver(bdf) == "nvme" and namespace_of(bdf) is not None
        assert not os.path.exists("/var/lib/nvmedirect/setup-journal.json")
    finally:
        sh("umount", "/var/lib")


def test_check_and_bind_without_vfio_loaded(dev, stacks, vm_mode):
    """Last in the module: unloads vfio for the rest of this boot."""
    for module in ("vfio_pci", "vfio_pci_core", "vfio_iommu_type1", "vfio"):
        sh("rmmod", module, ok=False)
    assert not os.path.exists("/sys/bus/pci/drivers/vfio-pci")
    proc = cli("check", "--no-gpu", "--json")
    checks = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}
    assert checks["vfio"]["status"] == "warn" and "not loaded" in checks["vfio"]["detail"]
    assert checks["noiommu"]["status"] == "unknown", checks["noiommu"]
    if vm_mode == "iommu":
        assert proc.returncode == 0 and checks["iommu"]["status"] == "ok"
    else:
        assert proc.returncode == 4 and checks["iommu"]["status"] == "fail"
        assert "vfio is not loaded" in checks["iommu"]["detail"]
    bdf = dev["free"]["bdf"]
    bound = cli("bind", "--yes", bdf)
    assert bound.returncode == 1 and "vfio-pci driver is not loaded" in bound.stderr, bound.stderr
    assert driver(bdf) == "nvme" and bdf not in json.loads(STATE.read_text())
