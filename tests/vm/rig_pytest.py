"""Run a pytest session inside the VM and bring back one result per guest test (through JUnit XML).

One boot runs a whole guest module (or several), so VM tests stay few and each boot pays off:

    result = run_guest_pytest(VmConfig(iommu=True), ["tests/vm/guest/test_rig_guest.py"], tmp_path)
    result.assert_passed()      # AssertionError listing every failed guest test with its message
"""

from __future__ import annotations

import shlex
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rig import GUEST_RESULTS, REPO, Vm, VmConfig, VmResult

JUNIT_NAME = "junit.xml"


@dataclass
class GuestTest:
    nodeid: str
    outcome: str  # passed, failed, error or skipped
    message: str
    seconds: float


@dataclass
class GuestPytestResult:
    vm: VmResult
    tests: list[GuestTest]
    session: GuestPytestResult | None = None  # the whole guest session, when this is a selection

    def select(self, modules: Iterable[str]) -> GuestPytestResult:
        """Only the tests of these guest modules (dotted, as JUnit names them: tests.vm.guest.x),
        for a host test that shares its boot with others."""
        wanted = set(modules)
        return GuestPytestResult(self.vm, [t for t in self.tests if t.nodeid.split("::", 1)[0] in wanted],
                                 self.session or self)

    @property
    def failures(self) -> list[GuestTest]:
        return [t for t in self.tests if t.outcome in ("failed", "error")]

    @property
    def passed(self) -> list[GuestTest]:
        return [t for t in self.tests if t.outcome == "passed"]

    def outcome(self, name: str) -> str:
        """Outcome of the one guest test whose name is `name` (parametrized ids included)."""
        found = [t for t in self.tests if t.nodeid.rsplit("::", 1)[-1] == name]
        if len(found) != 1:
            raise KeyError(f"{len(found)} guest tests named {name!r}; have {[t.nodeid for t in self.tests]}")
        return found[0].outcome

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for test in self.tests:
            counts[test.outcome] = counts.get(test.outcome, 0) + 1
        parts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())) or "no tests"
        return f"{parts} in {self.vm.elapsed:.1f} s ({self.vm.run_dir})"

    def assert_passed(self, allow_skips: bool = False) -> None:
        """Fail the host test unless the guest session ran tests and every one passed."""
        if self.vm.rc is None:
            raise AssertionError(f"guest pytest did not finish: {self.vm.failure}\n{self.vm.console_tail()}")
        problems = [f"{t.nodeid} {t.outcome.upper()}: {t.message}" for t in self.failures]
        if not allow_skips:
            problems += [f"{t.nodeid} SKIPPED: {t.message}" for t in self.tests if t.outcome == "skipped"]
        if not self.tests:
            problems.append(f"no guest test ran (pytest exited {self.vm.rc})")
        elif self.vm.rc not in (0, 5) and not problems and not (self.session or self).failures:
            problems.append(f"pytest exited {self.vm.rc} although every test passed")
        if problems:
            detail = "\n".join(problems)
            raise AssertionError(f"guest tests failed ({self.summary()}):\n{detail}\n"
                                 f"--- console tail ---\n{self.vm.console_tail(80)}")


def parse_junit(path: Path) -> list[GuestTest]:
    root = ET.parse(path).getroot()
    tests = []
    for case in root.iter("testcase"):
        nodeid = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            child = case.find(tag)
            if child is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                text = (child.text or "").strip()
                message = child.get("message", "") + (f"\n{text}" if text and outcome != "skipped" else "")
                break
        tests.append(GuestTest(nodeid, outcome, message.strip(), float(case.get("time", 0))))
    return tests


def guest_pytest_command(files: Sequence[str | Path], pytest_args: Sequence[str], repo: Path,
                         timeout: float) -> str:
    paths = [str(Path(f) if Path(f).is_absolute() else repo / f) for f in files]
    argv = ["python", "-m", "pytest", "-p", "no:cacheprovider", "-v", "-rA", "--color=no",
            f"--rootdir={repo}", f"--junitxml={GUEST_RESULTS}/{JUNIT_NAME}",
            # A hung guest test prints every thread's stack before the host kills the VM.
            "-o", f"faulthandler_timeout={max(int(timeout) - 20, 10)}",
            *pytest_args, *paths]
    return shlex.join(argv)


class PendingGuestPytest:
    """A guest pytest session that is running: `start_guest_pytest` boots and returns at once, so
    several VMs can run side by side; `result()` waits for this one (and powers it off)."""

    def __init__(self, vm: Vm, timeout: float):
        self.vm = vm
        self.timeout = timeout
        self._result: GuestPytestResult | None = None

    def result(self) -> GuestPytestResult:
        if self._result is None:
            with self.vm:
                vm_result = self.vm.wait(self.timeout)
            junit = vm_result.results_dir / JUNIT_NAME
            self._result = GuestPytestResult(vm_result, parse_junit(junit) if junit.exists() else [])
        return self._result

    def abandon(self) -> None:
        """Kill the VM without a result (a session ending early)."""
        self.vm.__exit__(None, None, None)


def start_guest_pytest(config: VmConfig, files: Sequence[str | Path], workdir: Path, timeout: float = 600,
                       pytest_args: Sequence[str] = (), env: dict[str, str] | None = None, repo: Path = REPO,
                       on_console: Sequence[tuple[str, Callable[[Vm], None]]] = ()) -> PendingGuestPytest:
    """Boot `config` running pytest on guest-side test `files` (relative to `repo`); do not wait."""
    vm = Vm(config, workdir)
    for marker, action in on_console:
        vm.on_console(marker, action)
    try:
        vm.start(guest_pytest_command(files, pytest_args, repo, timeout), env=env, cwd=repo)
    except BaseException:
        vm.__exit__(None, None, None)
        raise
    return PendingGuestPytest(vm, timeout)


def run_guest_pytest(config: VmConfig, files: Sequence[str | Path], workdir: Path, timeout: float = 600,
                     pytest_args: Sequence[str] = (), env: dict[str, str] | None = None, repo: Path = REPO,
                     on_console: Sequence[tuple[str, Callable[[Vm], None]]] = ()) -> GuestPytestResult:
    """Boot `config` and run pytest on guest-side test `files` (relative to `repo`) in it."""
    return start_guest_pytest(config, files, workdir, timeout, pytest_args, env, repo, on_console).result()
