"""GPU-initiated vs CPU-initiated NVMe commands per second against the same emulated controller
(nvmedirect/emulator.py): the GPU kernels of nvmedirect/gpu/doorbell.cu and the CPU reference
submitter (native/nvme_emu_host.c, one thread per queue) issue the same 4 KiB reads through the
same builder (native/nvme_sqe.h). The emulator is one CPU thread serving every queue, so at depth
it bounds both sides; at QD 1 the figure is one round trip (submitter -> doorbell -> controller ->
CQE -> submitter) and shows the latency of each side's path to host memory.

    python -m bench.doorbell_bench --out doorbell.json [--commands 20000] [--cpu-only]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

from nvmedirect.emulator import EmulatedController
from nvmedirect.gpu.rings import QueueMemory, QueueSpec, Workload, host_drive

CONFIGS = [(1, 1), (1, 32), (4, 64), (8, 128), (8, 255)]  # (queues, queue depth)
READ_BYTES = 4096


def page_reads(count: int, nsze: int, seed: int = 0) -> Workload:
    """`count` one-page reads at random 4 KiB-aligned LBAs, each into a page of its own."""
    rng = np.random.default_rng(seed)
    blocks = READ_BYTES // 512
    slba = rng.integers(0, nsze // blocks, count).astype(np.uint64) * np.uint64(blocks)
    offsets = np.arange(count, dtype=np.uint64) * np.uint64(READ_BYTES)
    return Workload(slba, np.full(count, blocks, dtype=np.uint64), offsets, count * READ_BYTES, 512)


def measure(emu: EmulatedController, queues: int, qd: int, count: int, gpu: bool) -> dict[str, object]:
    work = page_reads(count, emu.nsze)
    specs = [QueueSpec(q + 1, qd, qd + 1) for q in range(queues)]
    memory = QueueMemory(emu, specs, work, READ_BYTES)
    before = emu.counters()
    try:
        if gpu:
            from nvmedirect.gpu.doorbell import GpuQueues

            with GpuQueues(memory) as queues_on_gpu:
                queues_on_gpu.drive(timeout_s=10.0)  # warm-up: compile, first touches
                start = time.perf_counter()
                status = queues_on_gpu.drive(timeout_s=10.0)
                seconds = time.perf_counter() - start
        else:
            host_drive(memory, parallel=True)  # warm-up
            start = time.perf_counter()
            host_drive(memory, parallel=True)
            seconds = time.perf_counter() - start
            status = memory.status
    finally:
        memory.release()
    after = emu.counters()
    return {"side": "gpu" if gpu else "cpu", "queues": queues, "queue_depth": qd, "commands": count,
            "seconds": round(seconds, 4), "commands_per_s": round(count / seconds),
            "failed": int(np.count_nonzero(status)), "violations": after["violations"] - before["violations"],
            "sq_doorbells": (after["sq_doorbells"] - before["sq_doorbells"]) // 2,
            "cq_doorbells": (after["cq_doorbells"] - before["cq_doorbells"]) // 2}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commands", type=int, default=20000)
    parser.add_argument("--cpu-only", action="store_true", help="no GPU here: the CPU side only")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    results: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "namespace.img")
        np.random.default_rng(1).integers(0, 256, 64 << 20, dtype=np.uint8).tofile(path)
        with EmulatedController(path, mdts_bytes=1 << 20) as emu:
            emu.set_idle_sleep(0)  # spin: the controller's own latency as low as it goes
            for queues, qd in CONFIGS:
                for gpu in ((False,) if args.cpu_only else (False, True)):
                    try:
                        row = measure(emu, queues, qd, args.commands, gpu)
                    except Exception as exc:  # one failed configuration must not lose the others
                        row = {"side": "gpu" if gpu else "cpu", "queues": queues, "queue_depth": qd,
                               "error": f"{type(exc).__name__}: {str(exc)[:500]}"}
                    results.append(row)
                    print(json.dumps(row), flush=True)
    report = {"read_bytes": READ_BYTES, "emulator": "one CPU thread, all queues", "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if all("error" not in r and not r.get("failed") and not r.get("violations") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
