"""Errors the inference engine raises for bad input. Each carries one line that names the file, the
tensor or key, and the problem; the CLI prints that line and exits with code 2 (bad input)."""

from __future__ import annotations

from pathlib import Path


class ModelError(Exception):
    """A model file cannot be used. `str(err)` is one line: '<file>: <where>: <problem>'."""

    def __init__(self, path: str | Path, problem: str, where: str | None = None) -> None:
        self.path = str(path)
        self.where = where
        self.problem = problem
        parts = [self.path] + ([where] if where else []) + [problem]
        super().__init__(": ".join(parts).replace("\n", " "))


class GGUFFormatError(ModelError):
    """The file is not a well-formed GGUF file (magic, version, truncation, offsets, tensor types)."""


class UnsupportedModelError(ModelError):
    """The file is a valid GGUF file but describes a model this engine does not run."""


class UnsupportedTensorTypeError(ValueError):
    """A tensor type this engine cannot dequantize (raised by infer.quants; callers add the file)."""


class StorageUnavailable(Exception):
    """Tier C's source cannot be opened: no such device, a controller nobody can reach, no model
    stored there. `str(err)` is one line; the CLI exits with code 4 (not ready)."""


class NonFiniteValues(ValueError):
    """A model computed NaN or infinity (damaged weights, or weights read from the wrong place): the
    CLI names the model in one line, a server fails every request in flight."""


class NonFiniteActivations(NonFiniteValues):
    """A matrix product's input holds NaN or infinity (infer.cpu_kernels checks it where it reads it)."""

    def __init__(self) -> None:
        super().__init__("the model produced non-finite activations (NaN or infinity) before a matrix product: "
                         "its weights are damaged or were read from the wrong place")
