"""The packed path's operations around the products (issue 28): RMSNorm, the rotary embedding,
attention and SwiGLU in C (native/cpu_layers.c, native/cpu_decode.c; the products themselves are
infer.cpu_kernels'), in place of the ~30 small NumPy calls a layer makes for them, which cost
SmolLM2 about a quarter of its decode time.

RMSNorm and rope give the NumPy reference's bits (infer.model.rms_norm, infer.layers.Rope.apply).
Attention cannot (the reference's products are OpenBLAS's and its exp NumPy's): it keeps the
reference's float16 roundings of the query, the cache and the probabilities and sums in a fixed order
of its own over the slots a row sees, the same whatever the batch, the threads or the code path (AVX2
or portable): a sequence's logits do not depend on the pass it rides in, and a token tree's node gets
its path's. SwiGLU's exp is a fixed polynomial too, not NumPy's. The NumPy code stays the reference
and the exact mode; this is used only with the packed weights (infer.packed_weights).
"""

from __future__ import annotations

import numpy as np

from infer import cpu_kernels
from infer.arch import ModelArgs
from infer.kv_cache import KVCache
from infer.layers import Rope


class NativeLayers:
    """What Transformer.norm and Transformer._attention call instead of NumPy when the weights are
    packed (PackedWeights.native_layers)."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = cpu_kernels.default_threads() if threads is None else int(threads)
        self._attention: dict[Rope, Attention] = {}  # per Transformer (its rope and args)

    @staticmethod
    def norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        if x.dtype != np.float32:  # the reference takes any float; the C code float32
            from infer.model import rms_norm as reference

            return reference(x, weight, eps)
        return rms_norm(x, weight, eps)

    @staticmethod
    def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        return swiglu(gate, up)

    def attention_for(self, args: ModelArgs, rotary: Rope) -> Attention:
        """The native attention for a Transformer's args and rope (made once per rope: a test may
        run one model's weights under other args, such as the other rope pairing)."""
        attend = self._attention.get(rotary)
        if attend is None:
            q_scale, scale = 1.0, float(np.float32(args.scores_scale))
            if args.arch_table.scale_queries:  # Gemma: Q scaled in float32 before its float16 rounding
                q_scale, scale = scale, 1.0
            attend = self._attention[rotary] = Attention(
                args.n_heads, args.n_kv_heads, args.head_dim, rotary.n_pairs, rotary.args.rope_neox, rotary.fma, q_scale,
                scale, self.threads)
        return attend

    def attention(self, args: ModelArgs, rotary: Rope, q: np.ndarray, k: np.ndarray, v: np.ndarray, cache: KVCache,
                  index: int, start: int, cos: np.ndarray, sin: np.ndarray,
                  allowed: np.ndarray | None, sinks: np.ndarray | None = None) -> np.ndarray:
        """Transformer._attention after the QKV product (and Qwen3's / Gemma's q and k norms): q (T,
        heads, head_dim), k and v (T, kv_heads, head_dim) -> (T, q_dim), the input of attn_output.
        K is rotated here for the cache; Q inside the attention call (one call less a layer). sinks:
        gpt-oss's logit per query head (Attention)."""
        attend = self.attention_for(args, rotary)
        k = rope(k, cos, sin, rotary.n_pairs, rotary.args.rope_neox, rotary.fma)
        keys, values, first = cache.store(index, start, k, v)  # (S, kv_heads, head_dim) float16
        return attend(q, cos, sin, keys, values, first, start, None if allowed is None else allowed[:, first:], sinks)


# ---------------------------------------------------------------- the native calls (native/cpu_layers.c,
# native/cpu_decode.c). Called ~100 times a decode step, so the checks are the few that keep the C code
# inside its buffers.

def _ffi():  # noqa: ANN202 - cffi's objects have no useful static types
    return cpu_kernels.native()[0]


def _native_lib():  # noqa: ANN202
    return cpu_kernels.native()[1]


