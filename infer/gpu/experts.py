"""A mixture of experts computed on the GPU with its experts in VRAM (issue 26: the model fits).

Each block's expert stacks (ffn_{gate,up,down}_exps, n_experts x rows x cols) are uploaded as one
planar matrix each, the experts' rows one after another, so expert e of a stack is rows
[e * rows, (e + 1) * rows). A pass's feed-forward of such a block never leaves the device and takes
a fixed number of launches for any routing, so it sits inside the layer's CUDA graph:

    h       = RMSNorm(x) rounded to each product's input format       (ops.rmsnorm)
    logits  = router @ h                                              (the canonical product)
    ids, w  = the top k of softmax(logits), most probable first       (moe.cu moe_route)
    gu[j]   = [gate | up] of expert ids[j] times h of pair j's row    (qmm.cu qgemv_id: one launch for
    out[j]  = down of expert ids[j] times glu(gu[j])                   every (row, slot) pair j)
    x      += sum_j w[j] * out[j] (+ the shared expert, gated)        (moe.cu moe_combine)

The products are the canonical ones (qmm.cu), so a row gets the same bits in any pass, and its
numbers follow the CPU engine's (infer/moe.py) within the GPU-vs-CPU bound of docs/INFERENCE.md.
With few pairs an expert (decode, small batches, trees) a pair reads its expert's weights by itself
(qgemv_id). With many (prompts, large batches: GROUPED_FROM pairs an expert on average) the pairs
are first sorted by expert on the device (moe.cu moe_group; their input rows gathered in that
order, moe_gather8), and the tensor-core product walks each expert's pairs (qmm.cu qmm_id), so an
expert's weights come from HBM once a pass; gu, the down product's input and out then hold the pairs
in sorted order and the combination reads pair j's output at its position. Both products give a
pair the same bits, so a row's logits do not depend on which one its pass took. Every launch has a
fixed size for a given pass size (the routing only changes what the blocks do), so both sit inside
the layer's CUDA graph. Expert stacks in a float format (f16, bf16, f32) have no such product: their
blocks stay with the CPU (infer.tiers.cpu_tier.CpuExperts).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import cupy
import numpy as np

from infer.arch import ModelArgs, tensor_name
from infer.gguf_file import GGUFModel
from infer.gpu import kernels, ops, products
from infer.gpu.activations import Inputs
from infer.gpu.layout import FLOAT_FORMATS, format_of
from infer.gpu.ops import EIGHT_BIT, GpuMatrix, Int8Act, device_ptr, grid_blocks
from infer.gpu.weights import runs, upload_tensor
from infer.quants import activation_format
from infer.tiers.plan import format_bytes, span

if TYPE_CHECKING:
    from infer.gpu.expert_split import PickSplit
    from infer.gpu.expert_stream import ExpertStream

F32 = cupy.float32
ROUTE_MAX_K = 32  # moe.cu moe_route: a lane keeps each pick
MAX_PAIRS = 65535  # (row, slot) pairs of one pass: a launch's grid y
BUFFER_ROUNDING = 512  # CuPy's pool rounds each buffer up to this (a block's matrices are buffers of their own)
MATRICES_PER_BLOCK = 7  # at most: router, gate, up, down, and a shared expert's gate, gate/up and down
# mean pairs an expert from which a pass groups its pairs by expert: at 2 (32 decode rows of the
# 30B-A3B) grouped ran 2653 tok/s against 1358 per pair (H100, 2026-12-06, docs/PERFORMANCE.md);
# NVMEDIRECT_EXPERTS_GROUPED_FROM overrides it (sweeps; a large value keeps every pass per pair)
GROUPED_FROM = float(os.environ.get("NVMEDIRECT_EXPERTS_GROUPED_FROM", "1"))
STACKS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
SHARED = ("ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")


@dataclass
class ExpertBlock:
    """A block's feed-forward of experts on the device."""

    router: GpuMatrix  # (n_experts, dim): ffn_gate_inp
    gate: GpuMatrix  # (n_experts * width, dim): ffn_gate_exps, the experts' rows one after another
    up: GpuMatrix  # (n_experts * width, dim)
    down: GpuMatrix  # (n_experts * dim, width)
    shared_gate: GpuMatrix | None = None  # (1, dim): qwen2moe's ffn_gate_inp_shexp
    shared_gate_up: list[GpuMatrix] | None = None  # ffn_gate_shexp, ffn_up_shexp
    shared_down: GpuMatrix | None = None

    def matrices(self) -> list[GpuMatrix]:
        shared = [self.shared_gate, *(self.shared_gate_up or []), self.shared_down]
        return [self.router, self.gate, self.up, self.down, *(m for m in shared if m is not None)]

    def normed_inputs(self) -> list[GpuMatrix]:
        """The matrices that take the block's normed input (the router, gate and up, the shared expert's)."""
        return [m for m in (self.router, self.gate, self.up, self.shared_gate, *(self.shared_gate_up or []))
                if m is not None]


