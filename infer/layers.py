"""Pieces every engine's layer shares: rotary position embedding (llama.cpp's float32 steps,
linear and YaRN scaling, per-pair frequency factors), attention masks (causal, sliding window, token
trees) and the checks of a pass's batch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from infer.arch import ModelArgs
from infer.cmath import c_float_function


class Cache(Protocol):
    """One sequence's keys and values, positions [0, length) filled: what a pass needs of a KV cache
    (infer.kv_cache.KVCache on the CPU, infer.gpu.cache.GpuKVCache)."""

    length: int
    max_tokens: int

    def can_rewind(self, length: int) -> bool:
        """Whether `length` may be set back to this (a local layer's ring may have overwritten the
        window before it)."""
        ...


Batch = Sequence[tuple[np.ndarray, Cache]]  # a pass's (tokens, cache) pairs


def _c_math() -> tuple[Callable[[float], float], Callable[[float], float], Callable[[float, float], float]] | None:
    """The C library's cosf, sinf and powf, if there is one to load."""
    functions = [c_float_function(name, nargs) for name, nargs in (("cosf", 1), ("sinf", 1), ("powf", 2))]
    return None if None in functions else tuple(functions)  # type: ignore[return-value]


_C_MATH = _c_math()


class Rope:
    """Rotary position embedding over the first `rope_dim` dimensions of each head.

    The angles are llama.cpp's bit for bit: theta_scale = powf(base, -2/d), a running float32
    product, cosf and sinf of the C library (NumPy's float32 cos and sin differ from them in the last
    bit for about one angle in eight, and a rotated query or key one bit off rounds to another
    float16 about once in 8000). With `fma` the rotation rounds as llama.cpp's compiled loop does,
    which fuses the first product of each line: fma(a, c, -(b*s)) and fma(a, s, b*c); without it,
    each product and the sum are rounded on their own (what the GPU kernels compute)."""

    def __init__(self, args: ModelArgs, freq_factors: np.ndarray | None, fma: bool = False) -> None:
        self.args = args
        self.n_pairs = args.rope_dim // 2
        exponent = np.float32(-2.0) / np.float32(args.rope_dim)
        self.theta_scale = np.float32(_C_MATH[2](args.rope_base, exponent) if _C_MATH
                                      else np.float32(args.rope_base) ** np.float64(exponent))
        self.freq_factors = freq_factors
        self.fma = fma
        # linear / YaRN scaling and the attention factor (infer.rope_scaling.RopeScaling)
        self._scaled = args.rope_scaling.angle_scale(args.rope_dim, args.rope_base)
        self._table = np.zeros((2, 0, self.n_pairs), np.float32)  # cos, sin of positions 0.. so far

    def angles(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin, each (T, n_pairs). The angle of pair i is pos * theta_scale**i, computed as
        llama.cpp does (a running float32 product, then / freq_factor[i], then linear or YaRN
        scaling, and cos and sin times the attention factor) so both sides rotate by the same
        rounded angles."""
        positions = np.asarray(positions, dtype=np.int64)
        if len(positions) and positions.max() >= self._table.shape[1]:
            known = self._table.shape[1]
            more = np.arange(known, max(int(positions.max()) + 1, 2 * known))
            self._table = np.concatenate([self._table, self._cos_sin(more)], axis=1)
        return self._table[0, positions], self._table[1, positions]

    def _cos_sin(self, positions: np.ndarray) -> np.ndarray:
        steps = np.full((len(positions), self.n_pairs), self.theta_scale, dtype=np.float32)
        steps[:, 0] = positions.astype(np.float32)
        theta = np.cumprod(steps, axis=1, dtype=np.float32)
        if self.freq_factors is not None:
            theta = theta / self.freq_factors
        theta, mscale = self._scaled(theta, np.arange(self.n_pairs))
        if _C_MATH is None:  # no C library: the correctly rounded values, almost always the same
            cos_sin = np.stack([np.cos(theta.astype(np.float64)), np.sin(theta.astype(np.float64))]).astype(np.float32)
        else:
            cosf, sinf, _ = _C_MATH
            flat = theta.ravel().tolist()
            cos_sin = np.stack([np.fromiter(map(f, flat), np.float32, len(flat)).reshape(theta.shape)
                                for f in (cosf, sinf)])
        return cos_sin if mscale == 1 else cos_sin * np.float32(mscale)

    def apply(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """x: (T, heads, head_dim) -> rotated copy."""
        n = self.n_pairs
        out = x.copy()
        c, s = cos[:, None, :], sin[:, None, :]
        if self.args.rope_neox:
            a, b = x[..., :n], x[..., n : 2 * n]
            first, second = slice(0, n), slice(n, 2 * n)
        else:
            a, b = x[..., 0 : 2 * n : 2], x[..., 1 : 2 * n : 2]
            first, second = slice(0, 2 * n, 2), slice(1, 2 * n, 2)
        if self.fma:  # a float64 sum of an exact product and a float32 is one rounding away from fma's
            wide = np.float64
            out[..., first] = a.astype(wide) * c - b * s
            out[..., second] = a.astype(wide) * s + b * c
        else:
            out[..., first] = a * c - b * s
            out[..., second] = a * s + b * c
        return out



def visible(query_pos: np.ndarray, key_pos: np.ndarray, window: int) -> np.ndarray:
    """(queries, keys) mask: a key at or before the query and fewer than `window` positions back
    (llama.cpp's standard sliding window: masked when query - key >= window)."""
    diff = np.asarray(query_pos)[:, None] - np.asarray(key_pos)[None, :]
    return (diff >= 0) & (diff < window)


def tree_depths(parents: Sequence[int] | np.ndarray) -> np.ndarray:
    """Depths (N,) of the nodes of a token tree (parents[i] < i, -1 for a root)."""
    depths = np.zeros(len(parents), np.int64)
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"tree node {i} has parent {parent}: parents must come before their children")
        if parent >= 0:
            depths[i] = depths[parent] + 1
    return depths


def tree_layout(parents: np.ndarray, start: int) -> tuple[np.ndarray, np.ndarray]:
    """Depths (N,) of the nodes of a token tree (parents[i] < i, -1 for a root), and the attention
    mask (N, start + N): node i sees positions 0 .. start - 1 and the slots of its ancestors and itself."""
    n = len(parents)
    depths = tree_depths(parents)
    allowed = np.zeros((n, start + n), bool)
    allowed[:, :start] = True
    for i, parent in enumerate(parents):
        if parent >= 0:
            allowed[i, start : start + i] = allowed[parent, start : start + i]
        allowed[i, start + i] = True
    return depths, allowed


def check_batch(batch: Batch, vocab_size: int) -> list[int]:
    """Token counts of a pass's sequences, after checking each has tokens that fit its cache and
    lie in the vocabulary."""
    sizes = []
    for tokens, cache in batch:
        n = len(tokens)
        if n == 0:
            raise ValueError("every sequence in a pass needs at least one token")
        if cache.length + n > cache.max_tokens:
            raise ValueError(f"context full: {cache.length} + {n} tokens exceed the context size {cache.max_tokens}")
        if np.min(tokens) < 0 or np.max(tokens) >= vocab_size:
            raise ValueError(f"token id outside the vocabulary of {vocab_size}")
        sizes.append(n)
    return sizes
