"""The forward pass over streamed GPU weights, for a batch of sequences in one pass.

Each layer's weights are requested once per pass from GpuStreamingWeights (resident matrices, or
streamed ones repacked into the layer scratch) and applied to every row in flight:
- one row in total (single-sequence decode): the quantized GEMV kernels, float32 activations;
- more rows (a prompt chunk, or one token of each of many sequences): each matrix dequantized once
  to float16 and multiplied with cuBLAS for all rows together.
Attention is per sequence over its own float16 KV cache (the decode kernel for a single new token,
matrix products with a causal mask for a chunk). Everything is queued on one compute stream; the
only host synchronisation of a pass is fetching its logits at the end.

Kernels come from infer.gpu.ops (the GPU backend); this module only sequences them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import cupy
import numpy as np

from infer.gpu import ops
from infer.gpu.ops import GpuMatrix
from infer.model import ModelArgs, Rope
from infer.tiers.pipeline import GpuStreamingWeights

ATTN_CHUNK = 256  # positions per split of the decode attention kernel (ops.cu's ATTN_CHUNK)


@dataclass
class StreamKVCache:
    """One sequence's float16 keys and values, (n_layers, n_kv_heads, max_tokens, head_dim)."""

    keys: cupy.ndarray
    values: cupy.ndarray
    max_tokens: int
    n_splits: int
    part_o: cupy.ndarray  # decode attention's per-split partial outputs
    part_ml: cupy.ndarray
    length: int = 0


