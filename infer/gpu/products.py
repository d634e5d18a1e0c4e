"""The matrix products of a pass (infer/kernels/qmm.cu, pmm.cu): one Python call per launch, none
allocating, so each may sit inside a CUDA graph capture.

- `product`: the canonical rows (decode tokens, batches, tree nodes, scored prompts): qgemv for a
  few rows, the int8 tensor-core qmm for more, fgemv for float weights; every output in the
  canonical order of canon.cuh (the same bits for any N, kernel variant or split of K).
- `expert_product`: routed experts, each (row, slot) pair by the expert the router chose for it
  (qgemv_id: canonical sums, so the same bits as `product` on that expert's rows);
  `grouped_expert_product` the same pairs sorted by expert (qmm_id: each expert read once a call,
  the same bits).
- `prompt_product`: the prompt rows (prompt tokens whose logits nobody reads): float16 weights
  dequantized in shared memory, float32 sums on the tensor cores (pmm.cu), one order per output.
"""

from __future__ import annotations

import os

import cupy
import numpy as np

from infer.gpu import kernels, pdl
from infer.gpu.layout import FLOAT_FORMATS, K_FORMATS
from infer.gpu.ops import NULL, GpuMatrix, Int8Act, device_ptr, grid_blocks, with_shared

QGEMV_MAX = 4  # qgemv_*_v4: products of up to this many rows use the GEMV-shaped kernels
Input = Int8Act | cupy.ndarray  # the 8-bit form for quantized weights, float32 rows for float ones


FORMAT_KIND = {"q8": 1, "g4": 4, "g5": 5, "k4": 14, "k5": 15, "k6": 16}  # qmm.cu QMM_FORMAT
# n-tiles of a qmm block -> (warps of 16 rows, pipeline stages), and the qgemv kernels' (warps,
# loads in flight), chosen by timing the variants (bench/kernel_sweep.py, docs/PERFORMANCE.md);
# NVMEDIRECT_QMM_TUNING="1:2,4;8:4,3" and NVMEDIRECT_QGEMV_TUNING="4,2" override them (sweeps)
QMM_TUNING: dict[int, tuple[int, int]] = {1: (4, 3), 2: (4, 3), 4: (4, 3), 8: (4, 3)}
QGEMV_TUNING: tuple[int, int] = (4, 2)
# (row length up to, weight rows a qgemv warp takes): qgemv_rows
QGEMV_ROWS: tuple[tuple[int, int], ...] = ((1024, 4), (2048, 2), (1 << 30, 1))
# blocks per SM the registers of a format's qmm kernels must allow (qmm.cu MMQ_MIN_BLOCKS; absent:
# the kernel's default; NVMEDIRECT_QMM_MIN_BLOCKS overrides, for sweeps)
QMM_MIN_BLOCKS: dict[str, int] = {}


def _tuning_from_environment() -> None:
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


def qgemv_rows(cols: int) -> int:
    """Weight rows a qgemv warp takes (qmm.cu QG_ROWS) for rows of `cols` values: more for short
    rows, whose warps otherwise hold a load or two each (NVMEDIRECT_QGEMV_ROWS forces it: sweeps).
    Speed only: a row's sum does not depend on it."""
    forced = os.environ.get("NVMEDIRECT_QGEMV_ROWS")
    if forced:
        if not forced.isdigit() or not 1 <= int(forced) <= 8:
            raise ValueError(f"NVMEDIRECT_QGEMV_ROWS={forced!r}: weight rows a warp, 1 to 8")
        return int(forced)
    return next(rows for most, rows in QGEMV_ROWS if cols <= most)


def _gemv_defines(fmt: str, tuning: tuple[int, int] | None = None, rows: int = 1,
                  prefetch: bool = False) -> dict[str, int]:
    """The #defines of the module of format `fmt`'s qgemv (or float) kernels (tuning: warps, unroll;
    rows: weight rows a warp; prefetch: their first weight loads before the PDL wait, qmm.cu)."""
    warps, unroll = tuning or QGEMV_TUNING
    defines = {"QMM_FORMAT": FORMAT_KIND.get(fmt, 100), "QG_WARPS": warps, "QG_UNROLL": unroll, "QMM_KERNELS": 1}
    if rows != 1:
        defines["QG_ROWS"] = rows
    if prefetch:
        defines["PDL_PREFETCH"] = 1
    return defines


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


def _qmm_kernel(fmt: str, nt: int, tuning: tuple[int, int] | None = None, kind: str = "qmm"):  # noqa: ANN202
    """(kernel, dynamic shared bytes, warps) of <kind>_<fmt>_n<nt> (kind qmm, or qmm_id for grouped
    experts) in its tuned (or given) variant."""
    defines = _module_defines(fmt, nt, tuning)
    warps, stages = defines["MMQ_WARPS"], defines["MMQ_STAGES"]
    name = f"{kind}_{fmt}_n{nt}"
    smem = stages * _qmm_stage_bytes(fmt, nt, warps)
    fn = kernels.function("qmm", name, defines)
    return with_shared(fn, (name, *sorted(defines.items())), smem), smem, warps


