"""`nvmedirect setup`: plan, apply or roll back the system configuration the driver needs."""

from __future__ import annotations

import difflib

import click

from nvmedirect.cli.common import (
    EXIT_FAILED,
    BadInput,
    Refused,
    emit,
    output_option,
    root_option,
    wants_json,
)
from nvmedirect.system import SystemView
from nvmedirect.system.binding import BindFailed, BindRefused
from nvmedirect.system.journal import RollbackConflict
from nvmedirect.system.setup_plan import PlanRefused, SetupOptions, apply_plan, make_plan, rollback
from nvmedirect.system.setup_steps import IOMMU_MODES, TODO, Step


class Failed(click.ClickException):
    exit_code = EXIT_FAILED


def print_plan(view: SystemView, steps: list[Step], show_diff: bool = True) -> None:
    where = "" if view.is_live else f" for the system at {view.root}"
    click.echo(f"Plan{where} (nothing changes without --apply):")
    for number, step in enumerate(steps, 1):
        note = f" ({step.note})" if step.note else ""
        click.echo(f"{number:2}. [{step.status}] {step.key}: {step.what}{note}")
        if step.status != TODO:
            continue
        click.echo(f"      why:  {step.why}")
        click.echo(f"      risk: {step.risk}")
        click.echo(f"      undo: {step.undo}")
        for edit in step.edits:
            click.echo(f"      file: {edit.path}")
            if show_diff:
                old = (view.read_bytes(edit.path) or b"").decode(errors="replace").splitlines(keepends=True)
                new = edit.new.decode(errors="replace").splitlines(keepends=True)
                for line in difflib.unified_diff(old, new, f"a{edit.path}", f"b{edit.path}", n=1):
                    click.echo(f"        {line.rstrip()}")
        for command in step.after:
            click.echo(f"      then: {command}")


@click.command("setup")
@click.option("--iommu", type=click.Choice(IOMMU_MODES), help="IOMMU mode to put on the kernel command line "
              "(GRUB). Left alone when not given.")
@click.option("--unsafe-noiommu", is_flag=True, help="Also enable vfio's no-IOMMU mode (no DMA protection).")
@click.option("--patch-nvidia", is_flag=True, help="Patch the NVIDIA DKMS os-mlock.c for Linux 6.12+.")
@click.option("--patch-cuda", is_flag=True, help="Patch CUDA's math_functions.h for glibc 2.41+.")
@click.option("--nvme-only", is_flag=True, help="Only load vfio-pci now and bind the --bind devices.")
@click.option("--bind", "bind_devices", multiple=True, metavar="DEVICE",
              help="Controller to bind to vfio-pci (PCI address or /dev/nvmeXnY); repeatable.")
@click.option("--apply", is_flag=True, help="Make the changes (otherwise only print the plan).")
@click.option("--rollback", "do_rollback", is_flag=True, help="Undo everything earlier --apply runs did.")
@click.option("--force", is_flag=True, help="With --rollback: restore files even if changed since.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@output_option
@root_option
def setup_cmd(iommu: str | None, unsafe_noiommu: bool, patch_nvidia: bool, patch_cuda: bool, nvme_only: bool,
              bind_devices: tuple[str, ...], apply: bool, do_rollback: bool, force: bool, yes: bool,
              output: str, as_json: bool, root: str) -> None:
    """Print a plan of system changes; make them with --apply; undo them with --rollback.

    \b
    Steps: IOMMU mode on the kernel command line (/etc/default/grub), vfio
    modules at boot (/etc/modules-load.d, /etc/modprobe.d), optional patches
    (--patch-nvidia, --patch-cuda), loading vfio-pci now and binding --bind
    devices. Every edited file is backed up byte for byte and recorded in
    /var/lib/nvmedirect/setup-journal.json; applying again is a no-op.
    update-grub is run only with --apply on the live system.
    """
    as_json = wants_json(output, as_json)
    view = SystemView(root)
    if do_rollback and (apply or nvme_only or iommu or bind_devices):
        raise BadInput("--rollback takes no other plan options")
    if do_rollback:
        if not yes and not as_json:
            click.confirm("Restore every file setup changed to its original and restore bound devices?", abort=True)
        try:
            messages = rollback(view, force=force)
        except RollbackConflict as exc:
            raise Refused(str(exc)) from None
        except (BindFailed, OSError) as exc:
            raise Failed(str(exc)) from None
        _report({"root": root, "rollback": True, "messages": messages}, as_json)
        return
    opts = SetupOptions(iommu, unsafe_noiommu, patch_nvidia, patch_cuda, nvme_only, bind_devices)
    steps = make_plan(view, opts)
    if not apply:
        emit({"root": root, "applied": False, "steps": [s.to_dict() for s in steps]}, as_json,
             lambda _: print_plan(view, steps))
        return
    if not as_json:
        print_plan(view, steps)
    if any(s.status == TODO for s in steps) and not yes and not as_json:
        click.confirm("Apply these changes?", abort=True)
    try:
        messages = apply_plan(view, steps)
    except (PlanRefused, BindRefused) as exc:
        raise Refused(str(exc)) from None
    except (BindFailed, OSError) as exc:
        raise Failed(str(exc)) from None
    _report({"root": root, "applied": True, "steps": [s.to_dict() for s in steps], "messages": messages}, as_json)


def _report(data: dict, as_json: bool) -> None:
    emit(data, as_json, lambda d: [click.echo(message) for message in d["messages"]])