class GpuStreamingModel:
    """new_cache(max_tokens), forward(tokens, cache, all_logits) and forward_batch(...) over
    streamed weights; logits come back as NumPy float32."""

    def __init__(self, args: ModelArgs, weights: GpuStreamingWeights, ctx_size: int) -> None:
        self.args = args
        self.weights = weights
        model = weights.model
        factors = model.tensor("rope_freqs.weight").dequantize() if "rope_freqs.weight" in model.tensors else None
        self.rope = Rope(args, factors)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        cos, sin = self.rope.angles(np.arange(ctx_size))
        with self.stream:
            self.cos, self.sin = cupy.asarray(cos.astype(np.float32)), cupy.asarray(sin.astype(np.float32))
            self.token_embd: GpuMatrix = weights.global_tensor("token_embd.weight")
            tied = "output.weight" not in model.tensors
            self.output: GpuMatrix = self.token_embd if tied else weights.global_tensor("output.weight")
            self.output_norm = weights.global_tensor("output_norm.weight")
            biggest = max(int(np.prod(t.shape)) for t in weights.plan.tensors if t.layer is not None)
            self.half = cupy.empty(biggest, cupy.float16)  # one matrix dequantized for a batched product
        self.stream.synchronize()

    def new_cache(self, max_tokens: int) -> StreamKVCache:
        a = self.args
        if max_tokens > self.cos.shape[0]:
            raise ValueError(f"cache of {max_tokens} positions exceeds the context size {self.cos.shape[0]}")
        n_splits = -(-max_tokens // ATTN_CHUNK)
        shape = (a.n_layers, a.n_kv_heads, max_tokens, a.head_dim)
        with self.stream:
            cache = StreamKVCache(cupy.zeros(shape, cupy.float16), cupy.zeros(shape, cupy.float16), max_tokens,
                                  n_splits, cupy.zeros(a.n_heads * n_splits * a.head_dim, cupy.float32),
                                  cupy.zeros(a.n_heads * n_splits * 2, cupy.float32))
        self.stream.synchronize()
        return cache

    def forward(self, tokens: np.ndarray, cache: StreamKVCache, all_logits: bool = False) -> np.ndarray:
        return self.forward_batch([(np.asarray(tokens), cache)], all_logits)[0]

    # ------------------------------------------------------------------ one pass
    def forward_batch(self, batch: Sequence[tuple[np.ndarray, StreamKVCache]],
                      all_logits: bool = False) -> list[np.ndarray]:
        a = self.args
        sizes = [len(t) for t, _ in batch]
        for (tokens, cache), n in zip(batch, sizes, strict=True):
            if n == 0 or cache.length + n > cache.max_tokens:
                raise ValueError(f"{n} tokens do not fit a cache holding {cache.length} of {cache.max_tokens}")
            if np.min(tokens) < 0 or np.max(tokens) >= a.vocab_size:
                raise ValueError(f"token id outside the vocabulary of {a.vocab_size}")
        bounds = np.cumsum([0, *sizes]).tolist()
        rows = bounds[-1]
        with self.stream:
            ids = cupy.asarray(np.concatenate([np.asarray(t, np.int64) for t, _ in batch]).astype(np.int32))
            positions = [cupy.arange(c.length, c.length + n, dtype=cupy.int32)
                         for (_, c), n in zip(batch, sizes, strict=True)]
            x = cupy.empty((rows, a.dim), cupy.float32)
            ops.embed(self.token_embd, ids, rows, x)
            for i in range(a.n_layers):
                self._layer(i, self.weights.layer(i), x, batch, bounds, positions)
            for (_, cache), n in zip(batch, sizes, strict=True):
                cache.length += n
            picked = list(range(rows)) if all_logits else [b - 1 for b in bounds[1:]]
            logits = cupy.empty((len(picked), a.vocab_size), cupy.float32)
            xn = cupy.empty(a.dim, cupy.float32)
            for j, r in enumerate(picked):
                ops.rmsnorm(x[r], self.output_norm, a.norm_eps, 1, a.dim, y=xn)
                ops.gemv(self.output, xn, logits[j])
            host = cupy.asnumpy(logits, stream=self.stream)
        self.stream.synchronize()
        if all_logits:
            return [host[bounds[s]:bounds[s + 1]] for s in range(len(batch))]
        return [host[s] for s in range(len(batch))]

    def _half_weights(self, m: GpuMatrix) -> cupy.ndarray:
        half = m.as_half()
        if half is not None:
            return half
        out = self.half[: m.rows * m.cols]
        ops.dequantize(m, out)
        return out.reshape(m.rows, m.cols)

    def _mm(self, x16: cupy.ndarray, m: GpuMatrix, out: cupy.ndarray | None = None,
            accumulate: bool = False) -> cupy.ndarray:
        """(R, cols) float16 @ W.T -> (R, rows) float32, into `out` (added to it with accumulate)."""
        target = cupy.empty((x16.shape[0], m.rows), cupy.float32) if out is None else out
        ops.matmul_f16(x16, self._half_weights(m), target, accumulate=accumulate)
        return target

    def _layer(self, i: int, L: dict, x: cupy.ndarray, batch: Sequence[tuple[np.ndarray, StreamKVCache]],
               bounds: list[int], positions: list[cupy.ndarray]) -> None:
        a, rows = self.args, x.shape[0]
        single = rows == 1
        xn = cupy.empty((rows, a.dim), cupy.float32)
        xn16 = None if single else cupy.empty((rows, a.dim), cupy.float16)
        ops.rmsnorm(x, L["attn_norm"], a.norm_eps, rows, a.dim, y=xn, y16=xn16)
        q = cupy.empty((rows, a.q_dim), cupy.float32)
        k = cupy.empty((rows, a.kv_dim), cupy.float32)
        v = cupy.empty((rows, a.kv_dim), cupy.float32)
        for name, out in (("attn_q", q), ("attn_k", k), ("attn_v", v)):
            bias = L.get(name + ".bias")
            if single:
                ops.gemv(L[name], xn[0], out[0], bias=bias)
            else:
                self._mm(xn16, L[name], out=out)
                if bias is not None:
                    out += bias
        att = cupy.empty((rows, a.q_dim), cupy.float32)
        for s, (_, cache) in enumerate(batch):
            r0, r1 = bounds[s], bounds[s + 1]
            self._attention(i, q[r0:r1], k[r0:r1], v[r0:r1], cache, positions[s], att[r0:r1])
        if single:
            ops.gemv(L["attn_output"], att[0], x[0], residual=x[0])
        else:
            self._mm(att.astype(cupy.float16), L["attn_output"], out=x, accumulate=True)
        ops.rmsnorm(x, L["ffn_norm"], a.norm_eps, rows, a.dim, y=xn, y16=xn16)
        gate, up = L["ffn_gate"], L["ffn_up"]
        if single:
            ff = cupy.empty(a.ffn_dim, cupy.float32)
            if gate.fmt == up.fmt:
                ops.gemv_swiglu(gate, up, xn[0], ff)
            else:
                g, u = cupy.empty(a.ffn_dim, cupy.float32), cupy.empty(a.ffn_dim, cupy.float32)
                ops.gemv(gate, xn[0], g)
                ops.gemv(up, xn[0], u)
                ops.swiglu(g, u, ff, a.ffn_dim)
            ops.gemv(L["ffn_down"], ff, x[0], residual=x[0])
        else:
            g, u = self._mm(xn16, gate), self._mm(xn16, up)
            act = (g / (1.0 + cupy.exp(-g)) * u).astype(cupy.float16)
            self._mm(act, L["ffn_down"], out=x, accumulate=True)

    def _attention(self, i: int, q: cupy.ndarray, k: cupy.ndarray, v: cupy.ndarray, cache: StreamKVCache,
                   pos: cupy.ndarray, out: cupy.ndarray) -> None:
        a, n, start = self.args, q.shape[0], cache.length
        ops.rope_store(q, k, v, self.cos, self.sin, pos, n, a.n_heads, a.n_kv_heads, a.head_dim, self.rope.n_pairs,
                       a.rope_neox, cache.keys[i], cache.values[i], cache.max_tokens)
        if n == 1:
            ops.attention_decode(q[0], cache.keys[i], cache.values[i], pos, a.n_heads, a.n_kv_heads, a.head_dim,
                                 cache.max_tokens, cache.n_splits, cache.part_o, cache.part_ml, out[0])
            return
        end, group = start + n, a.n_heads // a.n_kv_heads
        keys = cache.keys[i, :, :end].astype(cupy.float32)  # (kv, S, hd)
        values = cache.values[i, :, :end].astype(cupy.float32)
        qg = q.astype(cupy.float16).astype(cupy.float32).reshape(n, a.n_kv_heads, group, a.head_dim)
        qg = qg.transpose(1, 2, 0, 3).reshape(a.n_kv_heads, group * n, a.head_dim)
        scores = cupy.matmul(qg, keys.transpose(0, 2, 1)) * np.float32(1.0 / np.sqrt(a.head_dim))
        scores = scores.reshape(a.n_kv_heads, group, n, end)
        future = cupy.arange(end)[None, :] > cupy.arange(start, end)[:, None]  # (T, S) causal mask
        scores = cupy.where(future, np.float32(-np.inf), scores)
        scores -= scores.max(axis=-1, keepdims=True)
        probs = cupy.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        o = cupy.matmul(probs.astype(cupy.float16).astype(cupy.float32).reshape(a.n_kv_heads, group * n, end), values)
        out[...] = o.reshape(a.n_kv_heads, group, n, a.head_dim).transpose(2, 0, 1, 3).reshape(n, a.q_dim)

