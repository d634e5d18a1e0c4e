"""Bandwidth measurement of a backend: storage → pinned host memory (→ GPU memory).

The source is read sequentially in windows; two windows of pinned memory alternate, so while one
is being filled the other's copy to the GPU (if any) runs on a CUDA stream. Each window is cut into
`io_size` reads, all handed to the backend at once (it keeps `queue_depth` of them in flight).
CPU utilisation is the process's user+system CPU time (all threads) over wall time; `dd` rows
count its own CPU (RUSAGE_CHILDREN).
"""

from __future__ import annotations

import re
import resource
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import psutil

from nvmedirect.host_memory import address_of
from nvmedirect.reader.base import StorageBackend

MIN_WINDOW = 64 << 20
MAX_WINDOW = 1 << 30
DD_BLOCK = 64 << 20


@dataclass
class BenchRow:
    path: str  # "userspace" (our NVMe driver), "kernel" (O_DIRECT through our reader), "dd"
    destination: str  # "pinned", "gpu", or "host" (dd's own buffer)
    queue_pairs: int
    queue_depth: int
    io_size: int
    nbytes: int
    seconds: float
    cpu_seconds: float

    @property
    def gb_s(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds else 0.0

    @property
    def iops(self) -> float:
        return self.nbytes / self.io_size / self.seconds if self.seconds else 0.0

    @property
    def cpu_percent(self) -> float:
        """CPU time over wall time, in percent of one core."""
        return 100.0 * self.cpu_seconds / self.seconds if self.seconds else 0.0

    @property
    def cpu_s_per_gb(self) -> float:
        return self.cpu_seconds / (self.nbytes / 1e9) if self.nbytes else 0.0

    def to_dict(self) -> dict:
        return asdict(self) | {"gb_s": round(self.gb_s, 4), "iops": round(self.iops, 1),
                               "cpu_percent": round(self.cpu_percent, 1),
                               "cpu_s_per_gb": round(self.cpu_s_per_gb, 4)}


def window_bytes(queue_depth: int, io_size: int) -> int:
    """Two windows in flight must hold at least the queue depth's worth of reads each."""
    return min(MAX_WINDOW, max(MIN_WINDOW, 2 * queue_depth * io_size))


class GpuSink:
    """Copies each filled window to device memory on one stream; `wait(slot)` before refilling."""

    def __init__(self, nbytes: int):
        import cupy

        self._cupy = cupy
        self.device = cupy.empty(nbytes, dtype=cupy.uint8)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.events: dict[int, Any] = {}

    def copy(self, slot: int, host_address: int, nbytes: int) -> None:
        runtime = self._cupy.cuda.runtime
        runtime.memcpyAsync(self.device.data.ptr, host_address, nbytes, runtime.memcpyHostToDevice,
                            self.stream.ptr)
        event = self._cupy.cuda.Event(block=False, disable_timing=True)
        event.record(self.stream)
        self.events[slot] = event

    def wait(self, slot: int) -> None:
        if slot in self.events:
            self.events.pop(slot).synchronize()

    def finish(self) -> None:
        self.stream.synchronize()


def _host_address(buffer: Any) -> int:
    return buffer.address if hasattr(buffer, "address") else address_of(buffer)


def measure(backend: StorageBackend, windows: list[Any], *, nbytes: int, io_size: int, path: str,
            queue_depth: int, queue_pairs: int = 1, gpu: GpuSink | None = None, start: int = 0) -> BenchRow:
    """Reads `nbytes` from byte `start` of `backend` through the two `windows` (equal-size buffers,
    NumPy or DmaBuffer); returns the row. The source must hold start + nbytes bytes."""
    window = min(windows[0].nbytes, nbytes)
    window -= window % io_size
    if window <= 0:
        raise ValueError(f"window smaller than one {io_size}-byte read")
    nwindows = max(1, nbytes // window)
    total = nwindows * window
    process = psutil.Process()
    cpu0 = sum(process.cpu_times()[:2])
    began = time.perf_counter()

    def submit(index: int):
        slot = index % 2
        if gpu is not None:
            gpu.wait(slot)  # the copy out of this buffer must be done before it is refilled
        base = start + index * window
        ranges = [(base + off, io_size) for off in range(0, window, io_size)]
        dests = [windows[slot][off:off + io_size] for off in range(0, window, io_size)]
        return backend.read_async(ranges, dests)

    pending = submit(0)
    for index in range(1, nwindows + 1):
        following = submit(index) if index < nwindows else None
        pending.wait()
        if gpu is not None:
            slot = (index - 1) % 2
            gpu.copy(slot, _host_address(windows[slot]), window)
        pending = following
    if gpu is not None:
        gpu.finish()
    seconds = time.perf_counter() - began
    cpu = sum(process.cpu_times()[:2]) - cpu0
    return BenchRow(path, "gpu" if gpu is not None else "pinned", queue_pairs, queue_depth, io_size,
                    total, seconds, cpu)


_DD_RESULT = re.compile(r"(\d+) bytes .* copied, ([0-9.]+) s")


def measure_dd(path: str, nbytes: int, skip_bytes: int = 0,
               runner: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> BenchRow:
    """`dd if=PATH of=/dev/null iflag=direct bs=64M`, the reference a reader must keep up with."""
    count = max(1, nbytes // DD_BLOCK)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    argv = ["dd", f"if={path}", "of=/dev/null", "iflag=direct", f"bs={DD_BLOCK}", f"count={count}"]
    if skip_bytes:
        argv.append(f"skip={skip_bytes // DD_BLOCK}")
    began = time.perf_counter()
    done = runner(argv, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"dd failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
    matches = list(_DD_RESULT.finditer(done.stderr))
    match = matches[-1] if matches else None
    copied, seconds = (int(match.group(1)), float(match.group(2))) if match else (count * DD_BLOCK, wall)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return BenchRow("dd", "host", 1, 1, DD_BLOCK, copied, seconds, cpu)
