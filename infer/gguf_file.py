"""A GGUF file opened for inference: metadata as a plain dict, tensors as views into a memory map.

Parsing is the `gguf` package's GGUFReader (the file is memory-mapped, never read whole). On top of
it this module checks what the reader takes on trust: every tensor's type is known, its rows hold
whole blocks, its bytes are aligned and lie inside the file. Any problem becomes a GGUFFormatError
whose message names the file, the tensor or key, and the problem.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from infer import quants
from infer.errors import GGUFFormatError, ModelError, UnsupportedModelError, UnsupportedTensorTypeError


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: its GGML type, NumPy-order shape (rows last-axis contiguous) and raw bytes."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    data: np.ndarray  # uint8 view into the memory map, `nbytes` long

    @property
    def nbytes(self) -> int:
        return int(self.data.size)

    @property
    def type_name(self) -> str:
        return quants.type_name(self.ggml_type)

    def dequantize(self, dtype: type = np.float32) -> np.ndarray:
        """The whole tensor as float32 (a new array), or exactly as float64 (quants.dequantize)."""
        return quants.dequantize(self.data, self.ggml_type, self.shape, dtype)


class _Truncated(Exception):
    """The header reads past the end of the file."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


class _CheckedReader(GGUFReader):
    """GGUFReader whose tensor table is validated and kept as TensorInfo records."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.checked: dict[str, TensorInfo] = {}
        super().__init__(path, "r")

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        # The reader slices its np.memmap once per value (hundreds of thousands of times for a
        # vocabulary); slicing a plain ndarray view of the same map is several times faster.
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        itemsize = np.dtype(dtype).itemsize
        if offset + itemsize * count > plain.size:  # else NumPy's own complaint about a short view
            raise _Truncated(plain.size)
        arr = plain[offset : offset + itemsize * count].view(dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _build_tensors(self, start_offs: int, fields: list) -> None:  # type: ignore[override]
        # GGUFReader keeps general.alignment as the field's NumPy uint32 and derives the data offset
        # from it, so every sum with either stays 32-bit: a tensor past 4 GiB would overflow, or
        # wrap around to the file's first bytes. Plain Python ints from here on.
        self.alignment = int(self.alignment)
        self.data_offset = start_offs = int(start_offs)
        file_size = int(self.data.size)
        self.checked: dict[str, TensorInfo] = {}
        for field in fields:
            _name_len, name_data, _n_dims, dims, raw_type, rel_offset = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            where = f"tensor {name}"
            if name in self.checked:
                raise GGUFFormatError(self.path, "duplicate tensor name", where)
            type_id = int(raw_type[0])
            try:
                ggml_type = GGMLQuantizationType(type_id)
            except ValueError:
                raise GGUFFormatError(self.path, f"unknown tensor type id {type_id}", where) from None
            ggml_dims = [int(d) for d in dims]
            if not ggml_dims or any(d <= 0 for d in ggml_dims):
                raise GGUFFormatError(self.path, f"invalid dimensions {ggml_dims}", where)
            block_size, type_size = GGML_QUANT_SIZES[ggml_type]
            if ggml_dims[0] % block_size:
                raise GGUFFormatError(
                    self.path, f"row length {ggml_dims[0]} is not a multiple of the {ggml_type.name} "
                    f"block size {block_size}", where)
            nbytes = int(np.prod(ggml_dims, dtype=np.int64)) // block_size * type_size
            offset = int(rel_offset[0])
            if offset % self.alignment:
                raise GGUFFormatError(self.path, f"data offset {offset} is not aligned to {self.alignment}", where)
            start = start_offs + offset
            if start + nbytes > file_size:
                raise GGUFFormatError(
                    self.path, f"data (bytes {start}..{start + nbytes}) lies outside the file "
                    f"({file_size} bytes): truncated or corrupt offset", where)
            self.checked[name] = TensorInfo(
                name=name, ggml_type=int(ggml_type), shape=tuple(reversed(ggml_dims)), offset=start,
                data=self.data[start : start + nbytes],
            )
        self.tensors = []  # the reader's own records are not used


class GGUFModel:
    """An opened GGUF file. `metadata` maps each key to a Python value (str, int, float, bool, or
    a list of those); `tensors` maps each tensor name to its TensorInfo, in whatever order the file
    stores them."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise ModelError(self.path, "no such file")
        if not self.path.is_file():
            raise ModelError(self.path, "not a regular file")
        if self.path.stat().st_size == 0:
            raise GGUFFormatError(self.path, "empty file, not a GGUF model")
        try:
            reader = _CheckedReader(self.path)
        except ModelError:
            raise
        except _Truncated as err:
            raise GGUFFormatError(self.path, f"truncated GGUF header (the file ends at byte {err.size}, inside "
                                  "its header)") from None
        except ValueError as err:
            message = str(err)
            if "magic" in message:
                raise GGUFFormatError(self.path, "not a GGUF file (bad magic)") from None
            if "version" in message:
                raise GGUFFormatError(self.path, f"unsupported GGUF version ({message})") from None
            raise GGUFFormatError(self.path, f"corrupt or truncated GGUF header ({message})") from None
        except (IndexError, KeyError, OverflowError, UnicodeDecodeError, MemoryError) as err:
            raise GGUFFormatError(self.path, f"corrupt or truncated GGUF header ({type(err).__name__})") from None
        self.version = int(reader.fields["GGUF.version"].parts[0][0])
        self.tensors: dict[str, TensorInfo] = reader.checked
        self.metadata: dict[str, Any] = {}
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                self.metadata[key] = field.contents()
            except (UnicodeDecodeError, IndexError) as err:
                raise GGUFFormatError(self.path, f"unreadable value ({type(err).__name__})", f"key {key}") from None
        self.file_size = int(reader.data.size)
        self._reader = reader  # keeps the memory map alive

    @property
    def data(self) -> np.ndarray:
        """The whole file as a read-only uint8 memory map (tensor data are views into it)."""
        return self._reader.data.view(np.ndarray)

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture", str))

    def require(self, key: str, kind: type | tuple[type, ...]) -> Any:
        """A metadata value that must exist and have type `kind`, else a one-line ModelError."""
        if key not in self.metadata:
            raise UnsupportedModelError(self.path, "required metadata key is missing", f"key {key}")
        value = self.metadata[key]
        if kind in (int, float) and isinstance(value, bool):
            raise UnsupportedModelError(self.path, f"expected a number, found {value!r}", f"key {key}")
        if kind is float and isinstance(value, int):
            value = float(value)
        if not isinstance(value, kind):
            raise UnsupportedModelError(
                self.path, f"expected {getattr(kind, '__name__', kind)}, found {type(value).__name__}",
                f"key {key}")
        return value

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise UnsupportedModelError(self.path, "required tensor is missing", f"tensor {name}") from None

    def check_tensor_supported(self, info: TensorInfo) -> None:
        try:
            quants.check_supported(info.ggml_type)
        except UnsupportedTensorTypeError as err:
            raise UnsupportedModelError(self.path, str(err), f"tensor {info.name}") from None

    def close(self) -> None:
        """Drops the references to the memory map (it closes once no array view is left)."""
        self.tensors = {}
        self._reader = None  # type: ignore[assignment]