def _f32(a: np.ndarray) -> np.ndarray:
    return a if a.dtype == np.float32 and a.flags.c_contiguous else np.ascontiguousarray(a, dtype=np.float32)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """infer.model.rms_norm (not exact) bit for bit: x (..., cols) float32 and weight (cols,)."""
    x, weight = _f32(x), _f32(weight)
    cols = x.shape[-1]
    if weight.shape != (cols,):
        raise ValueError(f"weight of shape {weight.shape} for rows of {cols}")
    out = np.empty_like(x)
    ffi = _ffi()
    _native_lib().qdot_rms_norm(ffi.from_buffer("float[]", x), ffi.from_buffer("float[]", weight), x.size // max(cols, 1),
                         cols, float(eps), ffi.from_buffer("float[]", out, require_writable=True))
    return out


def _cos_sin(cos: np.ndarray, sin: np.ndarray, n: int, n_pairs: int) -> tuple[np.ndarray, np.ndarray]:
    cos, sin = _f32(cos), _f32(sin)
    if cos.shape != (n, n_pairs) or sin.shape != (n, n_pairs):
        raise ValueError(f"cos/sin {cos.shape}/{sin.shape} for {n} rows and {n_pairs} pairs")
    return cos, sin


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_pairs: int, neox: bool, fma: bool) -> np.ndarray:
    """infer.layers.Rope.apply bit for bit: x (T, heads, head_dim) float32, cos and sin (T, n_pairs)
    -> a new (T, heads, head_dim)."""
    x = _f32(x)  # a strided view (the K columns of a QKV product) copied: cheaper than its address
    n, heads, head_dim = x.shape
    if not 0 <= 2 * n_pairs <= head_dim:
        raise ValueError(f"{n_pairs} pairs in heads of {head_dim}")
    cos, sin = _cos_sin(cos, sin, n, n_pairs)
    out = np.empty((n, heads, head_dim), np.float32)
    ffi = _ffi()
    _native_lib().qdot_rope(ffi.from_buffer("float[]", x), n, heads, head_dim, n_pairs, ffi.from_buffer("float[]", cos),
                     ffi.from_buffer("float[]", sin), int(neox), int(fma),
                     ffi.from_buffer("float[]", out, require_writable=True))
    return out


