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

F32, F16 = cupy.float32, cupy.float16


@dataclass
class StreamKVCache:
    """One sequence's float16 keys and values, (n_layers, n_kv_heads, max_tokens, head_dim)."""

    keys: cupy.ndarray
    values: cupy.ndarray
    max_tokens: int
    n_splits: int
    scores: cupy.ndarray  # decode attention work buffers
    part_o: cupy.ndarray
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
            self.half = cupy.empty(biggest, F16)  # one matrix dequantized for a batched product
        self.stream.synchronize()

    def new_cache(self, max_tokens: int) -> StreamKVCache:
        a = self.args
        if max_tokens > self.cos.shape[0]:
            raise ValueError(f"cache of {max_tokens} positions exceeds the context size {self.cos.shape[0]}")
        n_splits = ops.attention_splits(max_tokens)  # the kernels' own split size, not a copy of it
        shape = (a.n_layers, a.n_kv_heads, max_tokens, a.head_dim)
        with self.stream:
            cache = StreamKVCache(cupy.zeros(shape, F16), cupy.zeros(shape, F16), max_tokens, n_splits,
                                  *ops.attention_work(a.n_heads, a.head_dim, max_tokens))
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
            x = cupy.empty((rows, a.dim), F32)
            ops.embed(self.token_embd, ids, rows, x)
            for i in range(a.n_layers):
                self._layer(i, self.weights.layer(i), x, batch, bounds, positions)
            for (_, cache), n in zip(batch, sizes, strict=True):
                cache.length += n
            picked = list(range(rows)) if all_logits else [b - 1 for b in bounds[1:]]
            logits = cupy.empty((len(picked), a.vocab_size), F32)
            for j, r in enumerate(picked):
                xs = self._normed(x[r], self.output_norm, [self.output.act], 1)
                ops.gemv(self.output, xs[self.output.act], logits[j])
            host = cupy.asnumpy(logits, stream=self.stream)
        self.stream.synchronize()
        if all_logits:
            return [host[bounds[s]:bounds[s + 1]] for s in range(len(batch))]
        return [host[s] for s in range(len(batch))]

    # -------------------------------------------------------------- inputs rounded as llama.cpp's CPU does
    def _normed(self, x: cupy.ndarray, weight: cupy.ndarray, acts: list[str], rows: int) -> dict[str, cupy.ndarray]:
        """RMSNorm(x) * weight per row, float32, rounded to each activation format in `acts`."""
        a, unique = self.args, sorted(set(acts))
        if len(unique) == 1:
            y = cupy.empty((rows, a.dim), F32)
            ops.rmsnorm(x, weight, a.norm_eps, rows, a.dim, y=y, act=unique[0])
            return {unique[0]: y}
        base = cupy.empty((rows, a.dim), F32)
        ops.rmsnorm(x, weight, a.norm_eps, rows, a.dim, y=base)
        return {act: self._rounded(base, act) for act in unique}

    def _normed16(self, x: cupy.ndarray, weight: cupy.ndarray, acts: list[str]) -> dict[str, cupy.ndarray]:
        """The same as float16 (rows, dim): the inputs of the batched products."""
        a, rows, unique = self.args, x.shape[0], sorted(set(acts))
        base = cupy.empty((rows, a.dim), F32)
        if len(unique) == 1:
            y16 = cupy.empty((rows, a.dim), F16)
            ops.rmsnorm(x, weight, a.norm_eps, rows, a.dim, y=base, y16=y16, act=unique[0])
            return {unique[0]: y16}
        ops.rmsnorm(x, weight, a.norm_eps, rows, a.dim, y=base)
        return {act: self._rounded16(base, act) for act in unique}

    @staticmethod
    def _rounded(x: cupy.ndarray, act: str) -> cupy.ndarray:
        if act == "f32":
            return x
        y = cupy.empty_like(x)
        ops.round_act(x, y, x.shape[0] if x.ndim == 2 else 1, x.shape[-1], act)
        return y

    @staticmethod
    def _rounded16(x: cupy.ndarray, act: str) -> cupy.ndarray:
        y16 = cupy.empty(x.shape, F16)
        ops.round_act(x, cupy.empty_like(x), x.shape[0], x.shape[1], act, y16=y16)
        return y16

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
        target = cupy.empty((x16.shape[0], m.rows), F32) if out is None else out
        ops.matmul_f16(x16, self._half_weights(m), target, accumulate=accumulate)
        return target

    def _layer(self, i: int, L: dict, x: cupy.ndarray, batch: Sequence[tuple[np.ndarray, StreamKVCache]],
               bounds: list[int], positions: list[cupy.ndarray]) -> None:
        a, rows = self.args, x.shape[0]
        single = rows == 1
        wq, wk, wv, wo = L["attn_q"], L["attn_k"], L["attn_v"], L["attn_output"]
        gate, up, down = L["ffn_gate"], L["ffn_up"], L["ffn_down"]
        q, k, v = (cupy.empty((rows, n), F32) for n in (a.q_dim, a.kv_dim, a.kv_dim))
        if single:
            xs = self._normed(x, L["attn_norm"], [wq.act, wk.act, wv.act], 1)
            for name, m, out in (("attn_q", wq, q), ("attn_k", wk, k), ("attn_v", wv, v)):
                ops.gemv(m, xs[m.act][0], out[0], bias=L.get(name + ".bias"))
        else:
            xs16 = self._normed16(x, L["attn_norm"], [wq.act, wk.act, wv.act])
            for name, m, out in (("attn_q", wq, q), ("attn_k", wk, k), ("attn_v", wv, v)):
                self._mm(xs16[m.act], m, out=out)
                bias = L.get(name + ".bias")
                if bias is not None:
                    out += bias
        att = cupy.empty((rows, a.q_dim), F32)
        for s, (_, cache) in enumerate(batch):
            r0, r1 = bounds[s], bounds[s + 1]
            self._attention(i, q[r0:r1], k[r0:r1], v[r0:r1], cache, positions[s], att[r0:r1])
        if single:
            ops.gemv(wo, self._rounded(att, wo.act)[0], x[0], residual=x[0])
            xs = self._normed(x, L["ffn_norm"], [gate.act, up.act], 1)
            ff = cupy.empty((1, a.ffn_dim), F32)
            if gate.fmt == up.fmt and gate.act == up.act:
                ops.gemv_swiglu(gate, up, xs[gate.act][0], ff[0])
            else:
                g, u = cupy.empty(a.ffn_dim, F32), cupy.empty(a.ffn_dim, F32)
                ops.gemv(gate, xs[gate.act][0], g)
                ops.gemv(up, xs[up.act][0], u)
                ops.swiglu(g, u, ff[0], a.ffn_dim)
            ops.gemv(down, self._rounded(ff, down.act)[0], x[0], residual=x[0])
        else:
            self._mm(self._rounded16(att, wo.act), wo, out=x, accumulate=True)
            xs16 = self._normed16(x, L["ffn_norm"], [gate.act, up.act])
            g, u = self._mm(xs16[gate.act], gate), self._mm(xs16[up.act], up)
            self._mm(self._rounded16(g / (1.0 + cupy.exp(-g)) * u, down.act), down, out=x, accumulate=True)

    def _attention(self, i: int, q: cupy.ndarray, k: cupy.ndarray, v: cupy.ndarray, cache: StreamKVCache,
                   pos: cupy.ndarray, out: cupy.ndarray) -> None:
        a, n, start = self.args, q.shape[0], cache.length
        ops.rope_store(q, k, v, self.cos, self.sin, pos, n, a.n_heads, a.n_kv_heads, a.head_dim, self.rope.n_pairs,
                       a.rope_neox, cache.keys[i], cache.values[i], cache.max_tokens)
        if n == 1:
            ops.attention_decode(q[0], cache.keys[i], cache.values[i], pos, a.n_heads, a.n_kv_heads, a.head_dim,
                                 cache.max_tokens, cache.n_splits, cache.scores, cache.part_o, cache.part_ml, out[0])
            return
        end, group = start + n, a.n_heads // a.n_kv_heads
        keys = cache.keys[i, :, :end].astype(F32)  # (kv, S, hd)
        values = cache.values[i, :, :end].astype(F32)
        qg = q.astype(F16).astype(F32).reshape(n, a.n_kv_heads, group, a.head_dim)
        qg = qg.transpose(1, 2, 0, 3).reshape(a.n_kv_heads, group * n, a.head_dim)
        scores = cupy.matmul(qg, keys.transpose(0, 2, 1)) * np.float32(1.0 / np.sqrt(a.head_dim))
        scores = scores.reshape(a.n_kv_heads, group, n, end)
        future = cupy.arange(end)[None, :] > cupy.arange(start, end)[:, None]  # (T, S) causal mask
        scores = cupy.where(future, np.float32(-np.inf), scores)
        scores -= scores.max(axis=-1, keepdims=True)
        probs = cupy.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        o = cupy.matmul(probs.astype(F16).astype(F32).reshape(a.n_kv_heads, group * n, end), values)
        out[...] = o.reshape(a.n_kv_heads, group, n, a.head_dim).transpose(2, 0, 1, 3).reshape(n, a.q_dim)

