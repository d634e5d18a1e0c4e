"""Quantized matrix products on the CPU through the native kernels (native/cpu_qdot.c).

The weights stay in their packed GGUF blocks; the activations are rounded once per product to the
format the weight type multiplies with (infer.quants.activation_format: 8-bit blocks of 32 for
Q4_0..Q8_0, 8-bit blocks of 256 for the K-quants, f16/bf16/f32 for the float types), each block's
products are summed in integers and then scaled. Every output is computed by one fixed sequence of
float operations, so a result does not depend on the token batch, the thread count or whether the
AVX2 or the portable code ran. Build the extension with `python native/build_cpu_kernels.py` (or
`pip install -e .`); `available()` says whether it is importable.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np
from gguf.constants import GGMLQuantizationType

from infer.errors import NonFiniteActivations

try:
    from infer import _cpu_kernels  # type: ignore[attr-defined]
except ImportError:  # not built yet
    _cpu_kernels = None

T = GGMLQuantizationType
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4}
)
IMPLEMENTATIONS = ("avx512", "avx2", "portable")  # the fastest first; all give the same bits
_IMPLEMENTATION_CODES = {"portable": 0, "avx2": 1, "avx512": 2}  # native/cpu_qdot.h's QDOT_IMPL_*

_ERRORS = {-1: "unsupported weight type", -2: "bad column count", -3: "bad row range or token count",
           -4: "out of memory", -5: "implementation not available on this CPU",
           -6: "activations contain NaN or infinity"}
MAX_PARTS = 8  # matrices in one FusedProduct (native/cpu_qdot.c)


def available() -> bool:
    """Whether the native extension is built and importable."""
    return _cpu_kernels is not None


def _lib():  # noqa: ANN202 - the cffi lib object has no useful static type
    if _cpu_kernels is None:
        raise RuntimeError("the CPU kernels are not built: run `python native/build_cpu_kernels.py` "
                           "or `pip install -e .`")
    return _cpu_kernels.lib


def _check(rc: int, what: str) -> None:
    if rc < 0:
        raise RuntimeError(f"{what} failed: {_ERRORS.get(rc, f'error {rc}')}")


def native():  # noqa: ANN201 - cffi's ffi and lib objects have no useful static types
    """(ffi, lib) of the extension, for a module that builds its structures (infer.cpu_decode)."""
    return _cpu_kernels.ffi, _lib()


def raise_for(rc: int, what: str) -> None:
    """NonFiniteActivations for a native call that met NaN or infinity, RuntimeError for another
    negative return code."""
    if rc == -6:
        raise NonFiniteActivations
    _check(rc, what)


def _type_name(ggml_type: int) -> str:
    try:
        return T(ggml_type).name
    except ValueError:
        return f"type id {ggml_type}"


def _check_type(ggml_type: int) -> None:
    if ggml_type not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise ValueError(f"the CPU kernels do not support {_type_name(ggml_type)} (supported: {supported})")


def _row_bytes(func_name: str, ggml_type: int, cols: int) -> int:
    _check_type(ggml_type)
    n = getattr(_lib(), func_name)(int(ggml_type), int(cols))
    if n < 0:
        from infer.quants import block_layout

        block, _ = block_layout(ggml_type)
        raise ValueError(f"{cols} columns is not a positive multiple of the {_type_name(ggml_type)} "
                         f"block size {block}")
    return int(n)


def weight_row_nbytes(ggml_type: int, cols: int) -> int:
    """Bytes of one packed weight row of `cols` elements."""
    return _row_bytes("qdot_weight_row_bytes", ggml_type, cols)


def activation_row_nbytes(ggml_type: int, cols: int) -> int:
    """Bytes of one row of activations quantized for this weight type (a q8_0 block is 34 bytes per
    32 values, a q8_K block 292 bytes per 256, f16/bf16 2 bytes and f32 4 bytes per value)."""
    return _row_bytes("qdot_activation_row_bytes", ggml_type, cols)


THREADS_VARIABLE = "NVMEDIRECT_CPU_THREADS"  # the CLI's --threads sets it


@functools.cache
def default_threads() -> int:
    """NVMEDIRECT_CPU_THREADS when set, else the physical cores this process may run on
    (hyperthreads add nothing to these products). Counted once: psutil reads the CPU topology from
    /sys (~0.3 ms), and a decode step makes hundreds of products."""
    import psutil

    given = os.environ.get(THREADS_VARIABLE, "")
    if given:
        if not given.isdigit() or int(given) < 1:
            raise ValueError(f"{THREADS_VARIABLE}={given!r}: expected a whole number of threads, 1 or more")
        return int(given)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    physical = psutil.cpu_count(logical=False) or usable
    return max(1, min(physical, usable))


@functools.cache
def single_threaded_blas() -> bool:
    """Sets NumPy's OpenBLAS to one thread (once per process); whether it found the call. The engine's
    attention products are small, and two thread pools on the same cores take turns: OpenBLAS's idle
    threads spin after each product, against this module's workers (2026-12-04, the 2-core machine
    beside another job, under cProfile: a 127-token SmolLM2 prompt 4.4 s with OpenBLAS at 2 threads,
    1.0 s at 1)."""
    import ctypes
    from pathlib import Path

    libs = Path(np.__file__).resolve().parent.parent / "numpy.libs"
    for path in sorted(libs.glob("*openblas*.so*")) if libs.is_dir() else []:
        lib = ctypes.CDLL(str(path))  # already loaded by NumPy: the same handle
        for name in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_", "openblas_set_num_threads"):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.argtypes, fn.restype = [ctypes.c_int], None
                fn(1)
                return True
    return False


def implementation() -> str:
    """The code path in use: "avx512" (F, BW, VL and VNNI), "avx2" or "portable", the best the CPU
    runs unless NVMEDIRECT_CPU_KERNELS=avx2 or =portable caps it."""
    code = _lib().qdot_implementation()
    return next(name for name, c in _IMPLEMENTATION_CODES.items() if c == code)


def set_implementation(name: str) -> None:
    """Force a code path for this process ("avx512", "avx2" or "portable"); all give bit-identical
    results."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, not {name!r}")
    if _lib().qdot_set_implementation(_IMPLEMENTATION_CODES[name]) < 0:
        raise ValueError(f"this CPU cannot run the {name} kernels")


