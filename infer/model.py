"""The Llama/Qwen2/Qwen3/Gemma 3 decoder in NumPy float32 (and Qwen3-MoE / Mixtral / gpt-oss's mixtures of
experts, whose feed-forward is infer.moe's; gpt-oss's attention sinks and output bias are here): model
arguments from GGUF metadata, per-layer weights behind a small provider interface, and the forward
pass over a KV cache.

The forward pass follows llama.cpp's CPU numerics where that costs nothing: the KV cache is float16,
and the query and the attention probabilities are rounded to float16 before they meet it (llama.cpp
converts the other operand of an f16 matrix product to f16), and the inputs of matrix products are
rounded to the 8-bit (or f16) form llama.cpp gives them.

Two numerics. The default computes in float32 with float32 weights, as llama.cpp's CPU does (its
sums run in another order, so results agree to float rounding, not bit for bit). `exact=True` takes
every sum in float64 over exact terms and rounds it to float32 once: matrix products use the weights
dequantized exactly (float64) and the rounded activations exactly; RMSNorm's sum of squares,
attention's dot products, exponentials and weighted values, and SiLU are float64. A result then does
not depend on the order of summation (one batch or token by token, CPU or the GPU decode kernels,
which compute the same in double), so the 8-bit rounding of the next layer sees the same inputs
everywhere. With float32 sums a value on a rounding boundary can round either way, and on SmolLM2,
whose activations have large outliers, one such flip moves logits by percents (docs/GPU.md).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from infer import quants
from infer.arch import (  # noqa: F401 - ModelArgs re-exported: the model's description lives in infer.arch
    OUTPUT_NORM,
    TOKEN_EMBD,
    ModelArgs,
    RopeScaling,
    check_model,
    layer_vector_kinds,
    layer_vectors,
    output_name,
    rope_freq_factors,
    tensor_name,
)
from infer.cmath import c_float_function
from infer.gguf_file import GGUFModel
from infer.kv_cache import KVCache
from infer.layers import Batch, Rope, check_batch, tree_layout, visible
from infer.moe import MixtureOfExperts, SharedExpert


class Linear:
    """y = x @ W.T for W (out_features, in_features), made of row segments stacked in order; y is
    float32. With `exact`, the float64 product of the exact weights (give them as float64:
    quants.dequantize with dtype=np.float64) and the exactly rounded activations, rounded once; else
    a float32 product.

    Each segment remembers the activation format llama.cpp would convert x to for the weight's
    GGML type (see quants.round_activations); consecutive segments of one format are merged, so
    Q, K and V (or gate and up) usually become one matrix product.
    """

    def __init__(self, parts: list[tuple[np.ndarray, str]], exact: bool = False) -> None:
        self.exact = exact
        merged: list[tuple[np.ndarray, str]] = []
        for weight, fmt in parts:
            weight = np.asarray(weight, dtype=np.float64 if exact else np.float32)
            if merged and merged[-1][1] == fmt:
                merged[-1] = (np.concatenate([merged[-1][0], weight]), fmt)
            else:
                merged.append((weight, fmt))
        self.segments = merged

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w, _ in self.segments)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        outs = [(quants.round_activations(x, fmt, self.exact) @ w.T).astype(np.float32, copy=False)
                for w, fmt in self.segments]
        return outs[0] if len(outs) == 1 else np.concatenate(outs, axis=-1)


@dataclass
class LayerWeights:
    """One transformer block; vectors float32, matrices as Linear (out_features, in_features)."""

    attn_norm: np.ndarray  # (dim,)
    attn_qkv: Linear  # (q_dim + 2 * kv_dim, dim): attn_q, attn_k, attn_v stacked
    bqkv: np.ndarray | None  # (q_dim + 2 * kv_dim,) or None (qwen2 has biases, llama none)
    attn_output: Linear  # (dim, q_dim)
    ffn_norm: np.ndarray  # (dim,)
    ffn_gate_up: Linear | None  # (2 * ffn_dim, dim): ffn_gate then ffn_up; None in a block of experts
    ffn_down: Linear | None  # (dim, ffn_dim); None in a block of experts
    q_norm: np.ndarray | None = None  # (head_dim,): Qwen3's RMSNorm of each query head before rope
    k_norm: np.ndarray | None = None  # (head_dim,): the same for each key head
    post_attn_norm: np.ndarray | None = None  # (dim,): Gemma's RMSNorm of the attention output
    post_ffn_norm: np.ndarray | None = None  # (dim,): and of the FFN output
    experts: MixtureOfExperts | None = None  # the feed-forward of a mixture-of-experts block (infer.moe)
    sinks: np.ndarray | None = None  # (n_heads,): gpt-oss's logit per query head that joins each softmax
    bo: np.ndarray | None = None  # (dim,): gpt-oss's attention output bias

    @classmethod
    def assemble(cls, vectors: dict[str, np.ndarray | None], attn_qkv: Linear, attn_output: Linear,
                 ffn_gate_up: Linear | None, ffn_down: Linear | None,
                 experts: MixtureOfExperts | None = None) -> LayerWeights:
        """A block from arch.layer_vectors' vectors and its products (named by the kinds of the
        architecture table, infer.arch; a stack by the kinds it stacks)."""
        return cls(attn_norm=vectors["attn_norm"], attn_qkv=attn_qkv, bqkv=vectors["bqkv"],  # type: ignore[arg-type]
                   attn_output=attn_output, ffn_norm=vectors["ffn_norm"],  # type: ignore[arg-type]
                   ffn_gate_up=ffn_gate_up, ffn_down=ffn_down,
                   q_norm=vectors["q_norm"], k_norm=vectors["k_norm"], post_attn_norm=vectors.get("post_attn_norm"),
                   post_ffn_norm=vectors.get("post_ffn_norm"), experts=experts, sinks=vectors.get("sinks"),
                   bo=vectors.get("bo"))

    @property
    def nbytes(self) -> int:
        parts = [self.attn_norm, self.attn_qkv, self.bqkv, self.attn_output, self.ffn_norm, self.ffn_gate_up,
                 self.ffn_down, self.q_norm, self.k_norm, self.post_attn_norm, self.post_ffn_norm, self.experts,
                 self.sinks, self.bo]
        return sum(p.nbytes for p in parts if p is not None)


class WeightProvider(Protocol):
    """Where the forward pass gets its weights. The resident CPU store below dequantizes from the
    memory map; a streaming or GPU store implements the same four calls."""

    def layer(self, index: int) -> LayerWeights: ...

    def embed(self, tokens: np.ndarray) -> np.ndarray: ...  # (T,) ids -> (T, dim) float32

    def output_norm(self) -> np.ndarray: ...

    def output(self) -> Linear: ...  # (vocab, dim)


class DequantizedWeights:
    """The resident CPU weights: each layer dequantized on first use and kept while the float32
    total fits `budget_bytes` (least recently used layers are dropped first; a dropped layer is
    dequantized again on use). The file is assumed checked (infer.arch.check_model)."""

    def __init__(self, model: GGUFModel, args: ModelArgs, budget_bytes: int = 8 << 30,
                 match_llama_cpp: bool = True, exact: bool = False) -> None:
        self.model = model
        self.match_llama_cpp = match_llama_cpp  # round activations as llama.cpp does (else plain f32)
        self.exact = exact  # matrices as exact float64 (Linear's exact numerics)
        self.args = args
        self.budget_bytes = budget_bytes
        self._cache: OrderedDict[object, Any] = OrderedDict()
        self._cached_bytes = 0

    def _cached(self, key: object, build: Callable[[], Any]) -> Any:
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        value = build()
        size = value.nbytes
        while self._cache and self._cached_bytes + size > self.budget_bytes:
            _, dropped = self._cache.popitem(last=False)
            self._cached_bytes -= dropped.nbytes
        if size <= self.budget_bytes:
            self._cache[key] = value
            self._cached_bytes += size
        return value

    def _f32(self, name: str) -> np.ndarray:
        return self.model.tensor(name).dequantize()

    def _linear(self, *names: str) -> Linear:
        parts = []
        for name in names:
            info = self.model.tensor(name)
            fmt = quants.activation_format(info.ggml_type) if self.match_llama_cpp else "f32"
            weight = info.dequantize(np.float64 if self.exact else np.float32)
            parts.append((weight.reshape(1, -1) if weight.ndim == 1 else weight, fmt))  # a vector: one row
        return Linear(parts, self.exact)

    def _build_layer(self, i: int) -> LayerWeights:
        def name(kind: str) -> str:
            return tensor_name(i, kind)

        vectors = {kind: self._f32(name(kind)) for kind in layer_vector_kinds(self.args)
                   if name(kind) in self.model.tensors}
        return LayerWeights.assemble(
            layer_vectors(self.args, i, vectors),
            attn_qkv=self._linear(*(name(f"attn_{x}") for x in "qkv")),
            attn_output=self._linear(name("attn_output")),
            ffn_gate_up=None if self.args.n_experts else self._linear(name("ffn_gate"), name("ffn_up")),
            ffn_down=None if self.args.n_experts else self._linear(name("ffn_down")),
            experts=self._experts(i) if self.args.n_experts else None,
        )

    def _experts(self, i: int) -> MixtureOfExperts:
        """Block i's router and experts, the expert stacks dequantized whole and multiplied in NumPy
        (the packed engine keeps them packed: infer.packed_weights.PackedWeights._experts)."""
        def stack(kind: str) -> tuple[np.ndarray, str]:  # (n_experts, rows, cols), its activation format
            info = self.model.tensor(tensor_name(i, kind))
            fmt = quants.activation_format(info.ggml_type) if self.match_llama_cpp else "f32"
            return info.dequantize(np.float64 if self.exact else np.float32), fmt

        return MixtureOfExperts.from_stacks(
            self._linear(tensor_name(i, "ffn_gate_inp")), stack("ffn_gate_exps"), stack("ffn_up_exps"),
            stack("ffn_down_exps"), lambda parts: Linear(parts, self.exact), self.args.n_experts_used,
            self.args.expert_weights_norm, self._shared_expert(i), **self._expert_biases(i))

    def _expert_biases(self, i: int) -> dict[str, object]:
        """Block i's gating and expert biases as MixtureOfExperts takes them (gpt-oss; else none)."""
        table = self.args.arch_table
        if table.gating == "softmax":
            return {}

        def bias(kind: str) -> np.ndarray:
            return self._f32(tensor_name(i, kind)).reshape(self.args.n_experts, -1)

        return {"gating": table.gating, "router_bias": self._f32(tensor_name(i, "ffn_gate_inp.bias")),
                "gate_up_bias": np.concatenate([bias("ffn_gate_exps.bias"), bias("ffn_up_exps.bias")], axis=1),
                "down_bias": bias("ffn_down_exps.bias")}

    def _shared_expert(self, i: int) -> SharedExpert | None:
        """Block i's shared expert (qwen2moe), its matrices as this provider makes products."""
        if not self.args.shared_ffn_dim:
            return None
        return SharedExpert(self._linear(tensor_name(i, "ffn_gate_inp_shexp")),  # type: ignore[arg-type]
                            self._linear(tensor_name(i, "ffn_gate_shexp"), tensor_name(i, "ffn_up_shexp")),  # type: ignore[arg-type]
                            self._linear(tensor_name(i, "ffn_down_shexp")))  # type: ignore[arg-type]

    def layer(self, index: int) -> LayerWeights:
        return self._cached(("layer", index), lambda: self._build_layer(index))  # type: ignore[return-value]

    def warm(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Dequantizes every layer and the output matrix now (as far as the budget holds them);
        progress(done, total) after each of the n_layers + 1 steps."""
        total = self.args.n_layers + 1
        for i in range(self.args.n_layers):
            self.layer(i)
            if progress is not None:
                progress(i + 1, total)
        self.output()
        self.output_norm()
        if progress is not None:
            progress(total, total)

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        info = self.model.tensor(TOKEN_EMBD)
        return quants.dequantize_rows(info.data, info.ggml_type, self.args.dim, tokens)

    def output_norm(self) -> np.ndarray:
        return self._cached("output_norm", lambda: self._f32(OUTPUT_NORM))  # type: ignore[return-value]

    def output(self) -> Linear:
        return self._cached("output", lambda: self._linear(output_name(self.model)))  # type: ignore[return-value]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, exact: bool = False) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight in float32, rounded step by step as llama.cpp's CPU does:
    float32 squares summed in double, the mean rounded to float32, scale = 1 / sqrt(mean + eps),
    then x * scale * weight. With `exact` the sum of squares is taken in float64 over exact squares
    and rounded to float32 once, then x / sqrt(...) * weight (the GPU's rmsnorm kernels compute the
    same steps)."""
    if exact:
        x64 = x.astype(np.float64)
        mean_square = np.sum(x64 * x64, axis=-1, keepdims=True).astype(np.float32) / np.float32(x.shape[-1])
        return (x / np.sqrt(mean_square + np.float32(eps))) * weight
    # Bit for bit llama.cpp's: inputs made from quantized weights land exactly on 8-bit rounding
    # ties (x * 127 / amax = k + 1/2) often enough that the last bit of the norm decides them.
    squares = np.sum(np.square(x, dtype=np.float32), axis=-1, keepdims=True, dtype=np.float64)
    mean_square = (squares / x.shape[-1]).astype(np.float32)
    scale = np.float32(1.0) / np.sqrt(mean_square + np.float32(eps))
    return x * scale * weight


_GELU_TABLE: np.ndarray | None = None  # geglu's: the GELU of every float16 value


def _fma_f32(a: np.ndarray, b: np.ndarray, c: float) -> np.ndarray:
    """a * b + c rounded once to float32, as the fused multiply-add does: the product of two float32
    values is exact in float64; the sum's float64 rounding error (TwoSum) breaks the rare tie that a
    second rounding to float32 would otherwise decide wrongly."""
    p, c64 = a.astype(np.float64) * b.astype(np.float64), np.float64(c)
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)
    r = s.astype(np.float32)
    tie = (np.abs(r.astype(np.float64) - s) == np.abs(np.nextafter(r, np.float32(np.inf)).astype(np.float64)
                                                        - r.astype(np.float64)) / 2) & (err != 0)
    nudged = np.where(err > 0, np.nextafter(s, np.inf), np.nextafter(s, -np.inf)).astype(np.float32)
    return np.where(tie, nudged, r)