def stacks_on_device(model: GGUFModel, args: ModelArgs) -> str | None:
    """None when every block's expert stacks have a product on the device (quantized formats) and
    moe_route takes the routing, else why not."""
    if args.n_experts_used > ROUTE_MAX_K:
        return f"it routes {args.n_experts_used} experts a token: the GPU's router takes at most {ROUTE_MAX_K}"
    for i in range(args.n_layers):
        for kind in STACKS:
            info = model.tensors.get(tensor_name(i, kind))
            if info is None:
                continue
            fmt = format_of(info.ggml_type)
            if fmt in FLOAT_FORMATS:
                return f"its expert stacks are {fmt}: the GPU multiplies experts in quantized formats only"
    return None


def stacks_group(model: GGUFModel, layers: list[int]) -> bool:
    """Whether every expert stack of `layers` has the grouped product (products.groups_experts)."""
    for i in layers:
        for kind in STACKS:
            info = model.tensor(tensor_name(i, kind))
            if not products.uses_qmm(format_of(info.ggml_type), int(info.shape[-1]), products.QGEMV_MAX + 1):
                return False
    return True


def upload_piece(model: GGUFModel, layer: int, kind: str) -> GpuMatrix | None:
    """Tensor `kind` of block `layer` as one planar matrix (a stack: its experts' rows one after
    another; a vector: one row), None when the file has none."""
    name = tensor_name(layer, kind)
    if name not in model.tensors:
        return None
    info = model.tensor(name)
    shape = tuple(int(d) for d in info.shape)
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return ops.upload_stacked([(info.data, rows)], info.ggml_type, shape[-1])


def _upload_block(model: GGUFModel, args: ModelArgs, i: int) -> ExpertBlock:
    def up(kind: str) -> GpuMatrix | None:
        return upload_piece(model, i, kind)

    block = ExpertBlock(upload_tensor(model, tensor_name(i, "ffn_gate_inp")), *(up(kind) for kind in STACKS))
    if args.shared_ffn_dim:
        block.shared_gate = up("ffn_gate_inp_shexp")
        block.shared_gate_up = [up("ffn_gate_shexp"), up("ffn_up_shexp")]  # type: ignore[list-item]
        block.shared_down = up("ffn_down_shexp")
    return block


def _tensor_act(model: GGUFModel, name: str) -> str:
    return activation_format(model.tensor(name).ggml_type)


