"""`nvmedirect write-gguf` and `nvmedirect ls-gguf`: GGUF models on raw LBAs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click
from tqdm import tqdm

from nvmedirect.cli.common import BadInput, Refused, emit, output_option, wants_json
from nvmedirect.errors import NvmeDirectError
from nvmedirect.store.catalog import read_header, walk_chain
from nvmedirect.store.header import HeaderError, StoredModelHeader
from nvmedirect.store.routing import IMAGE, NVME, RouteError, route_device
from nvmedirect.store.targets import BlockTarget, KernelBlockTarget, TargetBusy
from nvmedirect.store.writer import (
    chain_end_lba,
    check_fit,
    foreign_signatures,
    plan_write,
    sha256_file,
    target_reader,
    verify_model,
    write_model,
)

device_option = click.option("--device", "-d", required=True, metavar="BDF|/dev/nvmeXnY|IMAGE",
                             help="PCI address of a vfio-bound controller, a kernel block device, or an image file.")
lba_size_option = click.option("--lba-size", type=click.Choice(["512", "4096"]), default=None,
                               help="LBA size for an image file (block devices report their own).")
noiommu_option = click.option("--noiommu", is_flag=True,
                              help="Force VFIO's no-IOMMU mode (default: the mode of the device's VFIO group).")


@contextmanager
def open_target(device: str, lba_size: str | None, noiommu: bool, for_writing: bool) -> Iterator[BlockTarget]:
    """The target for `device`, after the usage refusals (which --force never overrides)."""
    try:
        route = route_device(device)
    except RouteError as exc:
        raise BadInput(str(exc)) from None
    if for_writing and route.refusals:
        raise Refused(f"{device}: " + "; ".join(route.refusals))
    if lba_size and route.kind != IMAGE:
        raise BadInput("--lba-size is for image files: a device reports its own")
    try:
        if route.kind == NVME:
            from nvmedirect.store.nvme_target import NvmeTarget

            target_cm: Any = NvmeTarget.open(route.path, noiommu=noiommu or None, nsid=route.nsid)
        else:
            target_cm = KernelBlockTarget(route.path, lba_size=int(lba_size) if lba_size else None,
                                          writable=for_writing)
    except TargetBusy as exc:
        raise Refused(str(exc)) from None
    except NvmeDirectError as exc:
        raise click.ClickException(f"cannot open {device}: {exc}") from None
    with target_cm as target:
        yield target


def _bar(desc: str, total: int) -> tqdm:
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False,
                disable=None, dynamic_ncols=True)


def _describe(h: StoredModelHeader) -> dict:
    return {
        "name": h.model_name, "start_lba": h.start_lba, "data_lba": h.data_lba, "next_lba": h.next_lba,
        "lba_size": h.lba_size, "gguf_bytes": h.gguf_nbytes, "sha256": h.sha256.hex(),
        "created": datetime.fromtimestamp(h.created_unix, UTC).isoformat(timespec="seconds"),
    }


@click.command("write-gguf")
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@device_option
@click.option("--lba", type=click.IntRange(min=0), default=None, help="Start LBA of the header (default 0).")
@click.option("--append", is_flag=True, help="Start after the last model of the chain from LBA 0.")
@click.option("--name", default=None, help="Model name in the header (default: the file name).")
@lba_size_option
@click.option("--force", is_flag=True, help="Write even over a partition table or filesystem signature.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@noiommu_option
@output_option
def write_gguf_cmd(model: Path, device: str, lba: int | None, append: bool, name: str | None,
                   lba_size: str | None, force: bool, yes: bool, noiommu: bool, output: str, as_json: bool) -> None:
    """Write MODEL (a GGUF) to raw LBAs of a device, then read it back and compare its sha256.

    A header record (magic, format, size, sha256, name, LBA size) goes at the start LBA and the GGUF
    right after it. The boot device and devices that are mounted, swap or held are always refused;
    a partition table or filesystem signature is refused unless --force.
    """
    if append and lba is not None:
        raise BadInput("--lba and --append are exclusive")
    as_json = wants_json(output, as_json)
    with open_target(device, lba_size, noiommu, for_writing=True) as target:
        signatures = foreign_signatures(target)
        if signatures and not force:  # before anything else: somebody's data is there
            raise Refused(f"{device} carries {', '.join(signatures)} data at its start "
                          "(partition table or filesystem): --force to overwrite it")
        size = model.stat().st_size
        try:  # size and LBA range before the minutes a large model's hash takes
            start = chain_end_lba(target) if append else (lba or 0)
            check_fit(target, size, start, name or model.name)
        except (HeaderError, NvmeDirectError) as exc:
            raise BadInput(str(exc)) from None
        with _bar("hashing", size) as bar:
            digest = sha256_file(model, bar.update)
        try:
            plan = plan_write(target, model, lba=start, sha256=digest, name=name)
        except (HeaderError, NvmeDirectError) as exc:
            raise BadInput(str(exc)) from None
        if not yes:
            lost = "".join(f"\n  overwrites stored model {m.model_name!r} at LBA {m.start_lba}"
                           for m in plan.overwrites)
            signs = f"\n  destroys the {', '.join(plan.signatures)} data there" if plan.signatures else ""
            click.confirm(f"Write {model.name} ({size} bytes) to {device} at LBA {start} "
                          f"(LBAs {start}..{plan.header.end_lba - 1}){lost}{signs}\nContinue?",
                          abort=True, err=True)
        began = time.monotonic()
        try:
            with _bar("writing", size) as bar:
                write_model(target, model, plan.header, bar.update)
            wrote = time.monotonic() - began
            with _bar("verifying", size) as bar:
                verify_model(target, plan.header, bar.update)
        except NvmeDirectError as exc:
            raise click.ClickException(str(exc)) from None
        verified = time.monotonic() - began - wrote
    result = _describe(plan.header) | {
        "device": device, "via": target.via, "target": target.name, "verified": True, "write_seconds": round(wrote, 3),
        "write_gb_s": round(size / wrote / 1e9, 3) if wrote else None,
        "verify_gb_s": round(size / verified / 1e9, 3) if verified else None,
        "overwrote": [m.model_name for m in plan.overwrites],
    }
    emit(result, as_json, lambda r: click.echo(
        f"wrote {r['name']} ({r['gguf_bytes']} bytes) to {device} ({r['via']} {r['target']}) at LBA {r['start_lba']} "
        f"(data at LBA {r['data_lba']}, {r['lba_size']}-byte LBAs); sha256 verified {r['sha256']}\n"
        f"next free LBA {r['next_lba']}; write {r['write_gb_s']} GB/s, read-back {r['verify_gb_s']} GB/s"))


@click.command("ls-gguf")
@device_option
@click.option("--lba", type=click.IntRange(min=0), default=None,
              help="Follow the chain from this LBA instead of LBA 0.")
@lba_size_option
@click.option("--verify", is_flag=True, help="Read each model and check its sha256.")
@noiommu_option
@output_option
def ls_gguf_cmd(device: str, lba: int | None, lba_size: str | None, verify: bool, noiommu: bool,
                output: str, as_json: bool) -> None:
    """List the GGUF models stored on a device (the chain of headers from LBA 0, or from --lba)."""
    as_json = wants_json(output, as_json)
    with open_target(device, lba_size, noiommu, for_writing=False) as target:
        read = target_reader(target)
        try:
            models = walk_chain(read, target.lba_size, lba or 0, target.capacity_bytes)
        except HeaderError as exc:
            raise click.ClickException(f"{device}: {exc}") from None
        rows = []
        for header in models:
            row = _describe(header)
            if verify:
                try:
                    verify_model(target, header)
                    row["verified"] = True
                except NvmeDirectError as exc:
                    row["verified"] = False
                    row["error"] = str(exc)
            rows.append(row)
        if not models and lba is not None:
            try:
                read_header(read, lba, target.lba_size)
            except HeaderError as exc:
                raise click.ClickException(f"{device}: LBA {lba}: {exc}") from None
    emit({"device": device, "lba_size": target.lba_size, "models": rows}, as_json, _print_models)
    if verify and not all(r["verified"] for r in rows):
        raise click.ClickException("some stored models failed verification")


def _print_models(data: dict) -> None:
    if not data["models"]:
        click.echo(f"no models stored on {data['device']}")
        return
    click.echo(f"{'LBA':>12} {'DATA LBA':>12} {'BYTES':>14} {'NEXT LBA':>12}  {'CREATED':<25} SHA256        NAME")
    for m in data["models"]:
        mark = {True: " ok", False: " BAD"}.get(m.get("verified"), "")
        click.echo(f"{m['start_lba']:>12} {m['data_lba']:>12} {m['gguf_bytes']:>14} {m['next_lba']:>12}  "
                   f"{m['created']:<25} {m['sha256'][:12]}{mark}  {m['name']}")
