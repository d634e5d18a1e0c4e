"""Python faces of the CUDA kernels: each call states its grid and block and launches on the
current CuPy stream. None of them allocates, so every call may sit inside a CUDA graph capture;
outputs are passed in. Scalars are passed as NumPy types of the kernel's parameter width."""

from __future__ import annotations

from dataclasses import dataclass

import cupy
import numpy as np

from infer.gpu import kernels
from infer.gpu.layout import FLOAT_FORMATS, FLOAT_ITEMSIZE, PLANE_BYTES, PlaneLayout, format_of, plane_layout

NULL = np.uint64(0)
ATTN_GROUPS = (4, 8, 16)  # attention_decode_g{4,8,16}: query heads per KV head it can hold
ATTN_MAX_HEAD_DIM = 256


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

    def as_half(self) -> cupy.ndarray | None:
        """A (rows, cols) float16 view when the matrix is stored as float16, else None."""
        if self.fmt != "f16":
            return None
        return self.buffer.view(cupy.float16).reshape(self.rows, self.cols)


def upload_matrix(raw: np.ndarray, ggml_type: int, rows: int, cols: int) -> GpuMatrix:
    """Copies a GGUF tensor (uint8 bytes) to the GPU and repacks it there into its planar format."""
    return upload_stacked([(raw, rows)], ggml_type, cols)


def upload_stacked(parts: list[tuple[np.ndarray, int]], ggml_type: int, cols: int) -> GpuMatrix:
    """Several GGUF tensors of one type and row length, as one matrix of their rows stacked in order
    (e.g. Q, K and V: one GEMV launch instead of three). parts: (raw bytes, rows) each."""
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
            source = cupy.asarray(raw)
            kernel = kernels.function("repack", f"repack_{GGMLQuantizationType(ggml_type).name.lower()}")
            n_sb, sb0 = part_rows * cols // 32, row0 * cols // 32
            per_sb = (*PLANE_BYTES[fmt], 4 / 8)  # dm: 4 bytes per 8 sub-blocks (parts start on 256-weight blocks)
            planes = (np.uint64(base + o + int(sb0 * b)) if s else NULL
                      for o, s, b in zip(layout.offsets, layout.sizes, per_sb, strict=True))
            kernel((_blocks(n_sb, 256),), (256,), (source, np.int64(n_sb), *planes))
            del source
        row0 += part_rows
    from infer.quants import activation_format

    return GpuMatrix(fmt, rows, cols, layout, buffer, total, activation_format(ggml_type))


def _gemv_config(defines: dict[str, int] | None) -> int:
    return (defines or {}).get("GEMV_WARPS", kernels.DEFAULT_DEFINES["GEMV_WARPS"])


def _vector_grid(rows: int, warps: int, vectors: int) -> tuple[int, int]:
    if vectors < 1 or vectors > 65535:
        raise ValueError(f"a GEMV launch takes 1 to 65535 input vectors (grid y), not {vectors}")
    return (_blocks(rows, warps), vectors)


def gemv(m: GpuMatrix, x: cupy.ndarray, y: cupy.ndarray, bias: cupy.ndarray | None = None,
         residual: cupy.ndarray | None = None, defines: dict[str, int] | None = None, vectors: int = 1,
         ldy: int | None = None) -> None:
    """y = W x (+ bias) (+ residual); y may be the residual itself. `defines` picks a tuning variant
    (GEMV_WARPS, GEMV_UNROLL) of the kernel module. With `vectors` V, x is (V, cols) and row v of
    the output is y[v * ldy :][: rows] (ldy default rows; the residual alike): each vector gets the
    numbers it gets alone."""
    warps = _gemv_config(defines)
    fn = kernels.function("gemv", f"gemv_{m.fmt}", defines)
    fn(_vector_grid(m.rows, warps, vectors), (32 * warps,),
       (*m.planes(), np.int32(m.rows), np.int32(m.cols), x, y, _ptr(bias), _ptr(residual),
        np.int32(m.rows if ldy is None else ldy), np.int32(vectors)))


