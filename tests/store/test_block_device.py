"""The kernel block-device path on loop devices of this machine (root and losetup needed).

Same code as an NVMe namespace bound to the kernel: O_DIRECT, exclusive open, sysfs usage checks.
The VM tests repeat this on QEMU's NVMe (tests/vm/test_store.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from nvmedirect.cli import main
from nvmedirect.cli.common import EXIT_REFUSED
from nvmedirect.reader import BlockDeviceBackend, open_model


def run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@contextlib.contextmanager
def loop_device(backing: Path, sector_size: int) -> Iterator[str]:
    if os.geteuid() != 0 or shutil.which("losetup") is None:
        pytest.skip("needs root and losetup")
    made = subprocess.run(["losetup", "--sector-size", str(sector_size), "-f", "--show", str(backing)],
                          capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        pytest.skip(f"losetup does not work here: {made.stderr.strip()}")
    device = made.stdout.strip()
    try:
        yield device
    finally:
        subprocess.run(["losetup", "-d", device], check=False, timeout=30)


@pytest.fixture(params=[512, 4096], ids=["lba512", "lba4096"])
def loop(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    backing = tmp_path / "loop.img"
    with open(backing, "wb") as f:
        f.truncate(256 << 20)
    with loop_device(backing, request.param) as device:
        yield device


def test_write_and_read_back_through_the_block_device(loop: str, smollm2_path: Path) -> None:
    result = run("write-gguf", str(smollm2_path), "-d", loop, "--lba", "16", "-y", "--json")
    assert result.exit_code == 0, result.output
    written = json.loads(result.stdout)
    with BlockDeviceBackend(loop) as backend:
        assert backend.direct and backend.lba_size == written["lba_size"]
    raw = np.fromfile(smollm2_path, dtype=np.uint8)
    with open_model(loop, lba=16, queue_depth=16, io_size=1 << 20) as model:
        assert isinstance(model.backend, BlockDeviceBackend)
        for info in model.tensors.values():
            assert np.array_equal(model.read_tensor(info.name), raw[info.offset:info.offset + info.nbytes])
        model.verify()
    listing = json.loads(run("ls-gguf", "-d", loop, "--lba", "16", "--json").stdout)
    assert [m["start_lba"] for m in listing["models"]] == [16]


def test_mounted_device_is_refused_even_with_force(tmp_path: Path, smollm2_path: Path) -> None:
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("mkfs.ext4 not installed")
    backing = tmp_path / "fs.img"
    with open(backing, "wb") as f:
        f.truncate(256 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(backing)], check=True, capture_output=True)
    with loop_device(backing, 512) as device:
        mountpoint = tmp_path / "mnt"
        mountpoint.mkdir()
        if subprocess.run(["mount", device, str(mountpoint)], capture_output=True).returncode != 0:
            pytest.skip("cannot mount here")
        try:
            result = run("write-gguf", str(smollm2_path), "-d", device, "--force", "-y")
            assert result.exit_code == EXIT_REFUSED
            assert f"mounted at {mountpoint}" in result.output
        finally:
            subprocess.run(["umount", str(mountpoint)], check=True, timeout=60)
        # Unmounted, the filesystem signature alone still refuses without --force.
        result = run("write-gguf", str(smollm2_path), "-d", device, "-y")
        assert result.exit_code == EXIT_REFUSED and "ext2/3/4" in result.output