def cpu_has_avx2() -> bool:
    return bool(_lib().qdot_cpu_has_avx2())


def cpu_has_avx512() -> bool:
    """AVX-512 F, BW, VL and VNNI (the avx512 kernels' instructions)."""
    return bool(_lib().qdot_cpu_has_avx512())


def _activations(x: np.ndarray, cols: int | None = None) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"activations must be 2-D (n_tokens, cols), got shape {x.shape}")
    if x.dtype != np.float32:
        raise ValueError(f"activations must be float32, got {x.dtype}")
    if cols is not None and x.shape[1] != cols:
        raise ValueError(f"activations have {x.shape[1]} columns, the weights {cols}")
    if not np.isfinite(x).all():
        raise NonFiniteActivations
    return np.ascontiguousarray(x)


def quantize_activations(x: np.ndarray, ggml_type: int) -> np.ndarray:
    """x (n_tokens, cols) float32 -> (n_tokens, activation_row_nbytes) uint8: the rows in the format
    `ggml_type` multiplies with (standard GGML q8_0 / q8_K blocks, or f16 / bf16 / f32 values)."""
    x = _activations(x)
    n_tokens, cols = x.shape
    out = np.empty((n_tokens, activation_row_nbytes(ggml_type, cols)), dtype=np.uint8)
    ffi, lib = _cpu_kernels.ffi, _lib()
    _check(lib.qdot_quantize_activations(int(ggml_type), ffi.from_buffer("float[]", x), n_tokens, cols,
                                         ffi.from_buffer(out, require_writable=True)), "quantize_activations")
    return out


