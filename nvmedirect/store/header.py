"""The record nvmedirect writes in front of a GGUF stored on raw LBAs.

A stored model occupies one *header block* followed by the GGUF bytes:

    start_lba                       data_lba = start_lba + header_lbas          next_lba
    | header block (4096 B or 1 LBA) | GGUF bytes ... zero padding to an LBA | gap to 1 MiB | next model?

The header block is `max(4096, lba_size)` bytes so the GGUF data always starts 4 KiB-aligned, which is
what O_DIRECT reads and page-aligned DMA want. The record itself is the first 228 bytes of the block;
the rest is zero. Byte 510 stays zero so a stored model never looks like an MBR boot sector.

Several models coexist as a chain: each header's `next_lba` says where the next header may be
(the end of its data rounded up to 1 MiB). `catalog.walk_chain` follows it from LBA 0 (or any LBA).
"""

from __future__ import annotations

import struct
import time
import zlib
from dataclasses import dataclass, field

MAGIC = b"NVDGGUF\x00"
FORMAT_VERSION = 1
HEADER_BLOCK_MIN = 4096
CHAIN_ALIGN_BYTES = 1 << 20  # models start on 1 MiB boundaries: aligned for any LBA size and erase unit
MODEL_NAME_BYTES = 128

# (name, struct code) in on-disk order, little-endian, no implicit padding.
_FIELDS = [
    ("magic", "8s"),
    ("format_version", "I"),
    ("header_block_bytes", "I"),
    ("lba_size", "I"),
    ("flags", "I"),
    ("start_lba", "Q"),
    ("data_lba", "Q"),
    ("gguf_nbytes", "Q"),
    ("next_lba", "Q"),
    ("created_unix", "q"),
    ("sha256", "32s"),
    ("model_name", f"{MODEL_NAME_BYTES}s"),
]
_BODY = struct.Struct("<" + "".join(code for _, code in _FIELDS))
_CRC = struct.Struct("<I")
RECORD_BYTES = _BODY.size + _CRC.size

OFFSETS: dict[str, int] = {}
_pos = 0
for _name, _code in _FIELDS:
    OFFSETS[_name] = _pos
    _pos += struct.calcsize("<" + _code)
OFFSETS["crc32"] = _pos

# The layout is a file format: these must never move (docs/STORAGE.md lists the same table).
assert _BODY.size == 224, _BODY.size
assert RECORD_BYTES == 228
assert OFFSETS["lba_size"] == 16 and OFFSETS["start_lba"] == 24 and OFFSETS["gguf_nbytes"] == 40
assert OFFSETS["sha256"] == 64 and OFFSETS["model_name"] == 96 and OFFSETS["crc32"] == 224
assert RECORD_BYTES <= 510  # keeps the MBR signature bytes (510, 511) zero


class HeaderError(ValueError):
    """The bytes are not a valid nvmedirect header (wrong magic, bad checksum, inconsistent fields)."""


def header_block_bytes(lba_size: int) -> int:
    return max(HEADER_BLOCK_MIN, lba_size)


def check_lba_size(lba_size: int) -> None:
    if lba_size < 512 or lba_size & (lba_size - 1):
        raise HeaderError(f"LBA size {lba_size} is not a power of two >= 512")


