"""The attention launches of a pass (infer/kernels/attention.cu): rotary embedding and the KV store
of each row (`rope_rows`), then each row's attention over its own cache, position and span
(`attention`: attn_chunks, attn_merge), and the geometry and row fields they take; and the prompt
rows' attention on the tensor cores (`prompt_attention`, infer/kernels/prompt_attention.cu)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import cupy
import numpy as np

from infer.gpu import kernels
from infer.gpu.ops import ACT_CODES, NULL, Int8Act, int8_args, with_shared

ATTN_CHUNK = 32  # attention.cu: positions per chunk
ATTN_BLOCK_POSITIONS = 128  # positions per attn_chunks block (4 chunks)
ATTN_HEADS = 4  # query heads an attn_chunks warp takes at once
ATTN_THREADS = 128
ATTN_MAX_HEAD_DIM = 256
ATTN_MAX_GROUP = 16
# attention.cu's attn_chunks_s<S>_d<D> by head dimension: 3, 6 and 7 for the groups of 6 and 7 query
# heads a KV head of the Qwen2.5 family (0.5B: 7 of head size 64; 1.5B: 6 and 7B: 7 of 128)
HEAD_SPLITS = {64: (1, 2, 4, 7, 8), 128: (1, 2, 3, 4, 6, 7, 8), 256: (1, 2, 4, 8)}
HEAD_SPLIT_GRID = 256  # the most blocks a split launch may have


def prepare(shape: AttentionShape) -> None:
    """Raises attn_chunks' shared-memory opt-in for `shape` before any CUDA graph capture."""
    for splits in HEAD_SPLITS.get(shape.head_dim, (1,)):
        name = chunks_kernel(shape.head_dim, splits)
        with_shared(kernels.function("attention", name), (name,), shape.chunks_shared_bytes())


@dataclass
class AttentionShape:
    """The attention geometry of a model."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_pairs: int  # rotary pairs
    neox: bool

    @property
    def width(self) -> int:
        """Values of a row of Q, K and V."""
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    def check(self) -> None:
        group = self.n_heads // self.n_kv_heads
        if self.head_dim not in (64, 128, 256):
            raise ValueError(f"head dimension {self.head_dim} is not one of the attention kernels' 64, 128, 256")
        if self.n_heads % self.n_kv_heads or group > ATTN_MAX_GROUP:
            raise ValueError(f"{self.n_heads} query heads over {self.n_kv_heads} KV heads: at most "
                             f"{ATTN_MAX_GROUP} per KV head are supported")

    def chunks_shared_bytes(self) -> int:
        """attn_chunks' dynamic shared memory: the 4 chunks' partials, each warp's probabilities and
        slot numbers, and each warp's chunk of float16 keys and values."""
        g, d = self.n_heads // self.n_kv_heads, self.head_dim
        return 4 * (4 * g * (d + 2) + 4 * ATTN_CHUNK * ATTN_HEADS + 4 * ATTN_CHUNK) + 4 * 2 * ATTN_CHUNK * d * 2


# The prompt rows' attention on the tensor cores (prompt_attention.cu) where it fits, else attention.cu's
# (NVMEDIRECT_PROMPT_ATTENTION=0 turns it off; docs/GPU.md). On the H200 it took the 8B's pp512 from
# 9813 to 12579 tok/s (2026-12-03).
PROMPT_ATTENTION = os.environ.get("NVMEDIRECT_PROMPT_ATTENTION", "1") != "0"
PROMPT_KEYS = 64  # prompt_attention.cu: keys per tile


def _prompt_kernel(head_dim: int, window: bool = False):  # noqa: ANN202
    return kernels.function("prompt_attention", f"attn_prompt_{'window_' if window else ''}d{head_dim}")


