"""What the host side of the I/O path costs per command, without a device.

Two paths of the same queue pair: single commands (`submit` of a 128 KiB read from Python, then
`poll` of completions already in the CQ: phase check, CQ doorbell, delivery to the handle), and a
batch (`QueuePair.run`: the C loop builds PRPs and SQEs, rings one doorbell per batch, reaps and
finishes completions). Doorbells are plain memory and device addresses are host addresses, so
only our code is timed; the completions are posted into the CQ before they are reaped, with the
CIDs the free stack will hand out.

    python bench/nvme_hotpath.py [--depth 64] [--io-kib 128] [--repeats 20]

A third figure is the cost of one `run()` of a reused one-command batch: what a request adds to its
commands when requests go one at a time.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from nvmedirect.host_memory import PAGE_SIZE
from nvmedirect.queues.batch import Batch
from nvmedirect.queues.qpair import QueuePair
from nvmedirect.vfio._ffi import ffi
from nvmedirect.vfio.dma import DmaAllocator, _Allocation

LBA = 512


class HostAddressDma(DmaAllocator):
    """Device address = host address: enough to time the host side, never to drive hardware."""

    def _map(self, mem):
        pages = mem.address + PAGE_SIZE * np.arange(mem.nbytes // PAGE_SIZE, dtype=np.uint64)
        return _Allocation(self, mem, pages, None, physical=False)

    def _unmap(self, allocation):
        pass


def post_completions(qpair: QueuePair, cids: list[int]) -> None:
    """Write the CQEs a controller would, with the right phase tag for each slot."""
    native = qpair._native
    ring = ffi.cast("struct nvd_cqe *", qpair.cq_ring.address)
    head, phase = native.cq_head, native.phase
    for cid in cids:
        ring[head].cid, ring[head].sq_head, ring[head].status = cid, 0, phase
        head += 1
        if head == qpair.depth:
            head, phase = 0, phase ^ 1


def next_cids(qpair: QueuePair, count: int) -> list[int]:
    """The CIDs the next `count` submissions take (the top of the free stack)."""
    native = qpair._native
    return [native.free_cids[native.nfree - 1 - i] for i in range(count)]


def time_single(qpair: QueuePair, buffer, count: int, repeats: int) -> tuple[float, float]:
    submit_us, poll_us = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        commands = [qpair.submit(0x02, nsid=1, cdw12=len(buffer.view) // LBA - 1, data=buffer, ring=False)
                    for _ in range(count)]
        qpair.ring_doorbell()
        submit_us.append((time.perf_counter() - started) / count * 1e6)
        post_completions(qpair, [c.cid for c in commands])
        started = time.perf_counter()
        done = 0
        while done < count:
            done += qpair.poll()
        poll_us.append((time.perf_counter() - started) / count * 1e6)
    return min(submit_us), min(poll_us)


def time_batch(qpair: QueuePair, buffer, count: int, repeats: int) -> tuple[float, float]:
    """(build us per extent, run us per command) for batches of `count` one-command extents."""
    build_us, run_us = [], []
    blocks = buffer.nbytes // LBA
    for _ in range(repeats):
        started = time.perf_counter()
        batch = Batch(0x02, 1, LBA, blocks)
        for i in range(count):
            batch.add_direct(i * blocks, blocks, buffer)
        build_us.append((time.perf_counter() - started) / count * 1e6)
        post_completions(qpair, next_cids(qpair, count))
        started = time.perf_counter()
        assert qpair.run(batch) == count
        run_us.append((time.perf_counter() - started) / count * 1e6)
    return min(build_us), min(run_us)


def time_one_command_runs(qpair: QueuePair, buffer, count: int, repeats: int) -> float:
    """us per `run()` of a reused one-extent, one-command batch (posting its CQE included): what a
    request costs beyond its commands when requests go one at a time."""
    blocks = buffer.nbytes // LBA
    batch = Batch(0x02, 1, LBA, blocks)
    batch.add_direct(0, blocks, buffer)
    extent = batch.extents[0]
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for i in range(count):
            post_completions(qpair, next_cids(qpair, 1))
            extent.slba = i * blocks
            qpair.run(batch, 1)
        best = min(best, (time.perf_counter() - started) / count * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depth", type=int, default=64, help="queue entries (depth - 1 commands per round)")
    parser.add_argument("--io-kib", type=int, default=128, help="bytes per command (KiB)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    dma = HostAddressDma()
    doorbells = np.zeros(2, dtype=np.uint32)
    qpair = QueuePair(1, args.depth, dma, doorbells.ctypes.data, doorbells.ctypes.data + 4,
                      max_transfer=max(args.io_kib << 10, PAGE_SIZE))
    buffer = dma.alloc(args.io_kib << 10)
    count = args.depth - 1
    submit, poll = time_single(qpair, buffer, count, args.repeats)
    build, run = time_batch(qpair, buffer, count, args.repeats)
    per_request = time_one_command_runs(qpair, buffer, count, args.repeats)
    print(f"{args.io_kib} KiB commands, best of {args.repeats} rounds of {count}:")
    print(f"  single commands: submit {submit:.2f} us + poll/deliver {poll:.2f} us = {submit + poll:.2f} us per command")
    print(f"  batch:           build {build:.2f} us per extent + run {run:.2f} us per command "
          f"(PRPs, SQE, doorbell, reap in C)")
    print(f"  one-command batches, reused: {per_request:.2f} us per run() (posting its CQE included)")
    qpair.free()
    dma.close()


if __name__ == "__main__":
    main()
