"""The QEMU test rig: boot a TCG guest with emulated NVMe controllers and run one job inside it.

The guest's root is the host's root, read-only over 9p, so the job runs this checkout with the host's
Python and venv; a writable 9p share (the run's `share/`, `/run/vm/results` in the guest) carries
results back. Assets (kernel, initramfs) come from scripts/vm/build_assets.py.

Controllers are placed as rig_config describes (`controller_bdf`, `controller_id`).
The guest's /init also writes `controllers.json` (serial -> bdf, controller, namespaces) from sysfs.

    config = VmConfig(iommu=False, controllers=[NvmeSpec("ser-a", logical_block_size=4096)])
    result = run_in_vm(config, "python -c 'print(1)'", workdir=tmp_path)
    result.check()     # raises VmError with the console tail unless the job exited 0
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import shlex
import signal
import site
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rig_config import (
    FIRST_ROOT_PORT_SLOT,
    MIB,
    NamespaceSpec,
    NvmeSpec,
    VmConfig,
    controller_bdf,
    controller_id,
)
from rig_qmp import GuestRequestService, Qmp

__all__ = ["MIB", "NamespaceSpec", "NvmeSpec", "Vm", "VmConfig", "VmError", "VmResult", "assets_dir",
           "assets_problem", "controller_bdf", "controller_id", "run_in_vm"]

REPO = Path(__file__).resolve().parents[2]
BUILDER = REPO / "scripts/vm/build_assets.py"
GUEST_RESULTS = "/run/vm/results"
DEBUG_EXIT_PORT = 0xF4  # scripts/vm/init.sh writes the job's exit code here


class VmError(Exception):
    """The VM could not be started, or the job in it failed; the message carries the console tail."""


PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here, not in the forked child (no dlopen there)


def _die_with_parent() -> None:
    """Runs in QEMU's child before exec: the kernel sends it SIGTERM if the test process dies, so a
    killed pytest leaves no VM behind (the `with Vm` cleanup never runs then)."""
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


# -- assets ------------------------------------------------------------------------------------------
def assets_dir() -> Path:
    """The kernel/initramfs directory: $NVMEDIRECT_VM_ASSETS, else the builder's `current` link."""
    explicit = os.environ.get("NVMEDIRECT_VM_ASSETS")
    if explicit:
        return Path(explicit)
    cache = Path(os.environ.get("NVMEDIRECT_CACHE", Path.home() / ".cache" / "nvmedirect"))
    return cache / "vm" / "current"


def assets_problem() -> str | None:
    """None when the assets are present and built by the current recipe, else what is wrong."""
    directory = assets_dir()
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
    except (OSError, ValueError):
        return f"no VM assets in {directory}: run scripts/deps/20-vm.sh"
    spec = importlib.util.spec_from_file_location("vm_build_assets", BUILDER)
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    if manifest.get("recipe") != builder.recipe_digest():
        return f"VM assets in {directory} predate scripts/vm changes: rerun scripts/deps/20-vm.sh"
    return None


# -- results -----------------------------------------------------------------------------------------
@dataclass
class VmResult:
    """What a boot produced. `rc` is the job's exit code, or None when the job never reported one
    (then `failure` says why: timeout, rig failure before the job, guest crash)."""

    rc: int | None
    console: str
    results_dir: Path
    run_dir: Path
    elapsed: float
    timed_out: bool = False
    failure: str | None = None
    emulator_signal: int | None = None  # the signal QEMU itself died of (an emulator crash), if it did

    def console_tail(self, lines: int = 60) -> str:
        return "\n".join(self.console.splitlines()[-lines:])

    def check(self) -> VmResult:
        """Raise VmError unless the job ran and exited 0."""
        if self.rc != 0:
            why = self.failure or f"the job exited with {self.rc}"
            raise VmError(f"{why} (run dir {self.run_dir}); console tail:\n{self.console_tail()}")
        return self


def host_kernel_log_about(pid: int) -> str:
    """The host kernel's lines about process `pid` (a segfault names the faulting address and the
    binary or library it lies in), for a report of an emulator crash; or why there are none."""
    try:
        log = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the host's kernel log could not be read ({exc})"
    if log.returncode != 0:
        return f"the host's kernel log could not be read: {log.stderr.strip() or f'dmesg exited {log.returncode}'}"
    lines = [line.strip() for line in log.stdout.splitlines() if f"[{pid}]" in line]
    if not lines:
        return f"the host's kernel log has no line about process {pid}"
    return "the host's kernel log says: " + " | ".join(lines[-3:])