def _gelu_f32(x: np.ndarray) -> np.ndarray:
    """ggml_gelu_f32 in float32 as llama.cpp's CPU build computes it: 0.5 x (1 + tanh(sqrt(2/pi) x
    (1 + 0.044715 x^2))) with the C library's tanhf, the compiler fusing 1 + (0.044715 x) x into one
    multiply-add (the table entry at x = -1.999 tells the two apart: it lands on either side of a
    float16 rounding boundary)."""
    f32 = np.float32
    inner = (f32(0.79788456080286535587989211986876) * x).astype(f32) * _fma_f32((f32(0.044715) * x).astype(f32), x, 1.0)
    tanh = _c_tanhf(inner.astype(f32))
    return (f32(0.5) * x * (f32(1.0) + tanh)).astype(f32)


def _c_tanhf(x: np.ndarray) -> np.ndarray:
    fn = c_float_function("tanhf")
    if fn is None:
        return np.tanh(x)
    return np.fromiter(map(fn, x.ravel().tolist()), np.float32, x.size).reshape(x.shape)


def geglu(gate: np.ndarray, up: np.ndarray, exact: bool = False) -> np.ndarray:
    """gelu_tanh(gate) * up as llama.cpp's CPU computes it: the GELU read from a table over the
    float16 value of the gate (ggml_table_gelu_f16: each entry the float32 GELU rounded to float16),
    0 at or below -10, the gate itself at or above 10. `exact`: the tanh formula in float64."""
    if exact:
        g = gate.astype(np.float64)
        gelu = 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * g * (1.0 + 0.044715 * g * g)))
        return (gelu * up).astype(np.float32)
    global _GELU_TABLE
    if _GELU_TABLE is None:
        halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
        with np.errstate(all="ignore"):
            _GELU_TABLE = _gelu_f32(halves).astype(np.float16).astype(np.float32)
    with np.errstate(over="ignore"):
        bits = gate.astype(np.float16).view(np.uint16)
    gelu = np.where(gate <= -10.0, np.float32(0.0), np.where(gate >= 10.0, gate, _GELU_TABLE[bits]))
    return (gelu * up).astype(np.float32)


