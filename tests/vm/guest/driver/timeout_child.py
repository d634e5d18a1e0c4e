"""Child process for the timeout fault test: throttle the controller's drive through QMP so a read
cannot finish in time, report the CommandTimeout (of a single command, then of a batch) as JSON on
stdout, lift the throttle, and exit
WITHOUT closing the controller, so the interpreter-exit path must shut it down and unmap the DMA.

Usage: python timeout_child.py BDF QEMU_DRIVE_ID {iommu,noiommu} TIMEOUT_S
"""

from __future__ import annotations

import json
import logging
import sys
import time

import vmguest

from nvmedirect.errors import CommandTimeout, NvmeDirectError
from nvmedirect.nvme.controller import Controller

THROTTLED_BYTES_PER_S = 100_000  # a 512 KiB read then needs ~5 s
LIMITS = ("bps", "bps_rd", "bps_wr", "iops", "iops_rd", "iops_wr")


def throttle(drive: str, bps_rd: int) -> None:
    limits = {name: 0 for name in LIMITS} | {"bps_rd": bps_rd}
    vmguest.qmp_request("block_set_io_throttle", {"device": drive, **limits})


def main() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    bdf, drive, mode, timeout_s = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    ctrl = Controller.open(bdf, noiommu=mode == "noiommu", io_timeout_s=timeout_s)
    ns = ctrl.namespace(1)
    qpair = ctrl.default_qpair
    buf = ctrl.dma.alloc(ctrl.max_transfer)
    ns.read(0, 8, buf)  # the device works before the fault
    throttle(drive, THROTTLED_BYTES_PER_S)
    report = {"error": None}
    # QEMU's leaky bucket lets the first request through at once; the next ones wait for it.
    for attempt in range(4):
        started = time.monotonic()
        completion = ns.submit_read(qpair, attempt * 1024, ctrl.max_transfer // ns.lba_size, buf).wait()
        if not completion.ok:
            exc = completion.exception()
            report = {"error": type(exc).__name__, "message": str(exc), "attempt": attempt,
                      "elapsed_s": time.monotonic() - started, "timeout_s": timeout_s,
                      "is_timeout": isinstance(exc, CommandTimeout)}
            break
    # The same through a batch (the native loop's own deadline), while the throttle still holds.
    big = ctrl.dma.alloc(4 * ctrl.max_transfer)
    started = time.monotonic()
    try:
        ns.read(8192, big.nbytes // ns.lba_size, big)
        report["batch"] = {"error": None}
    except NvmeDirectError as exc:
        report["batch"] = {"error": type(exc).__name__, "message": str(exc), "elapsed_s": time.monotonic() - started}
    throttle(drive, 0)
    report["live_mappings_before_exit"] = ctrl.dma.live_mappings()
    print(json.dumps(report), flush=True)
    return 0  # no ctrl.close(): the atexit handler must release everything


if __name__ == "__main__":
    sys.exit(main())
