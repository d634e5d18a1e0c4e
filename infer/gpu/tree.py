"""Verification of a token tree with the decode step's own numbers.

A tree's nodes go through each layer together (the layer's weights are read, or streamed, once),
but every kernel is the decode kernel launched for all nodes at once: the GEMVs take one input
vector per node (grid y), the attention kernels one query per node (grid z) over that node's span
(the cache, then its ancestors' slots from the root: ops.TreeSpans). Each node therefore gets, bit
for bit, the logits the plain decode step computes at its position after its path, so speculative
greedy decoding emits exactly the tokens plain decoding emits (the float16 cuBLAS pass of many rows,
GpuTransformer._rows_pass, rounds differently and would part from it at near ties).

The host must not pace the pass: a Python launch costs more than most of these kernels run. A
`TreeRunner` keeps every buffer of a pass (trees of up to its capacity), so the runs of resident
layers are captured once per tree size as CUDA graphs (in the cache's graph table, as the decode
step's are) and replayed; the tree's tokens, positions and ancestor slots are copied into its index
in one transfer, and the attention kernels read the cache length from there. A streamed layer's
matrices are copied and repacked eagerly into its fixed scratch, then its kernels replay a graph
of their own (captured again if the scratch moved). Its buffers are bounded by
infer.tiers.budget.tree_buffers_nbytes (planned with the draft); no matrix is dequantized to float16,
and the logits of all nodes stay on the device only when they fit in the logits block plus the
plan's float16 scratches, else they come to the host block by block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import cupy
import numpy as np

from infer.gpu import ops
from infer.gpu.activations import RoundedInputs
from infer.model import check_batch
from infer.sampler import argmax_rows
from infer.tiers.budget import LOGITS_ROWS, tree_attention_nodes

if TYPE_CHECKING:
    from infer.gpu.model import GpuKVCache, GpuTransformer
    from infer.gpu.weights import GpuLayer

F32 = cupy.float32
CAPACITY_STEP = 16  # a runner grows to the next multiple of this many nodes


class TreeLogits:
    """The logits of a tree's nodes, fetched row by row (a walk down the tree reads a few rows of
    the hundreds verified). Rows on the device, or already on the host for very large trees."""

    def __init__(self, rows: cupy.ndarray | np.ndarray, stream: cupy.cuda.Stream) -> None:
        self.rows, self.stream = rows, stream

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.rows.shape)

    def __getitem__(self, node: int) -> np.ndarray:
        if isinstance(self.rows, np.ndarray):
            return self.rows[node]
        out = cupy.asnumpy(self.rows[node], stream=self.stream)
        self.stream.synchronize()
        return out

    def row_argmax(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, maxima, nonfinite) of every row: its arg-max as the decode step's sampler picks it
        (ties to the lowest id, NaN never chosen), that value, and its count of NaN and +inf. On the
        device one kernel and one small copy: a greedy walk reads these, not the rows it visits."""
        if isinstance(self.rows, np.ndarray):
            return argmax_rows(self.rows)
        n, vocab = self.rows.shape
        with self.stream:
            out = cupy.empty(3 * n, cupy.int32)  # ids, maxima (as float32 bits), nonfinite counts
            ops.argmax_rows(self.rows, n, vocab, out[:n], out[n : 2 * n].view(F32), out[2 * n :])
            host = cupy.asnumpy(out, stream=self.stream)
        self.stream.synchronize()
        return host[:n].astype(np.int64), host[n : 2 * n].view(np.float32), host[2 * n :]

    def to_host(self) -> np.ndarray:
        if isinstance(self.rows, np.ndarray):
            return self.rows
        out = cupy.asnumpy(self.rows, stream=self.stream)
        self.stream.synchronize()
        return out


def verify_tree(model: GpuTransformer, tokens: np.ndarray, parents: np.ndarray, cache: GpuKVCache) -> TreeLogits:
    """Logits of every node of a token tree (node i in cache slot cache.length + i, root's parent
    -1, parents[i] < i); cache.length stays, cache.accept keeps a path."""
    tokens, parents = np.asarray(tokens, dtype=np.int64).reshape(-1), np.asarray(parents, dtype=np.int64)
    check_batch([(tokens, cache)], model.args.vocab_size)
    if len(parents) != len(tokens) or parents[0] != -1 or (parents[1:] >= np.arange(1, len(parents))).any() \
            or (parents[1:] < 0).any():
        raise ValueError("a token tree needs parents[0] == -1 and 0 <= parents[i] < i")
    return model.tree_runner(len(tokens), cache.max_tokens).verify(tokens, parents, cache)