def buffers_nbytes(model: GGUFModel, args: ModelArgs, rows: int) -> int:
    """Device bytes of GpuExperts' buffers for passes of `rows` rows (planned before loading; as
    GpuExperts.__init__ allocates them, the 8-bit forms counted as float32 rows: an upper bound)."""
    k, d = args.n_experts_used, args.dim
    pairs, w, s = rows * k, args.expert_ffn_dim, args.shared_ffn_dim
    kinds = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", *(("ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp")
                                                                if s else ()))
    acts = {_tensor_act(model, tensor_name(0, kind)) for kind in kinds}
    total = 4 * rows * args.n_experts + 8 * pairs + 4 * pairs * (3 * w + d)
    total += Inputs.planned_nbytes(rows, [("ffn", act, d) for act in acts])
    total += 8 * pairs + 8 * (args.n_experts + 1) + len(acts) * pairs * d * 5 // 4  # grouping, gathered 8-bit rows
    if s:
        total += 4 * rows * (3 * s + d + 1)
    return total


def block_bytes(model: GGUFModel, layer: int) -> int:
    """Device bytes of block `layer`'s experts, router and shared expert (their planar forms)."""
    from infer.tiers.plan import gpu_nbytes

    kinds = ("ffn_gate_inp", *STACKS, *SHARED)
    return sum(gpu_nbytes(model.tensor(tensor_name(layer, kind))) for kind in kinds
               if tensor_name(layer, kind) in model.tensors)


def expert_bytes(model: GGUFModel, args: ModelArgs) -> int:
    """Device bytes of every block's experts, routers and shared experts."""
    return sum(block_bytes(model, i) for i in range(args.n_layers))


