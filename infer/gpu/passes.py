"""The rows of a pass: which token each row carries, at which position of which sequence, where its
key and value go, what it attends to, and which rows want logits. The host lays a pass out as a
list of `Row`s; `PassIndex` holds them on the device (one host-to-device copy a pass), where every
kernel of the pass reads them, so one captured CUDA graph per row count serves every pass.

A row's span (what it attends to) is its sequence's positions 0 .. pos: positions below `base` are
the cache's own slots, the rest the slots listed in `anc` (a token-tree node: its ancestors from
the tree's root, then itself). A decode token or a prompt position has no list: base = pos + 1.

A row is canonical (its logits are read: a decode token, a tree node, a prompt's last token, a
scored prompt) or a prompt row (a prompt token whose logits nobody reads). A pass lays its
canonical rows out first and its prompt rows after them (`pass_layout`), each region padded with
null rows; the products take the canonical rows through the canonical kernels and the prompt rows
through the prompt products (docs/GPU.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import cupy
import numpy as np

from infer.gpu.attention import RowFields
from infer.gpu.cache import GpuKVCache
from infer.gpu.uploads import copy_from_host
from infer.sampler import GREEDY_BELOW

# Row counts a pass is padded to (graphs are captured per bucket); a model's capacity is the last.
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def bucket_of(n: int, capacity: int) -> int:
    """The smallest bucket that holds n rows (the capacity itself past the last bucket below it)."""
    if n > capacity:
        raise ValueError(f"a pass of {n} rows exceeds the capacity of {capacity}")
    return next((b for b in BUCKETS if n <= b <= capacity), capacity)


@dataclass
class Row:
    """One token of a pass (`prompt`: a prompt token whose logits nobody reads, see pass_layout)."""

    cache: GpuKVCache
    token: int
    pos: int
    slot: int
    base: int  # span positions >= base come from `anc`
    anc: np.ndarray | None = None
    history: bool = False  # the sampled next token goes to cache.tokens[pos + 1]
    temperature: float = 0.0
    seed: int = 0
    prompt: bool = False
    history_at: int = 0  # with `history`: the token goes to the int32 array at this device address instead, at [pos + 1]


def sequence_rows(cache: GpuKVCache, tokens: Sequence[int], start: int, prompt: int = 0) -> list[Row]:
    """Rows of tokens at positions start, start + 1, ... of a sequence (a prompt chunk or a decode
    token): each stored in the slot of its position, attending to the slots before it; the first
    `prompt` of them are prompt rows."""
    return [Row(cache, int(t), start + j, start + j, start + j + 1, prompt=j < prompt) for j, t in enumerate(tokens)]


PROMPT_GRAIN = 64  # a pass's prompt region is padded to a multiple of this (fewer graph shapes)


@dataclass(frozen=True)
class PassShape:
    """The rows of a pass: [0, canonical) the canonical region, [canonical, canonical + prompt) the
    prompt region (each with its null padding rows). A CUDA graph is captured per shape."""

    canonical: int
    prompt: int = 0

    @property
    def rows(self) -> int:
        return self.canonical + self.prompt


def pass_layout(rows: Sequence[Row], capacity: int) -> tuple[list[Row | None], PassShape, list[int]]:
    """Where each row of a pass goes: (slots, shape, position of rows[i]). The canonical rows come
    first, padded to a bucket; the prompt rows after them, padded to a multiple of PROMPT_GRAIN (or
    to the capacity left). None in `slots` is a null row."""
    canonical = [i for i, r in enumerate(rows) if not r.prompt]
    prompt = [i for i, r in enumerate(rows) if r.prompt]
    bc = bucket_of(len(canonical), capacity) if canonical or not prompt else 0
    bp = min(-(-len(prompt) // PROMPT_GRAIN) * PROMPT_GRAIN, capacity - bc) if prompt else 0
    if len(prompt) > bp:
        raise ValueError(f"a pass of {len(canonical)} canonical rows (padded to {bc}) and {len(prompt)} prompt "
                         f"rows exceeds the capacity of {capacity}")
    slots: list[Row | None] = [None] * (bc + bp)
    where = [0] * len(rows)
    for k, i in enumerate(canonical):
        slots[k], where[i] = rows[i], k
    for k, i in enumerate(prompt):
        slots[bc + k], where[i] = rows[i], bc + k
    return slots, PassShape(bc, bp), where


def tree_rows(cache: GpuKVCache, tokens: Sequence[int], parents: np.ndarray) -> list[Row]:
    """Rows of a token tree over the cache (node i in slot cache.length + i, parents[i] < i, root -1):
    node i at position length + depth(i), attending to the cache and its ancestors' slots."""
    anc, positions = tree_ancestors(parents, cache.length)
    depth = positions - cache.length
    return [Row(cache, int(t), int(positions[i]), cache.length + i, cache.length, anc[i, : depth[i] + 1])
            for i, t in enumerate(tokens)]


