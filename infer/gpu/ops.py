"""Python faces of the CUDA kernels (attention's are in infer.gpu.attention): each call states its
grid and block and launches on the current CuPy stream. None of them allocates, so every call may
sit inside a CUDA graph capture; outputs are passed in. Scalars are passed as NumPy types of the
kernel's parameter width.

Every kernel works on the N rows of a pass and computes each row in an order that does not depend
on N or on the other rows (infer/kernels/canon.cuh, attention.cu): a row's numbers are the same
bits alone, in a batch, as a token-tree node or as a prompt position."""

from __future__ import annotations

from dataclasses import dataclass

import cupy
import numpy as np

from infer.gpu import kernels
from infer.gpu.layout import (
    FLOAT_FORMATS,
    FLOAT_ITEMSIZE,
    K_FORMATS,
    PLANE_BYTES,
    PlaneLayout,
    format_of,
    plane_layout,
)
from infer.gpu.memory import transient_pool

NULL = np.uint64(0)
QGEMV_MAX = 4  # qgemv_*_v4: products of up to this many rows use the GEMV-shaped kernels
_SHARED_DEFAULT = 48 * 1024  # more dynamic shared memory than this needs the kernel's opt-in


def _ptr(a: cupy.ndarray | None) -> np.uint64:
    return NULL if a is None else np.uint64(a.data.ptr)


def _blocks(n: int, threads: int) -> int:
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
    from gguf.constants import GGMLQuantizationType

    fmt = format_of(ggml_type)
    rows = sum(r for _, r in parts)
    layout = plane_layout(fmt, rows, cols)
    buffer = cupy.empty(layout.nbytes, dtype=cupy.uint8)
    base, row0, total = buffer.data.ptr, 0, 0
    for raw, part_rows in parts:
        raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
        total += int(raw.size)
        if fmt in FLOAT_FORMATS:
            start = row0 * cols * FLOAT_ITEMSIZE[fmt]
            buffer[start : start + raw.size].set(raw)
        else:
            kernel = kernels.function("repack", f"repack_{GGMLQuantizationType(ggml_type).name.lower()}")
            n_sb, sb0 = part_rows * cols // 32, row0 * cols // 32
            per_sb = (*PLANE_BYTES[fmt], 4 / 8)  # dm: 4 bytes per 8 sub-blocks (parts start on 256-weight blocks)
            planes = (np.uint64(base + o + int(sb0 * b)) if s else NULL
                      for o, s, b in zip(layout.offsets, layout.sizes, per_sb, strict=True))
            with transient_pool():
                source = cupy.asarray(raw)
                kernel((_blocks(n_sb, 256),), (256,), (source, np.int64(n_sb), *planes))
                del source
        row0 += part_rows
    from infer.quants import activation_format

    return GpuMatrix(fmt, rows, cols, layout, buffer, total, activation_format(ggml_type))


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


def rmsnorm(x: cupy.ndarray, weight: cupy.ndarray, eps: float, rows: int, n: int, y: cupy.ndarray | None = None,
            y16: cupy.ndarray | None = None, act: str = "f32", int8: Int8Act | None = None,
            src_rows: cupy.ndarray | None = None) -> None:
    """y/y16 = RMSNorm(x) * weight per row, rounded to activation format `act`; int8 (q8_0/q8_k):
    also its 8-bit form. y (float32) may be None where the 8-bit form is all that is wanted and the
    row fits the one-pass kernel. src_rows (int32, optional): output row i from input row src_rows[i]."""
    fast = n % {"q8_0": 32, "q8_k": 256}.get(act, 8) == 0 and n <= 8192
    if y is None and not (fast and act in EIGHT_BIT and int8 is not None):
        raise ValueError("rmsnorm needs the float32 output y here")
    if fast:  # one pass, values in registers (8 per thread)
        kernels.function("ops", "rmsnorm8")((rows,), (-(-n // 256) * 32,), (x, weight, _ptr(y), _ptr(y16), np.int32(n),
                                                                 np.float32(eps), np.int32(ACT_CODES[act]),
                                                                 *int8_args(int8), _ptr(src_rows)))
        return
    threads = 1024 if n >= 4096 else 256
    kernels.function("ops", "rmsnorm")((rows,), (threads,), (x, weight, _ptr(y), _ptr(y16), np.int32(n),
                                                             np.float32(eps), np.int32(ACT_CODES[act]),
                                                             *int8_args(int8), _ptr(src_rows)))


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
                                         (x, y, _ptr(y16), np.int32(n), np.int32(ACT_CODES[act]), *int8_args(int8)))


