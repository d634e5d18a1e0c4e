"""`check`'s GPU lines against a real GPU (runs where CuPy sees one, e.g. the H200 machine)."""

from __future__ import annotations

import pytest

from nvmedirect.system import SystemView, list_controllers
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
    view = SystemView("/")
    if any(c.driver == "vfio-pci" for c in list_controllers(view)):
        pytest.skip("a controller is bound to vfio-pci here: the probe would really run")
    check = check_gpu_mmio(view, probe=True)
    assert check.status == "unknown" and "no controller bound to vfio-pci" in check.detail, check
