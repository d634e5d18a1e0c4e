"""Attention of many query rows of one sequence over its float16 KV cache, with matrix products
(the decode kernels in attention.cu serve one new token).

The arithmetic is the CPU engine's (infer.model.Transformer._attention): the query rounded to
float16, float32 scores scaled by 1/sqrt(head_dim), masked, softmax, probabilities rounded to
float16, times the values. Scores are computed for blocks of query rows of about
ATTENTION_SCORES_BYTES, so a prompt against a long cache needs bounded memory (the budget counts
that block, infer.tiers.budget.activation_nbytes).

`allowed` generalises the causal mask: row t may see cache position s where allowed[t, s]
(a draft tree: each node sees the cache and its ancestors).
"""

from __future__ import annotations

import cupy
import numpy as np

from infer.tiers.budget import ATTENTION_SCORES_BYTES

F32, F16 = cupy.float32, cupy.float16


def causal_allowed(start: int, n: int) -> cupy.ndarray:
    """(n, start + n) bool: query t (position start + t) sees cache positions 0 .. start + t."""
    end = start + n
    return cupy.arange(end)[None, :] <= cupy.arange(start, end)[:, None]


def rows_attention(q: cupy.ndarray, k_cache: cupy.ndarray, v_cache: cupy.ndarray, end: int, n_kv_heads: int,
                   head_dim: int, out: cupy.ndarray, start: int | None = None,
                   allowed: cupy.ndarray | None = None) -> None:
    """out (T, n_heads * head_dim) = attention of the rotated queries q (T, n_heads * head_dim) over
    cache positions 0 .. end - 1 (caches (n_kv_heads, max_ctx, head_dim) float16, already holding
    the rows' own keys and values). Mask: `allowed` (T, end) bool, or causal for rows at positions
    start .. start + T - 1."""
    n = q.shape[0]
    n_heads = q.shape[1] // head_dim
    group = n_heads // n_kv_heads
    if allowed is None:
        if start is None:
            raise ValueError("rows_attention needs the rows' first position or a mask")
        allowed = causal_allowed(start, n)
    if allowed.shape != (n, end):
        raise ValueError(f"attention mask of shape {allowed.shape} for {n} rows over {end} positions")
    keys = k_cache[:, :end].astype(F32).transpose(0, 2, 1)  # (kv, hd, S)
    values = v_cache[:, :end].astype(F32)  # (kv, S, hd)
    scale = np.float32(1.0 / np.sqrt(head_dim))
    block = max(1, ATTENTION_SCORES_BYTES // (4 * n_heads * end))
    for t0 in range(0, n, block):
        t1 = min(n, t0 + block)
        nb = t1 - t0
        qg = q[t0:t1].astype(F16).astype(F32).reshape(nb, n_kv_heads, group, head_dim)
        qg = qg.transpose(1, 2, 0, 3).reshape(n_kv_heads, group * nb, head_dim)
        scores = cupy.matmul(qg, keys)  # (kv, g * nb, S)
        scores *= scale
        scores = scores.reshape(n_kv_heads, group, nb, end)
        scores = cupy.where(allowed[t0:t1], scores, np.float32(-np.inf))
        scores -= scores.max(axis=-1, keepdims=True)
        cupy.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        probs = scores.astype(F16).astype(F32)  # as the CPU engine (llama.cpp) rounds them
        del scores
        o = cupy.matmul(probs.reshape(n_kv_heads, group * nb, end), values)  # (kv, g * nb, hd)
        out[t0:t1] = o.reshape(n_kv_heads, group, nb, head_dim).transpose(2, 0, 1, 3).reshape(nb, n_heads * head_dim)
