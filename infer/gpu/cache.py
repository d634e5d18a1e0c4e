"""The KV cache of one sequence on the GPU, and its token history."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import cupy
import numpy as np

from infer.arch import ModelArgs


@dataclass
class GpuKVCache:
    """Keys and values of one sequence; `length` = positions filled, as in infer.model.KVCache.
    `tokens[p]` is the token at position p where the device sampled it (generation on the GPU)."""

    keys: cupy.ndarray  # (n_layers, n_kv_heads, max_tokens, head_dim) float16
    values: cupy.ndarray
    max_tokens: int
    tokens: cupy.ndarray  # int32[max_tokens + 1]
    length: int = 0
    stream: cupy.cuda.Stream | None = None  # the model's: work on the cache is ordered on it

    @classmethod
    def allocate(cls, args: ModelArgs, max_tokens: int, stream: cupy.cuda.Stream | None) -> GpuKVCache:
        shape = (args.n_layers, args.n_kv_heads, max_tokens, args.head_dim)
        with stream or cupy.cuda.get_current_stream():
            return cls(cupy.zeros(shape, cupy.float16), cupy.zeros(shape, cupy.float16), max_tokens,
                       cupy.zeros(max_tokens + 1, cupy.int32), stream=stream)

    @staticmethod
    def nbytes_for(args: ModelArgs, max_tokens: int) -> int:
        return 2 * 2 * args.n_layers * args.n_kv_heads * max_tokens * args.head_dim + 4 * (max_tokens + 1)

    def accept(self, nodes: Sequence[int]) -> None:
        """After a token-tree pass: keep tree nodes `nodes` (a root-to-node path) as the positions
        after `length`, and count them in (as infer.model.KVCache.accept)."""
        src = self.length + np.asarray(nodes, dtype=np.int64)
        dst = self.length + np.arange(len(nodes))
        if (src != dst).any():
            with self.stream or cupy.cuda.get_current_stream():
                take, put = cupy.asarray(src), cupy.asarray(dst)
                self.keys[:, :, put] = self.keys[:, :, take]  # the right side is gathered first
                self.values[:, :, put] = self.values[:, :, take]
        self.length += len(nodes)