class TreeRunner:
    """The buffers of verification passes of trees of up to `capacity` nodes over caches of
    `max_tokens` positions, and the passes themselves (resident layer runs as CUDA graphs)."""

    def __init__(self, model: GpuTransformer, capacity: int, max_tokens: int, generation: int) -> None:
        a = model.args
        self.model, self.capacity, self.max_tokens, self.generation = model, capacity, max_tokens, generation
        self.int8_dot = model.int8_dot
        width = a.q_dim + 2 * a.kv_dim
        with model.stream:
            self.x = cupy.zeros((capacity, a.dim), F32)
            self.qkv = cupy.zeros((capacity, width), F32)
            self.q = cupy.zeros((capacity, a.q_dim), F32)
            self.k = cupy.zeros((capacity, a.kv_dim), F32)
            self.v = cupy.zeros((capacity, a.kv_dim), F32)
            self.att = cupy.zeros((capacity, a.q_dim), F32)
            self.ff = cupy.zeros((capacity, a.ffn_dim), F32)
            self.gate_up: tuple[cupy.ndarray, cupy.ndarray] | None = None  # only for layers of mixed formats
            if any(f["ffn_gate"].fmt != f["ffn_up"].fmt or f["ffn_gate"].act != f["ffn_up"].act
                   for f in (model.weights.formats(i) for i in range(a.n_layers))):
                self.gate_up = (cupy.zeros((capacity, a.ffn_dim), F32), cupy.zeros((capacity, a.ffn_dim), F32))
            self.inputs = RoundedInputs(a, model.int8_dot, capacity)
            for i in range(a.n_layers):
                self.inputs.plan_layer(model.weights.formats(i))
            # the tree's index, one host-to-device copy a pass: tokens, positions, slots, then a row
            # of `capacity` ancestor slots per node (root first; row[0] is the cache length)
            self.index = cupy.zeros(3 * capacity + capacity * capacity, cupy.int32)
            self.ids = self.index[:capacity]
            self.pos = self.index[capacity : 2 * capacity]
            self.slots = self.index[2 * capacity : 3 * capacity]
            self.anc = self.index[3 * capacity :]
            self.chunk = tree_attention_nodes(a, max_tokens, capacity)
            self.work = ops.attention_work(a.n_heads, a.head_dim, max_tokens, self.chunk)
        model.stream.synchronize()
        # the decode step's segments without the embedding and the head: resident runs and streamed layers
        self.segments = [(capturable, [i for i in items if i >= 0]) for capturable, items in model._segments]
        self.segments = [(c, items) for c, items in self.segments if items]

    @property
    def nbytes(self) -> int:
        arrays = [self.x, self.qkv, self.q, self.k, self.v, self.att, self.ff, self.index, *self.work,
                  *(self.gate_up or ()), *self.inputs.buffers.values(), *(b for f in self.inputs.int8.values() for b in f)]
        return sum(int(b.nbytes) for b in arrays)

    def _set_index(self, tokens: np.ndarray, parents: np.ndarray, base: int) -> None:
        n, cap = len(tokens), self.capacity
        anc, positions = ops.tree_ancestors(parents, base, stride=cap)
        host = np.zeros(3 * cap + n * cap, np.int32)
        host[:n] = tokens
        host[cap : cap + n] = positions
        host[2 * cap : 2 * cap + n] = base + np.arange(n)
        host[3 * cap :] = anc.reshape(-1)
        self.index[: host.size].set(host, stream=self.model.stream)

    def verify(self, tokens: np.ndarray, parents: np.ndarray, cache: GpuKVCache) -> TreeLogits:
        model, n = self.model, len(tokens)
        with model.stream:
            self._set_index(tokens, parents, cache.length)
            ops.embed(model.token_embd, self.ids, n, self.x)
            for s, (resident, layers) in enumerate(self.segments):
                if resident:
                    self._replay(cache, ("tree", self.generation, s, n, self.int8_dot), None,
                                 lambda layers=layers: [self._layer(i, n, cache, model.weights.layer(i)) for i in layers])
                    continue
                for i in layers:  # streamed: its matrices copied and repacked now, its kernels replayed
                    L = model.weights.layer(i)
                    self._replay(cache, ("tree", self.generation, "layer", i, n, self.int8_dot), _addresses(L),
                                 lambda i=i, L=L: self._layer(i, n, cache, L))
            logits = _head(model, self.x[:n], n)
        model.stream.synchronize()
        return TreeLogits(logits, model.stream)

    def _replay(self, cache: GpuKVCache, key: tuple, addresses: tuple | None, launches: Callable[[], object]) -> None:
        """Replays the graph of `launches` kept in the cache under `key`, captured first if missing
        or if the weights it reads have moved (`addresses`: a streamed layer's scratch)."""
        stream = self.model.stream
        kept = cache.graphs.get(key)
        if kept is None or kept[1] != addresses:
            stream.begin_capture()
            try:
                launches()
            finally:
                graph = stream.end_capture()
            kept = cache.graphs[key] = (graph, addresses)
        kept[0].launch(stream)  # type: ignore[attr-defined]

    def _layer(self, i: int, n: int, cache: GpuKVCache, L: GpuLayer) -> None:
        """GpuTransformer._decode_layer for the first n nodes at once (the same kernels, a vector per
        node), on the runner's buffers only: nothing is allocated, so it may be captured."""
        model, inputs = self.model, self.inputs
        a = model.args
        x = self.x[:n]
        width = a.q_dim + 2 * a.kv_dim
        xs = inputs.normed(x, L.attn_norm, "attn", [m.act for m, _ in L.qkv], rows=n)
        flat = self.qkv.reshape(-1)
        for m, row in L.qkv:
            inputs.gemv(m, "attn", xs[m.act], flat[row:], bias=None if L.bqkv is None else L.bqkv[row : row + m.rows],
                        rows=n, ldy=width)
        q, k, v = self.q[:n], self.k[:n], self.v[:n]
        q[...] = self.qkv[:n, : a.q_dim]
        k[...] = self.qkv[:n, a.q_dim : a.q_dim + a.kv_dim]
        v[...] = self.qkv[:n, a.q_dim + a.kv_dim :]
        cos, sin = model._rope_tables
        # keys and values of every node into its slot; q rotated in place (the decode kernels' rotation)
        ops.rope_store(q, k, v, cos, sin, self.pos, n, a.n_heads, a.n_kv_heads, a.head_dim, model.rope.n_pairs,
                       a.rope_neox, cache.keys[i], cache.values[i], cache.max_tokens, slots=self.slots)
        att = self.att[:n]
        att8 = inputs.int8_of("att", L.wo.act) if L.wo.fmt in ops.INT8_FORMATS else None
        cap = self.capacity
        for c0 in range(0, n, self.chunk):
            c1 = min(n, c0 + self.chunk)
            part = ops.TreeSpans(self.anc[c0 * cap : c1 * cap], cap, cache.length, c1 - c0)
            ops.attention_decode(q[c0:c1], cache.keys[i], cache.values[i], self.pos[c0:c1], a.n_heads, a.n_kv_heads,
                                 a.head_dim, cache.max_tokens, cache.n_splits, *self.work, att[c0:c1], act=L.wo.act,
                                 int8=ops.int8_rows(att8, a.q_dim, L.wo.act, c0, c1), tree=part)
        inputs.gemv(L.wo, "att", att, x, residual=x, rows=n, ldy=a.dim)
        xs = inputs.normed(x, L.ffn_norm, "ffn", [L.w_gate.act, L.w_up.act], rows=n)
        ff = self.ff[:n]
        if L.w_gate.fmt == L.w_up.fmt and L.w_gate.act == L.w_up.act:
            int8 = inputs.int8_of("ffn", L.w_gate.act) if L.w_gate.fmt in ops.INT8_FORMATS else None
            if int8 is not None:
                ops.gemv8_swiglu(L.w_gate, L.w_up, int8, ff, vectors=n)
            else:
                ops.gemv_swiglu(L.w_gate, L.w_up, xs[L.w_gate.act], ff, vectors=n)
        else:
            assert self.gate_up is not None
            gate, up = self.gate_up[0][:n], self.gate_up[1][:n]
            inputs.gemv(L.w_gate, "ffn", xs[L.w_gate.act], gate, rows=n)
            inputs.gemv(L.w_up, "ffn", xs[L.w_up.act], up, rows=n)
            ops.swiglu(gate, up, ff, n * a.ffn_dim)
        inputs.gemv(L.w_down, "ff", inputs.rounded(ff, "ff", L.w_down.act, rows=n), x, residual=x, rows=n, ldy=a.dim)


