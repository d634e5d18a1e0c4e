"""Inside the VM: GGUF models on QEMU NVMe namespaces through the kernel block device and through
our userspace driver, read back tensor by tensor; refusals; bench userspace vs kernel.

Controllers (configured by tests/vm/test_store.py): nvd-store-512 and nvd-store-4k (blank, 512- and
4096-byte LBAs), nvd-store-fs (an ext4 filesystem made on the host). The tests run in file order.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import vmguest
from click.testing import CliRunner

from nvmedirect.cli import main
from nvmedirect.cli.common import EXIT_REFUSED
from nvmedirect.reader import BlockDeviceBackend, open_model
from nvmedirect.reader.nvme_backend import NvmeBackend
from nvmedirect.system import binding
from nvmedirect.system.devices import read_controller
from nvmedirect.system.sysview import SystemView

MODEL = Path(os.environ.get("NVD_STORE_MODEL", "/nonexistent"))
SERIALS = {512: "nvd-store-512", 4096: "nvd-store-4k"}
FS_SERIAL = "nvd-store-fs"
# Odd, not 1 MiB-aligned start LBAs for the second copy (the host checks the images at these).
NONZERO_LBA = {512: 300_001, 4096: 37_501}


def cli(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def kernel_device(serial: str) -> str:
    return "/dev/" + read_controller(SystemView(), bdf_of(serial)).block_devices[0]


def bdf_of(serial: str) -> str:
    return vmguest.controllers()[serial]["bdf"]


@pytest.fixture(scope="module", autouse=True)
def writable_state_dir() -> None:
    """`bind`/`restore` keep their state file under /var/lib; the guest's root is read-only."""
    upper = Path("/run/varlib")
    (upper / "upper").mkdir(parents=True, exist_ok=True)
    (upper / "work").mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                    f"lowerdir=/var/lib,upperdir={upper}/upper,workdir={upper}/work", "/var/lib"], check=True)


@pytest.fixture(scope="module")
def raw_model() -> np.ndarray:
    assert MODEL.is_file(), f"model {MODEL} not visible in the guest"
    return np.fromfile(MODEL, dtype=np.uint8)


@pytest.fixture
def vfio_bound(noiommu: bool) -> Iterator:
    """`vfio_bound(serial)` → BDF, bound to vfio-pci with `nvmedirect.system.binding` (so the bench's
    kernel comparison can restore it); handed back to the kernel after the test."""
    done: list[str] = []

    def bind(serial: str) -> str:
        bdf = bdf_of(serial)
        binding.bind(SystemView(), bdf, power_up=False)
        done.append(bdf)
        return bdf

    yield bind
    for bdf in done:
        binding.restore(SystemView(), bdf)


def every_tensor_equal(model, raw: np.ndarray) -> int:
    assert model.size == raw.nbytes
    infos = list(model.tensors.values())
    # Submit every tensor at once (many reads in flight), then wait once.
    outs = [np.empty(t.nbytes, dtype=np.uint8) for t in infos]
    model.read_async([t.byte_range for t in infos], outs).wait()
    for info, out in zip(infos, outs, strict=True):
        assert np.array_equal(out, raw[info.offset:info.offset + info.nbytes]), info.name
    return len(infos)


@pytest.mark.parametrize("lba_size", [512, 4096])
def test_kernel_block_device_write_at_lba0_and_read(lba_size: int, raw_model: np.ndarray) -> None:
    device = kernel_device(SERIALS[lba_size])
    # Named by /dev path, or by PCI address while the kernel nvme driver has it: both go through
    # the kernel block device.
    name = device if lba_size == 512 else bdf_of(SERIALS[lba_size])
    result = cli("write-gguf", MODEL, "-d", name, "--lba", 0, "--name", "kernel-written", "-y", "--json")
    assert result.exit_code == 0, result.output
    written = json.loads(result.stdout)
    assert written["lba_size"] == lba_size
    assert written["via"] == "kernel block device" and written["target"] == device
    with open_model(device) as model:
        assert isinstance(model.backend, BlockDeviceBackend) and model.backend.direct
        assert model.stored.model_name == "kernel-written" and model.stored.start_lba == 0
        assert every_tensor_equal(model, raw_model) == 272
        model.verify()