# -- the VM ------------------------------------------------------------------------------------------
class Vm:
    """One QEMU process. `start(command)`, then `wait()`; or use `run_in_vm`.

    `on_console(marker, action)` runs `action(vm)` on a host thread once `marker` appears on the
    console (e.g. `lambda vm: vm.qmp.execute("device_del", id=controller_id(1))`). Guest tests can
    also ask for QMP commands themselves through the results share (see rig_qmp).
    """

    def __init__(self, config: VmConfig, workdir: Path):
        self.config = config
        self.run_dir = Path(workdir)
        self.share = self.run_dir / "share"
        self.console_path = self.run_dir / "console.log"
        self._sock_dir: Path | None = None  # made on first use of qmp_path
        self._qmp: Qmp | None = None
        self._qmp_lock = threading.Lock()
        self._watchers: list[tuple[str, Callable[[Vm], None]]] = []
        self._proc: subprocess.Popen | None = None
        self._started = 0.0
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self.watcher_errors: list[str] = []
        self.requests: GuestRequestService | None = None

    @property
    def qmp_path(self) -> Path:
        if self._sock_dir is None:
            # AF_UNIX paths are limited to 108 bytes, so the socket lives in a short private directory.
            self._sock_dir = Path(tempfile.mkdtemp(prefix="nvd-qmp-"))
        return self._sock_dir / "qmp.sock"

    @property
    def qmp(self) -> Qmp:
        """The monitor connection, opened on first use."""
        with self._qmp_lock:
            if self._qmp is None:
                self._qmp = Qmp(self.qmp_path)
            return self._qmp

    @property
    def pid(self) -> int | None:
        """QEMU's process id (also its process group), once started."""
        return self._proc.pid if self._proc else None

    def on_console(self, marker: str, action: Callable[[Vm], None]) -> None:
        self._watchers.append((marker, action))

    def command_line(self) -> list[str]:
        cfg = self.config
        assets = assets_dir()
        # no_timer_check: on a loaded host the TCG guest's early IO-APIC timer test can fail and
        # panic the boot ("timer doesn't work through Interrupts-remapped IO-APIC").
        kernel_args = ["console=ttyS0", "panic=-1", "quiet", "no_timer_check", f"nvd.mode={cfg.mode}",
                       f"nvd.nctrl={len(cfg.controllers)}"]
        machine = "q35"
        iommu: list[str] = []
        if cfg.iommu:
            machine += ",kernel-irqchip=split"
            # Must precede every PCI device so they all sit behind it.
            iommu = ["-device", "intel-iommu,intremap=on,caching-mode=on"]
            kernel_args.append("intel_iommu=on")
        argv = [
            "qemu-system-x86_64", "-accel", "tcg", "-machine", machine, "-cpu", "max",
            "-m", cfg.memory, "-smp", str(cfg.cpus),
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-kernel", str(assets / "vmlinuz"), "-initrd", str(assets / "initramfs.cpio.gz"),
            "-append", " ".join(kernel_args + cfg.kernel_args),
            "-serial", f"file:{self.console_path}",
            "-qmp", f"unix:{self.qmp_path},server=on,wait=off",
            "-device", f"isa-debug-exit,iobase={DEBUG_EXIT_PORT:#x},iosize=0x04",
            *iommu,
            "-fsdev", "local,id=hostroot,path=/,readonly=on,security_model=none,multidevs=remap",
            "-device", "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot,bus=pcie.0,addr=0x3",
            "-fsdev", f"local,id=results,path={self.share},security_model=none",
            "-device", "virtio-9p-pci,fsdev=results,mount_tag=results,bus=pcie.0,addr=0x4",
        ]
        for index, spec in enumerate(cfg.controllers):
            argv += self._controller_args(index, spec)
        return argv + cfg.qemu_args

    def _controller_args(self, index: int, spec: NvmeSpec) -> list[str]:
        ctrl = controller_id(index)
        props = {"id": ctrl, "bus": f"rp{index}", "serial": spec.serial}
        for name in ("mdts", "max_ioqpairs"):
            if getattr(spec, name) is not None:
                props[name] = str(getattr(spec, name))
        props.update(spec.options)
        args = ["-device", f"pcie-root-port,id=rp{index},bus=pcie.0,"
                           f"addr={FIRST_ROOT_PORT_SLOT + index:#x},chassis={index + 1}",
                "-device", "nvme," + ",".join(f"{k}={v}" for k, v in props.items())]
        for nsid, ns in enumerate(spec.namespaces, start=1):
            drive = f"{ctrl}n{nsid}"
            image = ns.image or self._blank_image(drive, ns.size)
            lbs = ns.logical_block_size
            args += ["-drive", f"file={image},if=none,id={drive},format=raw",
                     "-device", f"nvme-ns,drive={drive},bus={ctrl},nsid={nsid},"
                                f"logical_block_size={lbs},physical_block_size={lbs}"]
        return args

    def _blank_image(self, name: str, size: int) -> Path:
        path = self.run_dir / f"{name}.img"
        with open(path, "wb") as image:
            image.truncate(size)
        return path

    def _describe(self) -> dict:
        """vm-config.json for guest tests: the mode and each controller's options and expected BDF."""
        controllers = []
        for index, spec in enumerate(self.config.controllers):
            entry = asdict(spec)
            entry.pop("extra_namespaces")
            entry["image"] = str(spec.image) if spec.image else None
            entry["namespaces"] = [{"nsid": i + 1, "size": ns.size, "logical_block_size": ns.logical_block_size,
                                    "image": str(ns.image) if ns.image else None}
                                   for i, ns in enumerate(spec.namespaces)]
            entry.update(index=index, qemu_id=controller_id(index), bdf=controller_bdf(index))
            controllers.append(entry)
        return {"mode": self.config.mode, "iommu": self.config.iommu, "controllers": controllers}

    def start(self, command: str, env: dict[str, str] | None = None, cwd: Path | None = None,
              python: str | None = None) -> None:
        """Boot, running `command` (a shell command line) in the guest as root, cwd `cwd`."""
        problem = assets_problem()
        if problem:
            raise VmError(problem)
        self.share.mkdir(parents=True, exist_ok=True)
        (self.share / "vm-config.json").write_text(json.dumps(self._describe(), indent=2))
        # The guest's PATH starts with the host interpreter's directory (the venv's bin when the host
        # tests run from a venv), so `python` in a job is the same Python the host tests use.
        python_bin = Path(python or sys.executable).parent
        exports = {
            "NVMEDIRECT_VM_GUEST": "1", "NVMEDIRECT_VM_MODE": self.config.mode,
            "NVMEDIRECT_VM_RESULTS": GUEST_RESULTS,
            "NVMEDIRECT_VM_CONTROLLERS": f"{GUEST_RESULTS}/controllers.json",
            "NVMEDIRECT_VM_CONFIG": f"{GUEST_RESULTS}/vm-config.json",
            # HOME is writable in the guest; the host user's site-packages stay importable anyway.
            "HOME": "/tmp", "PYTHONUSERBASE": site.getuserbase(), "PYTHONDONTWRITEBYTECODE": "1",
            "PATH": f"{python_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        }
        if os.environ.get("PYTHONPATH"):
            exports["PYTHONPATH"] = os.environ["PYTHONPATH"]
        exports.update(env or {})
        lines = [f"export {k}={shlex.quote(v)}" for k, v in exports.items()]
        lines += [f"cd {shlex.quote(str(cwd or REPO))}", command]
        (self.share / "job.sh").write_text("\n".join(lines) + "\n")
        self.console_path.write_text("")
        self.requests = GuestRequestService(self.share, lambda: self.qmp)
        self.requests.start()
        self._started = time.monotonic()
        with open(self.run_dir / "qemu.stderr", "wb") as stderr:
            self._proc = subprocess.Popen(self.command_line(), stdin=subprocess.DEVNULL,
                                          stdout=stderr, stderr=stderr, start_new_session=True,
                                          preexec_fn=_die_with_parent)
        if self._watchers:
            thread = threading.Thread(target=self._watch_console, name="vm-console", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _watch_console(self) -> None:
        pending = list(self._watchers)
        while pending and not self._stop.wait(0.1):
            text = self.console_path.read_text(errors="replace")
            for marker, action in list(pending):
                if marker in text:
                    pending.remove((marker, action))
                    try:
                        action(self)
                    except Exception as exc:  # reported with the result; the guest decides the outcome
                        self.watcher_errors.append(f"on_console({marker!r}): {exc!r}")

    def wait(self, timeout: float) -> VmResult:
        """Wait for the guest to power off; after `timeout` s kill QEMU's process group."""
        assert self._proc is not None, "start() first"
        timed_out = False
        try:
            self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            self.kill()
        elapsed = time.monotonic() - self._started
        self._shutdown_helpers()
        return self._result(elapsed, timed_out, timeout)

    def kill(self) -> None:
        """Stop QEMU (and anything it spawned): SIGTERM to its process group, SIGKILL after 3 s."""
        if self._proc is None or self._proc.poll() is not None:
            return
        for sig, grace in ((signal.SIGTERM, 3), (signal.SIGKILL, 10)):
            try:
                os.killpg(self._proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self._proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue

    def _shutdown_helpers(self) -> None:
        self._stop.set()
        if self.requests:
            self.requests.stop()
        for thread in self._threads:
            thread.join(timeout=5)
        if self._qmp is not None:
            self._qmp.close()
            self._qmp = None
        self._remove_sock_dir()

    def _remove_sock_dir(self) -> None:
        if self._sock_dir is not None:
            for leftover in self._sock_dir.iterdir():
                leftover.unlink()
            self._sock_dir.rmdir()
            self._sock_dir = None

    def _result(self, elapsed: float, timed_out: bool, timeout: float) -> VmResult:
        console = self.console_path.read_text(errors="replace")
        stderr = (self.run_dir / "qemu.stderr").read_text(errors="replace").strip()
        if stderr:
            console += f"\n[qemu stderr] {stderr}"
        for error in self.watcher_errors:
            console += f"\n[rig] {error}"
        rc_file = self.share / "job-exit-code"
        rc = int(rc_file.read_text()) if rc_file.exists() else None
        failure = None
        emulator_signal = None
        panics = [line.strip() for line in console.splitlines() if "Kernel panic" in line]
        if timed_out:
            failure = f"the VM was killed after the {timeout:.0f} s timeout"
        elif panics:
            failure = f"the guest kernel panicked: {panics[0]}"
        elif rc is None and not (self.share / "job-started").exists():
            init_errors = [line for line in console.splitlines()
                           if line.startswith("nvd-init") and "FAILED:" in line]
            failure = "the VM failed before the job started: " + (
                init_errors[-1] if init_errors else stderr or f"QEMU exited with {self._proc.returncode}")
        elif rc is None and self._proc.returncode is not None and self._proc.returncode < 0:
            emulator_signal = -self._proc.returncode
            failure = (f"QEMU itself died of {signal.Signals(emulator_signal).name} (an emulator crash); "
                       f"{host_kernel_log_about(self._proc.pid)}")
        elif rc is None:
            failure = "the guest stopped without reporting the job's exit code (kernel panic?)"
        return VmResult(rc=None if timed_out else rc, console=console, results_dir=self.share,
                        run_dir=self.run_dir, elapsed=elapsed, timed_out=timed_out, failure=failure,
                        emulator_signal=emulator_signal)

    def __enter__(self) -> Vm:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()
        if self._proc is not None and not self._stop.is_set():
            self._shutdown_helpers()
        self._remove_sock_dir()


def run_in_vm(config: VmConfig, command: str | Sequence[str], workdir: Path, timeout: float = 180,
              env: dict[str, str] | None = None, cwd: Path | None = None,
              on_console: Sequence[tuple[str, Callable[[Vm], None]]] = ()) -> VmResult:
    """Boot `config`, run `command` (a shell line, or argv to quote) in the guest, return the result."""
    line = command if isinstance(command, str) else shlex.join(command)
    with Vm(config, workdir) as vm:
        for marker, action in on_console:
            vm.on_console(marker, action)
        vm.start(line, env=env, cwd=cwd)
        return vm.wait(timeout)
