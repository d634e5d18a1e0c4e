"""How long a pass's small upload (its row index: tens of KB) takes while a streamed model's ring
refills are queued on the copy engine, by cudaMemcpyAsync and by the SMs (infer/gpu/uploads.py).

Each trial queues `--queued-mb` of pinned host-to-device copies on a copy stream (the ring's
refills; 0: the engine idle), then one upload on another stream, and times from the upload's
queueing to its completion on the host (what a speculative round's draft waits). The link's rate
is measured in the same run (the bulk copies alone), so the queued megabytes convert to the
milliseconds a copy-engine upload would wait if it queued behind all of them.

    python -m bench.upload_bench --out upload.json [--queued-mb 0,86,215] [--kb 4,43] [--trials 20]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

CHUNK = 10 << 20  # a ring slot of the real pair's target: about 10.8 MiB


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--queued-mb", default="0,86,215", help="megabytes of refills queued before the upload")
    p.add_argument("--kb", default="4,43", help="upload sizes in KB")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--out", help="write the JSON here too")
    args = p.parse_args(argv)
    try:
        import cupy
    except ImportError:
        print("upload_bench: needs CuPy and a GPU", file=sys.stderr)
        return 2
    from infer.gpu import uploads

    queued = [int(x) for x in args.queued_mb.split(",")]
    sizes = [int(x) for x in args.kb.split(",")]
    big = max(queued) << 20
    bulk_host = cupy.cuda.alloc_pinned_memory(max(big, CHUNK))
    bulk_dev = cupy.empty(max(big, CHUNK), cupy.uint8)
    copies, stream = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)

    def queue_bulk(nbytes: int) -> None:
        for at in range(0, nbytes, CHUNK):
            cupy.cuda.runtime.memcpyAsync(bulk_dev.data.ptr + at, bulk_host.ptr + at, min(CHUNK, nbytes - at),
                                          cupy.cuda.runtime.memcpyHostToDevice, copies.ptr)

    # the link's rate, measured here
    queue_bulk(big)
    copies.synchronize()
    began = time.perf_counter()
    queue_bulk(big)
    copies.synchronize()
    link_gbs = big / (time.perf_counter() - began) / 1e9 if big else None
    rows = []
    for kb in sizes:
        pinned = cupy.cuda.alloc_pinned_memory(kb << 10)
        host = np.frombuffer(pinned, np.uint8, kb << 10)
        device = cupy.empty(kb << 10, cupy.uint8)
        for mode in ("engine", "sms"):
            os.environ["NVMEDIRECT_SM_UPLOADS"] = "1" if mode == "sms" else "0"
            uploads.copy_from_host(device.data.ptr, host.ctypes.data, kb << 10, stream)  # compiled, warm
            stream.synchronize()
            for mb in queued:
                waits = []
                for _ in range(args.trials):
                    queue_bulk(mb << 20)
                    t0 = time.perf_counter()
                    uploads.copy_from_host(device.data.ptr, host.ctypes.data, kb << 10, stream)
                    stream.synchronize()
                    waits.append(time.perf_counter() - t0)
                    copies.synchronize()
                ms = 1e3 * float(np.median(waits))
                row = {"upload_kb": kb, "mode": mode, "queued_mb": mb, "median_ms": round(ms, 4),
                       "p90_ms": round(1e3 * float(np.percentile(waits, 90)), 4),
                       "queue_drain_ms": round(mb * 1.048576 / link_gbs, 3) if link_gbs and mb else 0.0}
                rows.append(row)
                print(json.dumps(row), flush=True)
    result = {"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "link_gbs": link_gbs,
              "trials": args.trials, "rows": rows, "command": "python -m bench.upload_bench " + " ".join(argv or sys.argv[1:])}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
