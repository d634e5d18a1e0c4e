"""`nvmedirect check`: a read-only readiness report, one line per prerequisite."""

from __future__ import annotations

import click

from nvmedirect.cli.common import EXIT_NOT_READY, emit, output_option, root_option, wants_json
from nvmedirect.system import SystemView
from nvmedirect.system.devices import BDF_SHORT
from nvmedirect.system.readiness import ready, run_checks

MARK = {"ok": "[ ok ]", "warn": "[warn]", "fail": "[FAIL]", "unknown": "[ ?? ]"}


def print_report(data: dict) -> None:
    width = max((len(c["name"]) for c in data["checks"]), default=8)
    for check in data["checks"]:
        click.echo(f"{MARK[check['status']]} {check['name']:<{width}}  {check['detail']}")
        if check["fix"]:
            click.echo(f"       {'':<{width}}  -> {check['fix']}")
    click.echo("ready" if data["ready"] else "NOT READY: fix the [FAIL] lines above")


@click.command("check")
@click.option("--no-gpu", is_flag=True, help="Skip the CuPy/GPU probe.")
@click.option("--probe-gpu-mmio", "probe_bdf", is_flag=False, flag_value="auto", default=None, metavar="[BDF]",
              help="Only probe the GPU doorbell path: a GPU kernel reads CAP/VS of BDF's BAR0 (a controller bound "
                   "to vfio-pci; default the first one) through cudaHostRegisterIoMemory. Writes nothing.")
@output_option
@root_option
def check_cmd(no_gpu: bool, probe_bdf: str | None, output: str, as_json: bool, root: str) -> None:
    """Report whether this system is ready: kernel, IOMMU, vfio, NVMe verdicts, GPU, BARs,
    Secure Boot, RLIMIT_MEMLOCK, GPU-MMIO. Changes nothing. Exit 0 when ready, 4 when not.
    """
    view = SystemView(root)
    if probe_bdf is not None:
        probe_cmd(view, probe_bdf, wants_json(output, as_json))
        return
    checks = run_checks(view, gpu=not no_gpu)
    data = {"ready": ready(checks), "checks": [c.to_dict() for c in checks]}
    emit(data, wants_json(output, as_json), print_report)
    if not data["ready"]:
        raise SystemExit(EXIT_NOT_READY)


def probe_cmd(view: SystemView, bdf: str, as_json: bool) -> None:
    """One line (or one JSON object): ok and exit 0, or the blocker named and exit 4."""
    from nvmedirect.gpu.probe import probe

    if BDF_SHORT.match(bdf.lower()):
        bdf = f"0000:{bdf}"
    result = probe(None if bdf == "auto" else bdf.lower(), view)
    emit(result.to_dict(), as_json, lambda r: click.echo(result.line()))
    if not result.ok:
        raise SystemExit(EXIT_NOT_READY)
