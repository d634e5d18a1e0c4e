"""bind/restore logic on fake roots: refusals change nothing; a driver that never binds is rolled
back; signals are held back through the critical window. (The real kernel path is in tests/vm.)"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from click.testing import CliRunner

from nvmedirect.cli import main
from nvmedirect.system import SystemView
from nvmedirect.system.binding import BindFailed, bind, restore, signals_deferred
from nvmedirect.system.state import StateFile

A = "0000:00:04.0"


def bind_cli(fake, device: str):
    return CliRunner().invoke(main, ["bind", "--root", str(fake.root), "--yes", device])


def snapshot(root):
    return {str(p): p.read_bytes() for p in root.rglob("*") if p.is_file() and not p.is_symlink()}


@pytest.mark.parametrize("setup,word", [
    (lambda f: f.mount("nvme0n1p1", "/"), "boot device"),
    (lambda f: f.mount("nvme0n1p1", "/boot/efi", "vfat"), "boot device"),
    (lambda f: f.mount("nvme0n1p1", "/data"), "mounted at /data"),
    (lambda f: f.swap("/dev/nvme0n1p1"), "active swap"),
    (lambda f: f.dm("dm-0", "vg-lv", "LVM-x", over=["nvme0n1p1"]), "LVM volume vg-lv"),
    (lambda f: f.md("md127", over=["nvme0n1"]), "MD RAID md127"),
])
def test_bind_refuses_with_exit_3_and_changes_nothing(fake, setup, word):
    fake.nvme(A, "nvme0", {"nvme0n1": ["nvme0n1p1"]})
    setup(fake)
    before = snapshot(fake.root)
    for device in (A, "/dev/nvme0n1", "/dev/nvme0n1p1"):
        result = bind_cli(fake, device)
        assert result.exit_code == 3, result.output
        assert result.output.startswith("Error: refused: 0000:00:04.0") and word in result.output
    assert snapshot(fake.root) == before  # no state file, no sysfs write


def test_refusal_and_unknown_devices_come_before_the_question(fake):
    fake.nvme(A, "nvme0", {"nvme0n1": ["nvme0n1p1"]})
    fake.mount("nvme0n1p1", "/data")
    asked = CliRunner().invoke(main, ["bind", "--root", str(fake.root), A], input="y\n")
    assert asked.exit_code == 3 and "Take" not in asked.output and "mounted at /data" in asked.output
    missing = CliRunner().invoke(main, ["bind", "--root", str(fake.root), "0000:99:00.0"], input="y\n")
    assert missing.exit_code == 2 and "Take" not in missing.output


def test_json_without_yes_is_a_usage_error_and_changes_nothing(fake):
    _free_controller(fake)
    before = snapshot(fake.root)
    result = CliRunner().invoke(main, ["bind", "--root", str(fake.root), "--json", A])
    assert result.exit_code == 2 and "--yes" in result.output
    assert snapshot(fake.root) == before


def test_the_question_names_the_resolved_controller(fake):
    _free_controller(fake)
    result = CliRunner().invoke(main, ["bind", "--root", str(fake.root), "/dev/nvme0n1"], input="n\n")
    assert result.exit_code == 1 and f"Take {A}" in result.output and "nvme0n1" in result.output


def test_bad_device_name_is_a_usage_error(fake):
    assert bind_cli(fake, "/dev/sda").exit_code == 2
    assert bind_cli(fake, "0000:99:00.0").exit_code == 2


def _free_controller(fake):
    fake.nvme(A, "nvme0", {"nvme0n1": []})
    (fake.root / "sys/bus/pci/drivers/vfio-pci").mkdir()


def test_driver_that_never_binds_is_rolled_back(fake):
    _free_controller(fake)
    view = SystemView(fake.root)
    with pytest.raises(BindFailed, match="vfio-pci did not take the device.*given back to nvme"):
        bind(view, A, timeout_s=0.2)
    # a fake tree has no kernel behind it: the writes are all that can be checked
    assert (fake.root / f"sys/bus/pci/devices/{A}/driver_override").read_text() == "\n"
    assert (fake.root / "sys/bus/pci/drivers_probe").read_text() == A
    assert (fake.root / "sys/bus/pci/drivers/nvme/unbind").read_text() == A
    assert StateFile(view).load() == {}


def test_no_iommu_group_and_noiommu_off_fails_before_touching_the_device(fake):
    fake.nvme(A, "nvme0", {"nvme0n1": []})
    fake.pci(A, group=None)
    (fake.root / "sys/bus/pci/drivers/vfio-pci").mkdir()
    before = snapshot(fake.root)
    result = bind_cli(fake, A)
    assert result.exit_code == 1 and "no IOMMU group" in result.output and "nothing was changed" in result.output
    assert snapshot(fake.root) == before


def test_vfio_pci_missing_on_a_foreign_root_fails_cleanly(fake):
    fake.nvme(A, "nvme0", {"nvme0n1": []})
    result = bind_cli(fake, A)
    assert result.exit_code == 1 and "vfio-pci driver is not loaded" in result.output


def test_already_bound_is_reported_not_redone(fake):
    fake.nvme(A, "nvme0", {}, driver="vfio-pci")
    result = CliRunner().invoke(main, ["bind", "--root", str(fake.root), "--json", A])
    assert result.exit_code == 0 and json.loads(result.output)["already"] is True


def test_list_shows_remembered_namespaces_of_a_bound_controller(fake):
    fake.nvme(A, "nvme0", {}, driver="vfio-pci")
    StateFile(SystemView(fake.root)).put(A, {"original_driver": "nvme", "name": "nvme0", "model": "QEMU NVMe Ctrl",
                                             "serial": "s1", "namespaces": [{"name": "nvme0n1", "size_bytes": 10**9,
                                                                             "partitions": []}]})
    result = CliRunner().invoke(main, ["list", "--root", str(fake.root)])
    assert result.exit_code == 0
    assert "(nvme0)" in result.output and "nvme0n1" in result.output and "hidden while bound" in result.output
    assert "held nvme0n1 before bind" in result.output


def test_restore_finds_the_controller_by_its_old_name_and_keeps_vfio_when_nvme_does_not_bind(fake):
    fake.nvme(A, "nvme0", {}, driver="vfio-pci")
    view = SystemView(fake.root)
    StateFile(view).put(A, {"original_driver": "nvme", "name": "nvme0",
                            "namespaces": [{"name": "nvme0n1", "size_bytes": 1, "partitions": []}]})
    with pytest.raises(BindFailed, match="nvme did not take the device back.*left bound to vfio-pci"):
        restore(view, "/dev/nvme0n1", timeout_s=0.2)
    assert (fake.root / "sys/bus/pci/drivers/vfio-pci/unbind").read_text() == A
    assert (fake.root / f"sys/bus/pci/devices/{A}/driver_override").read_text() == "vfio-pci"
    assert StateFile(view).get(A)["phase"] == "bound"  # restore can be retried


def test_restore_refuses_while_a_process_has_the_vfio_group_open(fake):
    fake.nvme(A, "nvme0", {}, driver="vfio-pci")
    fake.open_by(777, "python3", "/dev/vfio/7")
    result = CliRunner().invoke(main, ["restore", "--root", str(fake.root), A])
    assert result.exit_code == 3 and "open through VFIO by pid 777 (python3)" in result.output


@pytest.fixture
def sigint_raises():
    """Python's own SIGINT handler for the test: a shell starts background jobs (`cmd &`, nohup) with
    SIGINT ignored, and Python then leaves it ignored, so no KeyboardInterrupt would ever come."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_signals_are_held_back_until_the_window_closes(sigint_raises):
    events = []
    try:
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            events.append("inside, not interrupted")
        events.append("after the window")
    except KeyboardInterrupt:
        events.append("interrupted")
    assert events == ["inside, not interrupted", "interrupted"]


