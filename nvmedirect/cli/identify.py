"""`nvmedirect identify BDF`: bring up a vfio-bound controller with our driver and print Identify.

Read-only for the data on the drive: it issues only Identify and Set Features (Number of Queues),
then shuts the controller down again.
"""

from __future__ import annotations

import re

import click

from nvmedirect.cli.common import EXIT_NOT_READY, BadInput, emit, output_option, wants_json
from nvmedirect.errors import DeviceNotFound, NvmeDirectError, VfioError

BDF_PATTERN = re.compile(r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")


class NotReady(click.ClickException):
    exit_code = EXIT_NOT_READY


def describe(ctrl, bdf: str) -> dict:
    """What `identify` reports about a started controller; the mode is the one its DMA runs in
    (physical addresses: no-IOMMU), whatever the command line asked for."""
    from nvmedirect.spec.layout import version_string

    return {
        "bdf": bdf,
        "mode": "no-IOMMU" if ctrl.dma.physical else "IOMMU",
        "version": version_string(ctrl.version),
        "controller": ctrl.info.to_dict(),
        "max_transfer_bytes": ctrl.max_transfer,
        "max_queue_entries": ctrl.max_queue_entries,
        "doorbell_stride": 4 << ctrl.dstrd,
        "io_queue_pairs": ctrl.io_queue_limit,
        "namespaces": [ctrl.identify_namespace(nsid).to_dict() for nsid in ctrl.active_namespaces()],
    }


def collect(bdf: str, noiommu: bool) -> dict:
    from nvmedirect.nvme.controller import Controller

    with Controller.open(bdf, noiommu=noiommu or None, io_queues=1) as ctrl:
        return describe(ctrl, bdf)


def print_identify(data: dict) -> None:
    info = data["controller"]
    click.echo(f"{data['bdf']}  NVMe {data['version']}  ({data['mode']})")
    click.echo(f"  model     {info['model']}")
    click.echo(f"  serial    {info['serial']}")
    click.echo(f"  firmware  {info['firmware']}")
    mdts = f"MDTS {info['mdts']}" if info["mdts"] else "no MDTS limit"
    click.echo(f"  transfer  {data['max_transfer_bytes'] >> 10} KiB per command ({mdts})")
    click.echo(f"  queues    {data['io_queue_pairs']} I/O pairs, up to {data['max_queue_entries']} entries")
    for ns in data["namespaces"]:
        formats = ", ".join(f"{f['data_size']}{'*' if f['in_use'] else ''}" for f in ns["formats"])
        click.echo(f"  nsid {ns['nsid']}: {ns['size_blocks']} blocks of {ns['lba_size']} B = "
                   f"{ns['size_bytes'] / 1e9:.3f} GB   LBA formats: {formats}")


@click.command("identify")
@click.argument("bdf")
@click.option("--noiommu", is_flag=True,
              help="Force VFIO's unsafe no-IOMMU mode (default: the mode of the device's VFIO group).")
@output_option
def identify_cmd(bdf: str, noiommu: bool, output: str, as_json: bool) -> None:
    """Identify a vfio-bound controller and its namespaces (model, serial, firmware, MDTS, LBA formats)."""
    if not BDF_PATTERN.match(bdf):
        raise BadInput(f"{bdf!r} is not a PCI address like 0000:01:00.0")
    try:
        data = collect(bdf.lower(), noiommu)
    except DeviceNotFound as exc:
        raise NotReady(str(exc)) from None
    except VfioError as exc:
        raise NotReady(str(exc)) from None
    except NvmeDirectError as exc:
        raise click.ClickException(str(exc)) from None
    emit(data, wants_json(output, as_json), print_identify)
