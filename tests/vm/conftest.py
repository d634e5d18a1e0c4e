"""Fixtures for VM tests (host side). Guest-side tests live under tests/vm/guest/ and run only inside
the VM: on the host that folder is not collected (NVMEDIRECT_VM_GUEST marks the guest session).

    @pytest.mark.vm
    def test_x(vm_mode, guest_pytest):
        result = guest_pytest(VmConfig(iommu=vm_mode == "iommu"), ["tests/vm/guest/test_x_guest.py"])
        result.assert_passed()
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

IN_GUEST = os.environ.get("NVMEDIRECT_VM_GUEST") == "1"
collect_ignore = [] if IN_GUEST else ["guest"]

VFIO_MODES = ["iommu", "noiommu"]


def _vm_required() -> bool:
    return "vm" in {x.strip() for x in os.environ.get("NVMEDIRECT_REQUIRE", "").split(",")}


@pytest.fixture(scope="session")
def vm_assets() -> Path:
    """The kernel/initramfs directory; skips (or errors, under NVMEDIRECT_REQUIRE=vm) when missing."""
    from rig import assets_dir, assets_problem

    problem = assets_problem()
    if problem:
        if _vm_required():
            pytest.fail(problem, pytrace=False)
        pytest.skip(problem)
    return assets_dir()


@pytest.fixture(params=VFIO_MODES)
def vm_mode(request: pytest.FixtureRequest) -> str:
    """Both VFIO modes: "iommu" (emulated Intel IOMMU, type1) and "noiommu" (rebuilt VFIO)."""
    return request.param


@pytest.fixture
def guest_pytest(vm_assets: Path, tmp_path: Path) -> Callable:
    """`guest_pytest(config, files, timeout=600, ...)` boots once and runs pytest on the guest files;
    returns a GuestPytestResult. Each call gets its own run directory under tmp_path."""
    from rig import VmConfig
    from rig_pytest import GuestPytestResult, run_guest_pytest

    calls = []

    def run(config: VmConfig, files: Sequence[str | Path], **kwargs) -> GuestPytestResult:
        workdir = tmp_path / f"vm{len(calls)}"
        workdir.mkdir()
        result = run_guest_pytest(config, files, workdir, **kwargs)
        calls.append(result)
        print(f"guest pytest ({config.mode}): {result.summary()}")
        return result

    return run


def shared_boot_modes(items: Sequence[pytest.Item]) -> list[str]:
    """The VFIO modes the selected tests ask `shared_boot` for (their vm_mode/mode parameter)."""
    modes = set()
    for item in items:
        callspec = getattr(item, "callspec", None)
        if "shared_boot" in getattr(item, "fixturenames", ()) and callspec is not None:
            modes |= {v for k, v in callspec.params.items() if k in ("vm_mode", "mode") and v in VFIO_MODES}
    return sorted(modes)


@pytest.fixture(scope="session")
def shared_boot(vm_assets: Path, tmp_path_factory: pytest.TempPathFactory,
                request: pytest.FixtureRequest) -> Iterator[Callable]:
    """`shared_boot(mode)` → shared_boot.SharedBoot: the one boot per VFIO mode that runs the guest
    modules of the rig, driver, store, system and QMP tests together (see tests/vm/shared_boot.py).
    The first host test that asks boots every mode the selected tests need, side by side (each guest
    session is mostly one busy vCPU; NVMEDIRECT_VM_PARALLEL=0 boots one at a time), and waits for
    its own; the others inspect the same results."""
    import shared_boot as shared

    parallel = os.environ.get("NVMEDIRECT_VM_PARALLEL", "1") != "0"
    wanted = shared_boot_modes(request.session.items)
    pending: dict[str, shared.PendingSharedBoot] = {}
    failed: dict[str, Exception] = {}  # a mode started early whose setup failed: its own tests report it
    done: dict[str, shared.SharedBoot] = {}

    def start(mode: str) -> None:
        pending[mode] = shared.start(mode, tmp_path_factory.mktemp(f"shared-{mode}"))

    def get(mode: str) -> shared.SharedBoot:
        if mode in failed:
            raise failed.pop(mode)
        if mode not in done:
            if mode not in pending:
                start(mode)
                for other in wanted if parallel else []:
                    if other not in pending and other not in done:
                        try:
                            start(other)
                        except Exception as exc:
                            failed[other] = exc
            done[mode] = pending.pop(mode).finish()
        return done[mode]

    yield get
    for unfinished in pending.values():
        unfinished.abandon()


@pytest.fixture
def vm_workdir(vm_assets: Path, tmp_path: Path) -> Path:
    """A run directory for `run_in_vm` / `Vm`, after checking the assets exist."""
    workdir = tmp_path / "vm"
    workdir.mkdir()
    return workdir