def prepare_kernels(matrices: set[tuple[str, int]]) -> None:
    """Compiles the product kernels of matrices of these (format, row length), the qgemv variants
    their row lengths take (qgemv_rows), and raises the shared-memory opt-in of those that need more
    than the default, before any CUDA graph capture (attention: attention.prepare)."""
    for fmt in {fmt for fmt, _ in matrices}:
        per_warp = {qgemv_rows(cols) for f, cols in matrices if f == fmt} if fmt not in FLOAT_FORMATS else {1}
        for rows in per_warp:
            for prefetch in {False, pdl.prefetch_enabled()}:
                kernels.module("qmm", _gemv_defines(fmt, rows=rows, prefetch=prefetch))
        if fmt not in FLOAT_FORMATS:
            for nt in (1, 2, 4, 8):
                _qmm_kernel(fmt, nt)
                _qmm_kernel(fmt, nt, kind="qmm_id")
            for bn in PMM_TILES:
                _pmm_kernel(fmt, bn)


FGEMV_L2_BYTES = 8 << 20  # float matrices up to this size count as held by the L2 (fgemv's grid)
FGEMV_VECTORS = 8  # qmm.cu FG_VECTORS
SPLIT_MIN_BLOCKS = 264  # a qmm launch of fewer (row tile x token tile) blocks splits K (2 x 132 SMs)
SPLIT_SCRATCH_BYTES = 16 << 20  # the group sums of a split product (a model's pass buffers hold them)
CANON_GROUP = 1024  # canon.cuh: values of K per group (a split block computes one)


