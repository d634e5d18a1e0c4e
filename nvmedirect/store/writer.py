"""Writing a GGUF onto raw LBAs of a target, and reading it back to prove it landed.

Order of writes, chosen so a crash never leaves a valid header in front of wrong data:
zero the header block, write the GGUF, flush, write the header, flush.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from nvmedirect.host_memory import aligned_empty
from nvmedirect.store.catalog import overlapping, read_header, walk_chain
from nvmedirect.store.header import (
    HeaderError,
    StoredModelHeader,
    header_block_bytes,
    lbas_for,
)
from nvmedirect.store.signatures import NVMEDIRECT, PROBE_BYTES, detect_signatures
from nvmedirect.store.targets import BlockTarget, TargetError

CHUNK_BYTES = 8 << 20
Progress = Callable[[int], None]  # called with the number of bytes just handled


def _no_progress(_: int) -> None:
    pass


def sha256_file(path: str | os.PathLike, progress: Progress = _no_progress) -> bytes:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
            progress(len(chunk))
    return digest.digest()


def target_reader(target: BlockTarget) -> Callable[[int, int], bytes]:
    """A `read(offset, nbytes)` over whole LBAs of the target, for the catalog functions."""
    def read(offset: int, nbytes: int) -> bytes:
        start = offset - offset % target.lba_size
        span = lbas_for(offset + nbytes - start, target.lba_size) * target.lba_size
        if target.capacity_bytes is not None:
            span = min(span, target.capacity_bytes - start)
        data = target.read_blocks(start, span)
        return data[offset - start:offset - start + nbytes].tobytes()
    return read


@dataclass
class WritePlan:
    header: StoredModelHeader
    signatures: list[str]  # what the device's first bytes look like, other than our own header
    overwrites: list[StoredModelHeader] = field(default_factory=list)  # stored models this destroys
    chain: list[StoredModelHeader] = field(default_factory=list)  # the chain from LBA 0 before the write


def foreign_signatures(target: BlockTarget) -> list[str]:
    """Partition tables and filesystems at the start of the device (our own header excluded)."""
    probe = PROBE_BYTES if target.capacity_bytes is None else min(PROBE_BYTES, target.capacity_bytes)
    if not probe:
        return []
    return [s for s in detect_signatures(target_reader(target)(0, probe)) if s != NVMEDIRECT]


def chain_end_lba(target: BlockTarget) -> int:
    """Where `--append` writes: after the last model of the chain from LBA 0 (0 if none). Raises
    TargetError when that model reaches the end of the device (its `next_lba` lies past it)."""
    chain = walk_chain(target_reader(target), target.lba_size, 0, target.capacity_bytes)
    if not chain:
        return 0
    last = chain[-1]
    if target.capacity_bytes is not None and last.next_lba * target.lba_size >= target.capacity_bytes:
        raise TargetError(f"nothing can be appended: the last stored model ({last.model_name!r} at LBA "
                          f"{last.start_lba}) reaches the end of the device")
    return last.next_lba


def check_fit(target: BlockTarget, nbytes: int, lba: int, name: str) -> None:
    """Raises TargetError unless a model of `nbytes` bytes (its header included) fits at `lba`:
    cheap, so it runs before the model is hashed."""
    draft = StoredModelHeader(lba_size=target.lba_size, start_lba=lba, gguf_nbytes=nbytes, sha256=bytes(32),
                              model_name=name)
    if target.capacity_bytes is not None and draft.end_lba * target.lba_size > target.capacity_bytes:
        last = target.capacity_bytes // target.lba_size
        where = f"the device ends at LBA {last}" if lba < last else f"LBA {lba} is past the device's end (LBA {last})"
        raise TargetError(f"{name} ({nbytes} bytes) does not fit at LBA {lba}: {where}")


def plan_write(target: BlockTarget, gguf_path: str | os.PathLike, *, lba: int, sha256: bytes,
               name: str | None = None) -> WritePlan:
    """Everything the CLI must show or confirm before writing; raises TargetError if it cannot fit."""
    size = Path(gguf_path).stat().st_size
    name = name if name is not None else Path(gguf_path).name
    check_fit(target, size, lba, name)
    read = target_reader(target)
    signatures = foreign_signatures(target)
    try:
        chain = walk_chain(read, target.lba_size, 0, target.capacity_bytes)
    except HeaderError:
        chain = []  # a damaged chain: listed as nothing, overwritten like free space
    try:
        at_lba = read_header(read, lba, target.lba_size)
    except HeaderError:
        at_lba = None
    known = {m.start_lba: m for m in chain}
    if at_lba is not None:
        known.setdefault(at_lba.start_lba, at_lba)

    draft = StoredModelHeader(lba_size=target.lba_size, start_lba=lba, gguf_nbytes=size, sha256=sha256,
                              model_name=name)
    # Keep the chain reaching the models stored after this one: point at the first of them that
    # starts at or beyond our end, instead of at our own end.
    later = sorted(m.start_lba for m in known.values() if m.start_lba >= draft.end_lba)
    next_lba = later[0] if later else draft.end_lba_aligned
    header = StoredModelHeader(lba_size=target.lba_size, start_lba=lba, gguf_nbytes=size, sha256=sha256,
                               model_name=name, next_lba=next_lba, created_unix=draft.created_unix)
    return WritePlan(header, signatures, overlapping(list(known.values()), lba, header.end_lba), chain)


def write_model(target: BlockTarget, gguf_path: str | os.PathLike, header: StoredModelHeader,
                progress: Progress = _no_progress) -> None:
    """Writes the header block and the GGUF bytes (zero-padded to a whole LBA)."""
    lba_size = target.lba_size
    block = header_block_bytes(lba_size)
    target.write_blocks(header.start_lba * lba_size, aligned_empty(block))  # invalidate first
    buffer = aligned_empty(CHUNK_BYTES)
    position = header.data_byte_offset
    written = 0
    with open(gguf_path, "rb", buffering=0) as f:
        while written < header.gguf_nbytes:
            got = f.readinto(memoryview(buffer))
            if not got:
                raise TargetError(f"{gguf_path} shrank while being written")
            padded = lbas_for(got, lba_size) * lba_size
            buffer[got:padded] = 0
            target.write_blocks(position, buffer[:padded])
            position += padded
            written += got
            progress(got)
    target.flush()
    encoded = aligned_empty(block)
    encoded[:] = memoryview(header.encode())
    target.write_blocks(header.start_lba * lba_size, encoded)
    target.flush()


def verify_model(target: BlockTarget, header: StoredModelHeader,
                 progress: Progress = _no_progress) -> None:
    """Reads header and data back; raises TargetError when either differs from what was written."""
    found = read_header(target_reader(target), header.start_lba, target.lba_size)
    if found != header:
        raise TargetError(f"header read back at LBA {header.start_lba} differs from the one written")
    digest = hashlib.sha256()
    remaining = header.gguf_nbytes
    position = header.data_byte_offset
    while remaining:
        nbytes = min(CHUNK_BYTES, remaining)
        data = target.read_blocks(position, lbas_for(nbytes, target.lba_size) * target.lba_size)
        digest.update(data[:nbytes])
        position += data.nbytes
        remaining -= nbytes
        progress(nbytes)
    if digest.digest() != header.sha256:
        raise TargetError(f"read-back sha256 {digest.hexdigest()} differs from the GGUF's "
                          f"{header.sha256.hex()}: the device did not store the data faithfully")
