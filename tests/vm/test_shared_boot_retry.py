"""When a shared boot is booted again (shared_boot.PendingSharedBoot.finish), without booting: only
QEMU dying of a signal brings a second boot, at most one, named in a warning."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from rig import VmResult
from rig_pytest import GuestPytestResult, GuestTest
from shared_boot import EmulatorCrashed, PendingSharedBoot


class FinishedGuest:
    """A guest pytest session that has already ended with `result`."""

    def __init__(self, result: GuestPytestResult) -> None:
        self._result = result

    def result(self) -> GuestPytestResult:
        return self._result


def guest_result(tmp_path: Path, rc: int | None, emulator_signal: int | None = None,
                 failure: str | None = None, passed: int = 0) -> GuestPytestResult:
    vm = VmResult(rc=rc, console="nvd-init [1.0s]: starting job\nlast console line", results_dir=tmp_path,
                  run_dir=tmp_path, elapsed=1.0, failure=failure, emulator_signal=emulator_signal)
    return GuestPytestResult(vm, [GuestTest(f"tests.vm.guest.t::test_{i}", "passed", "", 0.1) for i in range(passed)])


CRASH = dict(rc=None, emulator_signal=signal.SIGSEGV, failure="QEMU itself died of SIGSEGV (an emulator crash)")


def pending(results: list[GuestPytestResult], boots: list[str], again: bool = True) -> PendingSharedBoot:
    """A boot whose sessions end with `results` in turn; `boots` records each boot after the first."""
    first, rest = results[0], results[1:]

    def boot_again() -> PendingSharedBoot:
        boots.append("again")
        return pending(rest, boots, again=False)

    return PendingSharedBoot("iommu", {}, FinishedGuest(first), boot_again if again else None)


def test_an_emulator_crash_boots_once_more_and_says_so(tmp_path):
    boots: list[str] = []
    good = guest_result(tmp_path, rc=0, passed=3)
    with pytest.warns(EmulatorCrashed, match=r"(?s)iommu shared boot is booted again: QEMU itself died of SIGSEGV"
                      r".* after 1 guest tests reported.*last console line"):
        boot = pending([guest_result(tmp_path, passed=1, **CRASH), good], boots).finish()
    assert boots == ["again"] and boot.whole is good


def test_a_second_crash_is_the_result(tmp_path):
    boots: list[str] = []
    second = guest_result(tmp_path, **CRASH)
    with pytest.warns(EmulatorCrashed):
        boot = pending([guest_result(tmp_path, **CRASH), second], boots).finish()
    assert boots == ["again"] and boot.whole is second and boot.whole.vm.failure.startswith("QEMU itself died")


@pytest.mark.parametrize("result", [
    dict(rc=1, passed=2),  # a guest test failed
    dict(rc=None, failure="the guest kernel panicked: Kernel panic - not syncing"),
    dict(rc=None, failure="the VM was killed after the 2400 s timeout"),
    dict(rc=0, passed=3),
], ids=["guest-test-failed", "guest-panic", "timeout", "passed"])
def test_nothing_else_is_booted_again(tmp_path, result, recwarn):
    boots: list[str] = []
    only = guest_result(tmp_path, **result)
    boot = pending([only, guest_result(tmp_path, rc=0)], boots).finish()
    assert boots == [] and boot.whole is only
    assert not [w for w in recwarn if issubclass(w.category, EmulatorCrashed)]
