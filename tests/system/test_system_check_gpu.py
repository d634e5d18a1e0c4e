"""`check`'s GPU lines against a real GPU (runs where CuPy sees one, e.g. the H200 machine)."""

from __future__ import annotations

import pytest

from nvmedirect.system import SystemView
from nvmedirect.system.readiness import check_bar_placement, check_gpu, check_gpu_mmio


@pytest.mark.gpu
def test_gpu_line_names_the_device_and_runtime():
    import cupy

    check = check_gpu()
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    assert check.status == "ok", check
    assert name in check.detail and "CUDA runtime" in check.detail


@pytest.mark.gpu
def test_bar_placement_reads_the_nvidia_gpu_bars():
    check = check_bar_placement(SystemView("/"))
    assert check.status in ("ok", "warn"), check  # "unknown" would mean the GPU was not found on the bus
    assert " BAR" in check.detail and "MiB" in check.detail


@pytest.mark.gpu
def test_gpu_mmio_probe_without_a_bound_controller_is_unknown():
    check = check_gpu_mmio(SystemView("/"), probe=True)
    assert check.status in ("unknown", "ok", "fail"), check
    if check.status == "unknown":
        assert "vfio-pci" in check.detail