def _addresses(L: GpuLayer) -> tuple[int, ...]:
    """The device addresses of a layer's matrices and vectors (what a captured graph reads)."""
    arrays = [L.attn_norm, L.ffn_norm, L.bqkv, *(m.buffer for m, _ in L.qkv),
              *(m.buffer for m in (L.wo, L.w_gate, L.w_up, L.w_down))]
    return tuple(0 if b is None else int(b.data.ptr) for b in arrays)


def _head(model: GpuTransformer, x: cupy.ndarray, n: int) -> cupy.ndarray | np.ndarray:
    """The final norm and output GEMV per node (the decode step's kernels), LOGITS_ROWS at a time."""
    a = model.args
    block = min(n, LOGITS_ROWS)
    inputs = RoundedInputs(a, model.int8_dot, block)
    inputs.plan("out", [model.output.act], a.dim)
    spare = 4 * LOGITS_ROWS * a.vocab_size + 2 * a.largest_matrix  # the planned logits block + float16 scratch
    on_device = 4 * n * a.vocab_size <= spare
    out: cupy.ndarray | np.ndarray = cupy.empty((n, a.vocab_size), F32) if on_device else \
        np.empty((n, a.vocab_size), np.float32)
    staging = None if on_device else cupy.empty((block, a.vocab_size), F32)
    for r0 in range(0, n, block):
        r1 = min(n, r0 + block)
        xs = inputs.normed(x[r0:r1], model.weights.output_norm, "out", [model.output.act], rows=r1 - r0)
        target = out[r0:r1] if on_device else staging
        inputs.gemv(model.output, "out", xs[model.output.act], target, rows=r1 - r0, ldy=a.vocab_size)
        if not on_device:
            out[r0:r1] = cupy.asnumpy(staging[: r1 - r0], stream=model.stream)
    return out
