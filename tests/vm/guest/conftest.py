"""Guest-side fixtures (these tests run inside the VM; see tests/vm/rig_pytest.py).

Subfolders (guest/driver/, guest/system/, ...) inherit these fixtures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import vmguest


@pytest.fixture(scope="session")
def vm_config() -> dict[str, Any]:
    return vmguest.vm_config()


@pytest.fixture(scope="session")
def vm_mode() -> str:
    """"iommu" or "noiommu": how this VM was booted."""
    return vmguest.vm_mode()


@pytest.fixture(scope="session")
def noiommu(vm_mode: str) -> bool:
    """The `noiommu=` argument for nvmedirect.vfio in this VM."""
    return vm_mode == "noiommu"


@pytest.fixture(scope="session")
def controllers() -> dict[str, dict[str, Any]]:
    """serial -> {bdf, controller, model, namespaces} as the guest kernel saw them at boot."""
    return vmguest.controllers()


@pytest.fixture
def vfio_bind() -> Iterator[Callable[[str], str]]:
    """`vfio_bind(bdf)` moves a controller to vfio-pci; it goes back to nvme after the test."""
    bound: list[str] = []

    def bind(bdf: str) -> str:
        vmguest.bind(bdf, "vfio-pci")
        bound.append(bdf)
        return bdf

    yield bind
    for bdf in bound:
        vmguest.restore_kernel_driver(bdf)
