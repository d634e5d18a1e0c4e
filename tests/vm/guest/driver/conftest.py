"""Guest-side fixtures for the driver tests, chained as pynvme does: bound → ctrl → ns → qpair.

Controllers are configured by tests/vm/test_driver.py (serials in driver_setup.py); each is moved to vfio-pci for
the module and handed back to the kernel's nvme driver afterwards.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import vmguest
from driver_setup import HUGE_PAGES, READ_SERIAL, image_bytes

from nvmedirect.nvme.controller import Controller


@pytest.fixture(scope="session", autouse=True)
def driver_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")


@pytest.fixture(scope="session", autouse=True)
def huge_pages() -> None:
    """Reserve huge pages: in no-IOMMU mode rings above 4 KiB must be physically contiguous."""
    Path("/proc/sys/vm/nr_hugepages").write_text(str(HUGE_PAGES))


@pytest.fixture(scope="module")
def bound() -> Iterator:
    """`bound(serial)` → BDF of that controller, now on vfio-pci; restored after the module."""
    done: list[str] = []

    def bind(serial: str) -> str:
        bdf = vmguest.controllers()[serial]["bdf"]
        vmguest.bind(bdf, "vfio-pci")
        done.append(bdf)
        return bdf

    yield bind
    for bdf in done:
        vmguest.restore_kernel_driver(bdf)


@pytest.fixture(scope="module")
def ctrl(bound, vm_mode) -> Iterator[Controller]:
    controller = Controller.open(bound(READ_SERIAL), noiommu=vm_mode == "noiommu", io_queues=4)
    yield controller
    controller.close()
    assert controller.dma.live_mappings() == 0


@pytest.fixture(scope="module")
def ns(ctrl):
    return ctrl.namespace(1)


@pytest.fixture
def qpair(ctrl):
    qp = ctrl.create_io_qpair(depth=65)  # 64 commands in flight
    yield qp
    ctrl.delete_io_qpair(qp)


@pytest.fixture(scope="module")
def read_image() -> bytes:
    return image_bytes(READ_SERIAL)
