"""The KV cache of one sequence on the CPU: float16 keys and values like llama.cpp's default.

A global layer keeps every position. A local (sliding-window) layer keeps a ring: position p in
slot p % ring, where ring is the window plus the largest pass so far (at most the context), so the
keys a pass still reads are never overwritten by the same pass; a larger pass widens the ring
first. infer.gpu.cache lays the GPU's cache out the same way."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from infer.arch import ModelArgs

PASS_ROWS = 512  # rows a pass is expected to hold at most (a prompt chunk); a larger one widens the ring


class KVCache:
    """Keys and values of every layer for positions [0, length)."""

    def __init__(self, args: ModelArgs, max_tokens: int, pass_rows: int | None = None) -> None:
        self.args = args
        self.max_tokens = max_tokens
        self.length = 0  # positions filled (committed after the last layer of a forward pass)
        self.lost = 0  # positions below this were overwritten in the local layers' ring
        self.local = [args.is_local(i) for i in range(args.n_layers)]
        self.index = [sum(self.local[:i]) if self.local[i] else i - sum(self.local[:i]) for i in range(args.n_layers)]
        n_local = sum(self.local)
        self.ring = args.kv_ring(max_tokens, PASS_ROWS if pass_rows is None else pass_rows)
        tail = (args.n_kv_heads, args.head_dim)
        self._full = [np.zeros((args.n_layers - n_local, max_tokens, *tail), np.float16) for _ in range(2)]
        self._rings = [np.zeros((n_local, self.ring, *tail), np.float16) for _ in range(2)]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self._full, *self._rings))

    def global_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The global layers' keys and values, each (layers, max_tokens, kv_heads, head_dim) float16
        (layer i at index[i]): for a native writer (infer.cpu_decode)."""
        return self._full[0], self._full[1]

    def store(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """Writes (T, kv_heads, head_dim) at slots start ..; returns the keys and values of the slots
        the layer still holds up to start + T, in slot order (S, kv_heads, head_dim), and the first
        of those slots (0 for a global layer; a local layer's ring holds the last `ring`)."""
        end, j = start + k.shape[0], self.index[layer]
        if not self.local[layer]:
            keys, values = self._full
            keys[j, start:end], values[j, start:end] = k, v
            return keys[j, :end], values[j, :end], 0
        self._widen(k.shape[0], start)
        self.lost = max(self.lost, end - self.ring)
        keys, values = self._rings
        slots = np.arange(start, end) % self.ring
        keys[j, slots], values[j, slots] = k, v
        if end <= self.ring:  # not wrapped yet: slot = position
            return keys[j, :end], values[j, :end], 0
        held = np.arange(end - self.ring, end) % self.ring
        return keys[j, held], values[j, held], end - self.ring

    def can_rewind(self, length: int) -> bool:
        """Whether the cache still holds what a pass at position `length` reads (a rewind to a
        shared prefix): the ring has not overwritten the window before it."""
        return length == 0 or max(0, length - self.args.sliding_window + 1) >= self.lost

    def _widen(self, rows: int, start: int) -> None:
        """A ring wide enough for a pass of `rows` at `start`: the window and the pass, every local
        layer at once (the first local layer of the pass widens it; the rest find it wide)."""
        want = self.args.kv_ring(self.max_tokens, rows)
        if want <= self.ring:
            return
        held = np.arange(max(0, start - self.ring), start)  # the positions the ring holds now
        for i, old in enumerate(self._rings):
            new = np.zeros((old.shape[0], want, *old.shape[2:]), old.dtype)
            new[:, held % want] = old[:, held % self.ring]
            self._rings[i] = new
        self.ring = want

    def accept(self, nodes: Sequence[int]) -> None:
        """After forward_tree: keep the keys and values of tree nodes `nodes` (a root-to-node path,
        indices increasing) as the positions after `length`, and count them in."""
        start = self.length
        for j, node in enumerate(nodes):
            if node != j:
                for group, size in ((self._full, self.max_tokens), (self._rings, self.ring)):
                    for a in group:
                        a[:, (start + j) % size] = a[:, (start + node) % size]
        self.length = start + len(nodes)