def prompt_attention_fits(shape: AttentionShape, window: bool = False) -> bool:
    """Whether a block of prompt_attention.cu (a warp per query head of a KV head) fits this device
    with the registers its compiled kernel uses (on the H200: 184 a thread at d128, 134 at d64, so
    groups up to 10 and 15 query heads per KV head); `window`: the local layers' kernel."""
    return shape.head_dim in (64, 128) and \
        32 * (shape.n_heads // shape.n_kv_heads) <= _prompt_kernel(shape.head_dim, window).max_threads_per_block


def uses_prompt_attention(shape: AttentionShape, window: bool = False) -> bool:
    """Whether the prompt rows of a model of this shape take prompt_attention.cu (otherwise attention.cu,
    as the canonical rows); `window`: of a local layer."""
    return PROMPT_ATTENTION and prompt_attention_fits(shape, window)


def prompt_attention(qkv: cupy.ndarray, shape: AttentionShape, layer: int, rows: RowFields, r0: int, n: int,
                     out16: cupy.ndarray, scale: float | None = None, window: int = 0) -> None:
    """out16 rows r0 .. r0 + n - 1 (float16, (rows, n_heads * head_dim)) = the attention of the
    prompt rows r0 .. of the pass over their sequences' slots 0..pos (keys and values stored by
    rope_rows), on the tensor cores: a tile of 16 rows and a KV head a block, a warp per query head.
    scale: the scores' factor (default 1 / sqrt(head_dim)). window > 0: a row at position p sees
    positions p - window + 1 .. p only (a local layer; its cache a ring)."""
    s = shape
    if n < 1:
        return
    group = s.n_heads // s.n_kv_heads
    if not prompt_attention_fits(s, window > 0):
        most = _prompt_kernel(s.head_dim, window > 0).max_threads_per_block // 32 if s.head_dim in (64, 128) else 0
        raise ValueError(f"prompt_attention.cu takes head size 64 or 128 (not {s.head_dim}) and at most {most} "
                         f"query heads per KV head on this device (not {group})")
    smem = 2 * PROMPT_KEYS * (s.head_dim + 8) * 2
    name = f"attn_prompt_{'window_' if window else ''}d{s.head_dim}"
    fn = with_shared(kernels.function("prompt_attention", name), (name,), smem)
    pos, _slot, _base, _off, _anc, kptr, vptr, cap = rows.offset(r0)
    q_values = s.n_heads * s.head_dim
    fn((s.n_kv_heads, -(-n // 16)), (32 * group,),
       (np.uint64(qkv.data.ptr + r0 * s.width * 4), np.int32(s.width), np.int32(s.n_heads), np.int32(s.n_kv_heads),
        np.float32(1.0 / np.sqrt(s.head_dim) if scale is None else scale), *([np.int32(window)] if window else []),
        np.int32(layer), pos, kptr, vptr, cap,
        np.int32(n),
        np.uint64(out16.data.ptr + r0 * q_values * 2)), shared_mem=smem)


def attention_blocks(max_ctx: int) -> int:
    """attn_chunks blocks a row of a cache of max_ctx positions may need (work buffer rows)."""
    return -(-max_ctx // ATTN_BLOCK_POSITIONS)


def position_blocks(nb: int, rows: int) -> int:
    """attn_chunks blocks along the positions for a pass of `rows` rows (each walks nb / that many
    position blocks): all nb for a few rows (decode wants every block at once), 4 for more (a
    prompt's rows in a long context would otherwise launch mostly empty blocks; 512 rows at ctx
    4096: 7/8 of them). Speed only: the bits do not depend on which block computes a chunk."""
    return nb if rows <= 16 else min(nb, 4)


def head_splits(group: int, blocks: int, head_dim: int = 128) -> int:
    """Parts (attn_chunks_s<S>_d<D>, S in HEAD_SPLITS[D]) a KV head's `group` query heads are
    split into, a block each, for an attn_chunks grid of `blocks` blocks otherwise: a decode step
    over a short cache launches a block per KV head, and a block's time grows with its query heads
    (the 30B-A3B's 8 a KV head: 16.5 us a layer at position 64 on the H100, 2026-12-06, against ~10
    for the 8B's 4; the Qwen2.5 0.5B draft's 7 of size 64: 14.4 us on the H200, 2026-12-03). The most
    parts that divide the group and keep the grid within HEAD_SPLIT_GRID blocks (each part copies
    the keys again); NVMEDIRECT_ATTN_SPLITS forces a number (sweeps). Speed only: a head's bits do
    not depend on its block."""
    import os

    splits = HEAD_SPLITS.get(head_dim, (1,))
    forced = os.environ.get("NVMEDIRECT_ATTN_SPLITS")
    if forced:
        if forced not in {str(s) for s in splits}:
            raise ValueError(f"NVMEDIRECT_ATTN_SPLITS={forced!r}: one of {splits} for heads of size {head_dim}")
        return int(forced) if group % int(forced) == 0 else 1
    return max(s for s in splits if group % s == 0 and (s == 1 or s * blocks <= HEAD_SPLIT_GRID))


def chunks_kernel(head_dim: int, splits: int) -> str:
    """The attn_chunks kernel of a head size and head split."""
    return f"attn_chunks_{f's{splits}_' if splits > 1 else ''}d{head_dim}"


def attention_group_rows(rows: int) -> int:
    """Rows an attn_chunks block takes one after the other (a prompt's rows then share the keys it
    copies): 1, a block per row, unless NVMEDIRECT_ATTN_GROUP says otherwise. Sharing measured
    slower on the H200 (2026-12-02, bench.kernel_sweep: 512 prompt rows 571 us in blocks of one
    row, 582 in fours, 779 in eights; 32 rows 38.8, 51.5, 76.5): the kernel is bound by its
    arithmetic, not by reading the keys."""
    import os

    forced = os.environ.get("NVMEDIRECT_ATTN_GROUP")
    return max(1, int(forced)) if forced else 1


def attention_work_nbytes(shape: AttentionShape, rows: int, max_ctx: int) -> int:
    """Float32 work of one attention launch over `rows` rows of caches up to max_ctx positions."""
    return 4 * rows * shape.n_heads * attention_blocks(max_ctx) * (shape.head_dim + 2)


@dataclass
class RowFields:
    """The device fields of a pass's rows that the attention kernels read (infer/gpu/passes.py)."""

    pos: cupy.ndarray
    slot: cupy.ndarray
    base: cupy.ndarray
    anc_off: cupy.ndarray
    anc: cupy.ndarray
    kptr: cupy.ndarray
    vptr: cupy.ndarray
    cap: cupy.ndarray

    def offset(self, r0: int) -> tuple:
        """Pointers to the fields of rows r0.. (anc is indexed by offsets: not moved)."""
        def at(a: cupy.ndarray) -> np.uint64:
            return np.uint64(a.data.ptr + r0 * a.itemsize)

        return (at(self.pos), at(self.slot), at(self.base), at(self.anc_off), self.anc, at(self.kptr), at(self.vptr),
                at(self.cap))


def rope_rows(qkv: cupy.ndarray, shape: AttentionShape, cos: cupy.ndarray, sin: cupy.ndarray, layer: int,
              rows: RowFields, n: int, q_norm: cupy.ndarray | None = None, k_norm: cupy.ndarray | None = None,
              eps: float = 0.0) -> None:
    """Rotates q (in place) and k of rows 0..n-1 of qkv (rows, shape.width) by their positions and
    stores k and v in each row's cache at its slot (layer `layer`); with q_norm / k_norm (head_dim
    floats) each query / key head is RMS-normalised (epsilon eps) and scaled by them first."""
    s = shape
    threads = min(128, max(32, -(-s.head_dim // 2 // 32) * 32))
    pos, slot, _base, _off, _anc, kptr, vptr, cap = rows.offset(0)
    kernels.function("attention", "rope_rows")(
        (n, s.n_heads + s.n_kv_heads), (threads,),
        (qkv, np.int32(s.width), cos, sin, np.int32(s.n_heads), np.int32(s.n_kv_heads), np.int32(s.head_dim),
         np.int32(s.n_pairs), np.int32(1 if s.neox else 0), np.int32(layer), pos, slot, kptr, vptr, cap,
         NULL if q_norm is None else q_norm, NULL if k_norm is None else k_norm, np.float32(eps)))


def attention(qkv: cupy.ndarray, shape: AttentionShape, layer: int, rows: RowFields, n: int, max_ctx: int,
              work: cupy.ndarray, work_rows: int, out: cupy.ndarray, act: str, int8: Int8Act | None = None,
              out16: cupy.ndarray | None = None, window: int = 0, scale: float | None = None) -> None:
    """out (n, n_heads * head_dim) = each row's attention over its span (its position, slots and
    cache in `rows`; keys and values stored by rope_rows), rounded to activation format `act` (with
    its 8-bit form into int8; out16, float16: the values before rounding, for the prompt products). `work` holds the partials of work_rows rows at a time
    (attention_work_nbytes); max_ctx bounds every row's position + 1. window > 0: a row at position p
    sees positions p - window + 1 .. p only (a sliding-window layer); scale: the scores' factor
    (default 1 / sqrt(head_dim))."""
    s = shape
    nb = attention_blocks(max_ctx)
    scale = np.float32(1.0 / np.sqrt(s.head_dim) if scale is None else scale)
    smem = s.chunks_shared_bytes()
    merge = kernels.function("attention", "attn_merge")
    q_values = s.n_heads * s.head_dim
    chunk = 256 if q_values % 256 == 0 else 32  # attn_merge: values a block (whole 8-bit groups)
    if act == "q8_k" and chunk != 256:
        raise ValueError(f"a q8_k output needs rows of whole 256-value groups, not {q_values}")
    for r0 in range(0, n, work_rows):
        m = min(work_rows, n - r0)
        group = attention_group_rows(m)
        pos, _slot, base, anc_off, anc, kptr, vptr, cap = rows.offset(r0)
        blocks = position_blocks(nb, n) * -(-m // group)
        splits = head_splits(s.n_heads // s.n_kv_heads, s.n_kv_heads * blocks, s.head_dim)
        name = chunks_kernel(s.head_dim, splits)
        chunks = with_shared(kernels.function("attention", name), (name,), smem)
        chunks((s.n_kv_heads * splits, position_blocks(nb, n), -(-m // group)), (ATTN_THREADS,),
               (np.uint64(qkv.data.ptr + r0 * s.width * 4), np.int32(s.width), np.int32(s.n_heads),
                np.int32(s.n_kv_heads), scale, np.int32(window), np.int32(layer), pos, base, anc_off, anc, kptr, vptr,
                cap, work,
                np.int32(nb), np.int32(m), np.int32(group)), shared_mem=smem)
        part = None if int8 is None else int8.rows(r0, r0 + m)
        merge((m, q_values // chunk), (chunk,), (work, np.int32(nb), np.int32(s.n_heads), np.int32(s.head_dim), pos,
                                                 np.int32(window), np.uint64(out.data.ptr + r0 * q_values * 4),
                                                 NULL if out16 is None else np.uint64(out16.data.ptr + r0 * q_values * 2),
                                                 np.int32(ACT_CODES[act]),
                                                 *int8_args(part)))