def half_to_float(a: np.ndarray) -> np.ndarray:
    """a float16 array -> the same values as float32 (exact; F16C where the AVX2 path runs)."""
    a = np.ascontiguousarray(a)
    if a.dtype != np.float16:
        raise ValueError(f"half_to_float takes float16, got {a.dtype}")
    out = np.empty(a.shape, dtype=np.float32)
    ffi = _cpu_kernels.ffi
    _lib().qdot_half_to_float(ffi.from_buffer(a), ffi.from_buffer("float[]", out, require_writable=True), a.size)
    return out


def matmul_quantized(raw: np.ndarray, ggml_type: int, rows: int, cols: int, xq: np.ndarray,
                     threads: int | None = None) -> np.ndarray:
    """Like `matmul`, with activations already from quantize_activations (reuse them across the
    weight matrices that share an input)."""
    row_bytes = weight_row_nbytes(ggml_type, cols)
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows}")
    raw = np.ascontiguousarray(np.asarray(raw).reshape(-1).view(np.uint8))
    if raw.size != rows * row_bytes:
        raise ValueError(f"{raw.size} bytes given for a {rows}x{cols} {_type_name(ggml_type)} matrix "
                         f"({rows * row_bytes} expected)")
    xq = np.asarray(xq)
    x_bytes = activation_row_nbytes(ggml_type, cols)
    if xq.dtype != np.uint8 or xq.ndim != 2 or xq.shape[1] != x_bytes:
        raise ValueError(f"quantized activations must be (n_tokens, {x_bytes}) uint8 for "
                         f"{_type_name(ggml_type)} x {cols} columns, got {xq.dtype} {xq.shape}")
    xq = np.ascontiguousarray(xq)
    n_tokens = xq.shape[0]
    threads = default_threads() if threads is None else int(threads)
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    y = np.empty((n_tokens, rows), dtype=np.float32)
    ffi, lib = _cpu_kernels.ffi, _lib()
    _check(lib.matmul_q(ffi.from_buffer(raw), int(ggml_type), rows, cols, ffi.from_buffer(xq), n_tokens,
                        ffi.from_buffer("float[]", y, require_writable=True), 0, rows, threads), "matmul")
    return y


def matmul(raw: np.ndarray, ggml_type: int, rows: int, cols: int, x: np.ndarray,
           threads: int | None = None) -> np.ndarray:
    """y = x @ W.T for a packed GGUF matrix W (raw: its rows*row_nbytes bytes, rows x cols) and
    x (n_tokens, cols) float32 -> (n_tokens, rows) float32. threads: default the physical cores."""
    _check_type(ggml_type)
    x = _activations(x, cols)
    return matmul_quantized(raw, ggml_type, rows, cols, quantize_activations(x, ggml_type), threads)


