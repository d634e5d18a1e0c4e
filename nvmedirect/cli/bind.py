"""`nvmedirect bind` and `nvmedirect restore`: move a controller between nvme and vfio-pci."""

from __future__ import annotations

import click

from nvmedirect.cli.common import EXIT_FAILED, BadInput, Refused, emit, output_option, root_option, wants_json
from nvmedirect.system import SystemView, TargetError
from nvmedirect.system.binding import BindFailed, BindRefused, Outcome, bind, check_bind, restore


class Failed(click.ClickException):
    exit_code = EXIT_FAILED


def print_outcome(verb: str):
    def printer(data: dict) -> None:
        if data["already"]:
            click.echo(f"{data['bdf']}: nothing to do, {data['notes'][0]}")
        else:
            held = f" (namespaces {', '.join(data['namespaces'])})" if data["namespaces"] else ""
            click.echo(f"{data['bdf']}: {verb} {data['driver']}{held}")
        for note in data["notes"][1 if data["already"] else 0:]:
            click.echo(f"  {note}")
    return printer


def _run(action, verb: str, device: str, root: str, output: str, as_json: bool, **kwargs) -> None:
    try:
        outcome: Outcome = action(SystemView(root), device, **kwargs)
    except TargetError as exc:
        raise BadInput(str(exc)) from None
    except BindRefused as exc:
        raise Refused(str(exc)) from None
    except (BindFailed, OSError) as exc:
        raise Failed(str(exc)) from None
    emit(outcome.to_dict(), wants_json(output, as_json), print_outcome(verb))


@click.command("bind")
@click.argument("device")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@output_option
@root_option
def bind_cmd(device: str, yes: bool, output: str, as_json: bool, root: str) -> None:
    """Hand an NVMe controller (DEVICE: PCI address, /dev/nvmeX or /dev/nvmeXnY) to vfio-pci.

    Its namespaces disappear from the kernel until `nvmedirect restore`. Refused
    (exit 3, before any question) for the boot device and for any controller with a
    mounted filesystem, swap, holders (LVM, MD, dm-crypt) or open device files. Asks
    for confirmation unless --yes (which --json needs). The original driver is
    recorded in /run/nvmedirect/bound.json first, so restore works after a crash.
    """
    view = SystemView(root)
    try:  # resolve and judge first: a device that does not exist or is refused gets no prompt
        checked = check_bind(view, device)
    except TargetError as exc:
        raise BadInput(str(exc)) from None
    except BindRefused as exc:
        raise Refused(str(exc)) from None
    except OSError as exc:
        raise Failed(str(exc)) from None
    if not yes and not checked.already_bound:
        if wants_json(output, as_json):
            raise BadInput("bind asks before it takes a device: add --yes to run it non-interactively (--json)")
        ctrl = checked.ctrl
        what = f"{checked.bdf} ({ctrl.model or 'NVMe controller'}" + (
            f", namespaces {', '.join(ctrl.block_devices)})" if ctrl.block_devices else ")")
        click.confirm(f"Take {what} away from the kernel? Its namespaces will be unusable until restore",
                      abort=True)
    _run(bind, "bound to", device, root, output, as_json)


@click.command("restore")
@click.argument("device")
@output_option
@root_option
def restore_cmd(device: str, output: str, as_json: bool, root: str) -> None:
    """Give a controller back to the driver it had before `bind` (the kernel nvme driver).

    Clears driver_override, rebinds and waits for the namespaces to reappear.
    Refused while a process holds the device open through VFIO.
    """
    _run(restore, "returned to", device, root, output, as_json)
