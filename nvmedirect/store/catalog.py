"""Finding stored models: read one header, or follow the chain of headers from an LBA.

The chain starts at LBA 0 by default. Each header's `next_lba` is where the next model may start;
the walk stops at the first position without a valid header. A model written at an LBA that no chain
reaches is still found by naming its LBA (`--lba`).
"""

from __future__ import annotations

from collections.abc import Callable

from nvmedirect.store.header import (
    HEADER_BLOCK_MIN,
    HeaderError,
    StoredModelHeader,
    decode_header,
    looks_like_header,
)

ReadFn = Callable[[int, int], bytes]  # (byte offset, nbytes) -> bytes, LBA-aligned requests
MAX_CHAIN = 4096  # a guard against a corrupted chain, far above any real use


def read_header(read: ReadFn, lba: int, lba_size: int) -> StoredModelHeader | None:
    """The header at `lba`, None when there is none; HeaderError when one is there but damaged."""
    data = read(lba * lba_size, max(HEADER_BLOCK_MIN, lba_size))
    if not looks_like_header(data):
        return None
    header = decode_header(data, expect_lba=lba)
    if header.lba_size != lba_size:
        raise HeaderError(f"header at LBA {lba} was written for {header.lba_size}-byte LBAs, "
                          f"the device has {lba_size}-byte LBAs")
    return header


def walk_chain(read: ReadFn, lba_size: int, start_lba: int = 0,
               capacity_bytes: int | None = None) -> list[StoredModelHeader]:
    """Every model reachable from `start_lba`, in device order."""
    found: list[StoredModelHeader] = []
    lba = start_lba
    while len(found) < MAX_CHAIN:
        if capacity_bytes is not None and (lba * lba_size + max(HEADER_BLOCK_MIN, lba_size)) > capacity_bytes:
            break
        header = read_header(read, lba, lba_size)
        if header is None:
            break
        found.append(header)
        if header.next_lba <= lba:
            raise HeaderError(f"header at LBA {lba} points back to LBA {header.next_lba}: corrupt chain")
        lba = header.next_lba
    return found


def find_model(models: list[StoredModelHeader], name: str | None) -> StoredModelHeader:
    """The model called `name`, or the only/first one when no name is given."""
    if not models:
        raise HeaderError("no nvmedirect model found (write one with `nvmedirect write-gguf`)")
    if name is None:
        return models[0]
    matches = [m for m in models if m.model_name == name]
    if not matches:
        known = ", ".join(m.model_name for m in models)
        raise HeaderError(f"no stored model named {name!r} (stored: {known})")
    return matches[0]


def overlapping(models: list[StoredModelHeader], start_lba: int, end_lba: int) -> list[StoredModelHeader]:
    """Stored models whose header or data intersect LBAs [start_lba, end_lba)."""
    return [m for m in models if m.start_lba < end_lba and start_lba < m.end_lba]
