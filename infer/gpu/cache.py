"""The KV cache of one sequence on the GPU, and its token history.

A global layer keeps every position of the context. A local (sliding-window) layer keeps a ring
of `ring` positions, position p in slot p % ring: a query at position p reads only p - window + 1
.. p, and a pass writes at most `capacity` rows, so window + capacity positions are enough for
every row of every pass (the oldest key a pass still needs is never overwritten by the same pass).
The kernels take each row's slot modulo its cache's positions (infer/kernels/attention.cu)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import cupy
import numpy as np

from infer.arch import ModelArgs
from infer.gpu import uploads


@dataclass
class KVGroup:
    """Keys and values of the layers of one kind (global or local): (layers, n_kv_heads, positions,
    head_dim) float16 each."""

    keys: cupy.ndarray
    values: cupy.ndarray

    @property
    def positions(self) -> int:
        return int(self.keys.shape[2])


@dataclass
class GpuKVCache:
    """Keys and values of one sequence; `length` = positions filled, as in infer.model.KVCache.
    `tokens[p]` is the token at position p where the device sampled it (generation on the GPU)."""

    full: KVGroup  # the global layers: max_tokens positions
    ring: KVGroup  # the local layers: a ring of min(max_tokens, window + capacity) positions
    layer_group: tuple[tuple[bool, int], ...]  # per layer: (in the ring group, index in its group)
    max_tokens: int
    tokens: cupy.ndarray  # int32[max_tokens + 1]
    length: int = 0
    stream: cupy.cuda.Stream | None = None  # the model's: work on the cache is ordered on it
    window: int = 0  # the local layers' sliding window
    lost: int = 0  # positions below this were overwritten in the local layers' ring
    stage: uploads.HostStage | None = field(default=None, repr=False)  # accept's indices (NVMEDIRECT_SM_UPLOADS)

    @classmethod
    def allocate(cls, args: ModelArgs, max_tokens: int, capacity: int, stream: cupy.cuda.Stream | None,
                 layers: Sequence[int] | None = None) -> GpuKVCache:
        """A cache of max_tokens positions for passes of up to `capacity` rows (`layers`: of those
        layers only, a stage of a pipeline across GPUs)."""
        ring = args.kv_ring(max_tokens, capacity)
        layers = range(args.n_layers) if layers is None else layers
        counts = {False: 0, True: 0}
        layer_group = []
        for i in range(args.n_layers):
            if i not in layers:
                layer_group.append((False, -1))  # another stage's
                continue
            is_local = args.is_local(i)
            layer_group.append((is_local, counts[is_local]))
            counts[is_local] += 1

        def group(layers: int, positions: int) -> KVGroup:
            shape = (layers, args.n_kv_heads, positions, args.head_dim)
            return KVGroup(cupy.zeros(shape, cupy.float16), cupy.zeros(shape, cupy.float16))

        with stream or cupy.cuda.get_current_stream():
            return cls(group(counts[False], max_tokens), group(counts[True], ring), tuple(layer_group), max_tokens,
                       cupy.zeros(max_tokens + 1, cupy.int32), stream=stream, window=args.sliding_window)

    @staticmethod
    def nbytes_for(args: ModelArgs, max_tokens: int, capacity: int) -> int:
        """Device bytes of one cache (keys, values and the token history)."""
        return args.kv_cache_nbytes(max_tokens, capacity) + 4 * (max_tokens + 1)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for g in (self.full, self.ring) for a in (g.keys, g.values)) + int(self.tokens.nbytes)

    def layer(self, i: int) -> tuple[KVGroup, int]:
        """(the group holding layer i, its index there)."""
        in_ring, index = self.layer_group[i]
        if index < 0:
            raise IndexError(f"layer {i} is another stage's: this cache holds no keys or values for it")
        return (self.ring if in_ring else self.full), index

    def wrote(self, end: int) -> None:
        """A pass writes slots up to end - 1: in the ring, it overwrites positions below end - ring."""
        if self.ring.keys.shape[0]:
            self.lost = max(self.lost, end - self.ring.positions)

    def can_rewind(self, length: int) -> bool:
        """Whether the cache still holds what a pass at position `length` reads (a rewind to a
        shared prefix): the ring has not overwritten the window before it."""
        return length == 0 or max(0, length - self.window + 1) >= self.lost

    def copy_from(self, other: GpuKVCache) -> None:
        """This cache made the same as `other` (a cache of the same model and size)."""
        for mine, theirs in ((self.full, other.full), (self.ring, other.ring)):
            mine.keys[...] = theirs.keys
            mine.values[...] = theirs.values
        self.tokens[...] = other.tokens
        self.length, self.lost = other.length, other.lost

    def accept(self, nodes: Sequence[int]) -> None:
        """After a token-tree pass: keep tree nodes `nodes` (a root-to-node path) as the positions
        after `length`, and count them in (as infer.model.KVCache.accept)."""
        src = self.length + np.asarray(nodes, dtype=np.int64)
        dst = self.length + np.arange(len(nodes))
        if (src != dst).any():
            groups = [g for g in (self.full, self.ring) if g.keys.shape[0]]
            stream = self.stream or cupy.cuda.get_current_stream()
            # every group's (take, put) indices in one upload
            host = np.concatenate([a % g.positions for g in groups for a in (src, dst)])
            with stream:
                if uploads.by_sms():  # not queued behind a ring's refills on the copy engine
                    self.stage = self.stage or uploads.HostStage()
                    index = self.stage.put(host, stream)
                else:
                    index = cupy.asarray(host)
                n = len(src)
                for k, group in enumerate(groups):
                    take, put = index[2 * k * n : (2 * k + 1) * n], index[(2 * k + 1) * n : (2 * k + 2) * n]
                    group.keys[:, :, put] = group.keys[:, :, take]  # the right side is gathered first
                    group.values[:, :, put] = group.values[:, :, take]
        self.length += len(nodes)