@pytest.mark.parametrize("lba_size", [512, 4096])
def test_userspace_write_at_nonzero_lba_and_read_both_ways(lba_size: int, raw_model: np.ndarray, vfio_bound,
                                                           noiommu: bool) -> None:
    serial, lba = SERIALS[lba_size], NONZERO_LBA[lba_size]
    old_name = kernel_device(serial)
    bdf = vfio_bound(serial)
    assert not os.path.exists(old_name)
    flag = ["--noiommu"] if noiommu else []
    result = cli("write-gguf", MODEL, "-d", bdf, "--lba", lba, "--name", "driver-written", "-y", "--json", *flag)
    assert result.exit_code == 0, result.output
    written = json.loads(result.stdout)
    assert written["lba_size"] == lba_size and written["start_lba"] == lba
    assert written["via"] == "userspace driver"
    listing = json.loads(cli("ls-gguf", "-d", bdf, "--lba", lba, "--json", *flag).stdout)
    assert [m["name"] for m in listing["models"]] == ["driver-written"]
    # Through the userspace driver: the model it wrote, and the one the kernel wrote at LBA 0.
    with open_model(bdf, lba=lba, noiommu=noiommu) as model:
        assert isinstance(model.backend, NvmeBackend) and model.backend.queue_pairs >= 2
        every_tensor_equal(model, raw_model)
        model.verify()
    # The /dev name the namespace had before `bind` still finds it (through the bind state file).
    with open_model(old_name, lba=0, noiommu=noiommu) as model:
        assert isinstance(model.backend, NvmeBackend)
        assert model.stored.model_name == "kernel-written"
        model.verify()
    # Back on the kernel driver, the driver-written copy reads the same through the block device.
    binding.restore(SystemView(), bdf)
    with open_model(kernel_device(serial), lba=lba) as model:
        assert model.stored.model_name == "driver-written"
        every_tensor_equal(model, raw_model)
        model.verify()


def test_refuses_device_with_a_filesystem() -> None:
    result = cli("write-gguf", MODEL, "-d", kernel_device(FS_SERIAL), "-y")
    assert result.exit_code == EXIT_REFUSED, result.output
    assert "ext2/3/4" in result.output and "--force" in result.output


def test_refuses_mounted_device_even_with_force() -> None:
    device = kernel_device(FS_SERIAL)
    mountpoint = Path("/run/nvd-store-mnt")
    mountpoint.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "ext4", device, str(mountpoint)], check=True)
    try:
        result = cli("write-gguf", MODEL, "-d", device, "--force", "-y")
        assert result.exit_code == EXIT_REFUSED, result.output
        assert f"mounted at {mountpoint}" in result.output
    finally:
        subprocess.run(["umount", str(mountpoint)], check=True)


def test_bench_userspace_against_kernel(vfio_bound, noiommu: bool) -> None:
    bdf = vfio_bound(SERIALS[512])
    flag = ["--noiommu"] if noiommu else []
    result = cli("bench", "-d", bdf, "--size", "96M", "--qd", "1,8", "--io-size", "128K,1M", "--qpairs", "1,2",
                 "--no-gpu", "--json", *flag)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    (vmguest.results_dir() / f"bench-{'noiommu' if noiommu else 'iommu'}.json").write_text(result.stdout)
    paths = {row["path"] for row in report["rows"]}
    assert {"userspace", "kernel", "dd"} <= paths
    assert all(row["gb_s"] > 0 and row["nbytes"] >= 64 << 20 for row in report["rows"])
    assert report["summary"]["userspace_vs_kernel"] > 0
    assert binding.current_driver(SystemView(), bdf) == "vfio-pci"  # bound back after the comparison
