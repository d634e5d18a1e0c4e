"""`nvmedirect check`: a read-only readiness report, one line per prerequisite."""

from __future__ import annotations

import click

from nvmedirect.cli.common import EXIT_NOT_READY, emit, output_option, root_option, wants_json
from nvmedirect.system import SystemView
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
@click.option("--probe-gpu-mmio", is_flag=True,
              help="Try cudaHostRegister(IoMemory) on a vfio-bound controller's BAR0 (opens the device).")
@output_option
@root_option
def check_cmd(no_gpu: bool, probe_gpu_mmio: bool, output: str, as_json: bool, root: str) -> None:
    """Report whether this system is ready: kernel, IOMMU, vfio, NVMe verdicts, GPU, BARs,
    Secure Boot, RLIMIT_MEMLOCK, GPU-MMIO. Changes nothing. Exit 0 when ready, 4 when not.
    """
    checks = run_checks(SystemView(root), gpu=not no_gpu, probe_gpu_mmio=probe_gpu_mmio)
    data = {"ready": ready(checks), "checks": [c.to_dict() for c in checks]}
    emit(data, wants_json(output, as_json), print_report)
    if not data["ready"]:
        raise SystemExit(EXIT_NOT_READY)
