"""The GGUF header — metadata and tensor table — parsed through a `read(offset, nbytes)` callable:
the project's one GGUF parser.

A model on raw LBAs has no file to mmap, so this parser pulls only the header bytes through the same
backend that later reads the tensors; the inference engine reads a memory-mapped file through it
(infer/gguf_file.py). Type sizes and names come from the `gguf` package's constants. It checks what
a reader could take on trust: known value and tensor types, tensor names unique, dimensions positive,
rows of whole blocks, data aligned and inside the GGUF. A problem raises GGUFFormatError naming the
key or tensor (`where`) and the problem.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
_FETCH = 1 << 20  # header bytes are pulled in 1 MiB pieces (SmolLM2's header is ~3 MB: tokenizer)
_MAX_STRING = 1 << 30
_LENGTH = struct.Struct("<Q")  # a string's length

_SCALARS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF header this parser understands. `problem` says what is wrong,
    `where` (may be empty) the key or tensor: "tensor blk.0.attn_q.weight"."""

    def __init__(self, problem: str, where: str = "") -> None:
        super().__init__(f"{where}: {problem}" if where else problem)
        self.problem = problem
        self.where = where


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: `offset` counts from the start of the GGUF (not of its data section)."""

    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    offset: int
    nbytes: int

    @property
    def byte_range(self) -> tuple[int, int]:
        return (self.offset, self.nbytes)


def tensor_nbytes(ggml_type: GGMLQuantizationType, shape: tuple[int, ...], where: str = "") -> int:
    block, block_bytes = GGML_QUANT_SIZES[ggml_type]
    if not shape or any(d <= 0 for d in shape):
        raise GGUFFormatError(f"invalid dimensions {list(shape)}", where)
    elements = 1
    for dim in shape:
        elements *= dim
    if shape[0] % block:
        raise GGUFFormatError(f"row length {shape[0]} is not a multiple of the {ggml_type.name} block size {block}",
                              where)
    return elements // block * block_bytes


def _value_type(code: int) -> GGUFValueType:
    try:
        return GGUFValueType(code)
    except ValueError:
        raise GGUFFormatError(f"unknown value type {code}") from None


class _Cursor:
    """Sequential little-endian decoding over lazily fetched header bytes."""

    def __init__(self, read: Callable[[int, int], bytes], limit: int):
        self._read = read
        self._limit = limit
        self._buf = b""
        self.pos = 0

    def _fetch_to(self, end: int) -> bytes:
        """The header bytes fetched so far, at least up to `end`."""
        if end > self._limit:
            raise GGUFFormatError(f"truncated GGUF header (the GGUF ends at byte {self._limit}, inside its header)")
        while len(self._buf) < end:
            start = len(self._buf)
            want = min(max(_FETCH, end - start), self._limit - start)
            chunk = self._read(start, want)
            if not chunk:
                raise GGUFFormatError(f"truncated GGUF header (nothing could be read at byte {start})")
            self._buf += chunk
        return self._buf

    def take(self, nbytes: int) -> bytes:
        end = self.pos + nbytes
        data = self._fetch_to(end)[self.pos:end]
        self.pos = end
        return data

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (a vocabulary, its merges: ~300k for a Qwen2 file), decoded in one
        loop rather than a call per item, which made them most of a model's load time."""
        out: list[str] = []
        buf, pos, read_length = self._buf, self.pos, _LENGTH.unpack_from
        for _ in range(count):
            if pos + 8 > len(buf):
                buf = self._fetch_to(pos + 8)
            (length,) = read_length(buf, pos)
            if length > _MAX_STRING:
                raise GGUFFormatError(f"string of {length} bytes in GGUF header: corrupt")
            start, pos = pos + 8, pos + 8 + length
            if pos > len(buf):
                buf = self._fetch_to(pos)
            try:
                out.append(buf[start:pos].decode("utf-8"))
            except UnicodeDecodeError as err:
                raise GGUFFormatError(f"a string that is not UTF-8 ({err.reason} at byte {err.start})") from None
        self.pos = pos
        return out

    def scalar(self, code: str) -> Any:
        return struct.unpack("<" + code, self.take(struct.calcsize(code)))[0]

    def string(self) -> str:
        length = self.scalar("Q")
        if length > _MAX_STRING:
            raise GGUFFormatError(f"string of {length} bytes in GGUF header: corrupt")
        try:
            return self.take(length).decode("utf-8")
        except UnicodeDecodeError as err:
            raise GGUFFormatError(f"a string that is not UTF-8 ({err.reason} at byte {err.start})") from None

    def value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            item_type = _value_type(self.scalar("I"))
            count = self.scalar("Q")
            if item_type in _SCALARS:
                code = _SCALARS[item_type]
                return list(struct.unpack(f"<{count}{code}", self.take(count * struct.calcsize(code))))
            if item_type == GGUFValueType.STRING:
                return self.strings(count)
            return [self.value(item_type) for _ in range(count)]
        if vtype not in _SCALARS:
            raise GGUFFormatError(f"unknown GGUF value type {vtype}")
        return self.scalar(_SCALARS[vtype])


@dataclass
class GGUFIndex:
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    alignment: int
    data_offset: int  # where the tensor data section starts


def parse_gguf_header(read: Callable[[int, int], bytes], total_size: int) -> GGUFIndex:
    """Parses the header of a GGUF of `total_size` bytes; `read(offset, n)` returns its bytes."""
    cur = _Cursor(read, total_size)
    if cur.take(4) != GGUF_MAGIC:
        raise GGUFFormatError("not a GGUF file (bad magic)")
    version = cur.scalar("I")
    if version not in (2, 3):
        raise GGUFFormatError(f"unsupported GGUF version {version} (2 and 3 are)")
    n_tensors, n_kv = cur.scalar("Q"), cur.scalar("Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        try:
            metadata[key] = cur.value(_value_type(cur.scalar("I")))
        except GGUFFormatError as exc:  # name the key, unless the header simply ends here
            if exc.problem.startswith("truncated"):
                raise
            raise GGUFFormatError(exc.problem, f"key {key}") from None
    raw_tensors = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.scalar("I")
        if n_dims > 8:
            raise GGUFFormatError(f"{n_dims} dimensions: corrupt", f"tensor {name}")
        shape = tuple(cur.scalar("Q") for _ in range(n_dims))
        type_id = cur.scalar("I")
        try:
            ggml_type = GGMLQuantizationType(type_id)
        except ValueError:
            raise GGUFFormatError(f"unknown tensor type id {type_id}", f"tensor {name}") from None
        raw_tensors.append((name, ggml_type, shape, cur.scalar("Q")))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    if alignment <= 0:
        raise GGUFFormatError(f"alignment {alignment}", "key general.alignment")
    data_offset = -(-cur.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, ggml_type, shape, relative in raw_tensors:
        where = f"tensor {name}"
        if name in tensors:
            raise GGUFFormatError("duplicate tensor name", where)
        if relative % alignment:
            raise GGUFFormatError(f"data offset {relative} is not aligned to {alignment}", where)
        info = TensorInfo(name, ggml_type, shape, data_offset + relative, tensor_nbytes(ggml_type, shape, where))
        if info.offset + info.nbytes > total_size:
            raise GGUFFormatError(f"data (bytes {info.offset}..{info.offset + info.nbytes}) lies outside the file "
                                  f"({total_size} bytes): truncated or corrupt offset", where)
        tensors[name] = info
    return GGUFIndex(version, metadata, tensors, alignment, data_offset)