# gpt-oss's gated activation (llama.cpp's ggml_swiglu_oai with the constants its graph passes)
SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0


def swiglu_oai(gate: np.ndarray, up: np.ndarray, exact: bool = False) -> np.ndarray:
    """min(g, 7) * sigmoid(1.702 min(g, 7)) * (clamp(u, -7, 7) + 1), float32, in ggml's steps:
    x / (1 + expf(alpha * -x)) * (y + 1), each rounded to float32 (expf correctly rounded here);
    `exact`: evaluated in float64 and rounded once."""
    f32 = np.float32
    x = np.minimum(gate, f32(SWIGLU_OAI_LIMIT))
    y = np.clip(up, f32(-SWIGLU_OAI_LIMIT), f32(SWIGLU_OAI_LIMIT))
    if exact:
        x64 = x.astype(np.float64)
        return (x64 / (1.0 + np.exp(-SWIGLU_OAI_ALPHA * x64)) * (y.astype(np.float64) + 1.0)).astype(f32)
    e = np.exp((f32(SWIGLU_OAI_ALPHA) * -x).astype(np.float64)).astype(f32)
    return ((x / (f32(1.0) + e)).astype(f32) * (y + f32(1.0))).astype(f32, copy=False)


class Transformer:
    """The decoder on the CPU. forward_batch runs each (tokens, cache) pair at its cache's next
    positions in ONE pass over the layers (each layer's weights fetched once for all rows; attention
    per sequence over its own cache) and extends the caches; forward is a batch of one."""

    device = "cpu"
    skip: frozenset[int] = frozenset()  # layers left out (infer.layerskip: a self-draft), none by default

    def __init__(self, args: ModelArgs, weights: WeightProvider, rope_freq_factors: np.ndarray | None = None,
                 exact: bool = False):
        self.args = args
        self.weights = weights
        self.rope = Rope(args, rope_freq_factors, fma=not exact)  # llama.cpp's rounding, or the GPU's
        # Gemma 3's local (sliding-window) layers rotate with their own base, unscaled (llama.cpp)
        local = dataclasses.replace(args, rope_base=args.rope_base_local, rope_scaling=RopeScaling())
        self.rope_local = Rope(local, None, fma=not exact) if args.rope_base_local else self.rope
        self.exact = exact  # float64 sums (module docstring); the weights' Linears must be exact too
        # packed weights: norms, rope and attention in C too (infer.cpu_layers); never with exact
        self._native = None if exact else getattr(weights, "native_layers", None)
        self._decode: tuple[frozenset[int], Any] | None = None  # (skip, its infer.cpu_decode.DecodeLayers or None)

    def new_cache(self, max_tokens: int) -> KVCache:
        return KVCache(self.args, max_tokens)

    def forward(self, tokens: np.ndarray, cache: KVCache, all_logits: bool = False, prompt: bool = False) -> np.ndarray:
        """Logits: (T, vocab) with all_logits, else (vocab,) of the last token. `prompt` (the GPU's
        prompt rows, docs/GPU.md) changes nothing here: the CPU has one product."""
        return self.forward_batch([(np.asarray(tokens, dtype=np.int64), cache)], all_logits)[0]

    def prefill(self, tokens: np.ndarray, cache: KVCache) -> None:
        """Appends prompt tokens whose logits nobody reads."""
        self.forward_batch([(np.asarray(tokens, dtype=np.int64), cache)])

    def forward_batch(self, batch: Batch, all_logits: bool = False, prompt_rows: Sequence[int] | None = None,
                      hidden: list[np.ndarray] | None = None,
                      trees: Sequence[np.ndarray | None] | None = None) -> list[np.ndarray]:
        """Per sequence the logits of its last token (vocab,) or of every token (T, vocab);
        prompt_rows as the GPU's (ignored: one product here). hidden: gets the residual stream
        (rows, dim) entering the first layer and after each layer run. trees[s]: the parents of
        sequence s's tokens, a token tree verified in this pass (forward_tree): all its logits come
        back and its cache's length stays (KVCache.accept keeps a path)."""
        sizes = check_batch(batch, self.args.vocab_size)
        trees = list(trees) if trees is not None else [None] * len(batch)
        if len(trees) != len(batch):
            raise ValueError(f"{len(trees)} trees for {len(batch)} sequences")
        if sizes == [1] and trees == [None] and hidden is None and self._native is not None:
            decode = self._decode_layers()
            if decode is not None:  # one token: every layer in one native call, the same bits
                tokens, cache = batch[0]
                cos, sin = self.rope.angles(np.array([cache.length]))
                x = decode(self._embed(np.asarray(tokens, np.int64))[0], cache, cache.length, cos, sin)
                cache.length += 1
                return [self.weights.output()(self.norm(x[None], self.weights.output_norm()))[0]]
        bounds = np.cumsum([0, *sizes])
        positions: list[np.ndarray] = []
        masks: list[np.ndarray | None] = []  # a tree's: each node sees the cache and its ancestors
        for (_, cache), n, parents in zip(batch, sizes, trees, strict=True):
            if parents is None:
                positions.append(np.arange(cache.length, cache.length + n))
                masks.append(None)
                continue
            if len(parents) != n:
                raise ValueError(f"a token tree of {n} tokens has {len(parents)} parents")
            depths, allowed = tree_layout(np.asarray(parents, np.int64), cache.length)
            positions.append(cache.length + depths)
            masks.append(allowed)
        angles = {rope: [rope.angles(p) for p in positions] for rope in {self.rope, self.rope_local}}
        # each sequence's local-layer mask, made once for every local layer: its own (causal or the
        # tree's) within the window over the keys' positions
        windows: list[np.ndarray | None] = []
        for p, (_, cache), mask in zip(positions, batch, masks, strict=True):
            if not any(self.args.local_layers):
                windows.append(None)
                continue
            keys = np.arange(cache.length + len(p)) if mask is None else np.concatenate([np.arange(cache.length), p])
            seen = visible(p, keys, self.args.sliding_window)
            windows.append(seen if mask is None else seen & mask)
        x = self._embed(np.concatenate([np.asarray(t, np.int64) for t, _ in batch]))  # (rows, dim)
        if hidden is not None:
            hidden.append(x)
        for i in range(self.args.n_layers):
            if i in self.skip:
                continue
            layer = self.weights.layer(i)  # fetched once for the whole batch
            h = self.norm(x, layer.attn_norm)
            attn = np.empty_like(x)
            for s, (_, cache) in enumerate(batch):
                rows = slice(bounds[s], bounds[s + 1])
                cos, sin = angles[self._rope_of(i)][s]
                seen = windows[s] if self.args.is_local(i) else masks[s]
                attn[rows] = self._attention(h[rows], layer, cache, i, cache.length, cos, sin, seen)
            x = self._residual(x, attn, layer.post_attn_norm)
            x = self._residual(x, self._feed_forward(self.norm(x, layer.ffn_norm), layer), layer.post_ffn_norm)
            if hidden is not None:
                hidden.append(x)
        for (_, cache), n, parents in zip(batch, sizes, trees, strict=True):
            if parents is None:
                cache.length += n
        # the rows whose logits come back: every row of a tree (or with all_logits), else the last
        every = [all_logits or parents is not None for parents in trees]
        picked = np.concatenate([np.arange(bounds[s], bounds[s + 1]) if every[s] else bounds[s + 1 : s + 2] - 1
                                 for s in range(len(batch))])
        logits = self.weights.output()(self.norm(x[picked], self.weights.output_norm()))
        counts = np.cumsum([0, *(sizes[s] if every[s] else 1 for s in range(len(batch)))])
        return [logits[counts[s]:counts[s + 1]] if every[s] else logits[counts[s]] for s in range(len(batch))]

    def forward_tree(self, tokens: np.ndarray, parents: np.ndarray, cache: KVCache) -> np.ndarray:
        """Logits (N, vocab) of every node of a token tree after the cache's positions, in one pass:
        node i (parents[i] < i, or -1 for a root that follows the cache) sits at position
        cache.length + its depth and sees the cache and its ancestors. Its keys and values go to cache
        slot cache.length + i; cache.length does not move (KVCache.accept keeps a path)."""
        tokens, parents = np.asarray(tokens, dtype=np.int64), np.asarray(parents, dtype=np.int64)
        return self.forward_batch([(tokens, cache)], trees=[parents])[0]

    def _decode_layers(self) -> Any:
        """The one-call decode of the packed path (infer.cpu_decode) for this model's layers, or None
        where it does not apply; made on first use (a layer-skipping view makes its own)."""
        if self._decode is None or self._decode[0] != self.skip:
            from infer.cpu_decode import DecodeLayers

            self._decode = (self.skip, DecodeLayers.for_model(self))
        return self._decode[1]

    def norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        if self._native is not None:
            return self._native.norm(x, weight, self.args.norm_eps)
        return rms_norm(x, weight, self.args.norm_eps, self.exact)

    def _rope_of(self, layer: int) -> Rope:
        return self.rope_local if self.args.is_local(layer) else self.rope

    def _embed(self, tokens: np.ndarray) -> np.ndarray:
        x = self.weights.embed(tokens)
        if self.args.arch_table.embed_scale:  # Gemma: ggml_scale by sqrtf(width)
            x = x * np.float32(np.sqrt(np.float32(self.args.dim)))
        return x

    def _residual(self, x: np.ndarray, out: np.ndarray, post_norm: np.ndarray | None) -> np.ndarray:
        """x + out, out first RMS-normalised where the block has a post-norm (Gemma)."""
        return x + (out if post_norm is None else self.norm(out, post_norm))

    def _attention(self, h: np.ndarray, layer: LayerWeights, cache: KVCache, index: int, start: int,
                   cos: np.ndarray, sin: np.ndarray, allowed: np.ndarray | None = None) -> np.ndarray:
        a, n = self.args, h.shape[0]
        qkv = layer.attn_qkv(h)  # (T, q_dim + 2 kv_dim)
        if layer.bqkv is not None:
            qkv += layer.bqkv
        q = qkv[:, : a.q_dim].reshape(n, a.n_heads, a.head_dim)
        k = qkv[:, a.q_dim : a.q_dim + a.kv_dim].reshape(n, a.n_kv_heads, a.head_dim)
        v = qkv[:, a.q_dim + a.kv_dim :].reshape(n, a.n_kv_heads, a.head_dim)
        if layer.q_norm is not None:  # Qwen3: each head normalised before rope
            q = self.norm(q, layer.q_norm)
        if layer.k_norm is not None:
            k = self.norm(k, layer.k_norm)
        if self._native is not None:  # rope and attention in C, not the reference's bits (infer.cpu_layers)
            out = self._native.attention(a, self.rope, q, k, v, cache, index, start, cos, sin, allowed, layer.sinks)
            out = layer.attn_output(out)
            return out if layer.bo is None else out + layer.bo
        q, k = self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin)
        # (S, kv_heads, head_dim) float16: slots first .. start + n - 1 (a local layer's ring may
        # hold only the last of them; the rest are outside every row's window)
        keys, values, first = cache.store(index, start, k, v)
        group = a.n_heads // a.n_kv_heads  # query heads per KV head (GQA): head h reads KV head h // group
        # float16 operands; float32 products, or float64 ones (exact) with `exact`
        wide = np.float64 if self.exact else np.float32
        scale = np.float32(a.scores_scale)
        if a.arch_table.scale_queries:  # Gemma: Q scaled in float32 (ggml_scale), attention's own scale 1
            q, scale = (q * scale).astype(np.float32), np.float32(1.0)
        q = q.astype(np.float16).astype(wide).reshape(n, a.n_kv_heads, group, a.head_dim).transpose(1, 2, 0, 3)
        keys = keys.astype(wide).transpose(1, 2, 0)[:, None]  # (kv, 1, hd, S)
        values = values.astype(wide).transpose(1, 0, 2)[:, None]  # (kv, 1, S, hd)
        scores = (q @ keys).astype(np.float32) * scale  # (kv, g, T, S)
        if allowed is not None:  # a token tree or a window: each row sees the slots allowed
            scores[..., ~allowed[:, first:]] = -np.inf
        elif n > 1:  # causal mask: query t (position start + t) sees keys 0..start + t
            future = np.arange(first, start + n)[None, :] > np.arange(start, start + n)[:, None]
            scores[..., future] = -np.inf
        top = scores.max(axis=-1, keepdims=True)
        if layer.sinks is not None:  # gpt-oss: each head's sink logit joins the max and the sum, not the values
            sinks = layer.sinks.reshape(a.n_kv_heads, group, 1, 1)
            top = np.maximum(top, sinks)
        exps = np.exp(scores.astype(wide) - top)
        total = exps.sum(axis=-1, keepdims=True)
        if layer.sinks is not None:
            total = total + np.exp((sinks - top).astype(wide))
        probs = (exps / total).astype(np.float32).astype(np.float16)
        out = (probs.astype(wide) @ values).astype(np.float32)  # (kv, g, T, hd)
        out = layer.attn_output(out.transpose(2, 0, 1, 3).reshape(n, a.q_dim))
        return out if layer.bo is None else out + layer.bo

    def _feed_forward(self, h: np.ndarray, layer: LayerWeights) -> np.ndarray:
        if layer.experts is not None:  # the routed experts' gated products, weighted (infer.moe)
            return layer.experts(h, self._glu, self.exact)
        gate_up = layer.ffn_gate_up(h)  # type: ignore[misc]  # (T, 2 ffn)
        gate, up = gate_up[:, : self.args.ffn_dim], gate_up[:, self.args.ffn_dim :]
        return layer.ffn_down(self._glu(gate, up))  # type: ignore[misc]

    def _glu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        """The gated activation, float32: GeGLU (Gemma) or SwiGLU, with `exact` evaluated in float64
        and rounded once."""
        if self.args.arch_table.activation == "gelu_tanh":
            return geglu(gate, up, self.exact)
        if self.args.arch_table.activation == "swiglu_oai":
            return swiglu_oai(gate, up, self.exact)
        if self._native is not None:  # packed: a fixed exp of its own (infer.cpu_decode uses it too)
            return self._native.swiglu(gate, up)
        if self.exact:
            gate = gate.astype(np.float64)
        return (gate / (1.0 + np.exp(-gate)) * up).astype(np.float32, copy=False)


def load_transformer(model: GGUFModel, budget_bytes: int = 8 << 30, match_llama_cpp: bool = True,
                     exact: bool = False, packed: bool | None = None) -> Transformer:
    """The CPU forward pass for a checked file (every tensor present, with its shape and type).
    packed: matrices left in the mapped file and multiplied by the native kernels
    (infer.packed_weights; None: NVMEDIRECT_CPU_PRODUCTS, by default packed when the native kernels are
    built); never with exact."""
    from infer.packed_weights import PackedWeights, native_products_requested

    args = check_model(model)
    if (native_products_requested() if packed is None else packed) and not exact:
        weights: DequantizedWeights = PackedWeights(model, args, budget_bytes, match_llama_cpp, exact)
    else:
        weights = DequantizedWeights(model, args, budget_bytes, match_llama_cpp, exact)
    return Transformer(args, weights, rope_freq_factors(model, args), exact)