class GpuExperts:
    """The feed-forward of blocks `layers` (default every block) on the device, their experts in
    VRAM, for passes of up to `rows` rows; with `stream` (infer.gpu.expert_stream) also the prompt
    rows of the CPU's blocks, their experts streamed in."""

    def __init__(self, model: GGUFModel, args: ModelArgs, rows: int, layers: list[int] | None = None,
                 progress: Callable[[int], None] | None = None, stream: ExpertStream | None = None) -> None:
        """progress(blocks done): after each block's upload."""
        if rows * args.n_experts_used > MAX_PAIRS:
            raise ValueError(f"passes of {rows} rows route {rows * args.n_experts_used} (row, expert) pairs, more "
                             f"than a launch takes ({MAX_PAIRS}): lower the pass size")
        self.args, self.rows, self.stream = args, rows, stream
        self.blocks: dict[int, ExpertBlock] = {}
        for j, i in enumerate(range(args.n_layers) if layers is None else layers):
            self.blocks[i] = _upload_block(model, args, i)
            if progress is not None:
                progress(j + 1)
        if not self.blocks and stream is None:
            raise ValueError("no block's experts to place on the GPU")
        every = list(self.blocks) + (stream.layers if stream is not None else [])
        act = {kind: {_tensor_act(model, tensor_name(i, kind)) for i in every}
               for kind in ("ffn_gate_inp", *STACKS, *SHARED) if tensor_name(every[0], kind) in model.tensors}
        k, w, d = args.n_experts_used, args.expert_ffn_dim, args.dim
        pairs = rows * k
        self.inputs = Inputs(args, rows, [("ffn", a, d) for kind in ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps",
                                                                         "ffn_gate_inp_shexp", "ffn_gate_shexp",
                                                                         "ffn_up_shexp") for a in act.get(kind, ())])
        self.logits = cupy.zeros((rows, args.n_experts), F32)
        self.ids = cupy.full(pairs, -1, cupy.int32)
        self.weights = cupy.zeros(pairs, F32)
        self.gu = cupy.zeros((pairs, 2 * w), F32)  # [gate | up] of each (row, slot) pair
        if len(act["ffn_down_exps"]) > 1 or len(act.get("ffn_down_shexp", ())) > 1:
            raise ValueError(f"the blocks' down stacks take inputs in several 8-bit forms ({sorted(act['ffn_down_exps'])}): "
                             "the GPU's expert buffers hold one")
        (down_act,) = act["ffn_down_exps"]
        self.ff: products.Input = Int8Act.zeros(pairs, w, down_act) if down_act in EIGHT_BIT else \
            cupy.zeros((pairs, w), F32)
        self.outs = cupy.zeros((pairs, d), F32)
        # the pairs sorted by expert (moe_group) and the gate/up inputs gathered in that order
        self.order, self.slot = cupy.zeros(pairs, cupy.int32), cupy.zeros(pairs, cupy.int32)
        self.starts, self.tiles = cupy.zeros(args.n_experts + 1, cupy.int32), cupy.zeros(args.n_experts + 1, cupy.int32)
        self.can_group = stacks_group(model, every)
        self.sorted_inputs = {a: Int8Act.zeros(pairs, d, a) for kind in STACKS[:2] for a in act[kind]} \
            if self.can_group else {}
        self.split: PickSplit | None = None  # the CPU's blocks' picks shared with the GPU (infer.gpu.expert_split)
        self.shared = None
        if args.shared_ffn_dim:
            s = args.shared_ffn_dim
            (sact,) = act["ffn_down_shexp"]
            self.shared = (cupy.zeros((rows, 2 * s), F32), Int8Act.zeros(rows, s, sact) if sact in EIGHT_BIT
                           else cupy.zeros((rows, s), F32), cupy.zeros((rows, d), F32), cupy.zeros(rows, F32))

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for b in self.blocks.values() for m in b.matrices())

    def matrix_shapes(self) -> set[tuple[str, int]]:
        """(format, row length) of every matrix the products take, resident or streamed (their
        kernels are compiled before any capture)."""
        shapes = {(m.fmt, m.cols) for b in self.blocks.values() for m in b.matrices()}
        if self.stream is not None:
            shapes |= {(format_of(t.ggml_type), int(t.shape[-1])) for t in self.stream.stacks.values()}
            shapes |= {(m.fmt, m.cols) for m in self.stream.resident.values() if m is not None}
        return shapes

    def describe(self) -> str:
        """One line for the load report."""
        a, n = self.args, len(self.blocks)
        which = "every block's" if n == a.n_layers else f"the experts of {n} of {a.n_layers} blocks ({span(self.blocks)})"
        line = (f"experts: {a.n_experts} per block, {a.n_experts_used} per token; {which} in VRAM, "
                f"{format_bytes(self.nbytes)} (routers, routed and shared experts), computed by the GPU")
        if self.stream is None:
            return line
        return f"{line}; the {self.stream.describe()}" + (f"; {self.split.why}" if self.split is not None else "")

    def run_ffn(self, model: object, i: int, shape: object, next_norm: NextNorm | None = None) -> bool:
        """Block i's feed-forward for the pass's rows: model.x in place (queued on the current stream).
        With next_norm, its last launch may also normalise model.x for the next layer: whether it did."""
        return self._ffn(self.blocks[i], model.weights.layer(i), model.x, shape.rows, model.index.d["live"],  # type: ignore[attr-defined]
                         next_norm)

    def streams(self, i: int, prompt_rows: int) -> bool:
        """Whether block i (one the CPU computes) takes a pass's `prompt_rows` (not counting null
        rows) here, streamed in."""
        return self.stream is not None and i not in self.blocks and self.stream.takes(prompt_rows)

    def run_streamed(self, model: object, i: int, shape: object) -> None:
        """Block i's feed-forward for the pass's prompt rows (model.x rows canonical .. rows), its
        experts streamed in (self.stream); the canonical rows are left to the CPU."""
        c = shape.canonical  # type: ignore[attr-defined]
        self._ffn(self.stream.block(i), model.weights.layer(i), model.x[c:], shape.prompt,  # type: ignore[union-attr, attr-defined]
                  model.index.d["live"][c:])  # type: ignore[attr-defined]

    def splits(self, i: int) -> bool:
        """Whether block i (one the CPU holds) splits its rows' picks between the GPU and the CPU."""
        return self.split is not None and i not in self.blocks

    def _ffn(self, B: ExpertBlock, L: object, x: cupy.ndarray, n: int, live: cupy.ndarray,
             next_norm: NextNorm | None = None) -> bool:
        """The feed-forward of experts B for rows 0..n of x (live: which are not null rows), in place;
        with next_norm the combination also normalises x for the next layer where it can (returned:
        moe_combine_norm, the next layer's norm launch saved, the same bits)."""
        a = self.args
        k, w, d, e = a.n_experts_used, a.expert_ffn_dim, a.dim, a.n_experts
        xs = self.inputs.normed(x, L.ffn_norm, "ffn", [m.act for m in B.normed_inputs()], n)  # type: ignore[attr-defined]
        products.product([B.router], xs[B.router.act], self.logits, n, ldy=e)
        route(self.logits, n, e, k, a.expert_weights_norm, live, self.ids, self.weights)
        pairs, gu = n * k, self.gu.reshape(-1)
        nt = self.group_tiles(pairs)
        if nt:
            group(self.ids, pairs, e, 8 * nt, self.starts, self.tiles, self.order, self.slot)
        for parts, row0 in runs([B.gate, B.up]):  # row0 counts the stacks' rows: an expert's are 1 / e of them
            x8 = xs[parts[0].act]
            if nt:
                xg = self.sorted_inputs[x8.act]  # type: ignore[union-attr]
                gather8(x8, self.order, self.starts[e:], k, pairs, xg)  # type: ignore[arg-type]
                products.grouped_expert_product(parts, e, xg, self.starts, self.tiles, pairs, nt, gu[row0 // e :], 2 * w)  # type: ignore[arg-type]
            else:
                products.expert_product(parts, e, x8, self.ids, pairs, k, gu[row0 // e :], 2 * w)
        self.gated(self.gu, w, pairs, self.ff, B.down.act)
        if nt:
            products.grouped_expert_product([B.down], e, self.ff, self.starts, self.tiles, pairs, nt, self.outs, d)  # type: ignore[arg-type]
        else:
            products.expert_product([B.down], e, self.ff, self.ids, pairs, 1, self.outs, d)
        shared = gate = None
        if self.shared is not None:
            shared, gate = self.run_shared(B, xs, n)
        norm = next_norm if fused_steps() else None  # (Inputs.norm_outputs: only a norm one launch takes)
        combine(self.outs, self.ids, self.weights, k, d, n, shared, gate, x, self.slot if nt else None, norm=norm)
        return norm is not None

    def group_tiles(self, pairs: int) -> int:
        """0 when a pass of `pairs` pairs takes the per-pair product, else the grouped product's n-tiles."""
        if not self.can_group or pairs < GROUPED_FROM * self.args.n_experts:
            return 0
        return products.group_tiles(pairs, self.args.n_experts)

    def run_shared(self, B: ExpertBlock, xs: dict[str, products.Input], n: int) -> tuple[cupy.ndarray, cupy.ndarray]:
        """qwen2moe's shared expert for n rows: (its output, its gate value) per row."""
        sgu, sff, sout, sgate = self.shared  # type: ignore[misc]
        s = self.args.shared_ffn_dim
        products.product([B.shared_gate], xs[B.shared_gate.act], sgate, n, ldy=1)  # type: ignore[list-item, union-attr]
        for parts, row0 in runs(B.shared_gate_up):  # type: ignore[arg-type]
            products.product(parts, xs[parts[0].act], sgu.reshape(-1)[row0:], n, ldy=2 * s)
        self.gated(sgu, s, n, sff, B.shared_down.act)  # type: ignore[union-attr]
        products.product([B.shared_down], sff, sout, n)  # type: ignore[list-item]
        return sout, sgate

    def gated(self, gu: cupy.ndarray, width: int, rows: int, out: products.Input, act: str) -> None:
        """out = the gated activation of rows [gate | up] of gu, rounded to `act` (its 8-bit form or floats)."""
        where = {"int8": out} if isinstance(out, Int8Act) else {"y": out}
        ops.glu_round(gu, width, rows, act, activation=self.args.arch_table.activation, **where)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- launches
def route(logits: cupy.ndarray, n: int, n_experts: int, k: int, normalize: bool, live: cupy.ndarray | None,
          ids: cupy.ndarray, weights: cupy.ndarray) -> None:
    """ids, weights (n * k) = the top k experts of each of n rows of router logits (n, n_experts),
    most probable first, and their (normalised) probabilities; rows with live 0: ids -1 (moe.cu)."""
    if n < 1:
        return
    threads = 128  # moe.cu ROUTE_THREADS: a block a row, its probabilities and picks in shared memory
    kernels.function("moe", "moe_route")((n,), (threads,),
                                         (logits, np.int32(n), np.int32(n_experts), np.int32(k), np.int32(normalize),
                                          device_ptr(live), ids, weights),
                                         shared_mem=4 * (n_experts + 2 * k))


def group(ids: cupy.ndarray, pairs: int, n_experts: int, tile: int, starts: cupy.ndarray, tiles: cupy.ndarray,
          order: cupy.ndarray, slot: cupy.ndarray) -> None:
    """The pairs sorted by expert (moe.cu moe_group): starts, tiles (of `tile` pairs) per expert and
    their totals at [n_experts], order (position -> pair), slot (pair -> position, -1 for none)."""
    if pairs < 1:
        return
    kernels.function("moe", "moe_group")((1,), (1024,), (ids, np.int32(pairs), np.int32(n_experts), np.int32(tile),
                                                        starts, tiles, order, slot), shared_mem=8 * n_experts)


def gather8(x: Int8Act, order: cupy.ndarray, count: cupy.ndarray, xdiv: int, pairs: int, out: Int8Act) -> None:
    """Row p < count[0] of out = row order[p] // xdiv of x (the 8-bit forms; moe.cu moe_gather8)."""
    group_size = 32 if x.act == "q8_0" else 256
    kernels.function("moe", "moe_gather8")((pairs,), (64,), (x.xq, x.xs, x.xsum, np.int32(x.n), np.int32(group_size),
                                                              order, count, np.int32(xdiv), out.xq, out.xs, out.xsum))


@dataclass
class NextNorm:
    """The next layer's input RMSNorm that a block's last launch can take over: its weight and where
    its outputs go (ops.NormOutputs)."""

    weight: cupy.ndarray
    eps: float
    outputs: ops.NormOutputs


def fused_steps() -> bool:
    """Whether the combination of a block of experts also writes the next layer's normalised input
    (moe_combine_norm); NVMEDIRECT_DECODE_FUSED=0 keeps the two launches apart (the same bits, for
    timing)."""
    return os.environ.get("NVMEDIRECT_DECODE_FUSED", "1") != "0"


def combine(outs: cupy.ndarray, ids: cupy.ndarray, weights: cupy.ndarray, k: int, dim: int, n: int,
            shared: cupy.ndarray | None, gate: cupy.ndarray | None, x: cupy.ndarray,
            slot: cupy.ndarray | None = None, norm: NextNorm | None = None) -> None:
    """x[r] += the weighted sum of row r's k expert outputs (+ the gated shared expert), r < n; pair
    j's output at row slot[j] of outs (slot None: row j) (moe.cu). With `norm`, x's rows normalised
    too, as ops.rmsnorm writes them (moe_combine_norm: a block a row)."""
    if n < 1:
        return
    if norm is not None:
        kernels.function("moe", "moe_combine_norm")((n,), (-(-dim // 256) * 32,),
                                                    (outs, ids, weights, np.int32(k), np.int32(dim), device_ptr(slot),
                                                     device_ptr(shared), device_ptr(gate), x, norm.weight,
                                                     np.float32(norm.eps), *norm.outputs.args()))
        return
    kernels.function("moe", "moe_combine")((grid_blocks(dim, 256), n), (256,),
                                           (outs, ids, weights, np.int32(k), np.int32(dim), device_ptr(slot),
                                            device_ptr(shared), device_ptr(gate), x))