class FusedProduct:
    """y = x @ [W_0; W_1; ...].T for packed matrices stacked row-wise (Q, K, V or gate, up), each in
    its own type, in one native call: x is rounded once per activation format inside it, and the
    threads share one task over all the parts' rows. The same bits as `matmul` on each part. What can
    be checked once (types, sizes, the buffers' addresses) is, at construction."""

    def __init__(self, parts: list[tuple[np.ndarray, int, int, int]], threads: int | None = None) -> None:
        if not 1 <= len(parts) <= MAX_PARTS:
            raise ValueError(f"a fused product takes 1 to {MAX_PARTS} matrices, not {len(parts)}")
        cols = {int(c) for _, _, _, c in parts}
        if len(cols) != 1:
            raise ValueError(f"the matrices of a fused product must share their column count, got {sorted(cols)}")
        self.cols = cols.pop()
        self.rows = sum(int(r) for _, _, r, _ in parts)
        self.threads = default_threads() if threads is None else int(threads)
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        _lib()  # raises if the extension is not built
        ffi = _cpu_kernels.ffi
        raws = []
        for raw, ggml_type, rows, cols_ in parts:
            row_bytes = weight_row_nbytes(ggml_type, cols_)
            raw = np.ascontiguousarray(np.asarray(raw).reshape(-1).view(np.uint8))
            if raw.size != rows * row_bytes:
                raise ValueError(f"{raw.size} bytes given for a {rows}x{cols_} {_type_name(ggml_type)} matrix "
                                 f"({rows * row_bytes} expected)")
            raws.append(raw)
        self._keep = raws  # the buffers the pointers below point into
        self._w = ffi.new("const void *[]", [ffi.from_buffer(r) for r in raws])
        self._types = ffi.new("int[]", [int(t) for _, t, _, _ in parts])
        self._rows = ffi.new("int[]", [int(r) for _, _, r, _ in parts])
        self._n = len(parts)

    @property
    def native_parts(self) -> tuple[int, object, object, object, int]:
        """(parts, weight pointers, types, rows, cols) as native/cpu_qdot.h's struct qdot_product
        takes them (infer.cpu_decode); valid while this object lives."""
        return self._n, self._w, self._types, self._rows, self.cols

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x (..., cols) float32 -> (..., rows) float32. A decode step makes ~100 of these calls, so
        the Python here is kept to a few operations."""
        if x.shape[-1] != self.cols:
            raise ValueError(f"activations have {x.shape[-1]} columns, the weights {self.cols}")
        if x.dtype != np.float32 or not x.flags.c_contiguous:
            x = np.ascontiguousarray(x, dtype=np.float32)
        y = np.empty((*x.shape[:-1], self.rows), dtype=np.float32)
        ffi = _cpu_kernels.ffi
        rc = _cpu_kernels.lib.matmul_q_parts(self._n, self._w, self._types, self._rows, self.cols,
                                             ffi.from_buffer("float[]", x), x.size // self.cols,
                                             ffi.from_buffer("float[]", y, require_writable=True), self.threads)
        raise_for(rc, "matmul")  # NaN or infinity is checked in C, where the values are read anyway
        return y


MAX_SLOTS = 32  # experts one token is routed to, at most (native/cpu_moe.c)
Stack = list[tuple[np.ndarray, int, int, int]]  # an expert stack: per expert (raw bytes, type, rows, cols)


class RoutedExperts:
    """One token's routed experts in one native call (native/cpu_moe.c): for each chosen expert its
    gate and up products of x, their SwiGLU (the native one) and its down product. The same bits as
    a FusedProduct of [gate; up], cpu_layers.swiglu and a FusedProduct of down per expert."""

    def __init__(self, gate: Stack, up: Stack, down: Stack, threads: int | None = None) -> None:
        if not len(gate) == len(up) == len(down) > 0:
            raise ValueError("the gate, up and down stacks must hold the same experts")
        for stack in (gate, up, down):
            if len({(int(t), int(r), int(c)) for _, t, r, c in stack}) != 1:
                raise ValueError("each stack's experts must share their type and shape")
        (_, self.gate_type, self.width, self.dim), (_, self.up_type, up_rows, up_cols) = gate[0], up[0]
        _, self.down_type, down_rows, down_cols = down[0]
        if (up_rows, up_cols, down_rows, down_cols) != (self.width, self.dim, self.dim, self.width):
            raise ValueError("the stacks' shapes do not make gated experts (gate, up: width x dim; down: dim x width)")
        self.n_experts = len(gate)
        self.threads = default_threads() if threads is None else int(threads)
        _lib()
        ffi = _cpu_kernels.ffi
        self._keep = [[np.ascontiguousarray(np.asarray(raw).reshape(-1).view(np.uint8)) for raw, *_ in stack]
                      for stack in (gate, up, down)]
        for stack, (_, t, r, c) in zip(self._keep, (gate[0], up[0], down[0]), strict=True):
            if any(raw.size != r * weight_row_nbytes(t, c) for raw in stack):
                raise ValueError(f"an expert's bytes do not make a {r}x{c} {_type_name(t)} matrix")
        self._tables = [ffi.new("const void *[]", [ffi.from_buffer(raw) for raw in stack]) for stack in self._keep]

    def __call__(self, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """x (dim,) float32, ids (k,) expert ids -> (k, dim) float32: each expert's output for x."""
        return _moe_row(self, self._tables, x, ids)

    def weighted_sum(self, x: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """x (dim,), ids (k,), weights (k,) float32 -> (dim,) float32: the experts' outputs for x
        weighted and summed as infer.moe.weighted_sum does, the same bits, in the same native call."""
        return _moe_row(self, self._tables, x, ids, weights)


def _moe_row(shape: RoutedExperts | ExpertTable, tables: list[Any], x: np.ndarray, ids: np.ndarray,
             weights: np.ndarray | None = None) -> np.ndarray:
    ids = np.ascontiguousarray(ids, dtype=np.int32)
    if not 1 <= ids.size <= MAX_SLOTS:
        raise ValueError(f"a token takes 1 to {MAX_SLOTS} experts, not {ids.size}")
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if x.size != shape.dim:
        raise ValueError(f"activations have {x.size} values, the experts {shape.dim}")
    ffi = _cpu_kernels.ffi
    if weights is None:
        out, weighted = np.empty((ids.size, shape.dim), np.float32), ffi.NULL
    else:
        weights = np.ascontiguousarray(weights, dtype=np.float32).reshape(-1)
        if weights.size != ids.size:
            raise ValueError(f"{weights.size} weights for {ids.size} experts")
        out, weighted = np.empty(shape.dim, np.float32), ffi.from_buffer("float[]", weights)
    rc = _cpu_kernels.lib.qdot_moe_row(ffi.from_buffer("int[]", ids), ids.size, *tables, shape.n_experts,
                                       int(shape.gate_type), int(shape.up_type), int(shape.down_type), shape.width,
                                       shape.dim, ffi.from_buffer("float[]", x), weighted,
                                       ffi.from_buffer("float[]", out, require_writable=True), shape.threads)
    raise_for(rc, "routed experts")
    return out


class ExpertTable:
    """A layer's experts held in separate buffers (infer.tiers.experts' cache), for one token's routed
    experts in one native call as RoutedExperts makes it, so the same bits: per expert id the
    pointers of its gate, up and down bytes, set by `hold` and cleared by `drop`. A call may name
    held experts only."""

    def __init__(self, n_experts: int, types: tuple[int, int, int], width: int, dim: int,
                 threads: int | None = None) -> None:
        _lib()
        ffi = _cpu_kernels.ffi
        self.n_experts, self.width, self.dim = n_experts, width, dim
        self.gate_type, self.up_type, self.down_type = types
        self.threads = default_threads() if threads is None else int(threads)
        self._tables = [ffi.new("const void *[]", n_experts) for _ in range(3)]
        self._held: dict[int, tuple[np.ndarray, ...]] = {}
        self._sizes = [self.width * weight_row_nbytes(self.gate_type, dim), self.width * weight_row_nbytes(self.up_type, dim),
                       dim * weight_row_nbytes(self.down_type, width)]

    def hold(self, expert: int, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> None:
        raws = tuple(np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in (gate, up, down))
        if [r.size for r in raws] != self._sizes:
            raise ValueError(f"expert {expert}'s bytes ({[r.size for r in raws]}) are not its matrices' ({self._sizes})")
        for table, raw in zip(self._tables, raws, strict=True):
            table[expert] = _cpu_kernels.ffi.from_buffer(raw)
        self._held[expert] = raws

    def drop(self, expert: int) -> None:
        for table in self._tables:
            table[expert] = _cpu_kernels.ffi.NULL
        del self._held[expert]

    def __call__(self, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """x (dim,) float32, ids (k,) held expert ids -> (k, dim) float32: each expert's output for x."""
        missing = [int(e) for e in np.asarray(ids).reshape(-1) if int(e) not in self._held]
        if missing:
            raise ValueError(f"experts {missing} are not held")
        return _moe_row(self, self._tables, x, ids)
