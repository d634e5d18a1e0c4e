"""The packed path's operations around the products (issue 28): RMSNorm, the rotary embedding and
attention in C (native/cpu_layers.c through infer.cpu_kernels), in place of the ~30 small NumPy
calls a layer makes for them, which cost SmolLM2 about a quarter of its decode time.

RMSNorm and rope give the NumPy reference's bits (infer.model.rms_norm, infer.layers.Rope.apply).
Attention cannot (the reference's products are OpenBLAS's and its exp NumPy's): it keeps the
reference's float16 roundings of the query, the cache and the probabilities and sums in a fixed order
of its own over the slots a row sees, the same whatever the batch, the threads or the code path (AVX2
or portable): a sequence's logits do not depend on the pass it rides in, and a token tree's node gets
its path's. The NumPy code stays the reference and the exact mode; this is used only with the packed
weights (infer.packed_weights).
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
        self._attention: dict[Rope, cpu_kernels.Attention] = {}  # per Transformer (its rope and args)

    @staticmethod
    def norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        if x.dtype != np.float32:  # the reference takes any float; the C code float32
            from infer.model import rms_norm

            return rms_norm(x, weight, eps)
        return cpu_kernels.rms_norm(x, weight, eps)

    @staticmethod
    def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        return cpu_kernels.swiglu(gate, up)

    def attention_for(self, args: ModelArgs, rope: Rope) -> cpu_kernels.Attention:
        """The native attention for a Transformer's args and rope (made once per rope: a test may
        run one model's weights under other args, such as the other rope pairing)."""
        attend = self._attention.get(rope)
        if attend is None:
            q_scale, scale = 1.0, float(np.float32(args.scores_scale))
            if args.arch_table.scale_queries:  # Gemma: Q scaled in float32 before its float16 rounding
                q_scale, scale = scale, 1.0
            attend = self._attention[rope] = cpu_kernels.Attention(
                args.n_heads, args.n_kv_heads, args.head_dim, rope.n_pairs, rope.args.rope_neox, rope.fma, q_scale,
                scale, self.threads)
        return attend

    def attention(self, args: ModelArgs, rope: Rope, q: np.ndarray, k: np.ndarray, v: np.ndarray, cache: KVCache,
                  index: int, start: int, cos: np.ndarray, sin: np.ndarray,
                  allowed: np.ndarray | None) -> np.ndarray:
        """Transformer._attention after the QKV product (and Qwen3's / Gemma's q and k norms): q (T,
        heads, head_dim), k and v (T, kv_heads, head_dim) -> (T, q_dim), the input of attn_output.
        K is rotated here for the cache; Q inside the attention call (one call less a layer)."""
        attend = self.attention_for(args, rope)
        k = cpu_kernels.rope(k, cos, sin, rope.n_pairs, rope.args.rope_neox, rope.fma)
        keys, values, first = cache.store(index, start, k, v)  # (S, kv_heads, head_dim) float16
        return attend(q, cos, sin, keys, values, first, start, None if allowed is None else allowed[:, first:])
