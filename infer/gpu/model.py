"""The Llama/Qwen2 forward pass on the GPU: the same function as infer.model.Transformer (same
ModelArgs, rotary tables from the same infer.model.Rope, float16 KV cache), with weights resident in
VRAM in their planar quantized formats.

- decode (one token): quantized GEMVs and fused kernels, all buffers preallocated, token and position
  read from device memory, so the whole step (sampling included) is captured once as a CUDA graph
  and replayed; only token ids come back to the host.
- prefill (many tokens): per layer, each matrix is dequantized to float16 and multiplied with cuBLAS
  (cupy.matmul); prompts run in chunks of `prefill_chunk` tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import cupy
import numpy as np

from infer.gguf_file import GGUFModel
from infer.gpu import ops
from infer.gpu.ops import GpuMatrix, upload_matrix, upload_stacked
from infer.model import ModelArgs, Rope

ATTN_CHUNK = 256  # must match ATTN_CHUNK of ops.cu (kernels.DEFAULT_DEFINES)


@dataclass
class GpuLayer:
    attn_norm: cupy.ndarray
    # Q, K and V rows stacked into as few matrices as their formats allow: (matrix, first row in the
    # q_dim + 2*kv_dim output); one GEMV launch each
    qkv: list[tuple[GpuMatrix, int]]
    bqkv: cupy.ndarray | None  # (q_dim + 2*kv_dim,) or None
    wo: GpuMatrix
    ffn_norm: cupy.ndarray
    w_gate: GpuMatrix
    w_up: GpuMatrix
    w_down: GpuMatrix

    def matrices(self) -> list[GpuMatrix]:
        return [m for m, _ in self.qkv] + [self.wo, self.w_gate, self.w_up, self.w_down]


@dataclass
class GpuKVCache:
    """KV cache and decode state of one sequence. `length` = positions filled, as in infer.model.KVCache."""

    keys: cupy.ndarray  # (n_layers, n_kv_heads, max_tokens, head_dim) float16
    values: cupy.ndarray
    max_tokens: int
    n_splits: int
    tok: cupy.ndarray  # int32[1]: the token the next decode step processes
    pos: cupy.ndarray  # int32[1]: its position
    tokens: cupy.ndarray  # int32[max_tokens + 1]: tokens[p] = the token at position p (sampled ones)
    part_o: cupy.ndarray
    part_ml: cupy.ndarray
    length: int = 0
    graphs: dict[tuple[float, int], object] = field(default_factory=dict)


class GpuTransformer:
    """Same calls as infer.model.Transformer: new_cache(max_tokens), forward(tokens, cache, all_logits)
    -> NumPy logits; plus generate() that decodes with a CUDA graph."""

    def __init__(self, model: GGUFModel, args: ModelArgs, rope_freq_factors: np.ndarray | None = None,
                 prefill_chunk: int = 512) -> None:
        self.args = args
        self.prefill_chunk = prefill_chunk
        # prompts up to this many tokens run through the decode kernels (no weight dequantization;
        # float32 activations): cheaper for a few tokens, and exact where a test needs the CPU's numerics
        self.gemv_prefill_max = 4
        self.rope = Rope(args, rope_freq_factors)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        a = args
        with self.stream:
            self.token_embd = self._matrix(model, "token_embd.weight")
            self.output_norm = self._vector(model, "output_norm.weight")
            tied = "output.weight" not in model.tensors
            self.output = self.token_embd if tied else self._matrix(model, "output.weight")
            self.layers = [self._layer(model, i) for i in range(a.n_layers)]
            # decode activations (one token)
            f32 = cupy.float32
            self.h = cupy.zeros(a.dim, f32)
            self.xn = cupy.zeros(a.dim, f32)
            self.qkv = cupy.zeros(a.q_dim + 2 * a.kv_dim, f32)
            self.q = self.qkv[: a.q_dim]
            self.k = self.qkv[a.q_dim : a.q_dim + a.kv_dim]
            self.v = self.qkv[a.q_dim + a.kv_dim :]
            self.att = cupy.zeros(a.q_dim, f32)
            self.gate = cupy.zeros(a.ffn_dim, f32)
            self.up = cupy.zeros(a.ffn_dim, f32)
            self.ff = cupy.zeros(a.ffn_dim, f32)
            self.logits = cupy.zeros(a.vocab_size, f32)
            self._scratch16: cupy.ndarray | None = None
            self._rope_tables = (cupy.zeros((0, self.rope.n_pairs), f32),) * 2
        self.stream.synchronize()

    # ------------------------------------------------------------------ loading
    @staticmethod
    def _matrix(model: GGUFModel, name: str) -> GpuMatrix:
        info = model.tensor(name)
        model.check_tensor_supported(info)
        rows, cols = info.shape
        return upload_matrix(info.data, info.ggml_type, rows, cols)

    @staticmethod
    def _vector(model: GGUFModel, name: str) -> cupy.ndarray:
        return cupy.asarray(model.tensor(name).dequantize().astype(np.float32).reshape(-1))

    @staticmethod
    def _stacked_qkv(model: GGUFModel, p: str) -> list[tuple[GpuMatrix, int]]:
        infos = [model.tensor(p + f"attn_{x}.weight") for x in "qkv"]
        groups: list[list] = []
        for info in infos:  # consecutive tensors of one type share a matrix
            if groups and groups[-1][0].ggml_type == info.ggml_type:
                groups[-1].append(info)
            else:
                groups.append([info])
        out, row = [], 0
        for group in groups:
            for info in group:
                model.check_tensor_supported(info)
            m = upload_stacked([(info.data, info.shape[0]) for info in group], group[0].ggml_type, group[0].shape[1])
            out.append((m, row))
            row += m.rows
        return out

    def _layer(self, model: GGUFModel, i: int) -> GpuLayer:
        p, a = f"blk.{i}.", self.args
        bqkv = None
        if any(p + f"attn_{x}.bias" in model.tensors for x in "qkv"):
            sizes = (a.q_dim, a.kv_dim, a.kv_dim)
            bqkv = cupy.asarray(np.concatenate([
                model.tensor(p + f"attn_{x}.bias").dequantize().reshape(-1) if p + f"attn_{x}.bias" in model.tensors
                else np.zeros(n, np.float32) for x, n in zip("qkv", sizes, strict=True)]).astype(np.float32))
        return GpuLayer(
            attn_norm=self._vector(model, p + "attn_norm.weight"),
            qkv=self._stacked_qkv(model, p), bqkv=bqkv,
            wo=self._matrix(model, p + "attn_output.weight"), ffn_norm=self._vector(model, p + "ffn_norm.weight"),
            w_gate=self._matrix(model, p + "ffn_gate.weight"), w_up=self._matrix(model, p + "ffn_up.weight"),
            w_down=self._matrix(model, p + "ffn_down.weight"),
        )

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads from VRAM (all layer matrices and the output)."""
        return sum(m.nbytes for layer in self.layers for m in layer.matrices()) + self.output.nbytes

    def source_bytes_per_token(self) -> int:
        """The same in GGUF bytes (what llama.cpp reads per token)."""
        return sum(m.source_nbytes for layer in self.layers for m in layer.matrices()) + self.output.source_nbytes

    # ------------------------------------------------------------------ cache
    def _ensure_rope(self, n: int) -> None:
        if self._rope_tables[0].shape[0] >= n:
            return
        cos, sin = self.rope.angles(np.arange(n))
        self._rope_tables = (cupy.asarray(cos.astype(np.float32)), cupy.asarray(sin.astype(np.float32)))

    def new_cache(self, max_tokens: int) -> GpuKVCache:
        a = self.args
        n_splits = -(-max_tokens // ATTN_CHUNK)
        with self.stream:
            self._ensure_rope(max_tokens)
            shape = (a.n_layers, a.n_kv_heads, max_tokens, a.head_dim)
            cache = GpuKVCache(
                keys=cupy.zeros(shape, cupy.float16), values=cupy.zeros(shape, cupy.float16), max_tokens=max_tokens,
                n_splits=n_splits, tok=cupy.zeros(1, cupy.int32), pos=cupy.zeros(1, cupy.int32),
                tokens=cupy.zeros(max_tokens + 1, cupy.int32),
                part_o=cupy.zeros(a.n_heads * n_splits * a.head_dim, cupy.float32),
                part_ml=cupy.zeros(a.n_heads * n_splits * 2, cupy.float32),
            )
        self.stream.synchronize()
        return cache

    # ------------------------------------------------------------------ decode (one token)
    def _decode_launches(self, cache: GpuKVCache, mark: Callable[[str], None] | None = None) -> None:
        """Kernels of one decode step: token cache.tok at position cache.pos -> self.logits."""
        a, done = self.args, mark or (lambda _name: None)
        cos, sin = self._rope_tables
        ops.embed(self.token_embd, cache.tok, 1, self.h)
        done("embed")
        for i, L in enumerate(self.layers):
            ops.rmsnorm(self.h, L.attn_norm, a.norm_eps, 1, a.dim, y=self.xn)
            done("rmsnorm")
            for m, row in L.qkv:
                ops.gemv(m, self.xn, self.qkv[row : row + m.rows],
                         bias=None if L.bqkv is None else L.bqkv[row : row + m.rows])
            done("gemv_qkv")
            ops.rope_store(self.q, self.k, self.v, cos, sin, cache.pos, 1, a.n_heads, a.n_kv_heads, a.head_dim,
                           self.rope.n_pairs, a.rope_neox, cache.keys[i], cache.values[i], cache.max_tokens)
            done("rope_store")
            ops.attention_decode(self.q, cache.keys[i], cache.values[i], cache.pos, a.n_heads, a.n_kv_heads,
                                 a.head_dim, cache.max_tokens, cache.n_splits, cache.part_o, cache.part_ml, self.att)
            done("attention")
            ops.gemv(L.wo, self.att, self.h, residual=self.h)
            done("gemv_o")
            ops.rmsnorm(self.h, L.ffn_norm, a.norm_eps, 1, a.dim, y=self.xn)
            done("rmsnorm")
            if L.w_gate.fmt == L.w_up.fmt:
                ops.gemv_swiglu(L.w_gate, L.w_up, self.xn, self.ff)
            else:
                ops.gemv(L.w_gate, self.xn, self.gate)
                ops.gemv(L.w_up, self.xn, self.up)
                ops.swiglu(self.gate, self.up, self.ff, a.ffn_dim)
            done("gemv_gate_up")
            ops.gemv(L.w_down, self.ff, self.h, residual=self.h)
            done("gemv_down")
        ops.rmsnorm(self.h, self.output_norm, a.norm_eps, 1, a.dim, y=self.xn)
        ops.gemv(self.output, self.xn, self.logits)
        done("output")

    def _set_position(self, cache: GpuKVCache, token: int, position: int) -> None:
        cache.tok.set(np.array([token], np.int32), stream=self.stream)
        cache.pos.set(np.array([position], np.int32), stream=self.stream)

    def _decode_graph(self, cache: GpuKVCache, temperature: float, seed: int) -> object:
        key = (float(temperature), int(seed))
        if key not in cache.graphs:
            with self.stream:
                self.stream.begin_capture()
                try:
                    self._decode_launches(cache)
                    ops.sample_token(self.logits, self.args.vocab_size, temperature, seed, cache.tok, cache.pos,
                                     cache.tokens)
                finally:
                    graph = self.stream.end_capture()
            cache.graphs[key] = graph
        return cache.graphs[key]

    # ------------------------------------------------------------------ prefill (many tokens)
    def _half_weights(self, m: GpuMatrix) -> cupy.ndarray:
        half = m.as_half()
        if half is not None:
            return half
        n = m.rows * m.cols
        if self._scratch16 is None or self._scratch16.size < n:
            biggest = max(x.rows * x.cols for layer in self.layers for x in layer.matrices())
            self._scratch16 = cupy.empty(max(n, biggest), cupy.float16)
        out = self._scratch16[:n]
        ops.dequantize(m, out)
        return out.reshape(m.rows, m.cols)

    def _mm(self, x16: cupy.ndarray, m: GpuMatrix, out: cupy.ndarray | None = None) -> cupy.ndarray:
        """(T, cols) float16 @ W.T -> (T, rows) float32; with `out`, added into it."""
        if out is None:
            result = cupy.empty((x16.shape[0], m.rows), cupy.float32)
            ops.matmul_f16(x16, self._half_weights(m), result)
            return result
        ops.matmul_f16(x16, self._half_weights(m), out, accumulate=True)
        return out

    def _prefill_chunk(self, ids: np.ndarray, cache: GpuKVCache, all_logits: bool) -> cupy.ndarray:
        a, n, start = self.args, len(ids), cache.length
        cos, sin = self._rope_tables
        ids_d = cupy.asarray(ids.astype(np.int32))
        pos_d = cupy.arange(start, start + n, dtype=cupy.int32)
        h = cupy.empty((n, a.dim), cupy.float32)
        ops.embed(self.token_embd, ids_d, n, h)
        xn16 = cupy.empty((n, a.dim), cupy.float16)
        group, end = a.n_heads // a.n_kv_heads, start + n
        future = cupy.arange(end)[None, :] > cupy.arange(start, end)[:, None]  # (T, S)
        for i, L in enumerate(self.layers):
            ops.rmsnorm(h, L.attn_norm, a.norm_eps, n, a.dim, y16=xn16)
            parts = [self._mm(xn16, m) for m, _ in L.qkv]
            qkv = parts[0] if len(parts) == 1 else cupy.concatenate(parts, axis=1)  # (T, q_dim + 2 kv_dim)
            if L.bqkv is not None:
                qkv += L.bqkv
            q = cupy.ascontiguousarray(qkv[:, : a.q_dim])
            k = cupy.ascontiguousarray(qkv[:, a.q_dim : a.q_dim + a.kv_dim])
            v = cupy.ascontiguousarray(qkv[:, a.q_dim + a.kv_dim :])
            ops.rope_store(q, k, v, cos, sin, pos_d, n, a.n_heads, a.n_kv_heads, a.head_dim, self.rope.n_pairs,
                           a.rope_neox, cache.keys[i], cache.values[i], cache.max_tokens)
            keys = cache.keys[i, :, :end].astype(cupy.float32)  # (kv, S, hd)
            values = cache.values[i, :, :end].astype(cupy.float32)
            qg = q.astype(cupy.float16).astype(cupy.float32).reshape(n, a.n_kv_heads, group, a.head_dim)
            qg = qg.transpose(1, 2, 0, 3).reshape(a.n_kv_heads, group * n, a.head_dim)
            scores = cupy.matmul(qg, keys.transpose(0, 2, 1)) * np.float32(1.0 / np.sqrt(a.head_dim))
            scores = scores.reshape(a.n_kv_heads, group, n, end)
            scores = cupy.where(future, np.float32(-np.inf), scores)
            scores -= scores.max(axis=-1, keepdims=True)
            probs = cupy.exp(scores)
            probs /= probs.sum(axis=-1, keepdims=True)
            out = cupy.matmul(probs.reshape(a.n_kv_heads, group * n, end), values)  # (kv, g*T, hd)
            out = out.reshape(a.n_kv_heads, group, n, a.head_dim).transpose(2, 0, 1, 3).reshape(n, a.q_dim)
            self._mm(out.astype(cupy.float16), L.wo, out=h)
            ops.rmsnorm(h, L.ffn_norm, a.norm_eps, n, a.dim, y16=xn16)
            g, u = self._mm(xn16, L.w_gate), self._mm(xn16, L.w_up)
            act = (g / (1.0 + cupy.exp(-g)) * u).astype(cupy.float16)
            self._mm(act, L.w_down, out=h)
        cache.length = end
        rows = range(n) if all_logits else [n - 1]
        logits = cupy.empty((len(rows), a.vocab_size), cupy.float32)
        xn = cupy.empty(a.dim, cupy.float32)
        for j, t in enumerate(rows):
            ops.rmsnorm(h[t], self.output_norm, a.norm_eps, 1, a.dim, y=xn)
            ops.gemv(self.output, xn, logits[j])
        return logits

    # ------------------------------------------------------------------ public calls
    def _check(self, tokens: np.ndarray, cache: GpuKVCache) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if cache.length + len(tokens) > cache.max_tokens:
            raise ValueError(f"context full: {cache.length} + {len(tokens)} tokens exceed the context size "
                             f"{cache.max_tokens}")
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= self.args.vocab_size):
            raise ValueError(f"token id outside the vocabulary of {self.args.vocab_size}")
        return tokens

    def forward_device(self, tokens: np.ndarray, cache: GpuKVCache, all_logits: bool = False) -> cupy.ndarray:
        """Logits on the device: (T, vocab) with all_logits, else (vocab,) of the last token."""
        tokens = self._check(tokens, cache)
        with self.stream:
            if len(tokens) <= self.gemv_prefill_max:  # token by token on the float32 GEMV path
                rows = []
                for token in tokens:
                    self._set_position(cache, int(token), cache.length)
                    self._decode_launches(cache)
                    cache.length += 1
                    if all_logits:
                        rows.append(self.logits.copy())
                return cupy.stack(rows) if all_logits else self.logits.copy()
            parts = []
            for at in range(0, len(tokens), self.prefill_chunk):
                parts.append(self._prefill_chunk(tokens[at : at + self.prefill_chunk], cache, all_logits))
            if not all_logits:
                return parts[-1][0]
            return cupy.concatenate(parts)

    def forward(self, tokens: np.ndarray, cache: GpuKVCache, all_logits: bool = False) -> np.ndarray:
        """As infer.model.Transformer.forward: NumPy float32 logits."""
        logits = self.forward_device(tokens, cache, all_logits)
        out = cupy.asnumpy(logits, stream=self.stream)
        self.stream.synchronize()
        return out

    def generate(self, prompt: np.ndarray, cache: GpuKVCache, n_new: int, temperature: float = 0.0, seed: int = 0,
                 stop: set[int] | frozenset[int] = frozenset(), check_every: int = 16,
                 on_tokens: Callable[[list[int]], None] | None = None) -> list[int]:
        """Prefill the prompt, then decode up to n_new tokens with the captured decode graph; stops
        after a token in `stop`. The last sampled token is not yet in the cache (cache.length counts
        the tokens processed)."""
        prompt = self._check(prompt, cache)
        if len(prompt) == 0:
            raise ValueError("generate needs at least one prompt token")
        if n_new <= 0:
            return []
        if cache.length + len(prompt) + n_new - 1 > cache.max_tokens:
            raise ValueError(f"context full: {cache.length} + {len(prompt)} + {n_new} tokens exceed "
                             f"{cache.max_tokens}")
        start = cache.length + len(prompt)  # position of the first new token
        with self.stream:
            logits = self.forward_device(prompt, cache)
            self.logits[...] = logits
            cache.pos.set(np.array([start - 1], np.int32), stream=self.stream)
            ops.sample_token(self.logits, self.args.vocab_size, temperature, seed, cache.tok, cache.pos, cache.tokens)
            graph = self._decode_graph(cache, temperature, seed) if n_new > 1 else None
        out: list[int] = []
        done = 0  # decode steps launched
        while True:
            batch = min(check_every, n_new - 1 - done)
            for _ in range(batch):
                graph.launch(self.stream)  # type: ignore[attr-defined]
            done += batch
            have = len(out)
            new = cupy.asnumpy(cache.tokens[start + have : start + done + 1], stream=self.stream)
            self.stream.synchronize()
            fresh = [int(t) for t in new]
            cut = next((j + 1 for j, t in enumerate(fresh) if t in stop), None)
            if cut is not None:
                fresh = fresh[:cut]
            out.extend(fresh)
            if on_tokens and fresh:
                on_tokens(fresh)
            if cut is not None or done >= n_new - 1:
                break
        cache.length = start + len(out) - 1
        return out
