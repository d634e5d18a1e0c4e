"""The on-disk header record: round trip, fixed layout, and every way a damaged header is rejected."""

from __future__ import annotations

import hashlib
import struct
import zlib

import pytest

from nvmedirect.store.header import (
    MAGIC,
    OFFSETS,
    RECORD_BYTES,
    HeaderError,
    StoredModelHeader,
    decode_header,
)

SHA = hashlib.sha256(b"model").digest()


def make(**kw) -> StoredModelHeader:
    fields = dict(lba_size=512, start_lba=2048, gguf_nbytes=98_362_432, sha256=SHA, model_name="smol")
    fields.update(kw)
    return StoredModelHeader(**fields)


@pytest.mark.parametrize("lba_size", [512, 4096, 8192])
def test_round_trip(lba_size: int) -> None:
    header = make(lba_size=lba_size, model_name="SmolLM2 ünïcode")
    block = header.encode()
    assert len(block) == max(4096, lba_size)
    assert decode_header(block, expect_lba=2048) == header


def test_layout_fields_at_documented_offsets() -> None:
    header = make(lba_size=4096, start_lba=7, gguf_nbytes=123456789)
    block = header.encode()
    assert block[:8] == MAGIC
    assert struct.unpack_from("<I", block, OFFSETS["lba_size"])[0] == 4096
    assert struct.unpack_from("<Q", block, OFFSETS["start_lba"])[0] == 7
    assert struct.unpack_from("<Q", block, OFFSETS["data_lba"])[0] == 8  # one 4096-byte header LBA
    assert struct.unpack_from("<Q", block, OFFSETS["gguf_nbytes"])[0] == 123456789
    assert block[OFFSETS["sha256"]:OFFSETS["sha256"] + 32] == SHA
    assert block[OFFSETS["model_name"]:OFFSETS["model_name"] + 4] == b"smol"
    crc = struct.unpack_from("<I", block, OFFSETS["crc32"])[0]
    assert crc == zlib.crc32(block[:OFFSETS["crc32"]])
    assert block[RECORD_BYTES:] == bytes(len(block) - RECORD_BYTES)
    assert block[510:512] == b"\0\0"  # never mistaken for an MBR


def test_geometry() -> None:
    h = make(lba_size=512, start_lba=100, gguf_nbytes=1000)
    assert h.header_lbas == 8 and h.data_lba == 108 and h.data_byte_offset == 108 * 512
    assert h.end_lba == 108 + 2  # 1000 bytes round up to two 512-byte LBAs
    assert h.next_lba == 2048  # rounded up to 1 MiB
    h4 = make(lba_size=4096, start_lba=256, gguf_nbytes=1 << 20)
    assert h4.data_lba == 257 and h4.end_lba == 513 and h4.next_lba == 768


@pytest.mark.parametrize("position", [0, 9, OFFSETS["gguf_nbytes"], OFFSETS["model_name"] + 3, 223])
def test_any_flipped_byte_is_detected(position: int) -> None:
    block = bytearray(make().encode())
    block[position] ^= 0x40
    with pytest.raises(HeaderError):
        decode_header(bytes(block))


def test_rejects_other_data() -> None:
    with pytest.raises(HeaderError, match="magic"):
        decode_header(bytes(4096))
    with pytest.raises(HeaderError, match="need"):
        decode_header(MAGIC)
    with pytest.raises(HeaderError, match="belongs at LBA 2048"):
        decode_header(make().encode(), expect_lba=0)


def test_rejects_future_version() -> None:
    block = bytearray(make().encode())
    struct.pack_into("<I", block, OFFSETS["format_version"], 2)
    struct.pack_into("<I", block, OFFSETS["crc32"], zlib.crc32(bytes(block[:OFFSETS["crc32"]])))
    with pytest.raises(HeaderError, match="version 2"):
        decode_header(bytes(block))


def test_bad_arguments() -> None:
    with pytest.raises(HeaderError, match="power of two"):
        make(lba_size=520)
    with pytest.raises(HeaderError, match="longer than"):
        make(model_name="x" * 129)
    with pytest.raises(HeaderError, match="inside the model"):
        make(next_lba=2050)
    with pytest.raises(HeaderError, match="32 bytes"):
        make(sha256=b"short")
