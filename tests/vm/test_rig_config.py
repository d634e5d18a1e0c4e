"""The rig's host-side logic without booting: QEMU command lines, spec validation, result parsing."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from rig import MIB, NamespaceSpec, NvmeSpec, Vm, VmConfig, VmResult, assets_problem, controller_bdf
from rig_pytest import GuestPytestResult, GuestTest, parse_junit


def device_args(argv: list[str], kind: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-device" and argv[i + 1].startswith(kind)]


def append_line(argv: list[str]) -> str:
    return argv[argv.index("-append") + 1]


def test_iommu_mode_puts_intel_iommu_before_every_pci_device(tmp_path):
    with Vm(VmConfig(iommu=True), tmp_path) as vm:
        argv = vm.command_line()
    devices = [argv[i + 1] for i, a in enumerate(argv) if a == "-device"]
    first_pci = next(i for i, d in enumerate(devices) if d.startswith(("virtio-9p-pci", "pcie-root-port")))
    assert devices.index("intel-iommu,intremap=on,caching-mode=on") < first_pci
    assert "q35,kernel-irqchip=split" in argv
    assert "intel_iommu=on" in append_line(argv).split()
    assert "nvd.mode=iommu" in append_line(argv).split()


def test_noiommu_mode_has_no_iommu(tmp_path):
    with Vm(VmConfig(iommu=False), tmp_path) as vm:
        argv = vm.command_line()
    assert not device_args(argv, "intel-iommu")
    assert "q35" in argv
    assert "intel_iommu=on" not in append_line(argv)
    assert "nvd.mode=noiommu" in append_line(argv).split()


def test_controllers_get_their_own_root_port_and_options(tmp_path):
    config = VmConfig(controllers=[
        NvmeSpec("a"),
        NvmeSpec("b", size=8 * MIB, logical_block_size=4096, mdts=3, max_ioqpairs=2,
                 extra_namespaces=[NamespaceSpec(size=MIB)], options={"msix_qsize": "8"}),
    ])
    with Vm(config, tmp_path) as vm:
        argv = vm.command_line()
    ports = device_args(argv, "pcie-root-port")
    assert ports == ["pcie-root-port,id=rp0,bus=pcie.0,addr=0x10,chassis=1",
                     "pcie-root-port,id=rp1,bus=pcie.0,addr=0x11,chassis=2"]
    nvme = device_args(argv, "nvme,")
    assert nvme[0] == "nvme,id=nvme0,bus=rp0,serial=a"
    assert nvme[1] == "nvme,id=nvme1,bus=rp1,serial=b,mdts=3,max_ioqpairs=2,msix_qsize=8"
    namespaces = device_args(argv, "nvme-ns")
    assert namespaces[1] == "nvme-ns,drive=nvme1n1,bus=nvme1,nsid=1,logical_block_size=4096,physical_block_size=4096"
    assert namespaces[2].startswith("nvme-ns,drive=nvme1n2,bus=nvme1,nsid=2,logical_block_size=512")
    assert (tmp_path / "nvme1n1.img").stat().st_size == 8 * MIB
    assert (tmp_path / "nvme1n2.img").stat().st_size == MIB
    assert "nvd.nctrl=2" in append_line(argv).split()
    assert [controller_bdf(i) for i in range(2)] == ["0000:01:00.0", "0000:02:00.0"]


def test_prefilled_image_is_used_in_place(tmp_path):
    image = tmp_path / "data.img"
    image.write_bytes(b"\x5a" * 4096 * 3)
    spec = NvmeSpec("img", image=image)
    assert spec.namespaces[0].size == 4096 * 3
    with Vm(VmConfig(controllers=[spec]), tmp_path) as vm:
        argv = vm.command_line()
    assert f"file={image},if=none,id=nvme0n1,format=raw" in argv


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"serial": "a,b"}, "without commas"),
    ({"serial": ""}, "non-empty"),
    ({"serial": "s" * 21}, "20 bytes"),
    ({"serial": "a", "logical_block_size": 1024}, "512 or 4096"),
    ({"serial": "a", "size": 1000}, "multiple of 512"),
    ({"serial": "a", "image": "/nonexistent/image"}, "does not exist"),
])
def test_bad_specs_are_refused_with_a_reason(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NvmeSpec(**kwargs)


def test_duplicate_serials_are_refused():
    with pytest.raises(ValueError, match="unique"):
        VmConfig(controllers=[NvmeSpec("x"), NvmeSpec("x")])


def test_controller_count_stops_below_the_lpc_bridge_slot(tmp_path):
    full = VmConfig(controllers=[NvmeSpec(f"nvd-many-{i}") for i in range(15)])
    with Vm(full, tmp_path) as vm:
        ports = device_args(vm.command_line(), "pcie-root-port")
    assert ports[-1].split("addr=")[1].split(",")[0] == "0x1e"  # 0x1f is q35's ICH9 LPC bridge
    with pytest.raises(ValueError, match="at most 15 NVMe controllers"):
        VmConfig(controllers=[NvmeSpec(f"nvd-many-{i}") for i in range(16)])


def test_missing_assets_say_how_to_build_them(tmp_path, monkeypatch):
    monkeypatch.setenv("NVMEDIRECT_VM_ASSETS", str(tmp_path))
    assert "scripts/deps/20-vm.sh" in assets_problem()


def run_real_pytest(tmp_path, body: str) -> GuestPytestResult:
    """Produce genuine JUnit XML from a real pytest run, as the guest would."""
    (tmp_path / "test_sample.py").write_text(textwrap.dedent(body))
    junit = tmp_path / "junit.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--rootdir={tmp_path}",
                           f"--junitxml={junit}", str(tmp_path / "test_sample.py")], capture_output=True, cwd=tmp_path)
    vm = VmResult(rc=proc.returncode, console=proc.stdout.decode(), results_dir=tmp_path, run_dir=tmp_path, elapsed=1)
    return GuestPytestResult(vm, parse_junit(junit))


def test_guest_results_name_each_failure(tmp_path):
    result = run_real_pytest(tmp_path, """
        import pytest
        def test_good(): pass
        def test_bad(): assert 1 + 1 == 3, "arithmetic is off"
        @pytest.mark.skip(reason="not here")
        def test_skipped(): pass
    """)
    assert {t.nodeid.rsplit("::", 1)[-1]: t.outcome for t in result.tests} == {
        "test_good": "passed", "test_bad": "failed", "test_skipped": "skipped"}
    assert result.outcome("test_bad") == "failed"
    with pytest.raises(AssertionError, match=r"test_bad FAILED: .*arithmetic is off"):
        result.assert_passed()


def test_guest_skips_fail_unless_allowed(tmp_path):
    result = run_real_pytest(tmp_path, """
        import pytest
        def test_good(): pass
        @pytest.mark.skip(reason="no device")
        def test_skipped(): pass
    """)
    with pytest.raises(AssertionError, match="test_skipped SKIPPED: no device"):
        result.assert_passed()
    result.assert_passed(allow_skips=True)


def test_a_session_without_results_fails(tmp_path):
    vm = VmResult(rc=None, console="kernel panic", results_dir=tmp_path, run_dir=tmp_path, elapsed=1,
                  failure="the guest stopped without reporting the job's exit code (kernel panic?)")
    with pytest.raises(AssertionError, match="did not finish: the guest stopped"):
        GuestPytestResult(vm, []).assert_passed()


def test_a_shared_session_is_judged_per_part(tmp_path):
    """shared_boot's parts: each host test sees only its own guest modules' outcomes."""
    vm = VmResult(rc=1, console="", results_dir=tmp_path, run_dir=tmp_path, elapsed=1)
    whole = GuestPytestResult(vm, [
        GuestTest("tests.vm.guest.test_a_guest::test_one", "passed", "", 0.1),
        GuestTest("tests.vm.guest.x.test_b_guest::test_two", "failed", "boom", 0.1),
    ])
    part_a = whole.select(["tests.vm.guest.test_a_guest"])
    assert [t.nodeid for t in part_a.tests] == ["tests.vm.guest.test_a_guest::test_one"]
    part_a.assert_passed()  # pytest's exit code 1 is the other part's failure
    with pytest.raises(AssertionError, match="test_two FAILED: boom"):
        whole.select(["tests.vm.guest.x.test_b_guest"]).assert_passed()
    with pytest.raises(AssertionError, match="no guest test ran"):
        whole.select(["tests.vm.guest.test_c_guest"]).assert_passed()
    # Every test passed yet pytest failed (e.g. an error outside any test): every part fails.
    clean = GuestPytestResult(vm, whole.tests[:1])
    with pytest.raises(AssertionError, match="pytest exited 1 although every test passed"):
        clean.select(["tests.vm.guest.test_a_guest"]).assert_passed()
    finished_early = VmResult(rc=None, console="", results_dir=tmp_path, run_dir=tmp_path, elapsed=1,
                              failure="the VM was killed after the 2400 s timeout")
    with pytest.raises(AssertionError, match="did not finish"):
        GuestPytestResult(finished_early, whole.tests[:1]).select(["tests.vm.guest.test_a_guest"]).assert_passed()


def test_shared_boot_names_guest_modules_as_junit_does():
    from shared_boot import guest_module_name

    assert guest_module_name("tests/vm/guest/driver/test_driver_guest.py") == "tests.vm.guest.driver.test_driver_guest"
