"""A GGUF file opened for inference: metadata as a plain dict, tensors as views into a memory map.

The header is parsed by the project's one GGUF parser (nvmedirect/reader/gguf_index.py, which the
NVMe store reads through as well) over the memory-mapped file (never read whole); it checks every
tensor's type, dimensions, alignment and extent. Any problem becomes a GGUFFormatError whose message
names the file, the tensor or key, and the problem.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from infer import quants
from infer.errors import GGUFFormatError, ModelError, UnsupportedModelError, UnsupportedTensorTypeError
from nvmedirect.reader import gguf_index


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
        data = np.memmap(self.path, dtype=np.uint8, mode="r").view(np.ndarray)
        try:
            index = gguf_index.parse_gguf_header(lambda offset, n: data[offset : offset + n].tobytes(), data.size)
        except gguf_index.GGUFFormatError as err:
            problem = err.problem.replace("the GGUF ends", "the file ends")
            raise GGUFFormatError(self.path, problem, err.where or None) from None
        self.version = index.version
        self.metadata: dict[str, Any] = index.metadata
        self.tensors: dict[str, TensorInfo] = {
            name: TensorInfo(name=name, ggml_type=int(t.type), shape=tuple(reversed(t.shape)), offset=t.offset,
                             data=data[t.offset : t.offset + t.nbytes])
            for name, t in index.tensors.items()}
        self.file_size = int(data.size)
        self._data = data  # keeps the memory map alive

    @property
    def data(self) -> np.ndarray:
        """The whole file as a read-only uint8 memory map (tensor data are views into it)."""
        return self._data

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
        self._data = None  # type: ignore[assignment]