def swiglu_round(gu: cupy.ndarray, n: int, rows: int, act: str, y: cupy.ndarray | None = None,
                 int8: Int8Act | None = None) -> None:
    """SiLU(gate) * up of rows [gate (n) | up (n)] of gu, rounded to `act`: the 8-bit form into
    int8 (q8_0/q8_k), and/or the rounded float32 values into y (rows, n)."""
    if act not in EIGHT_BIT and y is None:
        raise ValueError(f"SwiGLU rounded to {act} needs the float32 output y")
    per_block = 8 * {"q8_0": 32, "q8_k": 256}.get(act, 128)
    kernels.function("ops", "swiglu_round")((-(-n // per_block), rows), (256,),
                                            (gu, np.int32(n), _ptr(y), np.int32(ACT_CODES[act]), *int8_args(int8)))


# ---------------------------------------------------------------------------- products
Input = Int8Act | cupy.ndarray  # the 8-bit form for quantized weights, float32 rows for float ones


FORMAT_KIND = {"q8": 1, "g4": 4, "g5": 5, "k4": 14, "k5": 15, "k6": 16}  # qmm.cu QMM_FORMAT
# n-tiles of a qmm block -> (warps of 16 rows, pipeline stages), and the qgemv kernels' (warps,
# loads in flight), chosen by timing the variants (bench/kernel_sweep.py, docs/PERFORMANCE.md);
# NVMEDIRECT_QMM_TUNING="1:2,4;8:4,3" and NVMEDIRECT_QGEMV_TUNING="4,2" override them (sweeps)
QMM_TUNING: dict[int, tuple[int, int]] = {1: (4, 3), 2: (4, 3), 4: (4, 3), 8: (4, 3)}
QGEMV_TUNING: tuple[int, int] = (4, 2)
# blocks per SM the registers of a format's qmm kernels must allow (qmm.cu MMQ_MIN_BLOCKS; absent:
# the kernel's default; NVMEDIRECT_QMM_MIN_BLOCKS overrides, for sweeps)
QMM_MIN_BLOCKS: dict[str, int] = {}


def _tuning_from_environment() -> None:
    import os

    global QGEMV_TUNING
    for item in filter(None, os.environ.get("NVMEDIRECT_QMM_TUNING", "").split(";")):
        nt, _, pair = item.partition(":")
        warps, stages = (int(v) for v in pair.split(","))
        QMM_TUNING[int(nt)] = (warps, stages)
    if os.environ.get("NVMEDIRECT_QMM_MIN_BLOCKS"):
        QMM_MIN_BLOCKS.update({fmt: int(os.environ["NVMEDIRECT_QMM_MIN_BLOCKS"]) for fmt in FORMAT_KIND})
    if os.environ.get("NVMEDIRECT_QGEMV_TUNING"):
        warps, unroll = (int(v) for v in os.environ["NVMEDIRECT_QGEMV_TUNING"].split(","))
        QGEMV_TUNING = (warps, unroll)


_tuning_from_environment()


def _module_defines(fmt: str, nt: int = 1, tuning: tuple[int, int] | None = None) -> dict[str, int]:
    """The #defines of the qmm module that holds format `fmt`'s qmm kernels in the variant for nt
    n-tiles (or `tuning`: warps, stages)."""
    warps, stages = tuning or QMM_TUNING[nt]
    defines = {"QMM_FORMAT": FORMAT_KIND.get(fmt, 100), "MMQ_WARPS": warps, "MMQ_STAGES": stages, "QMM_KERNELS": 2}
    if fmt in QMM_MIN_BLOCKS:
        defines["MMQ_MIN_BLOCKS"] = QMM_MIN_BLOCKS[fmt]
    return defines


def _gemv_defines(fmt: str, tuning: tuple[int, int] | None = None) -> dict[str, int]:
    """The #defines of the module of format `fmt`'s qgemv (or float) kernels (tuning: warps, unroll)."""
    warps, unroll = tuning or QGEMV_TUNING
    return {"QMM_FORMAT": FORMAT_KIND.get(fmt, 100), "QG_WARPS": warps, "QG_UNROLL": unroll, "QMM_KERNELS": 1}


def _qmm_stage_bytes(fmt: str, nt: int, warps: int = 4) -> int:
    """Bytes of one shared-memory stage of qmm_<fmt>_n<nt> with `warps` warps (qmm.cu Stage)."""
    qs = 32 if fmt == "q8" else 16
    hi = {"g5": 4, "k5": 4, "k6": 8}.get(fmt, 0)
    sm = 4 if fmt in ("g4", "g5") else 2
    sup = fmt in K_FORMATS
    xsum = fmt in ("g4", "g5", "k4", "k5")
    bn = 8 * nt
    qstr, hstr, sstr = 8 * qs + 16, (8 * hi + 16 if hi else 0), (48 if sm == 4 else 16)
    dstr = 4 if sup else 0
    xsstr, xustr = (1 if sup else 12), (12 if xsum else 0)
    off_xs = 16 * warps * (qstr + hstr + sstr + dstr) + bn * 272
    off_xu = off_xs + -(-(bn * xsstr * 4) // 16) * 16
    return off_xu + bn * xustr * 4


def _tiles(n: int) -> int:
    """qmm n-tiles (of 8 tokens) per block for n rows."""
    return 1 if n <= 8 else 2 if n <= 16 else 4 if n <= 32 else 8


_opted_in: dict[tuple, int] = {}  # the opt-in set per key


def with_shared(fn, key: tuple, nbytes: int):  # noqa: ANN001, ANN202
    """The kernel with its dynamic shared memory opt-in raised to nbytes (per kernel, module variant
    and device; raised again when a later shape needs more)."""
    key = (cupy.cuda.Device().id, *key)
    if nbytes > max(_SHARED_DEFAULT, _opted_in.get(key, 0)):
        fn.max_dynamic_shared_size_bytes = nbytes
        _opted_in[key] = nbytes
    return fn


def _qmm_kernel(fmt: str, nt: int, tuning: tuple[int, int] | None = None):  # noqa: ANN202
    """(kernel, dynamic shared bytes, warps) of qmm_<fmt>_n<nt> in its tuned (or given) variant."""
    defines = _module_defines(fmt, nt, tuning)
    warps, stages = defines["MMQ_WARPS"], defines["MMQ_STAGES"]
    name = f"qmm_{fmt}_n{nt}"
    smem = stages * _qmm_stage_bytes(fmt, nt, warps)
    fn = kernels.function("qmm", name, defines)
    return with_shared(fn, (name, *sorted(defines.items())), smem), smem, warps


def prepare_kernels(formats: set[str]) -> None:
    """Compiles the product kernels of `formats` and raises the shared-memory opt-in of those that
    need more than the default, before any CUDA graph capture (attention: attention.prepare)."""
    for fmt in formats:
        kernels.module("qmm", _gemv_defines(fmt))
        if fmt not in FLOAT_FORMATS:
            for nt in (1, 2, 4, 8):
                _qmm_kernel(fmt, nt)


SPLIT_MIN_BLOCKS = 264  # a qmm launch of fewer (row tile x token tile) blocks splits K (2 x 132 SMs)
SPLIT_SCRATCH_BYTES = 16 << 20  # the group sums of a split product (a model's pass buffers hold them)
CANON_GROUP = 1024  # canon.cuh: values of K per group (a split block computes one)


def _split_groups(blocks: int, cols: int, n: int, rows: int, scratch: cupy.ndarray | None) -> int:
    """Groups of K a qmm launch of `blocks` blocks splits into (0: no split)."""
    import os

    groups = -(-cols // CANON_GROUP)
    if scratch is None or groups < 2 or blocks >= SPLIT_MIN_BLOCKS or os.environ.get("NVMEDIRECT_QMM_SPLIT") == "0":
        return 0
    return groups if 4 * groups * n * rows <= scratch.nbytes else 0


def uses_qmm(fmt: str, cols: int, n: int) -> bool:
    """Whether a product of n rows runs on the tensor-core kernel (else on qgemv, groups of 4 rows)."""
    return fmt not in FLOAT_FORMATS and n > QGEMV_MAX and not (fmt == "q8" and cols % 64)


def product(parts: list[GpuMatrix], x: Input, y: cupy.ndarray, n: int, ldy: int | None = None,
            bias: cupy.ndarray | None = None, residual: cupy.ndarray | None = None,
            tuning: tuple[int, int] | None = None, scratch: cupy.ndarray | None = None) -> None:
    """Rows v < n of y (row v at y[v * ldy:], ldy default the parts' total rows) = the parts'
    matrices, stacked row-wise (at most three, one format and row length), times input row v, +
    bias (of the stacked rows), + residual (laid out as y; y may be the residual itself). Every
    output in the canonical order: the same bits for any n and any kernel variant (`tuning`, for
    sweeps: a qmm kernel's (warps, stages), a qgemv kernel's (warps, loads in flight)). `scratch`
    (float32, SPLIT_SCRATCH_BYTES): room for the group sums when a launch with too few blocks
    splits K (the same bits: the canonical sum adds whole groups in order)."""
    m0 = parts[0]
    if not 1 <= len(parts) <= 3 or any(p.fmt != m0.fmt or p.cols != m0.cols for p in parts):
        raise ValueError("a product takes one to three matrices of one format and row length")
    if m0.fmt in FLOAT_FORMATS and len(parts) != 1:
        raise ValueError("float-format matrices are multiplied one at a time")
    rows = sum(p.rows for p in parts)
    ldy = rows if ldy is None else ldy
    if n < 1:
        return
    if m0.fmt in FLOAT_FORMATS:
        warps = QGEMV_TUNING[0]
        fn = kernels.function("qmm", f"fgemv_{m0.fmt}", _gemv_defines(m0.fmt))
        fn((_blocks(rows, warps), min(n, 64)), (32 * warps,),
           (m0.buffer, np.int32(rows), np.int32(m0.cols), x, np.int32(n), y, np.int32(ldy), _ptr(bias),
            _ptr(residual)))
        return
    if not isinstance(x, Int8Act) or x.act != m0.act:
        raise ValueError(f"a {m0.fmt} product takes the {m0.act} 8-bit form of its input")
    planes = [pl for p in parts for pl in p.planes()] + [NULL] * 4 * (3 - len(parts))
    ends = [*np.cumsum([p.rows for p in parts]).tolist(), rows, rows]  # where parts 1 and 2 start
    head = (*planes, np.int32(ends[0]), np.int32(ends[1]), np.int32(rows), np.int32(m0.cols), x.xq, x.xs, x.xsum,
            np.int32(n))
    args = (*head, y, np.int32(ldy), _ptr(bias), _ptr(residual), NULL)
    if uses_qmm(m0.fmt, m0.cols, n):
        nt = _tiles(n)
        fn, smem, warps = _qmm_kernel(m0.fmt, nt, tuning)
        grid = (_blocks(n, 8 * nt), _blocks(rows, 16 * warps))
        groups = _split_groups(grid[0] * grid[1], m0.cols, n, rows, scratch)
        if not groups:
            fn(grid, (32 * warps,), args, shared_mem=smem)
            return
        fn((*grid, groups), (32 * warps,), (*head, y, np.int32(ldy), NULL, NULL, scratch), shared_mem=smem)
        combine = kernels.function("qmm", "qmm_combine", _module_defines(m0.fmt, nt, tuning))
        combine((_blocks(n * rows, 256),), (256,), (scratch, np.int32(groups), np.int32(rows), np.int32(n), y,
                                                    np.int32(ldy), _ptr(bias), _ptr(residual)))
        return
    nv = 1 if n == 1 else 2 if n == 2 else 4
    warps = (tuning or QGEMV_TUNING)[0]
    fn = kernels.function("qmm", f"qgemv_{m0.fmt}_v{nv}", _gemv_defines(m0.fmt, tuning))
    fn((_blocks(rows, warps), _blocks(n, nv)), (32 * warps,), args)


def dequantize(m: GpuMatrix, out: cupy.ndarray) -> None:
    """out (float16, rows*cols elements) = the matrix's weights."""
    fn = kernels.function("dequant", f"dequant_{m.fmt}")
    n = m.rows * m.cols if m.fmt in FLOAT_FORMATS else m.layout.n_subblocks
    fn((_blocks(n, 256),), (256,), (*m.planes(), np.int64(n), out))


def embed(m: GpuMatrix, ids: cupy.ndarray, n: int, out: cupy.ndarray) -> None:
    """out[i, :] = row ids[i] of the matrix, float32 (ids: int32 on the device)."""
    fn = kernels.function("dequant", f"embed_{m.fmt}")
    work = n * m.cols if m.fmt in FLOAT_FORMATS else n * m.cols // 32
    fn((_blocks(work, 256),), (256,), (*m.planes(), np.int32(m.rows), np.int32(m.cols), ids, np.int32(n), out))


# ---------------------------------------------------------------------------- sampling
def argmax_rows(logits: cupy.ndarray, rows: int, vocab: int, ids: cupy.ndarray, maxima: cupy.ndarray,
                nonfinite: cupy.ndarray) -> None:
    """For each of the first `rows` rows of logits (rows, vocab): ids = its arg-max (ties to the lowest
    id, NaN never chosen: sample_rows's rule), maxima = that value, nonfinite = its NaN and +inf count."""
    if rows > 0:
        kernels.function("ops", "argmax_rows")((rows,), (1024,), (logits, np.int32(vocab), ids, maxima, nonfinite))


def sample_rows(logits: cupy.ndarray, n: int, vocab: int, out_rows: cupy.ndarray, temps: cupy.ndarray,
                seeds: cupy.ndarray, tok: cupy.ndarray, pos: cupy.ndarray, slot: cupy.ndarray, base: cupy.ndarray,
                hist: cupy.ndarray, advance: bool) -> None:
    """The next token of each of the first n logits rows (for pass row out_rows[i]: arg-max, or a
    draw at temps[row] seeded by seeds[row] and the position) into the row's token history; with
    `advance` the rows with a history become the next decode step (tok, pos, slot, base)."""
    if n > 0:
        kernels.function("ops", "sample_rows")(
            (n,), (1024,), (logits, np.int32(vocab), out_rows, temps, seeds, tok, pos, slot, base, hist,
                            np.int32(1 if advance else 0)))