def test_bind_after_an_interrupted_bind_keeps_the_original_record(fake):
    fake.pci(A, driver=None)  # what a SIGKILL inside the window leaves: no driver, override set
    fake.write(f"sys/bus/pci/devices/{A}/driver_override", "vfio-pci\n")
    (fake.root / "sys/bus/pci/drivers/vfio-pci").mkdir(parents=True, exist_ok=True)
    view = SystemView(fake.root)
    StateFile(view).put(A, {"original_driver": "nvme", "original_override": None, "name": "nvme0",
                            "namespaces": [{"name": "nvme0n1", "size_bytes": 1, "partitions": []}],
                            "phase": "binding"})
    with pytest.raises(BindFailed, match="left without a driver"):
        bind(view, A, timeout_s=0.2)
    record = StateFile(view).get(A)
    assert record["original_driver"] == "nvme" and record["original_override"] is None
    assert record["name"] == "nvme0" and record["phase"] == "unbound"


def test_a_signal_another_thread_receives_is_held_back_too(sigint_raises):
    """Process-directed signals may land on any thread that does not block them."""
    import threading

    events = []
    ready, sent = threading.Event(), threading.Event()

    def other_thread():  # does not block SIGINT, so the kernel may deliver it here
        ready.set()
        sent.wait(5)

    helper = threading.Thread(target=other_thread)
    helper.start()
    try:
        ready.wait(5)
        with signals_deferred():
            signal.pthread_kill(helper.ident, signal.SIGINT)  # force delivery to the other thread
            time.sleep(0.05)
            events.append("inside, not interrupted")
            sent.set()
        events.append("after the window")
    except KeyboardInterrupt:
        events.append("interrupted")
    helper.join()
    assert events == ["inside, not interrupted", "interrupted"]


def test_sigterm_is_delivered_once_after_the_window():
    received = []
    previous = signal.signal(signal.SIGTERM, lambda n, f: received.append(n))
    try:
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            assert received == []
        time.sleep(0.05)
        assert received == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)