def gemv_swiglu(gate: GpuMatrix, up: GpuMatrix, x: cupy.ndarray, y: cupy.ndarray,
                defines: dict[str, int] | None = None, vectors: int = 1) -> None:
    """y = SiLU(Wg x) * (Wu x); both matrices in one format (`vectors` as gemv, y (V, rows))."""
    if gate.fmt != up.fmt or (gate.rows, gate.cols) != (up.rows, up.cols):
        raise ValueError("fused SwiGLU needs gate and up of one format and shape")
    warps = _gemv_config(defines)
    fn = kernels.function("gemv", f"gemv_swiglu_{gate.fmt}", defines)
    fn(_vector_grid(gate.rows, warps, vectors), (32 * warps,),
       (*gate.planes(), *up.planes(), np.int32(gate.rows), np.int32(gate.cols), x, y, np.int32(gate.rows),
        np.int32(vectors)))


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


# activation formats (ops.cu ACT_*): what llama.cpp converts a matrix product's input to per weight type
ACT_CODES = {"f32": 0, "f16": 1, "bf16": 2, "q8_0": 3, "q8_k": 4}


Int8Act = tuple  # (xq int8[n], xs float32[n / group], xsum int32[n / 32]): 8-bit form of q8_0/q8_k activations


def int8_buffers(n: int, act: str) -> Int8Act:
    """Buffers for the 8-bit form of n activations of format q8_0 or q8_k."""
    group = 32 if act == "q8_0" else 256
    return cupy.zeros(n, cupy.int8), cupy.zeros(n // group, cupy.float32), cupy.zeros(n // 32, cupy.int32)


def _int8_args(int8: Int8Act | None) -> tuple:
    return (NULL, NULL, NULL) if int8 is None else tuple(int8)


def int8_rows(int8: Int8Act | None, n: int, act: str, r0: int, r1: int) -> Int8Act | None:
    """Rows r0 .. r1 - 1 of the 8-bit form of rows of n activations of format `act`."""
    if int8 is None:
        return None
    group = 32 if act == "q8_0" else 256
    xq, xs, xsum = int8
    return xq[r0 * n : r1 * n], xs[r0 * n // group : r1 * n // group], xsum[r0 * n // 32 : r1 * n // 32]


def rmsnorm(x: cupy.ndarray, weight: cupy.ndarray, eps: float, rows: int, n: int, y: cupy.ndarray | None = None,
            y16: cupy.ndarray | None = None, act: str = "f32", int8: Int8Act | None = None) -> None:
    """y/y16 = RMSNorm(x) * weight per row, rounded to activation format `act` (needs y unless f32);
    int8 (q8_0/q8_k only): also its 8-bit form."""
    if act != "f32" and y is None:
        raise ValueError("rounding to an activation format needs the float32 output y")
    if n % {"q8_0": 32, "q8_k": 256}.get(act, 8) == 0 and n <= 8192:  # one pass, values in registers (8 per thread)
        kernels.function("ops", "rmsnorm8")((rows,), (-(-n // 256) * 32,), (x, weight, _ptr(y), _ptr(y16), np.int32(n),
                                                                 np.float32(eps), np.int32(ACT_CODES[act]),
                                                                 *_int8_args(int8)))
        return
    threads = 1024 if n >= 4096 else 256
    kernels.function("ops", "rmsnorm")((rows,), (threads,), (x, weight, _ptr(y), _ptr(y16), np.int32(n),
                                                             np.float32(eps), np.int32(ACT_CODES[act]),
                                                             *_int8_args(int8)))


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
                                         (x, y, _ptr(y16), np.int32(n), np.int32(ACT_CODES[act]), *_int8_args(int8)))


INT8_FORMATS = ("q8", "g4", "g5", "k4", "k5", "k6")  # formats with an integer (dp4a) GEMV


def gemv8(m: GpuMatrix, int8: Int8Act, y: cupy.ndarray, bias: cupy.ndarray | None = None,
          residual: cupy.ndarray | None = None, defines: dict[str, int] | None = None, vectors: int = 1,
          ldy: int | None = None) -> None:
    """y = W x (+ bias) (+ residual) with x in its 8-bit form (dp4a integer dot products); `vectors`
    and `ldy` as gemv (the 8-bit forms of V rows, int8_buffers(V * cols))."""
    warps = _gemv_config(defines)
    fn = kernels.function("gemv", f"gemv8_{m.fmt}", defines)
    fn(_vector_grid(m.rows, warps, vectors), (32 * warps,),
       (*m.planes(), np.int32(m.rows), np.int32(m.cols), *int8, y, _ptr(bias), _ptr(residual),
        np.int32(m.rows if ldy is None else ldy), np.int32(vectors)))


def gemv8_swiglu(gate: GpuMatrix, up: GpuMatrix, int8: Int8Act, y: cupy.ndarray,
                 defines: dict[str, int] | None = None, vectors: int = 1) -> None:
    """y = SiLU(Wg x) * (Wu x) with x in its 8-bit form (`defines`: default kernels.SWIGLU_DEFINES)."""
    defines = kernels.SWIGLU_DEFINES if defines is None else defines
    warps = _gemv_config(defines)
    fn = kernels.function("gemv", f"gemv8_swiglu_{gate.fmt}", defines)
    fn(_vector_grid(gate.rows, warps, vectors), (32 * warps,),
       (*gate.planes(), *up.planes(), np.int32(gate.rows), np.int32(gate.cols), *int8, y, np.int32(gate.rows),
        np.int32(vectors)))


def rope_store(q: cupy.ndarray, k: cupy.ndarray, v: cupy.ndarray, cos: cupy.ndarray, sin: cupy.ndarray,
               pos: cupy.ndarray, n_tokens: int, n_heads: int, n_kv_heads: int, head_dim: int, n_pairs: int,
               neox: bool, k_cache: cupy.ndarray, v_cache: cupy.ndarray, max_ctx: int,
               slots: cupy.ndarray | None = None) -> None:
    """Rotates q (in place) and k by their positions `pos` and stores k and v in the cache at `pos`,
    or at `slots` (int32, a token tree's node slots) when given."""
    threads = min(128, max(32, -(-head_dim // 2 // 32) * 32))
    kernels.function("attention", "rope_store")(
        (n_tokens, n_heads + n_kv_heads), (threads,),
        (q, k, v, cos, sin, pos, _ptr(slots), np.int32(n_heads), np.int32(n_kv_heads), np.int32(head_dim),
         np.int32(n_pairs), np.int32(1 if neox else 0), k_cache, v_cache, np.int32(max_ctx)))


def attention_group_size(group: int) -> int:
    """The attention kernel instantiation (query heads per KV head it holds) for `group`."""
    for g in ATTN_GROUPS:
        if group <= g:
            return g
    raise ValueError(f"{group} query heads per KV head exceed the decode attention kernel's {ATTN_GROUPS[-1]}")


def attention_splits(max_ctx: int) -> int:
    """Splits (blocks along the sequence) the decode attention kernels use for a cache of max_ctx
    positions: part_o and part_ml are sized by it."""
    return -(-max_ctx // kernels.DEFAULT_DEFINES["ATTN_CHUNK"])


def attention_work(n_heads: int, head_dim: int, max_ctx: int,
                   nodes: int = 1) -> tuple[cupy.ndarray, cupy.ndarray, cupy.ndarray]:
    """Zeroed work buffers of attention_decode for a cache of max_ctx positions (for `nodes` query
    rows of a token tree at once): scores (float32), part_o and part_ml (float64: the kernels keep
    partial sums in double)."""
    n_splits = attention_splits(max_ctx)
    return (cupy.zeros(nodes * n_heads * max_ctx, cupy.float32),
            cupy.zeros(nodes * n_heads * n_splits * head_dim, cupy.float64),
            cupy.zeros(nodes * n_heads * n_splits * 2, cupy.float64))


@dataclass
class TreeSpans:
    """The attention spans of a token tree's nodes for attention_decode: node j attends to cache
    slots 0 .. base - 1, then anc[j, 0 .. depth_j] (its ancestors' slots from the root, then its
    own); its position is base + depth_j."""

    anc: cupy.ndarray  # (nodes, stride) int32
    stride: int
    base: int
    nodes: int


def tree_ancestors(parents: np.ndarray, base: int, stride: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Host rows of a token tree's spans (node i in cache slot base + i, parents[i] < i, root -1):
    anc (nodes, stride) int32, row i the slots of node i's ancestors from the root, then its own
    (default stride: the deepest path), and the nodes' positions (base + depth) int32."""
    from infer.model import tree_depths

    parents = np.asarray(parents, dtype=np.int64)
    depth = tree_depths(parents)
    anc = np.zeros((len(parents), int(depth.max()) + 1 if stride is None else stride), np.int32)
    for i, parent in enumerate(parents):  # a node's row is its parent's row, then itself
        if parent >= 0:
            anc[i, : depth[i]] = anc[parent, : depth[i]]
        anc[i, depth[i]] = base + i
    return anc, (base + depth).astype(np.int32)


def tree_spans(parents: np.ndarray, base: int) -> tuple[TreeSpans, np.ndarray]:
    """TreeSpans of a tree (parents[i] < i, root -1) whose node i sits in cache slot base + i,
    and the nodes' positions (base + depth) as int32."""
    anc, positions = tree_ancestors(parents, base)
    return TreeSpans(cupy.asarray(anc), anc.shape[1], base, len(positions)), positions


ATTN_FUSED_THREADS = 256
_STATIC_SHARED_LIMIT = 48 * 1024 - 512  # less the kernel's static shared memory


def attention_fused_bytes(n_heads: int, n_kv_heads: int, head_dim: int, max_ctx: int) -> int:
    """Dynamic shared memory of attention_fused for a cache of max_ctx positions: the group's
    queries and a row of scores per head (doubles); the rows also take the partial sums of the
    weighted values, (threads / (head_dim / 2) - 1) * head_dim per head."""
    group, phases = n_heads // n_kv_heads, ATTN_FUSED_THREADS // (head_dim // 2)
    return 8 * group * (head_dim + max(max_ctx, (phases - 1) * head_dim))


def attention_fused_fits(n_heads: int, n_kv_heads: int, head_dim: int, max_ctx: int, act: str) -> bool:
    """Whether one block per KV head can do the whole decode attention: its shared memory fits and
    its G * head_dim outputs are whole 8-bit groups of `act`."""
    group = {"q8_0": 32, "q8_k": 256}.get(act, 1)
    return (attention_fused_bytes(n_heads, n_kv_heads, head_dim, max_ctx) <= _STATIC_SHARED_LIMIT
            and (n_heads // n_kv_heads * head_dim) % group == 0)


def attention_decode(q: cupy.ndarray, k_cache: cupy.ndarray, v_cache: cupy.ndarray, pos: cupy.ndarray,
                     n_heads: int, n_kv_heads: int, head_dim: int, max_ctx: int, n_splits: int,
                     scores: cupy.ndarray, part_o: cupy.ndarray, part_ml: cupy.ndarray, out: cupy.ndarray,
                     act: str = "f32", rope: tuple | None = None, int8: Int8Act | None = None,
                     fused: bool | None = None, tree: TreeSpans | None = None) -> None:
    """Attention of one query token at position pos[0] over cache positions 0..pos[0]; `out` is
    rounded to activation format `act` (the output projection's input). Work buffers: scores
    (n_heads * max_ctx) float32, part_o (n_heads * n_splits * head_dim) and part_ml
    (n_heads * n_splits * 2) float64 (attention_work). rope = (k, v, cos, sin, n_pairs, neox): q, k
    and v are the new token's raw projections; the kernel rotates q and k and stores k and v at pos[0]
    (else q is rotated and the cache filled). `fused` (default: when attention_fused_fits) does it
    all in one kernel, a block per KV head (short caches); else three kernels split the sequence.
    The choice depends on max_ctx, not on pos, so a captured graph stays valid.

    `tree` (a token tree's nodes, keys and values already stored by rope_store, rope None): node j
    is query row j of q at position pos[j], attending to the slots tree.slots(j) lists (grid z =
    node; work buffers and out hold a node's after another's, attention_work(..., nodes)): each node
    gets the numbers the decode step at its position gets."""
    group = n_heads // n_kv_heads
    if scores.dtype != cupy.float32 or part_o.dtype != cupy.float64 or part_ml.dtype != cupy.float64:
        raise ValueError(f"attention work buffers are {scores.dtype}, {part_o.dtype}, {part_ml.dtype}; the kernels "
                         "want float32 scores and float64 part_o and part_ml (ops.attention_work)")
    if n_splits < attention_splits(max_ctx):  # else positions past n_splits splits would be left out
        raise ValueError(f"{n_splits} attention splits do not cover {max_ctx} cache positions "
                         f"(need {attention_splits(max_ctx)}: ops.attention_splits)")
    if head_dim % 8 or head_dim > ATTN_MAX_HEAD_DIM:
        raise ValueError(f"head dimension {head_dim} is not a multiple of 8 up to {ATTN_MAX_HEAD_DIM}")
    g = attention_group_size(group)
    nodes = 1 if tree is None else tree.nodes
    if tree is not None and rope is not None:
        raise ValueError("a token tree's keys are stored by rope_store first: no rope in tree attention")
    span = (NULL, np.int32(0)) if tree is None else (tree.anc, np.int32(tree.stride))
    grid = (n_kv_heads, n_splits, nodes)
    if rope is None:
        rope_args = (NULL, NULL, NULL, NULL, np.int32(0), np.int32(0), NULL)
    else:
        k, v, cos, sin, n_pairs, neox = rope
        rope_args = (k, v, cos, sin, np.int32(n_pairs), np.int32(1 if neox else 0), v_cache)
    fits = attention_fused_fits(n_heads, n_kv_heads, head_dim, max_ctx, act)
    if fused is None:
        fused = fits
    if fused:
        if not fits:
            raise ValueError(f"the fused attention kernel does not fit {n_heads}/{n_kv_heads} heads of {head_dim} "
                             f"over {max_ctx} positions with {act} output")
        kernels.function("attention", f"attention_fused_g{g}")(
            (n_kv_heads, 1, nodes), (ATTN_FUSED_THREADS,),
            (q, k_cache, v_cache, pos, np.int32(group), np.int32(head_dim), np.int32(max_ctx),
             np.float32(1.0 / np.sqrt(head_dim)), out, np.int32(ACT_CODES[act]), *_int8_args(int8), *rope_args[:6],
             *span),
            shared_mem=attention_fused_bytes(n_heads, n_kv_heads, head_dim, max_ctx))
        return
    kernels.function("attention", f"attention_scores_g{g}")(
        grid, (128,), (q, k_cache, pos, np.int32(group), np.int32(head_dim), np.int32(max_ctx),
                       np.float32(1.0 / np.sqrt(head_dim)), np.int32(n_splits), scores, part_ml, *rope_args, *span))
    kernels.function("attention", f"attention_values_g{g}")(
        grid, (128,), (v_cache, pos, np.int32(group), np.int32(head_dim), np.int32(max_ctx), np.int32(n_splits),
                       scores, part_ml, part_o, *span))
    n = n_heads * head_dim
    per_block = 8 * {"q8_0": 32, "q8_k": 256}.get(act, 128)  # 8 warps, a warp per 8-bit group
    kernels.function("attention", "attention_sum")(
        (-(-n // per_block), nodes), (256,), (part_o, pos, np.int32(n_splits), np.int32(n), np.int32(head_dim), out,
                                        np.int32(ACT_CODES[act]), *_int8_args(int8)))


_CUDA_R_16F, _CUDA_R_32F, _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT = 2, 0, 68, -1
_ONE, _ZERO = np.ones(1, np.float32), np.zeros(1, np.float32)
_gemm_ex_works: list[bool] = []  # set after the first call: False -> cupy.matmul fallback


def matmul_f16(x16: cupy.ndarray, w16: cupy.ndarray, out: cupy.ndarray, accumulate: bool = False) -> None:
    """out (T, N) float32 (+)= x16 (T, K) @ w16 (N, K).T, float16 inputs with float32 accumulation and a
    float32 result (cublasGemmEx): no rounding of the output to float16, and `accumulate` adds into
    out (the residual) in the same call. Falls back to cupy.matmul if GemmEx is unavailable."""
    t, k = x16.shape
    n = w16.shape[0]
    if not (x16.flags.c_contiguous and w16.flags.c_contiguous and out.flags.c_contiguous):
        raise ValueError("matmul_f16 needs C-contiguous operands")
    if _gemm_ex_works != [False]:
        out_before = out.copy() if accumulate and not _gemm_ex_works else None
        try:
            from cupy_backends.cuda.libs import cublas

            handle = cupy.cuda.device.get_cublas_handle()
            cublas.setStream(handle, cupy.cuda.get_current_stream().ptr)
            cublas.setPointerMode(handle, 0)  # host scalars
            # column-major view: out^T (N x T) = W (N x K, stored as K x N: transposed) @ x^T (K x T)
            cublas.gemmEx(handle, 1, 0, n, t, k, _ONE.ctypes.data, w16.data.ptr, _CUDA_R_16F, k, x16.data.ptr,
                          _CUDA_R_16F, k, (_ONE if accumulate else _ZERO).ctypes.data, out.data.ptr, _CUDA_R_32F, n,
                          _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT)
            if not _gemm_ex_works:  # first call: check the binding against cupy.matmul once
                want = cupy.matmul(x16, w16.T).astype(cupy.float32) + (out_before if accumulate else 0)
                err = float(cupy.linalg.norm(out - want) / max(float(cupy.linalg.norm(want)), 1e-30))
                _gemm_ex_works.append(err < 1e-2)
                if err >= 1e-2:
                    out[...] = want
            return
        except Exception:  # noqa: BLE001 - any cuBLAS binding problem: use the portable path
            _gemm_ex_works[:] = [False]
            if out_before is not None:
                out[...] = out_before
    product = cupy.matmul(x16.astype(cupy.float32), w16.astype(cupy.float32).T)  # float32 sums, as GemmEx
    if accumulate:
        out += product
    else:
        out[...] = product


def swiglu(gate: cupy.ndarray, up: cupy.ndarray, out: cupy.ndarray, n: int) -> None:
    kernels.function("ops", "swiglu_f32")((_blocks(n, 256),), (256,), (gate, up, out, np.int32(n)))


def argmax_rows(logits: cupy.ndarray, rows: int, vocab: int, ids: cupy.ndarray, maxima: cupy.ndarray,
                nonfinite: cupy.ndarray) -> None:
    """For each of the first `rows` rows of logits (rows, vocab): ids = its arg-max (ties to the lowest
    id, NaN never chosen: sample_token's rule), maxima = that value, nonfinite = its NaN and +inf count."""
    if rows > 0:
        kernels.function("ops", "argmax_rows")((rows,), (1024,), (logits, np.int32(vocab), ids, maxima, nonfinite))


def sample_token(logits: cupy.ndarray, vocab: int, temperature: float, seed: int, tok: cupy.ndarray,
                 pos: cupy.ndarray, tokens: cupy.ndarray) -> None:
    """tok = next token (arg-max, or a draw at `temperature`); tokens[pos + 1] = tok; pos += 1."""
    kernels.function("ops", "sample_token")(
        (1,), (1024,), (logits, np.int32(vocab), np.float32(temperature), np.uint32(seed & 0xFFFFFFFF), tok, pos,
                        tokens))
