"""Python faces of the CUDA kernels (attention's are in infer.gpu.attention): each call states its
grid and block and launches on the current CuPy stream. None of them allocates, so every call may
sit inside a CUDA graph capture; outputs are passed in. Scalars are passed as NumPy types of the
kernel's parameter width.

Every kernel works on the N rows of a pass and computes each row in an order that does not depend
on N or on the other rows (infer/kernels/canon.cuh, attention.cu, pmm.cu): a row's numbers are the
same bits alone, in a batch, as a token-tree node or as a scored prompt position; a prompt row's
(prompt_product) are the same bits in any pass too."""

from __future__ import annotations

from dataclasses import dataclass

import cupy
import numpy as np

from infer.gpu import kernels
from infer.gpu.layout import (
    FLOAT_FORMATS,
    FLOAT_ITEMSIZE,
    PLANE_BYTES,
    PlaneLayout,
    format_of,
    plane_layout,
)
from infer.gpu.memory import transient_pool

NULL = np.uint64(0)
# GGUF bytes a repack brings over at a time: the transient copy must fit what the VRAM budget leaves
# beside the plan while a model loads (the 8B's 431 MB output did not at a 3 GB budget)
UPLOAD_CHUNK_BYTES = 64 << 20
_SHARED_DEFAULT = 48 * 1024  # more dynamic shared memory than this needs the kernel's opt-in


def device_ptr(a: cupy.ndarray | None) -> np.uint64:
    return NULL if a is None else np.uint64(a.data.ptr)


