"""What the Python side of the I/O path costs per command, without a device: `submit` of a 128 KiB
read (PRPs + SQE + tracker) and `poll` of completions already in the CQ (phase check, CQ doorbell,
delivery). Doorbells are no-ops and device addresses are host addresses, so only our code is timed.

    python bench/nvme_hotpath.py [--commands 1000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from nvmedirect.queues.qpair import QueuePair
from nvmedirect.vfio._ffi import ffi
from nvmedirect.vfio.dma import DmaAllocator, _Allocation
from nvmedirect.vfio.memory import PAGE_SIZE


class HostAddressDma(DmaAllocator):
    """Device address = host address: enough to time the host side, never to drive hardware."""

    def _map(self, mem):
        pages = mem.address + PAGE_SIZE * np.arange(mem.nbytes // PAGE_SIZE, dtype=np.uint64)
        return _Allocation(self, mem, pages, None, physical=False)

    def _unmap(self, allocation):
        pass


class NoDoorbell:
    def ring(self, value: int) -> None:
        pass


def post_completions(qpair: QueuePair, commands: list) -> None:
    """Write the CQEs a controller would, with the right phase tag for each slot."""
    ring = ffi.cast("struct nvd_cqe *", qpair.cq_ring.address)
    head, phase = qpair._cq_head[0], qpair._cq_phase[0]
    for command in commands:
        ring[head].cid, ring[head].sq_head, ring[head].status = command.cid, 0, phase
        head += 1
        if head == qpair.depth:
            head, phase = 0, phase ^ 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--commands", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dma = HostAddressDma()
    qpair = QueuePair(1, args.commands + 1, dma, NoDoorbell(), NoDoorbell(), max_transfer=1 << 20)
    buffer = dma.alloc(128 << 10)
    submit_us, poll_us = [], []
    for _ in range(args.repeats):
        started = time.perf_counter()
        commands = [qpair.submit(0x02, nsid=1, cdw12=255, data=buffer, ring=False) for _ in range(args.commands)]
        qpair.ring_doorbell()
        submit_us.append((time.perf_counter() - started) / args.commands * 1e6)
        post_completions(qpair, commands)
        started = time.perf_counter()
        done = 0
        while done < args.commands:
            done += qpair.poll()
        poll_us.append((time.perf_counter() - started) / args.commands * 1e6)
    print(f"submit: {min(submit_us):.1f} us/command (best of {args.repeats}), "
          f"poll + deliver: {min(poll_us):.1f} us/command")
    qpair.free()
    dma.close()


if __name__ == "__main__":
    main()
