"""`open_model(source)`: a GGUF in a file, on a kernel block device, or behind the userspace driver.

    with open_model("/dev/nvme0n1") as model:           # first model of the chain at LBA 0
        info = model.tensors["blk.0.attn_q.weight"]       # type, shape, offset, nbytes
        dest = pinned_empty(info.nbytes)
        handle = model.read_async([info.byte_range], [dest])
        ...                                               # overlap other work
        handle.wait()

Byte offsets are GGUF offsets (0 = the file's first byte) whatever the source; the reader adds where
the GGUF starts on the device.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from collections.abc import Sequence
from typing import Any

import numpy as np

from nvmedirect.host_memory import aligned_empty
from nvmedirect.reader.base import ByteRange, ReadError, ReadHandle, StorageBackend
from nvmedirect.reader.file_backend import BlockDeviceBackend, FileBackend
from nvmedirect.reader.gguf_index import GGUF_MAGIC, GGUFIndex, TensorInfo, parse_gguf_header
from nvmedirect.store.catalog import find_model, read_header, walk_chain
from nvmedirect.store.header import OFFSETS, HeaderError, StoredModelHeader, looks_like_header

BDF_PATTERN = re.compile(r"^([0-9a-fA-F]{4}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
_VERIFY_CHUNK = 64 << 20


class ModelReader:
    """One GGUF on one backend: its tensor table and reads by GGUF byte offset."""

    def __init__(self, backend: StorageBackend, base_offset: int, size: int,
                 stored: StoredModelHeader | None = None):
        self.backend = backend
        self.base_offset = base_offset
        self.size = size
        self.stored = stored  # the nvmedirect header when the GGUF lives on raw LBAs
        if base_offset + size > backend.size:
            raise ReadError(f"{backend.name}: the GGUF ({size} bytes at byte {base_offset}) extends past "
                            f"the end of the source ({backend.size} bytes)")
        self.index: GGUFIndex = parse_gguf_header(self._read_header_bytes, size)

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        return self.index.tensors

    @property
    def metadata(self) -> dict[str, Any]:
        return self.index.metadata

    @property
    def name(self) -> str:
        if self.stored is not None:
            return self.stored.model_name
        return os.path.basename(self.backend.name)

    def _read_header_bytes(self, offset: int, nbytes: int) -> bytes:
        return self.backend.read_bytes(self.base_offset + offset, nbytes)

    def _translate(self, ranges: Sequence[ByteRange]) -> list[ByteRange]:
        out = []
        for offset, nbytes in ranges:
            if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
                raise ReadError(f"range [{offset}, {offset + nbytes}) lies outside the GGUF ({self.size} bytes)")
            out.append((self.base_offset + offset, nbytes))
        return out

    def read_async(self, ranges: Sequence[ByteRange], buffers: Sequence[Any]) -> ReadHandle:
        """Starts reading each (GGUF offset, nbytes) into its buffer; `wait()` on the result."""
        return self.backend.read_async(self._translate(ranges), buffers)

    def read_into(self, ranges: Sequence[ByteRange], buffers: Sequence[Any]) -> None:
        self.read_async(ranges, buffers).wait()

    def read_tensor(self, name: str, out: Any = None) -> np.ndarray:
        """The raw bytes of one tensor (page-aligned new memory unless `out` is given)."""
        try:
            info = self.tensors[name]
        except KeyError:
            raise ReadError(f"no tensor {name!r} in {self.name}") from None
        dest = aligned_empty(info.nbytes) if out is None else out
        self.read_into([info.byte_range], [dest])
        return dest if out is None else np.frombuffer(dest, dtype=np.uint8)[: info.nbytes]

    def sha256(self) -> bytes:
        """Hash of the whole GGUF as read through the backend."""
        digest = hashlib.sha256()
        buffer = aligned_empty(_VERIFY_CHUNK)
        for offset in range(0, self.size, _VERIFY_CHUNK):
            nbytes = min(_VERIFY_CHUNK, self.size - offset)
            self.read_into([(offset, nbytes)], [buffer])
            digest.update(buffer[:nbytes])
        return digest.digest()

    def verify(self) -> None:
        """Raises ReadError unless the stored header's sha256 matches the bytes on the device."""
        if self.stored is None:
            raise ReadError(f"{self.name} is a plain file: no stored checksum to verify against")
        got = self.sha256()
        if got != self.stored.sha256:
            raise ReadError(f"{self.name}: sha256 {got.hex()} differs from the header's {self.stored.sha256.hex()}")

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> ModelReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ModelReader({self.name!r}, {len(self.tensors)} tensors, {self.size} bytes, {self.backend!r})"


