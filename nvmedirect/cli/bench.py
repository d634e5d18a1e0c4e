"""`nvmedirect bench`: storage → pinned memory (→ GPU) bandwidth, swept over queue depth, I/O size
and queue pairs, with the kernel path and `dd` measured in the same run for comparison."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from nvmedirect.cli.common import BadInput, Refused, emit, output_option, wants_json
from nvmedirect.errors import NvmeDirectError
from nvmedirect.host_memory import gpu_present, pinned_empty
from nvmedirect.reader.bandwidth import BenchRow, GpuSink, measure, measure_dd, window_bytes
from nvmedirect.reader.file_backend import FileBackend
from nvmedirect.store.routing import IMAGE, NVME, RouteError, route_device

NAMESPACE_SETTLE_S = 15.0
_SIZE = re.compile(r"^(\d+)([KMGT]?)(I?B)?$", re.IGNORECASE)


def parse_size(text: str) -> int:
    match = _SIZE.match(text.strip())
    if not match:
        raise BadInput(f"not a size: {text!r} (use e.g. 4096, 256K, 1M, 2G)")
    return int(match.group(1)) << (10 * " KMGT".index(match.group(2).upper() or " "))


def parse_list(text: str, parse=int) -> list[int]:
    try:
        values = [parse(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise BadInput(f"not a comma-separated list of numbers: {text!r}") from None
    if not values or min(values) < 1:
        raise BadInput(f"need positive values, got {text!r}")
    return values


@contextmanager
def gpu_sink(enabled: bool, nbytes: int) -> Iterator[GpuSink | None]:
    yield GpuSink(nbytes) if enabled else None


def sweep_kernel_path(path: str, *, size: int, offset: int, qds: list[int], ios: list[int],
                      gpu: bool, notes: list[str]) -> list[BenchRow]:
    """Our reader through the kernel (O_DIRECT) for every (queue depth, I/O size)."""
    window = max(window_bytes(qd, io) for qd in qds for io in ios)
    windows = [pinned_empty(window), pinned_empty(window)]
    rows: list[BenchRow] = []
    for qd in qds:
        for io in ios:
            with FileBackend(path, queue_depth=qd, io_size=io) as backend:
                if not backend.direct and "buffered" not in " ".join(notes):
                    notes.append("O_DIRECT unsupported here: reads went through the page cache")
                n = min(size, backend.size - offset)
                rows.append(measure(backend, windows, nbytes=n, io_size=backend.io_size, path="kernel",
                                    queue_depth=qd, start=offset))
    if gpu and rows:
        best = max(rows, key=lambda r: r.gb_s)
        with FileBackend(path, queue_depth=best.queue_depth, io_size=best.io_size) as backend, \
                gpu_sink(True, window) as sink:
            rows.append(measure(backend, windows, nbytes=min(size, backend.size - offset), io_size=best.io_size,
                                path="kernel", queue_depth=best.queue_depth, gpu=sink, start=offset))
    return rows


def sweep_userspace(bdf: str, *, noiommu: bool | None, nsid: int, size: int, offset: int, qds: list[int],
                    ios: list[int], qpairs: list[int], gpu: bool, rows: list[BenchRow], notes: list[str]) -> None:
    """Our NVMe driver for every (queue pairs, queue depth, I/O size); DMA straight into the windows.
    Appends to `rows` as it goes, so the rows measured before a failure survive it; queue pair
    counts the controller does not grant are skipped with a note."""
    from nvmedirect.nvme.controller import Controller
    from nvmedirect.reader.nvme_backend import NvmeBackend

    window = max(window_bytes(qd * qp, io) for qd in qds for io in ios for qp in qpairs)
    with Controller.open(bdf, noiommu=noiommu, io_queues=max(qpairs)) as ctrl:
        granted = ctrl.io_queue_limit
        if skipped := [qp for qp in qpairs if qp > granted]:
            notes.append(f"--qpairs {','.join(map(str, skipped))} skipped: the controller grants {granted} "
                         "I/O queue pair(s)")
        source = "cuda-pinned" if gpu else "anon"
        windows = [ctrl.dma.alloc(window, source=source), ctrl.dma.alloc(window, source=source)]
        measured: list[BenchRow] = []
        for qp in (qp for qp in qpairs if qp <= granted):
            for qd in qds:
                for io in ios:
                    with NvmeBackend(ctrl, nsid=nsid, queue_pairs=qp, queue_depth=qd, io_size=io) as backend:
                        n = min(size, backend.size - offset)
                        measured.append(measure(backend, windows, nbytes=n, io_size=backend.io_size,
                                                path="userspace", queue_depth=qd, queue_pairs=qp, start=offset))
                        rows.append(measured[-1])
        if gpu and measured:
            best = max(measured, key=lambda r: r.gb_s)
            with NvmeBackend(ctrl, nsid=nsid, queue_pairs=best.queue_pairs, queue_depth=best.queue_depth,
                             io_size=best.io_size) as backend, gpu_sink(True, window) as sink:
                rows.append(measure(backend, windows, nbytes=min(size, backend.size - offset),
                                    io_size=best.io_size, path="userspace", queue_depth=best.queue_depth,
                                    queue_pairs=best.queue_pairs, gpu=sink, start=offset))


def kernel_compare(bdf: str, run_kernel) -> tuple[list[BenchRow], str]:
    """Hand the controller to the kernel nvme driver, measure, and bind it back to vfio-pci."""
    from nvmedirect.system.binding import bind, restore
    from nvmedirect.system.devices import read_controller
    from nvmedirect.system.events import KernelEvents
    from nvmedirect.system.sysview import SystemView

    view = SystemView()
    with KernelEvents(view, "block") as events:
        restore(view, bdf)
        # restore waits for the namespaces bind recorded; without a record, for the first one
        events.wait(lambda: bool(read_controller(view, bdf).block_devices), NAMESPACE_SETTLE_S)
    try:
        namespaces = read_controller(view, bdf).block_devices
        if not namespaces:
            raise click.ClickException(f"{bdf}: the kernel found no namespace after restore")
        device = f"/dev/{sorted(namespaces)[0]}"
        return run_kernel(device), device
    finally:
        bind(view, bdf)


def summarize(rows: list[BenchRow]) -> dict[str, Any]:
    best: dict[str, BenchRow] = {}
    for row in rows:
        key = row.path if row.path == "dd" else f"{row.path}-{row.destination}"
        if key not in best or row.gb_s > best[key].gb_s:
            best[key] = row
    summary: dict[str, Any] = {f"best_{k}_gb_s": round(v.gb_s, 4) for k, v in best.items()}
    dd_rows = [r for r in rows if r.path == "dd"]
    if dd_rows:
        dd_mean = sum(r.gb_s for r in dd_rows) / len(dd_rows)
        summary["dd_mean_gb_s"] = round(dd_mean, 4)
        reader = best.get("kernel-pinned")
        if reader is not None and dd_mean:
            summary["reader_vs_dd"] = round(reader.gb_s / dd_mean, 4)
    if "userspace-pinned" in best and "kernel-pinned" in best and best["kernel-pinned"].gb_s:
        summary["userspace_vs_kernel"] = round(best["userspace-pinned"].gb_s / best["kernel-pinned"].gb_s, 4)
    return summary


@click.command("bench")
@click.option("--device", "-d", default=None, metavar="BDF|/dev/nvmeXnY",
              help="A vfio-bound controller (userspace driver) or a kernel block device.")
@click.option("--file", "file_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Read a file through the kernel (O_DIRECT) instead of a device.")
@click.option("--size", default="1G", show_default=True, help="Bytes read per measurement.")
@click.option("--offset", default="0", show_default=True, help="Byte where reading starts.")
@click.option("--qd", "qd_text", default="1,4,16", show_default=True, help="Queue depths to sweep.")
@click.option("--io-size", "io_text", default="256K,1M,4M", show_default=True, help="I/O sizes to sweep.")
@click.option("--qpairs", "qp_text", default="1,2", show_default=True, help="NVMe queue pairs to sweep.")
@click.option("--gpu/--no-gpu", default=None, help="Also copy on to GPU memory (default: if a GPU is present).")
@click.option("--dd/--no-dd", "with_dd", default=True, show_default=True,
              help="Measure `dd iflag=direct bs=64M` on the same source, before and after the sweep.")
@click.option("--kernel-compare/--no-kernel-compare", default=True, show_default=True,
              help="With a BDF: also measure through the kernel nvme driver (rebinds the controller).")
@click.option("--nsid", type=int, default=1, show_default=True)
@click.option("--noiommu", is_flag=True,
              help="Force VFIO's no-IOMMU mode (default: the mode of the device's VFIO group).")
@output_option
def bench_cmd(device: str | None, file_path: str | None, size: str, offset: str, qd_text: str, io_text: str,
              qp_text: str, gpu: bool | None, with_dd: bool, kernel_compare: bool, nsid: int, noiommu: bool,
              output: str, as_json: bool) -> None:
    """Measure read bandwidth into pinned memory (and on to the GPU): GB/s, IOPS, CPU use.

    With --file or a block device the reader's O_DIRECT path is swept and compared with dd
    (`reader_vs_dd`). With a PCI address the userspace driver is swept, then (unless
    --no-kernel-compare) the controller is handed to the kernel for the same sweep and bound back.
    """
    as_json = wants_json(output, as_json)
    if (device is None) == (file_path is None):
        raise BadInput("give exactly one of --device and --file")
    nbytes, start = parse_size(size), parse_size(offset)
    qds, ios, qps = parse_list(qd_text), parse_list(io_text, parse_size), parse_list(qp_text)
    use_gpu = gpu_present() if gpu is None else gpu
    if use_gpu and not gpu_present():
        raise BadInput("--gpu given but CuPy sees no GPU")
    notes: list[str] = []

    def dd_rows(path: str) -> list[BenchRow]:
        if not with_dd:
            return []
        try:
            return [measure_dd(path, nbytes, start)]
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            notes.append(f"dd comparison skipped: {exc}")
            return []

    def kernel_run(path: str) -> list[BenchRow]:
        rows = dd_rows(path)
        try:
            rows += sweep_kernel_path(path, size=nbytes, offset=start, qds=qds, ios=ios, gpu=use_gpu, notes=notes)
        except NvmeDirectError as exc:
            raise click.ClickException(f"{path}: {exc}") from None
        return rows + dd_rows(path)

    if file_path is not None:
        source, kind = file_path, "file"
    else:
        try:
            route = route_device(device, nsid)
        except RouteError as exc:
            raise BadInput(str(exc)) from None
        source, kind = route.path, route.kind
        if kind == IMAGE:
            raise BadInput(f"{device} is a regular file: use --file")
        if kind == NVME and route.refusals:
            raise Refused(f"{device}: " + "; ".join(route.refusals))
    rows: list[BenchRow] = []
    failure = None
    if kind == NVME:
        try:
            sweep_userspace(source, noiommu=noiommu or None, nsid=nsid, size=nbytes, offset=start, qds=qds,
                            ios=ios, qpairs=qps, gpu=use_gpu, rows=rows, notes=notes)
            if kernel_compare:
                kernel_rows, kernel_device = kernel_compare_rows(source, kernel_run)
                rows += kernel_rows
                notes.append(f"kernel path measured on {kernel_device}; {source} bound back to vfio-pci")
        except (NvmeDirectError, click.ClickException) as exc:  # report what was measured, then fail
            failure = f"{device}: {exc.message if isinstance(exc, click.ClickException) else exc}"
            notes.append(f"stopped early: {failure}")
    else:
        rows = kernel_run(source)
    result = {"source": source, "gpu": use_gpu, "rows": [r.to_dict() for r in rows],
              "summary": summarize(rows), "notes": notes}
    emit(result, as_json, _print)
    if failure is not None:
        raise click.ClickException(failure)


def kernel_compare_rows(bdf: str, run_kernel) -> tuple[list[BenchRow], str]:
    try:
        return kernel_compare(bdf, run_kernel)
    except click.ClickException:
        raise
    except Exception as exc:  # BindRefused/BindFailed: the userspace figures still stand
        raise click.ClickException(f"kernel comparison failed: {exc}") from None


def _print(result: dict) -> None:
    click.echo(f"source: {result['source']}   GPU: {'yes' if result['gpu'] else 'no'}")
    click.echo(f"{'PATH':<10} {'DEST':<7} {'QP':>3} {'QD':>4} {'IO':>7} {'GB/s':>8} {'IOPS':>9} "
               f"{'CPU%':>6} {'CPU s/GB':>9} {'BYTES':>12}")
    for r in result["rows"]:
        io = f"{r['io_size'] >> 10}K" if r["io_size"] < (1 << 20) else f"{r['io_size'] >> 20}M"
        click.echo(f"{r['path']:<10} {r['destination']:<7} {r['queue_pairs']:>3} {r['queue_depth']:>4} {io:>7} "
                   f"{r['gb_s']:>8.3f} {r['iops']:>9.0f} {r['cpu_percent']:>6.0f} {r['cpu_s_per_gb']:>9.3f} "
                   f"{r['nbytes']:>12}")
    s = result["summary"]
    if "reader_vs_dd" in s:
        click.echo(f"reader (O_DIRECT, best) {s['best_kernel-pinned_gb_s']:.3f} GB/s vs dd iflag=direct bs=64M "
                   f"{s['dd_mean_gb_s']:.3f} GB/s (mean of before/after): {100 * s['reader_vs_dd']:.0f}% of dd")
    if "userspace_vs_kernel" in s:
        click.echo(f"userspace driver vs kernel O_DIRECT (best of each): {s['userspace_vs_kernel']:.2f}x")
    for note in result["notes"]:
        click.echo(f"note: {note}")
