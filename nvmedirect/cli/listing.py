"""`nvmedirect list`: NVMe controllers and namespaces with a safety verdict each."""

from __future__ import annotations

import click

from nvmedirect.cli.common import emit, output_option, root_option, wants_json
from nvmedirect.system import SystemView, UsageIndex, assess, list_controllers
from nvmedirect.system.state import StateFile


def human_size(nbytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if nbytes < 1000 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1000
    return ""


def inventory(view: SystemView) -> list[dict]:
    """Controllers as dictionaries with their verdict; a vfio-bound controller is described from
    the state file, since the kernel no longer shows its namespaces."""
    usage = UsageIndex(view)
    records = StateFile(view).load()
    rows = []
    for ctrl in list_controllers(view):
        record = records.get(ctrl.bdf)
        row = ctrl.to_dict()
        row["verdict"] = assess(ctrl, usage, record).to_dict()
        if record and ctrl.driver != "nvme":
            row["remembered"] = {k: record.get(k) for k in ("name", "model", "serial", "namespaces", "phase")}
        rows.append(row)
    return rows


def print_inventory(rows: list[dict]) -> None:
    if not rows:
        click.echo("no NVMe controllers found")
        return
    header = f"{'PCI address':<13} {'driver':<9} {'name':<7} {'model':<24} {'serial':<16} {'verdict'}"
    click.echo(header)
    click.echo("-" * len(header))
    for row in rows:
        known = row.get("remembered") or {}
        model = row["model"] or known.get("model") or f"[{row['vendor_id']}:{row['device_id']}]"
        name = row["name"] or (f"({known['name']})" if known.get("name") else "-")
        verdict = row["verdict"]
        click.echo(f"{row['bdf']:<13} {row['driver'] or '-':<9} {name:<7} {model[:24]:<24} "
                   f"{(row['serial'] or known.get('serial') or '-')[:16]:<16} {verdict['state']}")
        namespaces = row["namespaces"] or known.get("namespaces") or []
        for ns in namespaces:
            parts = f"  partitions: {', '.join(ns['partitions'])}" if ns["partitions"] else ""
            hidden = " (hidden while bound)" if not row["namespaces"] else ""
            click.echo(f"    {ns['name']:<12} {human_size(ns['size_bytes']):>10}{parts}{hidden}")
        for reason in verdict["reasons"]:
            click.echo(f"    - {reason}")


@click.command("list")
@output_option
@root_option
def list_cmd(output: str, as_json: bool, root: str) -> None:
    """List NVMe controllers with model, serial, size, driver and a safety verdict.

    \b
    Verdicts: free (may be bound), in-use (refused: mounted, swap, held by
    LVM/MD/dm, or open), boot (refused, no override), vfio (already bound),
    no-driver, other-driver (refused).
    """
    emit(inventory(SystemView(root)), wants_json(output, as_json), print_inventory)
