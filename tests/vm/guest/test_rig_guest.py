"""Inside the VM: the controllers are where and what the host configured, the kernel reads the backing
image, and nvmedirect.vfio reaches BAR0 in this boot's VFIO mode. Driven by tests/vm/test_rig.py.

The boot is shared with other guest modules (tests/vm/shared_boot.py), whose controllers are also
attached: the per-controller tests cover the rig's own (serials nvd-rig-*), the address test every
controller the host configured. This module runs first, while every controller is still on nvme."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from pathlib import Path

import pytest
from vmguest import controllers, current_driver, vm_config

from nvmedirect.errors import DeviceNotFound
from nvmedirect.vfio import VfioDevice

NVME_VERSION_1_4 = 0x00010400  # what QEMU 7.2's controller reports in VS
QEMU_DEFAULT_MDTS = 7
QEMU_DEFAULT_MAX_IOQPAIRS = 64
ALL_SERIALS = [c["serial"] for c in vm_config()["controllers"]]
SERIALS = [serial for serial in ALL_SERIALS if serial.startswith("nvd-rig-")]


def spec(serial: str) -> dict:
    return next(c for c in vm_config()["controllers"] if c["serial"] == serial)


def namespace_block(serial: str) -> Path:
    return Path("/sys/block") / controllers()[serial]["namespaces"][0]


def test_every_controller_at_its_configured_address(vm_config, controllers):
    assert sorted(controllers) == sorted(ALL_SERIALS)
    for ctrl in vm_config["controllers"]:
        found = controllers[ctrl["serial"]]
        assert found["bdf"] == ctrl["bdf"], f"{ctrl['serial']} at {found['bdf']}, rig promised {ctrl['bdf']}"
        assert found["model"] == "QEMU NVMe Ctrl"
        assert current_driver(found["bdf"]) == "nvme"


def test_vfio_modules_match_boot_mode(vm_mode):
    # Debian's own vfio.ko lacks the parameter; the rig's rebuilt one has it, switched on.
    param = Path("/sys/module/vfio/parameters/enable_unsafe_noiommu_mode")
    flag = param.read_text().strip() if param.exists() else "absent"
    assert flag == ("Y" if vm_mode == "noiommu" else "absent")


@pytest.mark.parametrize("serial", SERIALS)
def test_namespace_geometry_follows_spec(serial):
    ns = spec(serial)["namespaces"][0]
    block = namespace_block(serial)
    assert int((block / "queue/logical_block_size").read_text()) == ns["logical_block_size"]
    assert int((block / "size").read_text()) * 512 == ns["size"]


@pytest.mark.parametrize("serial", SERIALS)
def test_transfer_limit_follows_mdts(serial):
    mdts = spec(serial)["mdts"] or QEMU_DEFAULT_MDTS
    max_kb = int((namespace_block(serial) / "queue/max_hw_sectors_kb").read_text())
    assert max_kb == 4 * 2**mdts  # MDTS is a power of two in units of the 4 KiB minimum page


@pytest.mark.parametrize("serial", SERIALS)
def test_io_queue_count_follows_max_ioqpairs(serial):
    limit = spec(serial)["max_ioqpairs"] or QEMU_DEFAULT_MAX_IOQPAIRS
    hardware_queues = list((namespace_block(serial) / "mq").iterdir())
    assert len(hardware_queues) == min(os.cpu_count(), limit)


def test_kernel_reads_prefilled_image():
    prefilled = [c for c in vm_config()["controllers"] if c["image"] and c["serial"] in SERIALS]
    assert prefilled, "the host test configures one controller with a pre-filled image"
    for ctrl in prefilled:
        size = ctrl["namespaces"][0]["size"]
        device = f"/dev/{controllers()[ctrl['serial']]['namespaces'][0]}"
        data = subprocess.run(["dd", f"if={device}", "bs=1M", f"count={size >> 20}", "iflag=direct",
                               "status=none"], capture_output=True, check=True).stdout
        assert len(data) == size
        assert hashlib.sha256(data).hexdigest() == os.environ["NVD_RIG_IMAGE_SHA256"]
        assert data == Path(ctrl["image"]).read_bytes()  # the same file, seen over 9p


@pytest.mark.parametrize("serial", SERIALS)
def test_vfio_refuses_controller_still_on_nvme(serial, noiommu):
    with pytest.raises(DeviceNotFound):
        VfioDevice.open(controllers()[serial]["bdf"], noiommu=noiommu)


@pytest.mark.parametrize("serial", SERIALS)
def test_vfio_bar0_registers(serial, noiommu, vfio_bind):
    bdf = vfio_bind(controllers()[serial]["bdf"])
    with VfioDevice.open(bdf, noiommu=noiommu) as dev:
        pattern = r"/dev/vfio/noiommu-\d+" if noiommu else r"/dev/vfio/\d+"
        assert re.fullmatch(pattern, dev.group.path)
        bar = dev.map_bar(0)
        assert bar.read32(0x8) == NVME_VERSION_1_4
        cap = bar.read64(0x0)
        mqes = cap & 0xFFFF
        assert 1 <= mqes <= 0xFFFF and mqes + 1 >= 64, f"CAP.MQES {mqes} implausible"
        assert cap >> 16 & 1, "CAP.CQR: QEMU requires physically contiguous queues"
        assert cap >> 24 & 0xFF, "CAP.TO (ready timeout) is zero"
        assert cap >> 32 & 0xF == 0, "CAP.DSTRD: QEMU packs doorbells 4 bytes apart"
        assert cap >> 37 & 1, "CAP.CSS does not include the NVM command set"
        assert cap >> 48 & 0xF == 0, "CAP.MPSMIN should be 4 KiB"
        doorbells = 0x1000 + 8 * ((spec(serial)["max_ioqpairs"] or QEMU_DEFAULT_MAX_IOQPAIRS) + 1)
        assert bar.size >= doorbells


def test_each_controller_has_its_own_vfio_group(noiommu, vfio_bind):
    groups = set()
    for serial in SERIALS:
        bdf = vfio_bind(controllers()[serial]["bdf"])
        with VfioDevice.open(bdf, noiommu=noiommu) as dev:
            groups.add(dev.group.path)
    assert len(groups) == len(SERIALS)


def test_extra_virtio_disk_is_present():
    disks = [d for d in Path("/sys/block").glob("vd*") if (d / "serial").read_text().strip() == "nvd-extra"]
    assert len(disks) == 1, f"virtio disks: {[d.name for d in Path('/sys/block').glob('vd*')]}"
    assert int((disks[0] / "size").read_text()) * 512 == int(os.environ["NVD_RIG_EXTRA_DISK_SIZE"])
