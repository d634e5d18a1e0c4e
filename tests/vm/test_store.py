"""GGUF models on QEMU NVMe namespaces (issue 5), one boot: kernel and userspace paths, 512- and
4096-byte LBAs, LBA 0 and odd non-zero LBAs, refusals, and bench userspace vs kernel."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from rig import MIB, NvmeSpec, VmConfig

from nvmedirect.reader import open_model

REPO = Path(__file__).resolve().parents[2]
GUEST_MODULE = "tests/vm/guest/store/test_store_guest.py"
NONZERO_LBA = {512: 300_001, 4096: 37_501}  # the same as the guest module's
# One boot by default (the driver's own VM tests cover both VFIO modes); NVD_STORE_VM_MODES=iommu,noiommu
# runs this module in the no-IOMMU guest as well.
MODES = [m.strip() for m in os.environ.get("NVD_STORE_VM_MODES", "iommu").split(",") if m.strip()]


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    out = subprocess.run(["bash", str(REPO / "scripts/fetch-models.sh"), "smollm2"], check=True,
                         capture_output=True, text=True, timeout=900)
    return Path(out.stdout.strip().splitlines()[-1])


def blank(path: Path, size: int) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
    return path


@pytest.mark.vm
@pytest.mark.parametrize("mode", MODES)
def test_store_in_guest(mode: str, guest_pytest, tmp_path: Path, smollm2_path: Path) -> None:
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("mkfs.ext4 is needed to make the filesystem the refusal tests use")
    images = {512: blank(tmp_path / "ns512.img", 384 * MIB), 4096: blank(tmp_path / "ns4k.img", 384 * MIB)}
    fs_image = blank(tmp_path / "fs.img", 256 * MIB)  # the model would fit: only the filesystem refuses
    subprocess.run(["mkfs.ext4", "-q", "-F", str(fs_image)], check=True, capture_output=True)
    config = VmConfig(iommu=mode == "iommu", controllers=[
        NvmeSpec("nvd-store-512", image=images[512]),
        NvmeSpec("nvd-store-4k", image=images[4096], logical_block_size=4096),
        NvmeSpec("nvd-store-fs", image=fs_image),
    ])
    result = guest_pytest(config, [GUEST_MODULE], env={"NVD_STORE_MODEL": str(smollm2_path)}, timeout=900)
    result.assert_passed()
    assert len(result.passed) == 7

    # What the guest wrote is on the backing images where the headers say, byte for byte.
    raw = np.fromfile(smollm2_path, dtype=np.uint8)
    for lba_size, image in images.items():
        for lba, name in ((0, "kernel-written"), (NONZERO_LBA[lba_size], "driver-written")):
            with open_model(image, lba=lba, lba_size=lba_size) as model:
                assert model.stored.model_name == name
                data = model.backend.read_bytes(model.base_offset, model.size)
                assert data == raw.tobytes()
    # (Mounting updates the ext4 superblock, so only look for what write-gguf would have left.)
    head = fs_image.read_bytes()[:8192]
    assert not head.startswith(b"NVDGGUF") and head[4096:4100] != b"GGUF", "a refused write reached the device"

    report = json.loads((result.vm.results_dir / f"bench-{mode}.json").read_text())
    print(f"\nbench in the VM (QEMU NVMe, TCG, {mode}):")
    for row in report["rows"]:
        print(f"  {row['path']:<10} qp={row['queue_pairs']} qd={row['queue_depth']:>2} io={row['io_size'] >> 10:>5}K "
              f"{row['gb_s']:.3f} GB/s {row['iops']:.0f} IOPS cpu {row['cpu_percent']:.0f}%")
    print(f"  summary: {report['summary']}")
