"""The Llama/Qwen2 forward pass on the GPU: the same function as infer.model.Transformer (same
ModelArgs, rotary tables from the same infer.model.Rope, float16 KV cache, and by default the
inputs of every matrix product rounded as llama.cpp's CPU rounds them), with weights resident in VRAM
in their planar quantized formats.

- decode (one token): quantized GEMVs and fused kernels, all buffers preallocated, token and position
  read from device memory, so the whole step (sampling included) is captured once as a CUDA graph
  and replayed; only token ids come back to the host.
- prefill (many tokens): per layer, each matrix is dequantized to float16 and multiplied with cuBLAS
  (float32 accumulation and result); prompts run in chunks of `prefill_chunk` tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import cupy
import numpy as np

from infer.gguf_file import GGUFModel
from infer.gpu import kernels, ops
from infer.gpu.ops import GpuMatrix
from infer.gpu.weights import GpuWeights
from infer.model import ModelArgs, Rope

ATTN_CHUNK = kernels.DEFAULT_DEFINES["ATTN_CHUNK"]  # cache positions per decode-attention split
F32, F16 = cupy.float32, cupy.float16


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
    scores: cupy.ndarray  # decode attention work buffers
    part_o: cupy.ndarray
    part_ml: cupy.ndarray
    length: int = 0
    graphs: dict[tuple[float, int, bool], object] = field(default_factory=dict)


class GpuTransformer:
    """Same calls as infer.model.Transformer: new_cache(max_tokens), forward(tokens, cache, all_logits)
    -> NumPy logits; plus generate() that decodes with a CUDA graph."""

    def __init__(self, model: GGUFModel, args: ModelArgs, rope_freq_factors: np.ndarray | None = None,
                 prefill_chunk: int = 512, match_llama_cpp: bool = True, int8_dot: bool = True) -> None:
        self.args = args
        # decode GEMVs on the 8-bit form of q8_0/q8_k activations (dp4a integer dot products) where
        # the weight format has such a kernel; same numbers up to float32 summation order. The float
        # kernels read x as float32, each lane its own 128-byte piece: 32 L1 wavefronts per load
        # instruction, which bounded them to ~0.5-0.8 TB/s on the H200 (run 1); int8 x is 4x smaller.
        self.int8_dot = int8_dot
        self.prefill_chunk = prefill_chunk
        # prompts up to this many tokens run through the decode kernels (no weight dequantization,
        # float32 products): cheaper for a few tokens, and the CPU's exact numerics where a test needs them
        self.gemv_prefill_max = 4
        self.rope = Rope(args, rope_freq_factors)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        a = args
        with self.stream:
            self.w = GpuWeights(model, args, match_llama_cpp)
            self.layers, self.token_embd, self.output = self.w.layers, self.w.token_embd, self.w.output
            # decode activations (one token)
            self.h = cupy.zeros(a.dim, F32)
            self.qkv = cupy.zeros(a.q_dim + 2 * a.kv_dim, F32)
            self.q = self.qkv[: a.q_dim]
            self.k = self.qkv[a.q_dim : a.q_dim + a.kv_dim]
            self.v = self.qkv[a.q_dim + a.kv_dim :]
            self.att = cupy.zeros(a.q_dim, F32)
            self.gate = cupy.zeros(a.ffn_dim, F32)
            self.up = cupy.zeros(a.ffn_dim, F32)
            self.ff = cupy.zeros(a.ffn_dim, F32)
            self.logits = cupy.zeros(a.vocab_size, F32)
            self._act: dict[tuple[str, str], cupy.ndarray] = {}  # (input, activation format) -> buffer
            self._act8: dict[tuple[str, str], ops.Int8Act] = {}  # the same inputs' 8-bit forms
            self._plan_act_buffers()
            self._scratch16: cupy.ndarray | None = None
            self._keep16: bool | None = None  # keep float16 copies of the weights for prompts (decided once)
            self._copies16: dict[int, cupy.ndarray] = {}
            self._rope_tables = (cupy.zeros((0, self.rope.n_pairs), F32),) * 2
        self.stream.synchronize()

    def set_int8_dot(self, enabled: bool) -> None:
        """Switches the decode GEMVs between the float and the integer (dp4a) kernels."""
        self.int8_dot = enabled
        if enabled:  # buffers stay allocated once made: captured graphs may refer to them
            with self.stream:
                for key, act in list(self._act):
                    if act in ("q8_0", "q8_k") and (key, act) not in self._act8:
                        self._act8[(key, act)] = ops.int8_buffers(self._act[(key, act)].size, act)
            self.stream.synchronize()

    def _int8(self, key: str, act: str) -> ops.Int8Act | None:
        """The 8-bit form buffers of input `key` in format `act`, when the integer kernels are on."""
        return self._act8.get((key, act)) if self.int8_dot else None

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads from VRAM (all layer matrices and the output)."""
        return self.w.bytes_per_token()[0]

    def source_bytes_per_token(self) -> int:
        """The same in GGUF bytes (what llama.cpp reads per token)."""
        return self.w.bytes_per_token()[1]

    # ------------------------------------------------------------------ cache
    def _ensure_rope(self, n: int) -> None:
        if self._rope_tables[0].shape[0] >= n:
            return
        cos, sin = self.rope.angles(np.arange(n))
        self._rope_tables = (cupy.asarray(cos.astype(np.float32)), cupy.asarray(sin.astype(np.float32)))

    def new_cache(self, max_tokens: int) -> GpuKVCache:
        a = self.args
        n_splits = ops.attention_splits(max_tokens)
        with self.stream:
            self._ensure_rope(max_tokens)
            shape = (a.n_layers, a.n_kv_heads, max_tokens, a.head_dim)
            scores, part_o, part_ml = ops.attention_work(a.n_heads, a.head_dim, max_tokens)
            cache = GpuKVCache(
                keys=cupy.zeros(shape, F16), values=cupy.zeros(shape, F16), max_tokens=max_tokens,
                n_splits=n_splits, tok=cupy.zeros(1, cupy.int32), pos=cupy.zeros(1, cupy.int32),
                tokens=cupy.zeros(max_tokens + 1, cupy.int32), scores=scores, part_o=part_o, part_ml=part_ml,
            )
        self.stream.synchronize()
        return cache

    # ------------------------------------------------------------------ activation rounding (decode)
    def _plan_act_buffers(self) -> None:
        """Allocates now every rounded-input buffer the decode step uses (none may be allocated
        while a CUDA graph is being captured)."""
        a = self.args
        for L in self.layers:
            self._norm_buffers("attn", [m.act for m, _ in L.qkv], a.dim)
            self._norm_buffers("ffn", [L.w_gate.act, L.w_up.act], a.dim)
            self._act_buffer("ff", L.w_down.act, a.ffn_dim)
            self._act_buffer("att", L.wo.act, a.q_dim)  # only its 8-bit form is used (att holds the floats)
        self._norm_buffers("out", [self.output.act], a.dim)

    def _act_buffer(self, key: str, act: str, n: int) -> cupy.ndarray:
        if (key, act) not in self._act:
            self._act[(key, act)] = cupy.zeros(n, F32)
            if self.int8_dot and act in ("q8_0", "q8_k"):
                self._act8[(key, act)] = ops.int8_buffers(n, act)
        return self._act[(key, act)]

    def _norm_buffers(self, key: str, acts: list[str], n: int) -> None:
        for act in set(acts) | ({"f32"} if len(set(acts)) > 1 else set()):
            self._act_buffer(key, act, n)

    def _normed(self, src: cupy.ndarray, weight: cupy.ndarray, key: str, acts: list[str]) -> dict[str, cupy.ndarray]:
        """RMSNorm(src) * weight, rounded to each activation format in `acts` (one launch for one)."""
        a, unique = self.args, sorted(set(acts))
        if len(unique) == 1:
            y = self._act[(key, unique[0])]
            ops.rmsnorm(src, weight, a.norm_eps, 1, a.dim, y=y, act=unique[0], int8=self._int8(key, unique[0]))
            return {unique[0]: y}
        base = self._act[(key, "f32")]
        ops.rmsnorm(src, weight, a.norm_eps, 1, a.dim, y=base)
        out = {"f32": base}
        for act in unique:
            if act != "f32":
                out[act] = self._act[(key, act)]
                ops.round_act(base, out[act], 1, a.dim, act, int8=self._int8(key, act))
        return out

    def _rounded(self, x: cupy.ndarray, key: str, act: str) -> cupy.ndarray:
        if act == "f32":
            return x
        y = self._act[(key, act)]
        ops.round_act(x, y, 1, x.size, act, int8=self._int8(key, act))
        return y

    def _gemv(self, m: GpuMatrix, key: str, x: cupy.ndarray, y: cupy.ndarray, bias: cupy.ndarray | None = None,
              residual: cupy.ndarray | None = None) -> None:
        """y = W x (+bias, +residual) where x is input `key` rounded for m: the integer kernel when
        its 8-bit form exists, else the float one."""
        int8 = self._int8(key, m.act) if m.fmt in ops.INT8_FORMATS else None
        if int8 is not None:
            ops.gemv8(m, int8, y, bias=bias, residual=residual)
        else:
            ops.gemv(m, x, y, bias=bias, residual=residual)

    # ------------------------------------------------------------------ decode (one token)
    def _decode_launches(self, cache: GpuKVCache, mark: Callable[[str], None] | None = None) -> None:
        """Kernels of one decode step: token cache.tok at position cache.pos -> self.logits."""
        a, done = self.args, mark or (lambda _name: None)
        cos, sin = self._rope_tables
        ops.embed(self.token_embd, cache.tok, 1, self.h)
        done("embed")
        for i, L in enumerate(self.layers):
            xs = self._normed(self.h, L.attn_norm, "attn", [m.act for m, _ in L.qkv])
            done("rmsnorm")
            for m, row in L.qkv:
                self._gemv(m, "attn", xs[m.act], self.qkv[row : row + m.rows],
                           bias=None if L.bqkv is None else L.bqkv[row : row + m.rows])
            done("gemv_qkv")
            # rotary embedding and the KV store happen inside the attention kernels
            ops.attention_decode(self.q, cache.keys[i], cache.values[i], cache.pos, a.n_heads, a.n_kv_heads,
                                 a.head_dim, cache.max_tokens, cache.n_splits, cache.scores, cache.part_o, cache.part_ml,
                                 self.att, act=L.wo.act,  # the output is wo's rounded input
                                 rope=(self.k, self.v, cos, sin, self.rope.n_pairs, a.rope_neox),
                                 int8=self._int8("att", L.wo.act) if L.wo.fmt in ops.INT8_FORMATS else None)
            done("attention")
            self._gemv(L.wo, "att", self.att, self.h, residual=self.h)
            done("gemv_o")
            xs = self._normed(self.h, L.ffn_norm, "ffn", [L.w_gate.act, L.w_up.act])
            done("rmsnorm")
            if L.w_gate.fmt == L.w_up.fmt and L.w_gate.act == L.w_up.act:
                int8 = self._int8("ffn", L.w_gate.act) if L.w_gate.fmt in ops.INT8_FORMATS else None
                if int8 is not None:
                    ops.gemv8_swiglu(L.w_gate, L.w_up, int8, self.ff)
                else:
                    ops.gemv_swiglu(L.w_gate, L.w_up, xs[L.w_gate.act], self.ff)
            else:
                self._gemv(L.w_gate, "ffn", xs[L.w_gate.act], self.gate)
                self._gemv(L.w_up, "ffn", xs[L.w_up.act], self.up)
                ops.swiglu(self.gate, self.up, self.ff, a.ffn_dim)
            done("gemv_gate_up")
            self._gemv(L.w_down, "ff", self._rounded(self.ff, "ff", L.w_down.act), self.h, residual=self.h)
            done("gemv_down")
        xs = self._normed(self.h, self.w.output_norm, "out", [self.output.act])
        self._gemv(self.output, "out", xs[self.output.act], self.logits)
        done("output")

    def _set_position(self, cache: GpuKVCache, token: int, position: int) -> None:
        cache.tok.set(np.array([token], np.int32), stream=self.stream)
        cache.pos.set(np.array([position], np.int32), stream=self.stream)

    def _decode_graph(self, cache: GpuKVCache, temperature: float, seed: int) -> object:
        key = (float(temperature), int(seed), self.int8_dot)
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
        """The matrix as float16 (rows, cols) for cuBLAS: its own data (F16), a kept copy (when all
        layers' float16 copies fit in a third of the free VRAM: dequantized once, at the first
        prompt), or a scratch buffer dequantized now."""
        half = m.as_half()
        if half is not None:
            return half
        if self._keep16 is None:
            total = sum(2 * x.rows * x.cols for layer in self.layers for x in layer.matrices())
            self._keep16 = total < cupy.cuda.runtime.memGetInfo()[0] // 3
        if self._keep16:
            if id(m) not in self._copies16:
                copy = cupy.empty(m.rows * m.cols, F16)
                ops.dequantize(m, copy)
                self._copies16[id(m)] = copy.reshape(m.rows, m.cols)
            return self._copies16[id(m)]
        n = m.rows * m.cols
        if self._scratch16 is None or self._scratch16.size < n:
            biggest = max(x.rows * x.cols for layer in self.layers for x in layer.matrices())
            self._scratch16 = cupy.empty(max(n, biggest), F16)
        out = self._scratch16[:n]
        ops.dequantize(m, out)
        return out.reshape(m.rows, m.cols)

    def _mm(self, x16: cupy.ndarray, m: GpuMatrix, out: cupy.ndarray | None = None) -> cupy.ndarray:
        """(T, cols) float16 @ W.T -> (T, rows) float32; with `out`, added into it."""
        if out is None:
            result = cupy.empty((x16.shape[0], m.rows), F32)
            ops.matmul_f16(x16, self._half_weights(m), result)
            return result
        ops.matmul_f16(x16, self._half_weights(m), out, accumulate=True)
        return out

    def _normed16(self, h: cupy.ndarray, weight: cupy.ndarray, acts: list[str]) -> dict[str, cupy.ndarray]:
        """Per row RMSNorm(h) * weight, rounded to each activation format, as float16 (T, dim)."""
        a, n, unique = self.args, h.shape[0], sorted(set(acts))
        base = cupy.empty((n, a.dim), F32)
        if len(unique) == 1:
            y16 = cupy.empty((n, a.dim), F16)
            ops.rmsnorm(h, weight, a.norm_eps, n, a.dim, y=base, y16=y16, act=unique[0])
            return {unique[0]: y16}
        ops.rmsnorm(h, weight, a.norm_eps, n, a.dim, y=base)
        return {act: self._rounded16(base, act) for act in unique}

    @staticmethod
    def _rounded16(x: cupy.ndarray, act: str) -> cupy.ndarray:
        """(T, n) float32 -> rounded to `act`, as float16."""
        y16 = cupy.empty(x.shape, F16)
        ops.round_act(x, cupy.empty_like(x), x.shape[0], x.shape[1], act, y16=y16)
        return y16

    def _prefill_chunk(self, ids: np.ndarray, cache: GpuKVCache, all_logits: bool) -> cupy.ndarray:
        a, n, start = self.args, len(ids), cache.length
        cos, sin = self._rope_tables
        ids_d = cupy.asarray(ids.astype(np.int32))
        pos_d = cupy.arange(start, start + n, dtype=cupy.int32)
        h = cupy.empty((n, a.dim), F32)
        ops.embed(self.token_embd, ids_d, n, h)
        group, end = a.n_heads // a.n_kv_heads, start + n
        future = cupy.arange(end)[None, :] > cupy.arange(start, end)[:, None]  # (T, S)
        for i, L in enumerate(self.layers):
            xs = self._normed16(h, L.attn_norm, [m.act for m, _ in L.qkv])
            parts = [self._mm(xs[m.act], m) for m, _ in L.qkv]
            qkv = parts[0] if len(parts) == 1 else cupy.concatenate(parts, axis=1)  # (T, q_dim + 2 kv_dim)
            if L.bqkv is not None:
                qkv += L.bqkv
            q = cupy.ascontiguousarray(qkv[:, : a.q_dim])
            k = cupy.ascontiguousarray(qkv[:, a.q_dim : a.q_dim + a.kv_dim])
            v = cupy.ascontiguousarray(qkv[:, a.q_dim + a.kv_dim :])
            ops.rope_store(q, k, v, cos, sin, pos_d, n, a.n_heads, a.n_kv_heads, a.head_dim, self.rope.n_pairs,
                           a.rope_neox, cache.keys[i], cache.values[i], cache.max_tokens)
            keys = cache.keys[i, :, :end].astype(F32)  # (kv, S, hd)
            values = cache.values[i, :, :end].astype(F32)
            qg = q.astype(F16).astype(F32).reshape(n, a.n_kv_heads, group, a.head_dim)
            qg = qg.transpose(1, 2, 0, 3).reshape(a.n_kv_heads, group * n, a.head_dim)
            scores = cupy.matmul(qg, keys.transpose(0, 2, 1)) * np.float32(1.0 / np.sqrt(a.head_dim))
            scores = cupy.where(future, np.float32(-np.inf), scores.reshape(a.n_kv_heads, group, n, end))
            scores -= scores.max(axis=-1, keepdims=True)
            probs = cupy.exp(scores)
            probs /= probs.sum(axis=-1, keepdims=True)
            probs = probs.astype(F16).astype(F32)  # as the CPU engine (llama.cpp) rounds them
            out = cupy.matmul(probs.reshape(a.n_kv_heads, group * n, end), values)  # (kv, g*T, hd)
            out = out.reshape(a.n_kv_heads, group, n, a.head_dim).transpose(2, 0, 1, 3).reshape(n, a.q_dim)
            self._mm(self._rounded16(cupy.ascontiguousarray(out), L.wo.act), L.wo, out=h)
            xs = self._normed16(h, L.ffn_norm, [L.w_gate.act, L.w_up.act])
            g, u = self._mm(xs[L.w_gate.act], L.w_gate), self._mm(xs[L.w_up.act], L.w_up)
            ops.swiglu(g, u, g, g.size)  # in place: one kernel instead of a chain of elementwise ones
            self._mm(self._rounded16(g, L.w_down.act), L.w_down, out=h)
        cache.length = end
        rows = range(n) if all_logits else [n - 1]
        logits = cupy.empty((len(rows), a.vocab_size), F32)
        for j, t in enumerate(rows):
            xs = self._normed(h[t], self.w.output_norm, "out", [self.output.act])
            ops.gemv(self.output, xs[self.output.act], logits[j])
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
        out: list[int] = []
        for fresh in self.generate_iter(prompt, cache, n_new, temperature, seed, stop, check_every):
            out.extend(fresh)
            if on_tokens:
                on_tokens(fresh)
        return out

    def generate_iter(self, prompt: np.ndarray, cache: GpuKVCache, n_new: int, temperature: float = 0.0,
                      seed: int = 0, stop: set[int] | frozenset[int] = frozenset(),
                      check_every: int = 16) -> Iterator[list[int]]:
        """generate() as it goes: yields the new tokens in lists of up to `check_every` (the graph
        replays between two looks at the sampled ids). cache.length is final once exhausted."""
        prompt = self._check(prompt, cache)
        if len(prompt) == 0:
            raise ValueError("generate needs at least one prompt token")
        if n_new <= 0:
            return
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
        produced = 0
        done = 0  # decode steps launched
        while True:
            batch = min(check_every, n_new - 1 - done)
            for _ in range(batch):
                graph.launch(self.stream)  # type: ignore[attr-defined]
            done += batch
            new = cupy.asnumpy(cache.tokens[start + produced : start + done + 1], stream=self.stream)
            self.stream.synchronize()
            fresh = [int(t) for t in new]
            cut = next((j + 1 for j, t in enumerate(fresh) if t in stop), None)
            if cut is not None:
                fresh = fresh[:cut]
            produced += len(fresh)
            cache.length = start + produced - 1
            if fresh:
                yield fresh
            if cut is not None or done >= n_new - 1:
                return
