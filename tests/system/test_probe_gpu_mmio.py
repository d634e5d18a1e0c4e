"""`nvmedirect check --probe-gpu-mmio [BDF]`: one line naming the blocker and exit 4, never a
traceback. Here (no GPU) the real answer is "no GPU"; with a stand-in CuPy that reports a device,
the controller blockers on fake sysfs trees. The GPU machine tests the "no NVMe bound" answer for
real (tests/gpu/test_doorbell_gpu.py); the positive path needs a GPU and a vfio-bound drive in one
machine (docs/DRIVER.md)."""

from __future__ import annotations

import json
import sys
import types

import pytest
from click.testing import CliRunner

from nvmedirect.cli import main
from nvmedirect.gpu.probe import registration_blocker

A = "0000:00:04.0"


def probe(fake, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["check", "--root", str(fake.root), "--probe-gpu-mmio", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output


@pytest.fixture
def gpu_present(monkeypatch):
    """A CuPy stand-in that reports one device (only the probe's first question is asked of it)."""
    runtime = types.SimpleNamespace(getDeviceCount=lambda: 1)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime)))


def test_without_a_gpu_the_blocker_is_the_gpu(fake):
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount():
            pytest.skip("a GPU is present here")
    except Exception:
        pass
    code, out = probe(fake, A)
    assert code == 4 and out.count("\n") == 1
    assert out.startswith(f"gpu-mmio {A}: blocked (no GPU): ")


def test_a_missing_controller_is_named(fake, gpu_present):
    code, out = probe(fake, "ff:1f.7")
    assert code == 4 and out.strip() == ("gpu-mmio 0000:ff:1f.7: blocked (no vfio-bound controller): no PCI device "
                                         "0000:ff:1f.7, so no vfio-bound NVMe controller there (see `nvmedirect list`)")


def test_a_controller_of_the_kernel_driver_must_be_bound_first(fake, gpu_present):
    fake.nvme(A, "nvme0", {"nvme0n1": []})
    code, out = probe(fake, A)
    assert code == 4 and f"bound to nvme, not vfio-pci: run `nvmedirect bind {A}` first" in out


def test_not_an_nvme_function(fake, gpu_present):
    fake.pci(A, pci_class="0x030000", driver=None)
    code, out = probe(fake, A)
    assert code == 4 and "is not an NVMe controller" in out


def test_without_a_bdf_the_first_vfio_controller_or_none(fake, gpu_present):
    code, out = probe(fake, "--json")
    data = json.loads(out)
    assert code == 4 and data["blocker"] == "no vfio-bound controller" and "nvmedirect bind" in data["detail"]


def test_a_vfio_bound_controller_of_a_fake_root_is_not_mapped(fake, gpu_present):
    fake.pci(A, driver="vfio-pci")
    code, out = probe(fake, A)
    assert code == 4 and "blocked (not a live system)" in out


def test_registration_refusals_name_the_follow_pfn_patch():
    text = registration_blocker(RuntimeError("cudaErrorNotSupported: operation not supported"))
    assert "follow_pfn" in text and "--patch-nvidia" in text
    assert "invalid argument" in registration_blocker(RuntimeError("cudaErrorInvalidValue: invalid argument"))
