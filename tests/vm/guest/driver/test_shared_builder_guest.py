"""Inside the VM: the submitter the GPU kernels mirror (native/nvme_emu_host.c over native/nvme_ring.h
and nvme_sqe.h) drives a real I/O queue pair of QEMU's NVMe controller, in this boot's VFIO mode:
the workloads of the GPU doorbell tests (same seeds, same generator) read the right bytes. What the
GPU's SQEs are, byte for byte, is tested on the GPU machine against this same builder
(tests/gpu/test_doorbell_gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest
import vmguest
from driver_setup import READ_SERIAL

from nvmedirect.emulator import ffi, library
from nvmedirect.gpu.rings import RING_DTYPE, WORK_DTYPE, list_pages_needed, random_reads
from nvmedirect.host_memory import PAGE_SIZE, address_of


def _drive(ctrl, qpair, work, queue_depth: int) -> np.ndarray:
    """Run `work` on `qpair`'s rings and doorbells with the shared submitter; returns the statuses
    and the destination bytes."""
    native = qpair._native  # the production queue pair is idle: its rings and doorbells are borrowed
    list_pages = list_pages_needed(ctrl.max_transfer)
    lists = ctrl.dma.alloc(max(1, queue_depth * list_pages) * PAGE_SIZE)
    dst = ctrl.dma.alloc(work.dst_bytes)
    try:
        list_iovas = np.ascontiguousarray(lists.page_addresses(), dtype=np.uint64)
        dst_pages = np.ascontiguousarray(dst.page_addresses(), dtype=np.uint64)
        status = np.full(work.count, 0xFFFF, dtype=np.uint32)
        ring = np.zeros(1, dtype=RING_DTYPE)
        ring[0] = (qpair.sq_ring.address, qpair.cq_ring.address, int(ffi.cast("uintptr_t", native.sq_doorbell)),
                   int(ffi.cast("uintptr_t", native.cq_doorbell)), lists.address, address_of(list_iovas),
                   qpair.depth, qpair.cq_depth, queue_depth, list_pages, 1, 512, 0, work.count,
                   native.sq_tail, native.cq_head, native.phase)
        work_struct = np.zeros(1, dtype=WORK_DTYPE)
        work_struct[0] = (address_of(work.slba), address_of(work.nblocks), address_of(work.dst_offset),
                          address_of(dst_pages), len(dst_pages), address_of(status))
        ok = library().nvd_host_drive(ffi.cast("struct nvd_ring *", address_of(ring)),
                                      ffi.cast("struct nvd_work *", address_of(work_struct)), 20 * 10**9)
        # Hand the ring indices back, so the production queue pair (and its deletion) go on from here.
        native.sq_tail, native.cq_head, native.phase = (int(ring[0][f]) for f in ("sq_tail", "cq_head", "cq_phase"))
        native.sq_head = native.sq_tail
        assert ok == work.count, f"{work.count - ok} of {work.count} reads failed: {sorted(set(status[status != 0]))[:4]}"
        return status, dst.view.copy()
    finally:
        lists.free()
        dst.free()


@pytest.mark.parametrize(("seed", "queue_depth"), [(1515, 64), (7, 1), (42, 17)])
def test_the_gpu_workloads_read_the_right_bytes_through_the_shared_submitter(ctrl, qpair, read_image, seed,
                                                                              queue_depth):
    nsze = len(read_image) // 512
    work = random_reads(seed=seed, count=600, nsze=nsze, lba_size=512, max_bytes=ctrl.max_transfer, large_fraction=0.02)
    status, got = _drive(ctrl, qpair, work, queue_depth)
    assert not status.any()
    expected = work.expected(np.frombuffer(read_image, dtype=np.uint8))
    assert np.array_equal(got, expected), "a byte differs from the backing image"
    # The production queue pair still works on the rings the shared submitter left behind.
    ns = ctrl.namespace(1)
    buf = ctrl.dma.alloc(64 * 512)
    batch = ns.batch()
    batch.add_direct(3, 64, buf)
    ns.run(batch, qpair=qpair)
    assert bytes(buf.view) == read_image[3 * 512:67 * 512]
    buf.free()


def test_probe_gpu_mmio_on_a_vfio_bound_controller_names_the_missing_gpu(ctrl):
    """The guest has a controller on vfio-pci (the one `ctrl` opened) and no GPU: one line, exit 4."""
    from click.testing import CliRunner

    from nvmedirect.cli import main

    bdf = vmguest.controllers()[READ_SERIAL]["bdf"]
    result = CliRunner().invoke(main, ["check", "--probe-gpu-mmio", bdf])
    assert result.exit_code == 4, result.output
    assert result.output.startswith(f"gpu-mmio {bdf}: blocked (no GPU): ") and result.output.count("\n") == 1
