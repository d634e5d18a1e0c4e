"""`nvmedirect setup` as data: build the plan, apply it (journaled, with backups), roll it back."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

from nvmedirect.system import binding
from nvmedirect.system.devices import read_controller, resolve_target
from nvmedirect.system.journal import Journal
from nvmedirect.system.patches import cuda_math_steps, nvidia_mlock_steps
from nvmedirect.system.safety import VFIO, assess
from nvmedirect.system.setup_steps import (
    DONE,
    REFUSED,
    SKIPPED,
    TODO,
    Step,
    grub_step,
    modprobe_step,
    modules_step,
)
from nvmedirect.system.state import StateFile
from nvmedirect.system.sysview import SystemView
from nvmedirect.system.usage import UsageIndex

NOIOMMU_PARAM = binding.NOIOMMU_PARAM


@dataclass
class SetupOptions:
    iommu: str | None = None  # "on" | "passthrough" | "off"; None leaves the command line alone
    unsafe_noiommu: bool = False
    patch_nvidia: bool = False
    patch_cuda: bool = False
    nvme_only: bool = False
    bind: tuple[str, ...] = ()


class PlanRefused(Exception):
    """A requested step cannot be done safely; nothing was changed."""


def make_plan(view: SystemView, opts: SetupOptions) -> list[Step]:
    steps: list[Step] = []
    if not opts.nvme_only:
        if opts.iommu:
            steps.append(grub_step(view, opts.iommu))
        else:
            steps.append(Step("grub-cmdline", "leave the kernel command line alone", "no --iommu mode was chosen",
                              "none", "nothing to undo", status=SKIPPED,
                              note="pass --iommu on|passthrough|off to set the IOMMU mode"))
        steps += [modules_step(view), modprobe_step(view, opts.unsafe_noiommu)]
        if opts.patch_nvidia:
            steps += nvidia_mlock_steps(view)
        if opts.patch_cuda:
            steps += cuda_math_steps(view)
    steps.append(load_vfio_step(view, opts.unsafe_noiommu))
    steps += [bind_step(view, device) for device in opts.bind]
    return steps


def load_vfio_step(view: SystemView, unsafe_noiommu: bool) -> Step:
    step = Step(
        key="load-vfio-now",
        what="load vfio-pci now" + (" with enable_unsafe_noiommu_mode=1" if unsafe_noiommu else ""),
        why="so controllers can be bound without a reboot",
        risk="none for devices (nothing is bound by loading); no-IOMMU mode taints the kernel" if unsafe_noiommu
             else "none: loading the module does not take any device",
        undo="`modprobe -r vfio-pci` once no device is bound to it (rollback leaves modules loaded)",
        action={"kind": "modprobe", "unsafe_noiommu": unsafe_noiommu},
    )
    loaded = view.exists("/sys/bus/pci/drivers/vfio-pci")
    noiommu_ok = not unsafe_noiommu or (view.read(NOIOMMU_PARAM) or "N").upper().startswith("Y")
    if loaded and noiommu_ok:
        step.status, step.note = DONE, "already loaded"
    elif not view.is_live:
        step.status, step.note = SKIPPED, "only done on the live system (not with --root)"
    return step


def bind_step(view: SystemView, device: str) -> Step:
    step = Step(key="bind", what=f"bind {device} to vfio-pci", why="the userspace driver reads it through VFIO",
                risk="its namespaces disappear from the kernel until restore; data on it is only as safe as "
                     "what you write there next",
                undo=f"`nvmedirect restore {device}` (rollback does this)", action={"kind": "bind", "device": device})
    state = StateFile(view)
    try:
        bdf = resolve_target(view, device, state.remembered_names())
    except ValueError as exc:
        step.status, step.note = REFUSED, str(exc)
        return step
    step.action["bdf"] = bdf
    verdict = assess(read_controller(view, bdf), UsageIndex(view), state.get(bdf))
    if verdict.state == VFIO:
        step.status, step.note = DONE, "already bound to vfio-pci"
    elif not verdict.may_bind:
        step.status, step.note = REFUSED, f"{bdf}: {verdict.summary()}"
    elif not view.is_live:
        step.status, step.note = SKIPPED, "only done on the live system (not with --root)"
    return step


def apply_plan(view: SystemView, steps: list[Step]) -> list[str]:
    """Write every file edit of the plan (journaled, backed up), then run its runtime actions."""
    refused = [s for s in steps if s.status == REFUSED]
    if refused:
        raise PlanRefused("; ".join(f"{s.key}: {s.note}" for s in refused) + "; nothing was changed")
    todo = [s for s in steps if s.status == TODO]
    if not todo:
        return ["nothing to do: the plan is already applied"]
    messages = []
    journal = Journal(view)
    edits = [e for s in todo for e in s.edits]
    if edits:
        journal.apply([s.key for s in todo if s.edits], edits)
        messages += [f"wrote {e.path} (backup in the journal)" for e in edits]
    for step in todo:
        if step.action and step.action["kind"] == "modprobe":
            messages.append(_load_vfio(view, step.action["unsafe_noiommu"]))
        elif step.action and step.action["kind"] == "bind":
            outcome = binding.bind(view, step.action["bdf"])
            journal.record_action({"kind": "bind", "bdf": outcome.bdf})
            messages.append(f"bound {outcome.bdf} to vfio-pci; " + "; ".join(outcome.notes))
    if any(s.key == "grub-cmdline" for s in todo):
        messages.append(_update_grub(view))
    return messages


def _load_vfio(view: SystemView, unsafe_noiommu: bool) -> str:
    if unsafe_noiommu:
        if view.exists(NOIOMMU_PARAM):
            view.write(NOIOMMU_PARAM, "1")
        else:
            subprocess.run(["modprobe", "vfio", "enable_unsafe_noiommu_mode=1"], check=False, timeout=60)
    subprocess.run(["modprobe", "vfio-pci"], check=False, timeout=60)
    if not view.exists("/sys/bus/pci/drivers/vfio-pci"):
        return "modprobe vfio-pci did not load the driver (see dmesg)"
    return "vfio-pci loaded"


def _update_grub(view: SystemView) -> str:
    if not view.is_live:
        return f"run update-grub inside {view.root} (e.g. chroot {view.root} update-grub); then reboot it"
    tool = shutil.which("update-grub")
    if tool is None:
        return "update-grub not found: run grub2-mkconfig -o /boot/grub2/grub.cfg (or your distribution's tool)"
    done = subprocess.run([tool], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        return f"update-grub failed ({done.stderr.strip()[-200:]}): run it by hand before rebooting"
    return "update-grub done: reboot to use the new kernel command line"


def rollback(view: SystemView, force: bool = False) -> list[str]:
    """Restore every file setup wrote to its original bytes and give back controllers it bound."""
    journal = Journal(view)
    messages = []
    for action in reversed(journal.actions()):
        bound = view.is_live and binding.current_driver(view, action.get("bdf", "")) == "vfio-pci"
        if action.get("kind") == "bind" and bound:
            outcome = binding.restore(view, action["bdf"])
            messages.append(f"restored {outcome.bdf} to {outcome.driver}")
    messages += journal.rollback(force=force)
    if any(m.endswith("/etc/default/grub") for m in messages):
        messages.append(_update_grub(view))
    return messages or ["nothing to roll back"]