def open_backend(source: str | os.PathLike, *, lba_size: int | None = None, **options: Any) -> StorageBackend:
    """The backend for a path (file or block device) or a PCI address (userspace driver)."""
    text = os.fspath(source)
    if not os.path.exists(text) and (BDF_PATTERN.match(text) or text.startswith(("/dev/nvme", "nvme"))):
        # A controller by PCI address, or a namespace whose controller `nvmedirect bind` handed to
        # vfio-pci: our driver if it is on vfio-pci, else the namespace's kernel block device.
        from nvmedirect.store.routing import NVME, RouteError, route_device

        try:
            route = route_device(text, options.pop("nsid", 1))
        except RouteError as exc:
            raise ReadError(str(exc)) from None
        if route.kind == NVME:
            from nvmedirect.reader.nvme_backend import NvmeBackend

            return NvmeBackend.open(route.path, nsid=route.nsid, **options)
        text = route.path
    for nvme_only in ("noiommu", "queue_pairs", "nsid"):  # meaningless for files and block devices
        options.pop(nvme_only, None)
    try:
        mode = os.stat(text).st_mode
    except OSError as exc:
        raise ReadError(f"cannot open {text}: {exc.strerror}") from None
    if stat.S_ISBLK(mode):
        return BlockDeviceBackend(text, lba_size=lba_size, **options)
    return FileBackend(text, lba_size=lba_size, **options)


def open_model(source: str | os.PathLike | StorageBackend, *, lba: int | None = None,
               name: str | None = None, lba_size: int | None = None, **options: Any) -> ModelReader:
    """Opens a GGUF: a plain .gguf file, or a model stored by `write-gguf` on a device or image.

    On a device, `lba` names the header's LBA; without it the chain from LBA 0 is searched for
    `name` (or its first model is taken). `options` go to the backend (queue_depth, io_size, ...).
    """
    backend = source if isinstance(source, StorageBackend) else open_backend(source, lba_size=lba_size, **options)
    try:
        return _open_on(backend, lba, name)
    except BaseException:
        if backend is not source:
            backend.close()
        raise


def _open_on(backend: StorageBackend, lba: int | None, name: str | None) -> ModelReader:
    def read(offset: int, nbytes: int) -> bytes:
        return backend.read_bytes(offset, min(nbytes, backend.size - offset))

    head = read(0, min(4096, backend.size))
    if lba is None and head[:4] == GGUF_MAGIC:
        return ModelReader(backend, 0, backend.size)
    lba_size = backend.lba_size
    if lba is None and looks_like_header(head):  # an image's header says its own LBA size
        at = OFFSETS["lba_size"]
        lba_size = int.from_bytes(head[at:at + 4], "little")
    try:
        if lba is not None:
            stored = read_header(read, lba, lba_size)
            if stored is None:
                raise HeaderError(f"no nvmedirect model header at LBA {lba} of {backend.name}")
            if name is not None and stored.model_name != name:
                raise HeaderError(f"the model at LBA {lba} is {stored.model_name!r}, not {name!r}")
        else:
            stored = find_model(walk_chain(read, lba_size, 0, backend.size), name)
    except HeaderError as exc:
        raise ReadError(f"{backend.name}: {exc}") from None
    return ModelReader(backend, stored.data_byte_offset, stored.gguf_nbytes, stored)