def _split_groups(blocks: int, cols: int, n: int, rows: int, scratch: cupy.ndarray | None) -> int:
    """Groups of K a qmm launch of `blocks` blocks splits into (0: no split)."""
    groups = -(-cols // CANON_GROUP)
    if scratch is None or groups < 2 or blocks >= SPLIT_MIN_BLOCKS or os.environ.get("NVMEDIRECT_QMM_SPLIT") == "0":
        return 0
    return groups if 4 * groups * n * rows <= scratch.nbytes else 0


def _check_parts(parts: list[GpuMatrix]) -> None:
    m0 = parts[0]
    if not 1 <= len(parts) <= 3 or any(p.fmt != m0.fmt or p.cols != m0.cols for p in parts):
        raise ValueError("a product takes one to three matrices of one format and row length")


def _parts_args(parts: list[GpuMatrix]) -> tuple:
    """A launch's PARTS_ARGS (qmm_operands.cuh): each part's planes (null for absent parts), then the
    rows where parts 1 and 2 start, then M."""
    rows = sum(p.rows for p in parts)
    planes = [pl for p in parts for pl in p.planes()] + [NULL] * 4 * (3 - len(parts))
    ends = [*np.cumsum([p.rows for p in parts]).tolist(), rows, rows]
    return (*planes, np.int32(ends[0]), np.int32(ends[1]), np.int32(rows))


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
    _check_parts(parts)
    if m0.fmt in FLOAT_FORMATS and len(parts) != 1:
        raise ValueError("float-format matrices are multiplied one at a time")
    rows = sum(p.rows for p in parts)
    ldy = rows if ldy is None else ldy
    if n < 1:
        return
    if m0.fmt in FLOAT_FORMATS:
        warps = QGEMV_TUNING[0]
        fn = kernels.function("qmm", f"fgemv_{m0.fmt}", _gemv_defines(m0.fmt, prefetch=pdl.prefetch_weights(parts)))
        # a warp a row, FGEMV_VECTORS vectors at a time (each weight sub-block read once for them);
        # grid y strides the groups of vectors. A matrix the L2 holds (a router) takes a block row
        # per group: a 512-row prompt's router took 274 us on the H100 (2026-12-06) with a vector at
        # a time and 64 block rows. A larger matrix keeps at most 64 block rows, each weight row read
        # from memory once per 64 groups. The sums are the same for any grid.
        small = m0.nbytes <= FGEMV_L2_BYTES
        groups = -(-n // FGEMV_VECTORS)
        fn((grid_blocks(rows, warps), min(groups, 65535 if small else 64)), (32 * warps,),
           (m0.buffer, np.int32(rows), np.int32(m0.cols), x, np.int32(n), y, np.int32(ldy), device_ptr(bias),
            device_ptr(residual)))
        return
    if not isinstance(x, Int8Act) or x.act != m0.act:
        raise ValueError(f"a {m0.fmt} product takes the {m0.act} 8-bit form of its input")
    head = (*_parts_args(parts), np.int32(m0.cols), x.xq, x.xs, x.xsum, np.int32(n))
    args = (*head, y, np.int32(ldy), device_ptr(bias), device_ptr(residual), NULL)
    if uses_qmm(m0.fmt, m0.cols, n):
        nt = _tiles(n)
        fn, smem, warps = _qmm_kernel(m0.fmt, nt, tuning)
        grid = (grid_blocks(n, 8 * nt), grid_blocks(rows, 16 * warps))
        groups = _split_groups(grid[0] * grid[1], m0.cols, n, rows, scratch)
        if not groups:
            fn(grid, (32 * warps,), args, shared_mem=smem)
            return
        fn((*grid, groups), (32 * warps,), (*head, y, np.int32(ldy), NULL, NULL, scratch), shared_mem=smem)
        combine = kernels.function("qmm", "qmm_combine", _module_defines(m0.fmt, nt, tuning))
        combine((grid_blocks(n * rows, 256),), (256,), (scratch, np.int32(groups), np.int32(rows), np.int32(n), y,
                                                    np.int32(ldy), device_ptr(bias), device_ptr(residual)))
        return
    nv = 1 if n == 1 else 2 if n == 2 else 4
    warps, per_warp = (tuning or QGEMV_TUNING)[0], qgemv_rows(m0.cols)
    fn = kernels.function("qmm", f"qgemv_{m0.fmt}_v{nv}", _gemv_defines(m0.fmt, tuning, per_warp,
                                                                          pdl.prefetch_weights(parts)))
    fn((grid_blocks(rows, warps * per_warp), grid_blocks(n, nv)), (32 * warps,), args)


def _expert_parts(parts: list[GpuMatrix], n_experts: int, x: Input) -> tuple[int, tuple]:
    """(rows an expert, the launch's PARTS_ARGS for one expert's rows) of stacks of experts."""
    m0 = parts[0]
    if m0.fmt in FLOAT_FORMATS or not isinstance(x, Int8Act) or x.act != m0.act:
        raise ValueError(f"experts in {m0.fmt} take the {m0.act} 8-bit form of their input on the GPU")
    per_expert = [p.rows // n_experts for p in parts]
    rows = sum(per_expert)
    ends = [*np.cumsum(per_expert).tolist(), rows, rows]
    planes = [pl for p in parts for pl in p.planes()] + [NULL] * 4 * (3 - len(parts))
    return rows, (*planes, np.int32(ends[0]), np.int32(ends[1]), np.int32(rows))


def expert_product(parts: list[GpuMatrix], n_experts: int, x: Input, ids: cupy.ndarray, pairs: int,
                   xdiv: int, y: cupy.ndarray, ldy: int) -> None:
    """Row j < pairs of y (at y[j * ldy:]) = the rows of expert ids[j] in each part (a stack of
    n_experts experts; parts: one matrix, or gate and up) times input row j // xdiv; ids[j] < 0
    leaves row j as it is (qmm.cu qgemv_id)."""
    m0 = parts[0]
    rows, parts_args = _expert_parts(parts, n_experts, x)
    if pairs < 1:
        return
    warps, per_warp = QGEMV_TUNING[0], qgemv_rows(m0.cols)
    fn = kernels.function("qmm", f"qgemv_id_{m0.fmt}", _gemv_defines(m0.fmt, rows=per_warp))
    fn((grid_blocks(rows, warps * per_warp), pairs), (32 * warps,),
       (*parts_args, np.int32(m0.cols), x.xq, x.xs, x.xsum, ids, np.int32(xdiv), y, np.int32(ldy)))  # type: ignore[union-attr]


def groups_experts(parts: list[GpuMatrix]) -> bool:
    """Whether stacks of experts like these have the grouped product (qmm_id: the tensor-core one)."""
    return all(uses_qmm(p.fmt, p.cols, QGEMV_MAX + 1) for p in parts)


def group_tiles(pairs: int, n_experts: int) -> int:
    """qmm_id n-tiles (of 8 pairs) a block for `pairs` pairs over n_experts experts: by the mean pairs
    an expert (moe_group's tiles must be made for the same)."""
    return _tiles(-(-pairs // n_experts))


def grouped_expert_product(parts: list[GpuMatrix], n_experts: int, x: Int8Act, starts: cupy.ndarray,
                           tiles: cupy.ndarray, pairs: int, nt: int, y: cupy.ndarray, ldy: int) -> None:
    """The pairs grouped by expert (moe.cu moe_group with tiles of 8 * nt pairs: starts, tiles), at
    most `pairs`: row p < starts[E] of y (at y[p * ldy:]) = the rows of the expert of sorted position p
    in each part times row p of x (qmm.cu qmm_id). Each expert's weights are read once a call; each
    row has the bits expert_product gives the same pair."""
    m0 = parts[0]
    rows, parts_args = _expert_parts(parts, n_experts, x)
    if not groups_experts(parts):
        raise ValueError(f"no grouped expert product for {m0.fmt} rows of {m0.cols} values")
    if pairs < 1:
        return
    fn, smem, warps = _qmm_kernel(m0.fmt, nt, kind="qmm_id")
    grid = (grid_blocks(pairs, 8 * nt) + n_experts, grid_blocks(rows, 16 * warps))  # every expert's last tile partial
    fn(grid, (32 * warps,), (*parts_args, np.int32(m0.cols), x.xq, x.xs, x.xsum, starts, tiles, np.int32(n_experts), y,
                             np.int32(ldy)), shared_mem=smem)


# ---------------------------------------------------------------------------- prompt products
PMM_TILES = (32, 64, 128)  # tokens per pmm block (pmm.cu pmm_<fmt>_t<BN>)
PMM_SLOTS = 3  # pmm.cu's stages in shared memory
# Weight rows per pmm block. The 64-row variants (pmm_<fmt>_t<BN>_m64, for matrices of few rows) were
# slower on the H200 at every 8B prompt shape, even where 128 leaves fewer blocks than two per SM
# (bench.pmm_sweep, 2026-12-03: down 372 against 317 us, wo 88 against 76): only bench.pmm_sweep
# and the tests take them (block_rows=64).
PMM_ROWS = 128
PMM_BLOCK_ROWS = (128, 64)


def uses_pmm(fmt: str, cols: int) -> bool:
    """Whether prompt rows of a matrix take the float16 tensor-core product (pmm.cu); else they take
    the canonical product like every other row."""
    return fmt not in FLOAT_FORMATS and cols % 64 == 0


def _pmm_shared_bytes(fmt: str, bn: int, bm: int = PMM_ROWS) -> int:
    """Dynamic shared memory of pmm_<fmt>_t<bn>[_m64] (pmm.cu PStage::TOTAL)."""
    qs = 32 if fmt == "q8" else 16
    hi = {"g5": 4, "k5": 4, "k6": 8}.get(fmt, 0)
    smb = 4 if fmt in ("g4", "g5") else 2
    off_d = bm * ((2 * qs + 16) + 2 * hi + 2 * smb)
    off_x = -(-(off_d + (bm * 4 if fmt in K_FORMATS else 0)) // 128) * 128
    return PMM_SLOTS * (off_x + bn * 160)


def _pmm_tile(n: int) -> int:
    return next((t for t in PMM_TILES if n <= t), PMM_TILES[-1])


def _pmm_kernel(fmt: str, bn: int, bm: int = PMM_ROWS):  # noqa: ANN202
    defines = {"PMM_FORMAT": FORMAT_KIND[fmt]}
    name = f"pmm_{fmt}_t{bn}" + ("" if bm == PMM_ROWS else f"_m{bm}")
    smem = _pmm_shared_bytes(fmt, bn, bm)
    fn = kernels.function("pmm", name, defines)
    return with_shared(fn, (name, *sorted(defines.items())), smem), smem


def prompt_product(parts: list[GpuMatrix], x16: cupy.ndarray, y: cupy.ndarray, n: int, ldy: int | None = None,
                   bias: cupy.ndarray | None = None, residual: cupy.ndarray | None = None,
                   tile: int | None = None, block_rows: int | None = None) -> None:
    """Rows v < n of y = the parts' matrices (stacked row-wise, as `product`) times float16 input row
    v of x16 (n, cols), + bias, + residual (y may be the residual): the prompt rows' product
    (pmm.cu), float16 weights and float32 sums on the tensor cores, each output summed in one order
    for any n, any `tile` (tokens per block: 32, 64 or 128) and any `block_rows` (64 or 128)."""
    m0 = parts[0]
    _check_parts(parts)
    if not uses_pmm(m0.fmt, m0.cols):
        raise ValueError(f"no prompt product for {m0.fmt} rows of {m0.cols} values")
    if n < 1:
        return
    rows = sum(p.rows for p in parts)
    ldy = rows if ldy is None else ldy
    bn = tile or _pmm_tile(n)
    bm = block_rows or PMM_ROWS
    fn, smem = _pmm_kernel(m0.fmt, bn, bm)
    fn((grid_blocks(n, bn), grid_blocks(rows, bm)), (256,),
       (*_parts_args(parts), np.int32(m0.cols), x16, np.int32(n), y, np.int32(ldy), device_ptr(bias),
        device_ptr(residual)), shared_mem=smem)