def lbas_for(nbytes: int, lba_size: int) -> int:
    return -(-nbytes // lba_size)


@dataclass(frozen=True)
class StoredModelHeader:
    """One decoded header record. Byte positions on the device are `lba * lba_size`."""

    lba_size: int
    start_lba: int
    gguf_nbytes: int
    sha256: bytes
    model_name: str
    next_lba: int = -1  # -1: computed from the data extent
    created_unix: int = field(default_factory=lambda: int(time.time()))
    format_version: int = FORMAT_VERSION
    flags: int = 0

    def __post_init__(self) -> None:
        check_lba_size(self.lba_size)
        if len(self.sha256) != 32:
            raise HeaderError("sha256 must be 32 bytes")
        if len(self.model_name.encode()) > MODEL_NAME_BYTES:
            raise HeaderError(f"model name longer than {MODEL_NAME_BYTES} bytes (UTF-8)")
        if self.start_lba < 0 or self.gguf_nbytes < 0:
            raise HeaderError("start LBA and GGUF size must be non-negative")
        if self.next_lba == -1:
            object.__setattr__(self, "next_lba", self.end_lba_aligned)
        if self.next_lba < self.data_lba + lbas_for(self.gguf_nbytes, self.lba_size):
            raise HeaderError(f"next LBA {self.next_lba} lies inside the model's own data")

    @property
    def header_lbas(self) -> int:
        return header_block_bytes(self.lba_size) // self.lba_size

    @property
    def data_lba(self) -> int:
        return self.start_lba + self.header_lbas

    @property
    def data_byte_offset(self) -> int:
        """Device byte offset of the first GGUF byte."""
        return self.data_lba * self.lba_size

    @property
    def end_lba(self) -> int:
        """First LBA after the model's data (the data is zero-padded to a whole LBA)."""
        return self.data_lba + lbas_for(self.gguf_nbytes, self.lba_size)

    @property
    def end_lba_aligned(self) -> int:
        per_chunk = max(1, CHAIN_ALIGN_BYTES // self.lba_size)
        return -(-self.end_lba // per_chunk) * per_chunk

    def encode(self) -> bytes:
        """The full header block: record + CRC32 + zero padding."""
        body = _BODY.pack(
            MAGIC, self.format_version, header_block_bytes(self.lba_size), self.lba_size, self.flags,
            self.start_lba, self.data_lba, self.gguf_nbytes, self.next_lba, self.created_unix,
            self.sha256, self.model_name.encode().ljust(MODEL_NAME_BYTES, b"\0"),
        )
        record = body + _CRC.pack(zlib.crc32(body))
        return record.ljust(header_block_bytes(self.lba_size), b"\0")


def looks_like_header(data: bytes) -> bool:
    return data[: len(MAGIC)] == MAGIC


def decode_header(data: bytes, expect_lba: int | None = None) -> StoredModelHeader:
    """Decodes the record at the start of `data`; raises HeaderError with the reason if invalid."""
    if len(data) < RECORD_BYTES:
        raise HeaderError(f"need {RECORD_BYTES} bytes for a header, got {len(data)}")
    if not looks_like_header(data):
        raise HeaderError("no nvmedirect header here (magic differs)")
    body = bytes(data[: _BODY.size])
    (stored_crc,) = _CRC.unpack_from(data, _BODY.size)
    if zlib.crc32(body) != stored_crc:
        raise HeaderError("header checksum mismatch (torn or overwritten header)")
    (_, version, block_bytes, lba_size, flags, start_lba, data_lba, gguf_nbytes, next_lba, created,
     sha, name) = _BODY.unpack(body)
    if version != FORMAT_VERSION:
        raise HeaderError(f"header format version {version} is not supported (this build reads {FORMAT_VERSION})")
    check_lba_size(lba_size)
    if block_bytes != header_block_bytes(lba_size):
        raise HeaderError(f"header block size {block_bytes} does not match LBA size {lba_size}")
    if expect_lba is not None and start_lba != expect_lba:
        raise HeaderError(f"header found at LBA {expect_lba} says it belongs at LBA {start_lba}")
    header = StoredModelHeader(
        lba_size=lba_size, start_lba=start_lba, gguf_nbytes=gguf_nbytes, sha256=sha,
        model_name=name.rstrip(b"\0").decode(errors="replace"), next_lba=next_lba,
        created_unix=created, format_version=version, flags=flags,
    )
    if header.data_lba != data_lba:
        raise HeaderError(f"data LBA {data_lba} inconsistent with start LBA {start_lba}")
    return header
