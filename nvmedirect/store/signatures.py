"""Recognises what already lives at the start of a device, from its first bytes.

Used before writing raw LBAs: a partition table or filesystem signature means somebody's data is
there. The offsets are the ones each format's own tools (and blkid) look at.
"""

from __future__ import annotations

from dataclasses import dataclass

from nvmedirect.store.header import looks_like_header

# Enough to see every signature below (btrfs puts its superblock at 64 KiB).
PROBE_BYTES = 128 * 1024

NVMEDIRECT = "nvmedirect-model"


@dataclass(frozen=True)
class Signature:
    name: str
    offset: int
    magic: bytes


# Fixed-offset magics. GPT is checked for both 512- and 4096-byte sectors; swap for the common page
# sizes because mkswap puts the magic at the end of the first page.
SIGNATURES: list[Signature] = [
    Signature("gpt", 512, b"EFI PART"),
    Signature("gpt", 4096, b"EFI PART"),
    Signature("ext2/3/4", 1080, b"\x53\xef"),
    Signature("xfs", 0, b"XFSB"),
    Signature("btrfs", 65536 + 64, b"_BHRfS_M"),
    Signature("f2fs", 1024, b"\x10\x20\xf5\xf2"),
    Signature("ntfs", 3, b"NTFS    "),
    Signature("vfat", 82, b"FAT32   "),
    Signature("vfat", 54, b"FAT16   "),
    Signature("vfat", 54, b"FAT12   "),
    Signature("luks", 0, b"LUKS\xba\xbe"),
    Signature("iso9660", 32769, b"CD001"),
    Signature("squashfs", 0, b"hsqs"),
    *[Signature("swap", page - 10, magic) for page in (4096, 8192, 16384, 65536)
      for magic in (b"SWAPSPACE2", b"SWAP-SPACE")],
    *[Signature("lvm2", sector * 512, b"LABELONE") for sector in range(4)],
]


def detect_signatures(head: bytes) -> list[str]:
    """Names of every known signature in `head` (the device's first bytes), in table order, unique.

    Our own header at offset 0 is reported as NVMEDIRECT and nothing else: the GGUF bytes behind it
    are arbitrary and may contain anything at the fixed offsets checked here.
    """
    if looks_like_header(head):
        return [NVMEDIRECT]
    found: list[str] = []
    for sig in SIGNATURES:
        end = sig.offset + len(sig.magic)
        if end <= len(head) and head[sig.offset:end] == sig.magic and sig.name not in found:
            found.append(sig.name)
    # A DOS partition table (or any boot sector) ends its first sector with 55 AA.
    if len(head) >= 512 and head[510:512] == b"\x55\xaa" and not {"ntfs", "vfat"} & set(found):
        found.append("mbr")
    return found
