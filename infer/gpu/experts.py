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
A pair reads its expert's weights by itself: right for decode, batches and trees, where few rows
share an expert; a long prompt's rows re-read them per pair (grouping the prompt's rows by expert
is the next step). Expert stacks in a float format (f16, bf16, f32) have no such product: their
blocks stay with the CPU (infer.tiers.cpu_tier.CpuExperts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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

F32 = cupy.float32
ROUTE_MAX_K = 32  # moe.cu moe_route: a lane keeps each pick
MAX_PAIRS = 65535  # (row, slot) pairs of one pass: a launch's grid y
BUFFER_ROUNDING = 512  # CuPy's pool rounds each buffer up to this (a block's matrices are buffers of their own)
MATRICES_PER_BLOCK = 7  # at most: router, gate, up, down, and a shared expert's gate, gate/up and down
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


def _upload_block(model: GGUFModel, args: ModelArgs, i: int) -> ExpertBlock:
    def up(kind: str) -> GpuMatrix | None:
        name = tensor_name(i, kind)
        if name not in model.tensors:
            return None
        info = model.tensor(name)
        shape = tuple(int(d) for d in info.shape)
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        return ops.upload_stacked([(info.data, rows)], info.ggml_type, shape[-1])

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
    VRAM, for passes of up to `rows` rows."""

    def __init__(self, model: GGUFModel, args: ModelArgs, rows: int, layers: list[int] | None = None,
                 progress: Callable[[int], None] | None = None) -> None:
        """progress(blocks done): after each block's upload."""
        if rows * args.n_experts_used > MAX_PAIRS:
            raise ValueError(f"passes of {rows} rows route {rows * args.n_experts_used} (row, expert) pairs, more "
                             f"than a launch takes ({MAX_PAIRS}): lower the pass size")
        self.args, self.rows = args, rows
        self.blocks: dict[int, ExpertBlock] = {}
        for j, i in enumerate(range(args.n_layers) if layers is None else layers):
            self.blocks[i] = _upload_block(model, args, i)
            if progress is not None:
                progress(j + 1)
        if not self.blocks:
            raise ValueError("no block's experts to place on the GPU")
        b0 = next(iter(self.blocks.values()))
        k, w, d = args.n_experts_used, args.expert_ffn_dim, args.dim
        pairs = rows * k
        self.inputs = Inputs(args, rows, [("ffn", m.act, args.dim) for b in self.blocks.values()
                                          for m in b.normed_inputs()])
        self.logits = cupy.zeros((rows, args.n_experts), F32)
        self.ids = cupy.full(pairs, -1, cupy.int32)
        self.weights = cupy.zeros(pairs, F32)
        self.gu = cupy.zeros((pairs, 2 * w), F32)  # [gate | up] of each (row, slot) pair
        down_act = b0.down.act
        self.ff: products.Input = Int8Act.zeros(pairs, w, down_act) if down_act in EIGHT_BIT else \
            cupy.zeros((pairs, w), F32)
        self.outs = cupy.zeros((pairs, d), F32)
        self.shared = None
        if args.shared_ffn_dim:
            s = args.shared_ffn_dim
            act = b0.shared_down.act  # type: ignore[union-attr]
            self.shared = (cupy.zeros((rows, 2 * s), F32), Int8Act.zeros(rows, s, act) if act in EIGHT_BIT
                           else cupy.zeros((rows, s), F32), cupy.zeros((rows, d), F32), cupy.zeros(rows, F32))

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for b in self.blocks.values() for m in b.matrices())

    def formats(self) -> set[str]:
        return {m.fmt for b in self.blocks.values() for m in b.matrices()}

    def describe(self) -> str:
        """One line for the load report."""
        a, n = self.args, len(self.blocks)
        which = "every block's" if n == a.n_layers else f"the experts of {n} of {a.n_layers} blocks ({span(self.blocks)})"
        return (f"experts: {a.n_experts} per block, {a.n_experts_used} per token; {which} in VRAM, "
                f"{format_bytes(self.nbytes)} (routers, routed and shared experts), computed by the GPU")

    def run_ffn(self, model: object, i: int, shape: object) -> None:
        """Block i's feed-forward for the pass's rows: model.x in place (queued on the current stream)."""
        a, B = self.args, self.blocks[i]
        n, k, w, d, e = shape.rows, a.n_experts_used, a.expert_ffn_dim, a.dim, a.n_experts  # type: ignore[attr-defined]
        L = model.weights.layer(i)  # type: ignore[attr-defined]
        xs = self.inputs.normed(model.x, L.ffn_norm, "ffn", [m.act for m in B.normed_inputs()], n)  # type: ignore[attr-defined]
        products.product([B.router], xs[B.router.act], self.logits, n, ldy=e)
        route(self.logits, n, e, k, a.expert_weights_norm, model.index.d["live"], self.ids, self.weights)  # type: ignore[attr-defined]
        pairs, gu = n * k, self.gu.reshape(-1)
        for parts, row0 in runs([B.gate, B.up]):  # row0 counts the stacks' rows: an expert's are 1 / e of them
            products.expert_product(parts, e, xs[parts[0].act], self.ids, pairs, k, gu[row0 // e :], 2 * w)
        self._glu(self.gu, w, pairs, self.ff, B.down.act)
        products.expert_product([B.down], e, self.ff, self.ids, pairs, 1, self.outs, d)
        shared = gate = None
        if self.shared is not None:
            shared, gate = self._shared(B, xs, n)
        combine(self.outs, self.ids, self.weights, k, d, n, shared, gate, model.x)  # type: ignore[attr-defined]

    def _shared(self, B: ExpertBlock, xs: dict[str, products.Input], n: int) -> tuple[cupy.ndarray, cupy.ndarray]:
        """qwen2moe's shared expert for n rows: (its output, its gate value) per row."""
        sgu, sff, sout, sgate = self.shared  # type: ignore[misc]
        s = self.args.shared_ffn_dim
        products.product([B.shared_gate], xs[B.shared_gate.act], sgate, n, ldy=1)  # type: ignore[list-item, union-attr]
        for parts, row0 in runs(B.shared_gate_up):  # type: ignore[arg-type]
            products.product(parts, xs[parts[0].act], sgu.reshape(-1)[row0:], n, ldy=2 * s)
        self._glu(sgu, s, n, sff, B.shared_down.act)  # type: ignore[union-attr]
        products.product([B.shared_down], sff, sout, n)  # type: ignore[list-item]
        return sout, sgate

    def _glu(self, gu: cupy.ndarray, width: int, rows: int, out: products.Input, act: str) -> None:
        """out = the gated activation of rows [gate | up] of gu, rounded to `act` (its 8-bit form or floats)."""
        where = {"int8": out} if isinstance(out, Int8Act) else {"y": out}
        ops.glu_round(gu, width, rows, act, activation=self.args.arch_table.activation, **where)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- launches
def route(logits: cupy.ndarray, n: int, n_experts: int, k: int, normalize: bool, live: cupy.ndarray | None,
          ids: cupy.ndarray, weights: cupy.ndarray) -> None:
    """ids, weights (n * k) = the top k experts of each of n rows of router logits (n, n_experts),
    most probable first, and their (normalised) probabilities; rows with live 0: ids -1 (moe.cu)."""
    rows_a_block = 4  # moe.cu ROUTE_ROWS: a warp a row, a row's probabilities in shared memory
    kernels.function("moe", "moe_route")((grid_blocks(n, rows_a_block),), (32 * rows_a_block,),
                                         (logits, np.int32(n), np.int32(n_experts), np.int32(k), np.int32(normalize),
                                          device_ptr(live), ids, weights),
                                         shared_mem=rows_a_block * n_experts * 4)


def combine(outs: cupy.ndarray, ids: cupy.ndarray, weights: cupy.ndarray, k: int, dim: int, n: int,
            shared: cupy.ndarray | None, gate: cupy.ndarray | None, x: cupy.ndarray) -> None:
    """x[r] += the weighted sum of row r's k expert outputs (+ the gated shared expert), r < n (moe.cu)."""
    if n < 1:
        return
    kernels.function("moe", "moe_combine")((grid_blocks(dim, 256), n), (256,),
                                           (outs, ids, weights, np.int32(k), np.int32(dim), device_ptr(shared),
                                            device_ptr(gate), x))
