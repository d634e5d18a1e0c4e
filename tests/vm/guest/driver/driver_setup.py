"""What tests/vm/test_driver.py configured for the driver's guest tests: controller serials and
how to reach each one's backing image (shared over 9p)."""

from __future__ import annotations

from pathlib import Path

import vmguest

READ_SERIAL = "nvd-drv-read"  # 512-byte LBAs, random image, QEMU's default MDTS (512 KiB)
BIG_LBA_SERIAL = "nvd-drv-4k"  # 4096-byte LBAs, random image, no MDTS limit
WRITE_SERIAL = "nvd-drv-write"  # blank image the host checks afterwards
FAULT_SERIAL = "nvd-drv-fault"  # throttled through QMP to force a command timeout
ONE_QPAIR_SERIAL = "nvd-drv-1qp"  # grants one I/O queue pair; holds a model stored by write-gguf
HUGE_PAGES = 64  # 128 MiB of 2 MiB pages: contiguous DMA without an IOMMU


def spec(serial: str) -> dict:
    return next(c for c in vmguest.vm_config()["controllers"] if c["serial"] == serial)


def image_bytes(serial: str) -> bytes:
    return Path(spec(serial)["image"]).read_bytes()
