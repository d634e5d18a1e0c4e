"""A decode token through every layer of the packed engine in one native call (native/cpu_decode.c):
the layer recipe of infer.model.Transformer.forward_batch with infer.cpu_layers, for one row, with
the same native functions and float operations, so a token decoded here gets the bits it gets in a
batch, a prompt or a tree. What it saves is Python: ~12 small calls a layer, a quarter of SmolLM2's
decode step on the 2-core machine.

It takes the common case only: dense pre-norm layers with global attention and SwiGLU (Llama,
Qwen2, Qwen3: biases and q/k norms included), all four products packed, weights resident
(infer.packed_weights.PackedWeights). Anything else (Gemma's post-norms and local layers, experts,
the CPU streaming simulation, float matrices left to NumPy) decodes through forward_batch as before.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from infer import cpu_kernels, cpu_layers
from infer.arch import ModelArgs
from infer.kv_cache import KVCache


def _pointer(ffi: Any, a: np.ndarray | None, ctype: str = "float *") -> Any:
    return ffi.NULL if a is None else ffi.cast(ctype, ffi.from_buffer(a))


class DecodeLayers:
    """decode(x, cache, pos, cos, sin): x (dim,) float32 through the layers `indices` in place,
    writing the token's keys and values at slot pos of `cache`. Made by `for_model` where the model
    qualifies."""

    def __init__(self, args: ModelArgs, layers: list[Any], indices: list[int], attention: cpu_layers.Attention,
                 threads: int) -> None:
        ffi, lib = cpu_kernels.native()
        self.args, self.indices, self.threads = args, indices, threads
        self._keep: list[Any] = [attention]  # what the C structures point into
        self._shape = ffi.new("struct qdot_decode_shape *")
        self._shape.attn = attention.native_shape
        self._shape.dim, self._shape.ffn_dim, self._shape.eps = args.dim, args.ffn_dim, args.norm_eps
        self._layers = ffi.new("struct qdot_decode_layer[]", len(indices))
        for slot, layer in zip(self._layers, layers, strict=True):
            vectors = {name: None if getattr(layer, name) is None else
                       np.ascontiguousarray(getattr(layer, name), dtype=np.float32)
                       for name in ("attn_norm", "ffn_norm", "bqkv", "q_norm", "k_norm")}
            self._keep.append(vectors)
            for name, vector in vectors.items():
                setattr(slot, name, _pointer(ffi, vector))
            for field, product in (("qkv", layer.attn_qkv), ("o", layer.attn_output), ("gate_up", layer.ffn_gate_up),
                                   ("down", layer.ffn_down)):
                self._keep.append(product)
                target = getattr(slot, field)
                target.n_parts, target.w, target.types, target.rows, target.cols = product.native_parts
        self._scratch = np.empty(int(lib.qdot_decode_scratch_floats(self._shape)), np.float32)
        self._caches: weakref.WeakKeyDictionary[KVCache, tuple[Any, ...]] = weakref.WeakKeyDictionary()

    @classmethod
    def for_model(cls, model: Any) -> DecodeLayers | None:
        """For an infer.model.Transformer on packed resident weights whose layers qualify (module
        docstring), else None."""
        from infer.packed_weights import PackedLinear, PackedWeights

        a, weights = model.args, model.weights
        if model.exact or type(weights) is not PackedWeights or a.n_experts or any(a.local_layers) or \
                a.arch_table.activation != "silu" or a.arch_table.scale_queries or model.rope_local is not model.rope:
            return None
        indices = [i for i in range(a.n_layers) if i not in model.skip]
        layers = [weights.layer(i) for i in indices]
        for layer in layers:
            products = (layer.attn_qkv, layer.attn_output, layer.ffn_gate_up, layer.ffn_down)
            if not all(isinstance(p, PackedLinear) for p in products) or layer.post_attn_norm is not None or \
                    layer.post_ffn_norm is not None or layer.experts is not None:
                return None
        attention = weights.native_layers.attention_for(a, model.rope)
        return cls(a, layers, indices, attention, weights.native_layers.threads)

    def _cache_layers(self, cache: KVCache) -> Any:
        """The layer structures with `cache`'s keys and values filled in (made once per cache: its
        arrays of the global layers never move)."""
        kept = self._caches.get(cache)
        if kept is None:
            ffi, _ = cpu_kernels.native()
            layers = ffi.new("struct qdot_decode_layer[]", len(self.indices))
            ffi.memmove(layers, self._layers, ffi.sizeof(self._layers))
            keys, values = cache.global_arrays()
            for slot, i in zip(layers, self.indices, strict=True):
                j = cache.index[i]
                slot.keys = ffi.cast("uint16_t *", ffi.from_buffer(keys[j]))
                slot.values = ffi.cast("uint16_t *", ffi.from_buffer(values[j]))
            kept = self._caches[cache] = (layers, keys, values)
        return kept[0]

    def __call__(self, x: np.ndarray, cache: KVCache, pos: int, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        if not 0 <= pos < cache.max_tokens:
            raise ValueError(f"position {pos} outside a cache of {cache.max_tokens}")
        ffi, lib = cpu_kernels.native()
        x = np.array(x, dtype=np.float32).reshape(self.args.dim)
        cos, sin = np.ascontiguousarray(cos, np.float32), np.ascontiguousarray(sin, np.float32)
        rc = lib.qdot_decode_layers(
            self._shape, self._cache_layers(cache), len(self.indices), ffi.from_buffer("float[]", x, require_writable=True),
            ffi.from_buffer("float[]", cos), ffi.from_buffer("float[]", sin), pos,
            ffi.from_buffer("float[]", self._scratch, require_writable=True), self.threads)
        cpu_kernels.raise_for(rc, "the decode step")
        return x
