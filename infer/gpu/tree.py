"""Verification of a token tree with the decode step's own numbers.

A tree's nodes go through each layer together (the layer's weights are read, or streamed, once),
but every kernel is the decode kernel launched for all nodes at once: the GEMVs take one input
vector per node (grid y), the attention kernels one query per node (grid z) over that node's span
(the cache, then its ancestors' slots from the root: ops.TreeSpans). Each node therefore gets, bit
for bit, the logits the plain decode step computes at its position after its path, so speculative
greedy decoding emits exactly the tokens plain decoding emits (the float16 cuBLAS pass of many rows,
GpuTransformer._rows_pass, rounds differently and would part from it at near ties).

Memory stays inside the activation plan of a pass of as many rows (infer.tiers.budget
activation_nbytes): no matrix is dequantized to float16 (the plan's two largest-matrix scratches
are free), the attention work buffers are taken for TREE_ATTENTION_BYTES of nodes at a time, and
the logits of all nodes stay on the device only when they fit in the logits block plus those
scratches; otherwise they come to the host block by block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import cupy
import numpy as np

from infer.gpu import ops
from infer.gpu.activations import RoundedInputs
from infer.model import check_batch
from infer.tiers.budget import ATTENTION_SCORES_BYTES, LOGITS_ROWS, attention_work_nbytes

if TYPE_CHECKING:
    from infer.gpu.model import GpuKVCache, GpuTransformer

F32 = cupy.float32
TREE_ATTENTION_BYTES = 4 * ATTENTION_SCORES_BYTES  # the plan's attention allowance for a pass of many rows


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
    a, n = model.args, len(tokens)
    with model.stream:
        spans, positions = ops.tree_spans(parents, cache.length)
        pos = cupy.asarray(positions)
        slots = cupy.arange(cache.length, cache.length + n, dtype=cupy.int32)
        x = cupy.empty((n, a.dim), F32)
        ops.embed(model.token_embd, cupy.asarray(tokens.astype(np.int32)), n, x)
        inputs = RoundedInputs(a, model.int8_dot, n)
        for i in range(a.n_layers):
            inputs.plan_layer(model.weights.formats(i))
        chunk = max(1, min(n, TREE_ATTENTION_BYTES // attention_work_nbytes(a, cache.max_tokens)))
        work = ops.attention_work(a.n_heads, a.head_dim, cache.max_tokens, chunk)
        for i in range(a.n_layers):
            if i not in model.skip:
                _layer(model, i, inputs, x, cache, spans, pos, slots, chunk, work)
        del work
        logits = _head(model, x, n)
    model.stream.synchronize()
    return TreeLogits(logits, model.stream)


def _layer(model: GpuTransformer, i: int, inputs: RoundedInputs, x: cupy.ndarray, cache: GpuKVCache,
           spans: ops.TreeSpans, pos: cupy.ndarray, slots: cupy.ndarray, chunk: int, work: tuple) -> None:
    """GpuTransformer._decode_layer for every node at once (the same kernels, a vector per node)."""
    a, L, n = model.args, model.weights.layer(i), x.shape[0]
    width = a.q_dim + 2 * a.kv_dim
    qkv = cupy.empty((n, width), F32)
    xs = inputs.normed(x, L.attn_norm, "attn", [m.act for m, _ in L.qkv])
    flat = qkv.reshape(-1)
    for m, row in L.qkv:
        inputs.gemv(m, "attn", xs[m.act], flat[row:], bias=None if L.bqkv is None else L.bqkv[row : row + m.rows],
                    ldy=width)
    q = cupy.ascontiguousarray(qkv[:, : a.q_dim])
    k = cupy.ascontiguousarray(qkv[:, a.q_dim : a.q_dim + a.kv_dim])
    v = cupy.ascontiguousarray(qkv[:, a.q_dim + a.kv_dim :])
    del qkv
    cos, sin = model._rope_tables
    # keys and values of every node into its slot; q rotated in place (the decode kernels' rotation)
    ops.rope_store(q, k, v, cos, sin, pos, n, a.n_heads, a.n_kv_heads, a.head_dim, model.rope.n_pairs, a.rope_neox,
                   cache.keys[i], cache.values[i], cache.max_tokens, slots=slots)
    del k, v
    att = cupy.empty((n, a.q_dim), F32)
    att8 = inputs.int8_of("att", L.wo.act) if L.wo.fmt in ops.INT8_FORMATS else None
    for c0 in range(0, n, chunk):
        c1 = min(n, c0 + chunk)
        part = ops.TreeSpans(spans.anc[c0:c1], spans.stride, spans.base, c1 - c0)
        ops.attention_decode(q[c0:c1], cache.keys[i], cache.values[i], pos[c0:c1], a.n_heads, a.n_kv_heads,
                             a.head_dim, cache.max_tokens, cache.n_splits, *work, att[c0:c1], act=L.wo.act,
                             int8=ops.int8_rows(att8, a.q_dim, L.wo.act, c0, c1), tree=part)
    del q
    inputs.gemv(L.wo, "att", att, x, residual=x, ldy=a.dim)
    del att
    xs = inputs.normed(x, L.ffn_norm, "ffn", [L.w_gate.act, L.w_up.act])
    ff = cupy.empty((n, a.ffn_dim), F32)
    if L.w_gate.fmt == L.w_up.fmt and L.w_gate.act == L.w_up.act:
        int8 = inputs.int8_of("ffn", L.w_gate.act) if L.w_gate.fmt in ops.INT8_FORMATS else None
        if int8 is not None:
            ops.gemv8_swiglu(L.w_gate, L.w_up, int8, ff, vectors=n)
        else:
            ops.gemv_swiglu(L.w_gate, L.w_up, xs[L.w_gate.act], ff, vectors=n)
    else:
        gate, up = cupy.empty((n, a.ffn_dim), F32), cupy.empty((n, a.ffn_dim), F32)
        inputs.gemv(L.w_gate, "ffn", xs[L.w_gate.act], gate)
        inputs.gemv(L.w_up, "ffn", xs[L.w_up.act], up)
        ops.swiglu(gate, up, ff, n * a.ffn_dim)
        del gate, up
    inputs.gemv(L.w_down, "ff", inputs.rounded(ff, "ff", L.w_down.act), x, residual=x, ldy=a.dim)


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
