"""Signature detection: real filesystems made by their own tools, plus each table entry in isolation."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from nvmedirect.store.header import StoredModelHeader
from nvmedirect.store.signatures import NVMEDIRECT, PROBE_BYTES, SIGNATURES, detect_signatures


def head_of(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(PROBE_BYTES)


@pytest.mark.parametrize(("tool", "args", "expected"), [
    ("mkfs.ext4", ["-q", "-F"], "ext2/3/4"),
    ("mkswap", [], "swap"),
    ("mkfs.xfs", ["-q", "-f"], "xfs"),
    ("mkfs.btrfs", ["-q", "-f"], "btrfs"),
    ("mkfs.vfat", [], "vfat"),
])
def test_real_filesystems(tmp_path: Path, tool: str, args: list[str], expected: str) -> None:
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} not installed")
    image = tmp_path / "fs.img"
    with open(image, "wb") as f:
        f.truncate(320 << 20)
    subprocess.run([tool, *args, str(image)], check=True, capture_output=True, timeout=60)
    assert expected in detect_signatures(head_of(image))


def test_blank_and_random_devices_are_clean() -> None:
    assert detect_signatures(bytes(PROBE_BYTES)) == []
    # Random bytes hit none of the multi-byte magics (fixed seed: this is a regression check).
    import numpy as np

    noise = np.random.default_rng(7).integers(0, 256, PROBE_BYTES, dtype=np.uint8).tobytes()
    assert detect_signatures(noise) == []


@pytest.mark.parametrize("sig", SIGNATURES, ids=lambda s: f"{s.name}@{s.offset}")
def test_each_signature_alone(sig) -> None:
    head = bytearray(PROBE_BYTES)
    head[sig.offset:sig.offset + len(sig.magic)] = sig.magic
    assert sig.name in detect_signatures(bytes(head))


def test_mbr_boot_signature() -> None:
    head = bytearray(PROBE_BYTES)
    head[510:512] = b"\x55\xaa"
    assert detect_signatures(bytes(head)) == ["mbr"]


def test_short_head_checks_what_it_can() -> None:
    head = bytearray(2048)
    head[1080:1082] = b"\x53\xef"
    assert detect_signatures(bytes(head)) == ["ext2/3/4"]


def test_our_header_wins_over_data_behind_it() -> None:
    block = StoredModelHeader(lba_size=512, start_lba=0, gguf_nbytes=1 << 20, sha256=bytes(32),
                              model_name="m").encode()
    head = bytearray(PROBE_BYTES)
    head[:len(block)] = block
    head[65536 + 64:65536 + 72] = b"_BHRfS_M"  # inside the GGUF bytes: not a filesystem
    assert detect_signatures(bytes(head)) == [NVMEDIRECT]