def tree_ancestors(parents: np.ndarray, base: int) -> tuple[np.ndarray, np.ndarray]:
    """Host rows of a token tree's spans (node i in cache slot base + i, parents[i] < i, root -1):
    anc (nodes, deepest path + 1) int32, row i the slots of node i's ancestors from the root, then
    its own, and the nodes' positions (base + depth) int32."""
    from infer.layers import tree_depths

    parents = np.asarray(parents, dtype=np.int64)
    depth = tree_depths(parents)
    anc = np.zeros((len(parents), int(depth.max()) + 1), np.int32)
    for i, parent in enumerate(parents):  # a node's row is its parent's row, then itself
        if parent >= 0:
            anc[i, : depth[i]] = anc[parent, : depth[i]]
        anc[i, depth[i]] = base + i
    return anc, (base + depth).astype(np.int32)


def _cache_fields(cache: GpuKVCache) -> dict[str, int]:
    """A row's cache as the kernels see it: each group's keys, values and positions."""
    full, ring = cache.full, cache.ring
    return {"kptr": full.keys.data.ptr, "vptr": full.values.data.ptr, "cap": full.positions,
            "kptr_l": ring.keys.data.ptr, "vptr_l": ring.values.data.ptr, "ring": ring.positions}


class PassIndex:
    """The device table of up to `capacity` rows (row `capacity` is a null row: padding and unused
    logits rows point at it), filled from the host through a pinned staging buffer."""

    # kptr/vptr/cap: the row's global layers' keys, values and positions; kptr_l/vptr_l/ring: its
    # local layers' (infer.gpu.cache)
    I64 = ("kptr", "vptr", "kptr_l", "vptr_l", "hist")
    I32 = ("tok", "pos", "slot", "base", "anc_off", "cap", "ring", "out_rows", "seeds", "live")
    F32 = ("temps",)

    def __init__(self, capacity: int, null_cache: GpuKVCache, stream: cupy.cuda.Stream) -> None:
        self.capacity, self.stream, self.null = capacity, stream, null_cache
        self.live_rows = np.zeros(0, np.int64)  # the current pass's rows that are not null rows
        self.live_prompt_rows = 0  # of them in the prompt region
        rows = capacity + 1
        self.anc_capacity = capacity * (capacity + 1) // 2  # any tree of `capacity` nodes
        self.header = rows * (8 * len(self.I64) + 4 * len(self.I32) + 4 * len(self.F32))
        self.nbytes = self._table_nbytes(capacity)  # what the host lays out and copies
        self._pinned = cupy.cuda.alloc_pinned_memory(self.nbytes)
        self.host = np.frombuffer(self._pinned, np.uint8, self.nbytes)
        with stream:
            self.device = cupy.zeros(self.nbytes_for(capacity), cupy.uint8)
        self.kept = self.device[self.nbytes :].view(cupy.int32)  # tokens kept across a fill (fill's carry)
        self._views(rows)
        self._uploaded = cupy.cuda.Event(disable_timing=True)
        self._uploaded.record(stream)
        self.n = 0  # real rows of the last fill
        self.shape = PassShape(0)

    @classmethod
    def nbytes_for(cls, capacity: int) -> int:
        """Device bytes of the index of `capacity` rows: the table, and a token a row kept across a fill."""
        return cls._table_nbytes(capacity) + 4 * (capacity + 1)

    @classmethod
    def _table_nbytes(cls, capacity: int) -> int:
        """Bytes of the table (pinned on the host, copied to the device)."""
        per_row = 8 * len(cls.I64) + 4 * len(cls.I32) + 4 * len(cls.F32)
        return (capacity + 1) * per_row + 4 * capacity * (capacity + 1) // 2

    def _views(self, rows: int) -> None:
        at = 0
        self.h: dict[str, np.ndarray] = {}
        self.d: dict[str, cupy.ndarray] = {}
        for names, dtype in ((self.I64, np.uint64), (self.I32, np.int32), (self.F32, np.float32)):
            for name in names:
                size = rows * np.dtype(dtype).itemsize
                self.h[name] = self.host[at : at + size].view(np.uint32 if name == "seeds" else dtype)
                self.d[name] = self.device[at : at + size].view(cupy.uint32 if name == "seeds" else dtype)
                at += size
        self.h["anc"] = self.host[at:].view(np.int32)
        self.d["anc"] = self.device[at : self.nbytes].view(cupy.int32)

    @property
    def fields(self) -> RowFields:
        """The rows' fields for a global layer."""
        d = self.d
        return RowFields(d["pos"], d["slot"], d["base"], d["anc_off"], d["anc"], d["kptr"], d["vptr"], d["cap"])

    @property
    def fields_local(self) -> RowFields:
        """The rows' fields for a local (sliding-window) layer: their rings."""
        d = self.d
        return RowFields(d["pos"], d["slot"], d["base"], d["anc_off"], d["anc"], d["kptr_l"], d["vptr_l"], d["ring"])

    def fill(self, slots: Sequence[Row | None], shape: PassShape, out_rows: Sequence[int], carry: int = 0) -> None:
        """Lays out the pass's rows (`slots`, shape.rows of them: None a null row) and the rows whose
        logits are wanted, and copies them to the device on the stream (infer.gpu.uploads; the staging buffer is reused
        only after the previous copy ran). carry: rows 0..carry-1 keep the tokens the previous pass
        sampled into them (advance), which the host does not know (their Row.token is not used)."""
        n, cap = len(slots), self.capacity
        if n != shape.rows or n > cap or len(out_rows) > cap:
            raise ValueError(f"{n} rows for a pass shape of {shape.rows} (capacity {cap}), {len(out_rows)} logits rows")
        self._uploaded.synchronize()
        h, null = self.h, self.null
        real = [(r, row) for r, row in enumerate(slots) if row is not None]
        self.live_rows = np.asarray([r for r, _ in real], np.int64)  # host work of a pass skips the null rows
        self.live_prompt_rows = int(np.count_nonzero(self.live_rows >= shape.canonical))
        nulls = np.asarray([r for r, row in enumerate(slots) if row is None] + [cap], np.int64)
        # null rows: the null cache's one slot, no history
        for name, value in _cache_fields(null).items():
            h[name][nulls] = value
        h["hist"][nulls] = 0
        for name in ("tok", "pos", "slot", "seeds", "live"):
            h[name][nulls] = 0
        h["base"][nulls], h["anc_off"][nulls], h["temps"][nulls] = 1, -1, 0.0
        used = 0
        if real:
            idx = np.asarray([r for r, _ in real], np.int64)
            rows = [row for _, row in real]
            fields = {id(row.cache): _cache_fields(row.cache) for row in rows}
            for name in ("kptr", "vptr", "kptr_l", "vptr_l", "cap", "ring"):
                h[name][idx] = [fields[id(row.cache)][name] for row in rows]
            h["hist"][idx] = [(row.history_at or row.cache.tokens.data.ptr) if row.history else 0 for row in rows]
            h["tok"][idx] = [row.token for row in rows]
            h["pos"][idx] = [row.pos for row in rows]
            h["live"][idx] = 1  # a mixture of experts routes no null row (infer/kernels/moe.cu)
            h["slot"][idx] = [row.slot for row in rows]
            h["base"][idx] = [row.base for row in rows]
            # the host sampler's rule: temperatures too small to divide by are greedy
            h["temps"][idx] = [0.0 if row.temperature < GREEDY_BELOW else row.temperature for row in rows]
            h["seeds"][idx] = [row.seed & 0xFFFFFFFF for row in rows]
            h["anc_off"][idx] = -1
            for r, row in real:
                if row.anc is None:
                    continue
                k = len(row.anc)
                if used + k > self.anc_capacity:
                    raise ValueError("token-tree spans exceed the pass index")
                h["anc"][used : used + k] = row.anc
                h["anc_off"][r] = used
                used += k
        h["out_rows"][:] = cap
        h["out_rows"][: len(out_rows)] = np.asarray(out_rows, np.int32)
        size = self.header + 4 * used
        with self.stream:
            if carry:
                self.kept[:carry] = self.d["tok"][:carry]
            copy_from_host(self.device.data.ptr, self.host.ctypes.data, size, self.stream)
            self._uploaded.record(self.stream)
            if carry:
                self.d["tok"][:carry] = self.kept[:carry]
        self.n, self.shape = len(real), shape

    def set_out_rows(self, out_rows: Sequence[int]) -> None:
        """Only the logits rows (a head run in blocks)."""
        self._uploaded.synchronize()
        h = self.h["out_rows"]
        h[:] = self.capacity
        h[: len(out_rows)] = np.asarray(out_rows, np.int32)
        off = int(self.h["out_rows"].ctypes.data - self.host.ctypes.data)
        copy_from_host(self.device.data.ptr + off, h.ctypes.data, h.nbytes, self.stream)
        self._uploaded.record(self.stream)