def grid_blocks(n: int, threads: int) -> int:
    return max(1, -(-n // threads))


@dataclass
class GpuMatrix:
    """A weight matrix (rows x cols) in VRAM in its planar format."""

    fmt: str
    rows: int
    cols: int
    layout: PlaneLayout
    buffer: cupy.ndarray  # uint8, layout.nbytes
    source_nbytes: int  # bytes of the GGUF tensor it came from
    act: str = "f32"  # activation format its input is rounded to (infer.quants.activation_format)
    streamed: bool = False  # lives in the streaming scratch (its bytes change every pass)

    @property
    def nbytes(self) -> int:
        return int(self.buffer.nbytes)

    def planes(self) -> tuple[np.uint64, np.uint64, np.uint64, np.uint64]:
        base = self.buffer.data.ptr
        return tuple(np.uint64(base + o) if s else NULL  # type: ignore[return-value]
                     for o, s in zip(self.layout.offsets, self.layout.sizes, strict=True))


def upload_matrix(raw: np.ndarray, ggml_type: int, rows: int, cols: int) -> GpuMatrix:
    """Copies a GGUF tensor (uint8 bytes) to the GPU and repacks it there into its planar format."""
    return upload_stacked([(raw, rows)], ggml_type, cols)


def upload_stacked(parts: list[tuple[np.ndarray, int]], ggml_type: int, cols: int) -> GpuMatrix:
    """Several GGUF tensors of one type and row length, as one matrix of their rows stacked in order
    (e.g. Q, K and V). parts: (raw bytes, rows) each."""
    fmt = format_of(ggml_type)
    rows = sum(r for _, r in parts)
    layout = plane_layout(fmt, rows, cols)
    buffer = cupy.empty(layout.nbytes, dtype=cupy.uint8)
    base, row0, total = buffer.data.ptr, 0, 0
    for raw, part_rows in _in_chunks(parts):
        total += int(raw.size)
        if fmt in FLOAT_FORMATS:
            start = row0 * cols * FLOAT_ITEMSIZE[fmt]
            buffer[start : start + raw.size].set(raw)
        else:
            with transient_pool():
                source = cupy.asarray(raw)
                repack_sub_blocks(source, ggml_type, layout, base, row0 * cols // 32, part_rows * cols // 32)
                del source
        row0 += part_rows
    from infer.quants import activation_format

    return GpuMatrix(fmt, rows, cols, layout, buffer, total, activation_format(ggml_type))


def repack_sub_blocks(raw: cupy.ndarray, ggml_type: int, layout: PlaneLayout, base: int, sb0: int, n_sb: int) -> None:
    """Repacks n_sb sub-blocks (32 values each) of GGUF bytes `raw` (device) into the planes of the
    matrix of `layout` at device address `base`, from its sub-block sb0 on (a part of stacked
    matrices, an expert of a stack: it starts on a 256-value block), queued on the current stream."""
    from gguf.constants import GGMLQuantizationType

    kernel = kernels.function("repack", f"repack_{GGMLQuantizationType(ggml_type).name.lower()}")
    per_sb = (*PLANE_BYTES[layout.fmt], 4 / 8)  # dm: 4 bytes per 8 sub-blocks
    planes = (np.uint64(base + o + int(sb0 * b)) if size else NULL
              for o, size, b in zip(layout.offsets, layout.sizes, per_sb, strict=True))
    kernel((grid_blocks(n_sb, 256),), (256,), (raw, np.int64(n_sb), *planes))


def _in_chunks(parts: list[tuple[np.ndarray, int]]) -> list[tuple[np.ndarray, int]]:
    """The parts split into runs of rows of at most UPLOAD_CHUNK_BYTES (a multiple of 256 rows, so
    every run starts on a 256-weight block, as the repack kernels' planes need)."""
    out = []
    for raw, part_rows in parts:
        raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
        row_bytes = raw.size // max(part_rows, 1)
        step = max(256, UPLOAD_CHUNK_BYTES // max(row_bytes, 1) // 256 * 256)
        out += [(raw[r * row_bytes : min(r + step, part_rows) * row_bytes], min(step, part_rows - r))
                for r in range(0, part_rows, step)] or [(raw, part_rows)]
    return out


# ---------------------------------------------------------------------------- activations
# activation formats (act.cuh ACT_*): what llama.cpp converts a matrix product's input to per weight type
ACT_CODES = {"f32": 0, "f16": 1, "bf16": 2, "q8_0": 3, "q8_k": 4}
EIGHT_BIT = ("q8_0", "q8_k")


@dataclass
class Int8Act:
    """The 8-bit form of rows of activations (q8_0 / q8_k): int8 values, a float scale per group
    (32 or 256 values), the sum of the values per 32."""

    xq: cupy.ndarray
    xs: cupy.ndarray
    xsum: cupy.ndarray
    n: int  # values per row
    act: str

    @classmethod
    def zeros(cls, rows: int, n: int, act: str) -> Int8Act:
        group = 32 if act == "q8_0" else 256
        return cls(cupy.zeros(rows * n, cupy.int8), cupy.zeros(rows * n // group, cupy.float32),
                   cupy.zeros(rows * n // 32, cupy.int32), n, act)

    def rows(self, r0: int, r1: int) -> Int8Act:
        """Rows r0 .. r1 - 1 (views)."""
        group = 32 if self.act == "q8_0" else 256
        n = self.n
        return Int8Act(self.xq[r0 * n : r1 * n], self.xs[r0 * n // group : r1 * n // group],
                       self.xsum[r0 * n // 32 : r1 * n // 32], n, self.act)

    @property
    def nbytes(self) -> int:
        return int(self.xq.nbytes + self.xs.nbytes + self.xsum.nbytes)


def int8_args(int8: Int8Act | None) -> tuple:
    return (NULL, NULL, NULL) if int8 is None else (int8.xq, int8.xs, int8.xsum)


def norm_fits_one_pass(n: int, act: str) -> bool:
    """Whether rmsnorm8 (one pass, 8 values a thread in registers) takes rows of n values rounded to `act`."""
    return n % {"q8_0": 32, "q8_k": 256}.get(act, 8) == 0 and n <= 8192


@dataclass
class NormOutputs:
    """Where rmsnorm8 (ops.cu; act.cuh norm8_row) writes a normalised row: y the values rounded to
    activation format `act`, int8 its 8-bit form, y16 / y_unrounded the values before rounding (float16,
    float32); any may be None. moe.cu's moe_combine_norm writes the same."""

    act: str
    y: cupy.ndarray | None = None
    y16: cupy.ndarray | None = None
    int8: Int8Act | None = None
    y_unrounded: cupy.ndarray | None = None

    def args(self) -> tuple:
        """The kernels' (fmt, y, y16, yf, xq, xs, xsum) arguments."""
        return (np.int32(ACT_CODES[self.act]), device_ptr(self.y), device_ptr(self.y16), device_ptr(self.y_unrounded),
                *int8_args(self.int8))


def rmsnorm(x: cupy.ndarray, weight: cupy.ndarray, eps: float, rows: int, n: int, y: cupy.ndarray | None = None,
            y16: cupy.ndarray | None = None, act: str = "f32", int8: Int8Act | None = None,
            src_rows: cupy.ndarray | None = None, y_unrounded: cupy.ndarray | None = None) -> None:
    """y = RMSNorm(x) * weight per row, rounded to activation format `act`; int8 (q8_0/q8_k): also
    its 8-bit form; y16 (float16) and y_unrounded (float32): the values before rounding (the prompt
    products' input; a float product's beside an 8-bit one, only where norm_fits_one_pass). y
    (float32) may be None where the 8-bit form is all that is wanted and the row fits the one-pass
    kernel. src_rows (int32, optional): output row i from input row src_rows[i]."""
    fast = norm_fits_one_pass(n, act)
    if y is None and not (fast and act in EIGHT_BIT and int8 is not None):
        raise ValueError("rmsnorm needs the float32 output y here")
    if y_unrounded is not None and not fast:
        raise ValueError(f"rmsnorm writes the unrounded values beside a {act} row of {n} only in one pass")
    if fast:  # one pass, values in registers (8 per thread)
        kernels.function("ops", "rmsnorm8")((rows,), (-(-n // 256) * 32,), (x, weight, device_ptr(y), device_ptr(y16), np.int32(n),
                                                                 np.float32(eps), np.int32(ACT_CODES[act]),
                                                                 *int8_args(int8), device_ptr(src_rows),
                                                                 device_ptr(y_unrounded)))
        return
    threads = 1024 if n >= 4096 else 256
    kernels.function("ops", "rmsnorm")((rows,), (threads,), (x, weight, device_ptr(y), device_ptr(y16), np.int32(n),
                                                             np.float32(eps), np.int32(ACT_CODES[act]),
                                                             *int8_args(int8), device_ptr(src_rows)))


def round_act(x: cupy.ndarray, y: cupy.ndarray, rows: int, n: int, act: str, y16: cupy.ndarray | None = None,
              int8: Int8Act | None = None) -> None:
    """y (may be x) and y16 = x rounded to activation format `act`, per row of n values; int8
    (q8_0/q8_k only): also its 8-bit form."""
    # a warp per 8-bit group, 8 warps a block, the row spread over blocks (grid x) so that short rows
    # still use many SMs; float formats: 1024 values a block
    per_block = 8 * {"q8_0": 32, "q8_k": 256}.get(act, 128)
    if rows > 65535:
        raise ValueError(f"round_act takes at most 65535 rows at a time, not {rows}")
    kernels.function("ops", "round_act")((-(-n // per_block), rows), (256,),
                                         (x, y, device_ptr(y16), np.int32(n), np.int32(ACT_CODES[act]), *int8_args(int8)))


def glu_round(gu: cupy.ndarray, n: int, rows: int, act: str, y: cupy.ndarray | None = None,
              int8: Int8Act | None = None, y16: cupy.ndarray | None = None, activation: str = "silu") -> None:
    """SiLU(gate) * up (activation "gelu_tanh": GELU(gate) * up) of rows [gate (n) | up (n)] of gu,
    rounded to `act`: the 8-bit form into int8 (q8_0/q8_k), and/or the rounded float32 values into
    y (rows, n); y16 (rows, n) float16: the values before rounding (the prompt products' input)."""
    if act not in EIGHT_BIT and y is None:
        raise ValueError(f"the gated activation rounded to {act} needs the float32 output y")
    if activation not in ("silu", "gelu_tanh"):
        raise ValueError(f"unknown gated activation {activation!r}")
    per_block = 8 * {"q8_0": 32, "q8_k": 256}.get(act, 128)
    kernels.function("ops", "glu_round")((-(-n // per_block), rows), (256,),
                                         (gu, np.int32(n), device_ptr(y), device_ptr(y16), np.int32(ACT_CODES[act]),
                                          *int8_args(int8), np.int32(activation == "gelu_tanh")))


def norm_add(t: cupy.ndarray, weight: cupy.ndarray, x: cupy.ndarray, rows: int, n: int, eps: float) -> None:
    """x[r] += RMSNorm(t[r]) * weight for rows r < rows of n values (Gemma's post-norms)."""
    threads = 1024 if n >= 4096 else 256
    kernels.function("ops", "norm_add")((rows,), (threads,), (t, weight, x, np.int32(n), np.float32(eps)))


# ---------------------------------------------------------------------------- shared memory
_opted_in: dict[tuple, int] = {}  # the opt-in set per key


def with_shared(fn, key: tuple, nbytes: int):  # noqa: ANN001, ANN202
    """The kernel with its dynamic shared memory opt-in raised to nbytes (per kernel, module variant
    and device; raised again when a later shape needs more)."""
    key = (cupy.cuda.Device().id, *key)
    if nbytes > max(_SHARED_DEFAULT, _opted_in.get(key, 0)):
        fn.max_dynamic_shared_size_bytes = nbytes
        _opted_in[key] = nbytes
    return fn



def dequantize(m: GpuMatrix, out: cupy.ndarray) -> None:
    """out (float16, rows*cols elements) = the matrix's weights."""
    fn = kernels.function("dequant", f"dequant_{m.fmt}")
    n = m.rows * m.cols if m.fmt in FLOAT_FORMATS else m.layout.n_subblocks
    fn((grid_blocks(n, 256),), (256,), (*m.planes(), np.int64(n), out))


def embed(m: GpuMatrix, ids: cupy.ndarray, n: int, out: cupy.ndarray, scale: float = 1.0) -> None:
    """out[i, :] = row ids[i] of the matrix times `scale` (Gemma's sqrt(width)), float32 (ids: int32
    on the device)."""
    fn = kernels.function("dequant", f"embed_{m.fmt}")
    work = n * m.cols if m.fmt in FLOAT_FORMATS else n * m.cols // 32
    fn((grid_blocks(work, 256),), (256,), (*m.planes(), np.int32(m.rows), np.int32(m.cols), ids, np.int32(n), out,
                                           np.float32(scale)))


# ---------------------------------------------------------------------------- sampling
def argmax_rows(logits: cupy.ndarray, rows: int, vocab: int, ids: cupy.ndarray, maxima: cupy.ndarray,
                nonfinite: cupy.ndarray) -> None:
    """For each of the first `rows` rows of logits (rows, vocab): ids = its arg-max (ties to the lowest
    id, NaN never chosen: sample_rows's rule), maxima = that value, nonfinite = its NaN and +inf count."""
    if rows > 0:
        kernels.function("ops", "argmax_rows")((rows,), (1024,), (logits, np.int32(vocab), ids, maxima, nonfinite))


def top_rows(logits: cupy.ndarray, rows: int, k: int) -> cupy.ndarray:
    """(rows, k) int32 ids of each row's k largest logits, largest first, ties to the lower id (the
    host's `speculative.top_k` order): k rounds of argmax_rows, each masking what it found. For the
    few runners-up a draft tree wants this reads the rows k times instead of sorting them. `logits`
    is overwritten (the found entries become -inf)."""
    vocab = logits.shape[1]
    out = cupy.empty((rows, k), cupy.int32)
    ids, maxima, bad = cupy.empty(rows, cupy.int32), cupy.empty(rows, cupy.float32), cupy.empty(rows, cupy.int32)
    every = cupy.arange(rows)
    for j in range(k):
        argmax_rows(logits, rows, vocab, ids, maxima, bad)
        out[:, j] = ids
        if j + 1 < k:
            logits[every, ids] = -np.inf
    return out


def sample_rows(logits: cupy.ndarray, n: int, vocab: int, out_rows: cupy.ndarray, temps: cupy.ndarray,
                seeds: cupy.ndarray, tok: cupy.ndarray, pos: cupy.ndarray, slot: cupy.ndarray, base: cupy.ndarray,
                anc_off: cupy.ndarray, hist: cupy.ndarray, advance: bool) -> None:
    """The next token of each of the first n logits rows (for pass row out_rows[i]: arg-max, or a
    draw at temps[row] seeded by seeds[row] and the position) into the row's token history; with
    `advance` the rows with a history become the next decode step (tok, pos, slot, and base where
    the row has no span of its own: anc_off < 0)."""
    if n > 0:
        kernels.function("ops", "sample_rows")(
            (n,), (1024,), (logits, np.int32(vocab), out_rows, temps, seeds, tok, pos, slot, base, anc_off, hist,
                            np.int32(1 if advance else 0)))
