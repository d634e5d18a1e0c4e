"""GGUF models on QEMU NVMe namespaces (issue 5): kernel and userspace paths, 512- and 4096-byte
LBAs, LBA 0 and odd non-zero LBAs, refusals, and bench userspace vs kernel. The guest module runs in
the boot it shares with the other VM tests (tests/vm/shared_boot.py: store_part configures the
controllers; NVD_STORE_VM_MODES=iommu,noiommu adds the no-IOMMU boot)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from shared_boot import STORE_MODES

from nvmedirect.reader import open_model

NONZERO_LBA = {512: 300_001, 4096: 37_501}  # the same as the guest module's


@pytest.mark.vm
@pytest.mark.parametrize("mode", STORE_MODES)
def test_store_in_guest(mode: str, shared_boot) -> None:
    boot = shared_boot(mode)
    result = boot.result("store")
    result.assert_passed()
    assert len(result.passed) == 7, result.summary()
    files = boot.parts["store"].files
    images = {512: files["ns512"], 4096: files["ns4k"]}

    # What the guest wrote is on the backing images where the headers say, byte for byte.
    raw = np.fromfile(files["model"], dtype=np.uint8)
    for lba_size, image in images.items():
        for lba, name in ((0, "kernel-written"), (NONZERO_LBA[lba_size], "driver-written")):
            with open_model(image, lba=lba, lba_size=lba_size) as model:
                assert model.stored.model_name == name
                data = model.backend.read_bytes(model.base_offset, model.size)
                assert data == raw.tobytes()
    # (Mounting updates the ext4 superblock, so only look for what write-gguf would have left.)
    head = files["fs"].read_bytes()[:8192]
    assert not head.startswith(b"NVDGGUF") and head[4096:4100] != b"GGUF", "a refused write reached the device"

    report = json.loads((result.vm.results_dir / f"bench-{mode}.json").read_text())
    print(f"\nbench in the VM (QEMU NVMe, TCG, {mode}):")
    for row in report["rows"]:
        print(f"  {row['path']:<10} qp={row['queue_pairs']} qd={row['queue_depth']:>2} io={row['io_size'] >> 10:>5}K "
              f"{row['gb_s']:.3f} GB/s {row['iops']:.0f} IOPS cpu {row['cpu_percent']:.0f}%")
    print(f"  summary: {report['summary']}")