class Attention:
    """Softmax attention over a float16 KV cache in native/cpu_layers.c, for one model's heads,
    rotary embedding and scales (fixed at construction). It rounds as
    infer.model.Transformer._attention does (the rotated query times q_scale, and the probabilities,
    to float16), but sums in its own fixed order, so the last bits differ from the reference's."""

    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int, n_pairs: int, neox: bool, fma: bool,
                 q_scale: float, scale: float, threads: int | None = None) -> None:
        if n_heads < 1 or n_kv_heads < 1 or n_heads % n_kv_heads or not 0 <= 2 * n_pairs <= head_dim:
            raise ValueError(f"{n_heads} query heads, {n_kv_heads} KV heads of {head_dim} with {n_pairs} "
                             "rotated pairs")
        _native_lib()
        self.n_heads, self.n_kv_heads, self.head_dim, self.n_pairs = n_heads, n_kv_heads, head_dim, n_pairs
        self.threads = cpu_kernels.default_threads() if threads is None else int(threads)
        self._shape = _ffi().new("struct qdot_attn_shape *", {
            "n_heads": n_heads, "n_kv_heads": n_kv_heads, "head_dim": head_dim, "n_pairs": n_pairs,
            "neox": int(neox), "fma": int(fma), "q_scale": q_scale, "scale": scale})

    @property
    def native_shape(self) -> object:
        """The struct qdot_attn_shape it calls with (infer.cpu_decode copies it)."""
        return self._shape[0]

    def __call__(self, q: np.ndarray, cos: np.ndarray | None, sin: np.ndarray | None, keys: np.ndarray,
                 values: np.ndarray, first: int, start: int, mask: np.ndarray | None = None,
                 sinks: np.ndarray | None = None) -> np.ndarray:
        """q (T, heads, head_dim) float32, not yet rotated when cos and sin (T, n_pairs) are given;
        keys, values (S, kv_heads, head_dim) float16, the slots of positions
        first..first+S-1. Query t (position start + t) sees the slots up to its position, or where
        mask (T, S) is true; sinks (heads,): a logit per head that joins its softmax with no value
        (gpt-oss). -> (T, heads * head_dim) float32."""
        n = q.shape[0]
        if q.shape[1:] != (self.n_heads, self.head_dim):
            raise ValueError(f"queries of shape {q.shape} for {self.n_heads} heads of {self.head_dim}")
        q = _f32(q)
        keys, values = np.ascontiguousarray(keys), np.ascontiguousarray(values)
        n_keys = keys.shape[0]
        if keys.dtype != np.float16 or values.dtype != np.float16 or keys.shape != values.shape or \
                keys.shape[1:] != (self.n_kv_heads, self.head_dim):
            raise ValueError(f"keys/values {keys.dtype} {keys.shape} / {values.dtype} {values.shape} for "
                             f"{self.n_kv_heads} KV heads of {self.head_dim}")
        ffi = _ffi()
        if mask is not None:
            if mask.shape != (n, n_keys):
                raise ValueError(f"mask of shape {mask.shape} for {n} rows and {n_keys} slots")
            mask = np.ascontiguousarray(mask, dtype=np.bool_).view(np.uint8)
        elif start < first or start - first + n > n_keys:
            raise ValueError(f"rows at {start}..{start + n - 1} past the slots {first}..{first + n_keys - 1}")
        rotate = cos is not None and sin is not None
        if rotate:
            cos, sin = _cos_sin(cos, sin, n, self.n_pairs)  # type: ignore[arg-type]
        if sinks is not None:
            sinks = _f32(sinks)
            if sinks.shape != (self.n_heads,):
                raise ValueError(f"sinks of shape {sinks.shape} for {self.n_heads} heads")
        out = np.empty((n, self.n_heads * self.head_dim), np.float32)
        rc = _native_lib().qdot_attention_sinks(
            self._shape, ffi.from_buffer("float[]", q), n, ffi.from_buffer("float[]", cos) if rotate else ffi.NULL,
            ffi.from_buffer("float[]", sin) if rotate else ffi.NULL, ffi.from_buffer(keys), ffi.from_buffer(values),
            n_keys, first, start, ffi.NULL if mask is None else ffi.from_buffer(mask),
            ffi.NULL if sinks is None else ffi.from_buffer("float[]", sinks),
            ffi.from_buffer("float[]", out, require_writable=True), self.threads)
        cpu_kernels.raise_for(rc, "attention")
        return out


def exp_softmax(x: np.ndarray) -> np.ndarray:
    """The attention's exp of x <= 0 (float32; 0 below -87), for tests."""
    x = _f32(x)
    y = np.empty_like(x)
    ffi = _ffi()
    _native_lib().qdot_exp_softmax(ffi.from_buffer("float[]", x), ffi.from_buffer("float[]", y, require_writable=True), x.size)
    return y


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up in float32, elementwise, with native/cpu_decode.c's fixed exp polynomial (not
    NumPy's): the packed path's SwiGLU, the same bits in its batched and its one-call decode recipe."""
    gate, up = _f32(gate), _f32(up)
    if gate.shape != up.shape:
        raise ValueError(f"gate {gate.shape} and up {up.shape} differ")
    out = np.empty_like(gate)
    ffi = _ffi()
    _native_lib().qdot_swiglu(ffi.from_buffer("float[]", gate), ffi.from_buffer("float[]", up), gate.size,
                       ffi.from_buffer("float[]", out, require_writable=True))
    return out
