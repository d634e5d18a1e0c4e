"""Experts as the unit of placement (issue 26) on the CPU engine: a mixture-of-experts model whose
experts do not all fit the RAM budget keeps what fits in RAM and reads the rest from tier C (the
O_DIRECT file reader or the NVMe driver, infer.tiers.tier_c) when a token is routed to them. Only
routed experts move; everything else (attention, norms, routers, the output) stays in the mapped file
as the packed engine has it.

`ExpertCache` holds expert slices (an expert's gate, up and down rows of its layer's stacks) in RAM
buffers up to a byte budget, kept by a policy of infer.tiers.expert_policy (by default a fading
frequency: an expert used often stays over one used once lately); a layer's missing experts are read
in one batch of requests. Router statistics (routings per expert) are kept per model between runs: a
run starts with the most used experts preloaded and its plan states the hit rate they predict. Products run on the cached bytes with the native kernels, so a tiered run
computes what the all-RAM packed run computes, bit for bit. `tiered_weights` makes the packed
engine's weights take their experts from such a cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from infer import cpu_kernels
from infer.arch import ModelArgs, tensor_name
from infer.cpu_kernels import ExpertTable
from infer.gguf_file import GGUFModel
from infer.host_memory import HugePageSlots
from infer.moe import Glu, MixtureOfExperts, weighted_sum
from infer.packed_weights import PackedLinear, PackedWeights
from infer.tiers.expert_policy import (
    DEFAULT_POLICY,
    ExpertResidency,
    ExpertUse,
)
from infer.tiers.plan import format_bytes
from infer.tiers.tier_c import StorageSource

STACKS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@dataclass(frozen=True)
class ExpertSlices:
    """Where a layer's experts lie in the file: per stack its offset, bytes per expert, GGML type,
    rows and columns of one expert's matrix."""

    offsets: tuple[int, int, int]
    nbytes: tuple[int, int, int]
    types: tuple[int, int, int]
    shapes: tuple[tuple[int, int], tuple[int, int], tuple[int, int]]

    @property
    def expert_nbytes(self) -> int:
        return sum(self.nbytes)

    def ranges(self, expert: int) -> list[tuple[int, int]]:
        return [(offset + expert * n, n) for offset, n in zip(self.offsets, self.nbytes, strict=True)]

    @classmethod
    def of_layer(cls, model: GGUFModel, layer: int) -> ExpertSlices:
        infos = [model.tensor(tensor_name(layer, kind)) for kind in STACKS]
        return cls(tuple(i.offset for i in infos), tuple(i.nbytes // i.shape[0] for i in infos),  # type: ignore[arg-type]
                   tuple(i.ggml_type for i in infos), tuple((i.shape[1], i.shape[2]) for i in infos))  # type: ignore[arg-type]


@dataclass
class ExpertStats:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    @property
    def read_gbps(self) -> float:
        return self.bytes_read / self.read_seconds / 1e9 if self.read_seconds else 0.0


class ExpertCache:
    """Expert slices of the MoE layers in RAM up to `budget_bytes`, the rest read from `source` on
    demand, kept by `policy` (infer.tiers.expert_policy). `use`: past router statistics, which seed the
    policy and `preload`; the routings of this run are added to them (`self.use`).
    `products(layer, expert)` -> (gate_up, down) packed products over the cached bytes."""

    def __init__(self, model: GGUFModel, args: ModelArgs, source: StorageSource | None, budget_bytes: int,
                 threads: int | None = None, policy: str = DEFAULT_POLICY, use: ExpertUse | None = None,
                 layers: Sequence[int] | None = None) -> None:
        """layers: the blocks whose experts this cache serves (default all; the GPU engine's CPU
        blocks when the others' experts are in VRAM): only theirs are preloaded and counted. source:
        None only when `layers` is empty (nothing is ever read)."""
        if not args.n_experts:
            raise ValueError(f"{model.path.name} has no experts to tier")
        self.args, self.source, self.threads = args, source, threads
        self.layers = list(range(args.n_layers)) if layers is None else sorted(set(layers))
        if source is None and self.layers:
            raise ValueError("an expert cache that serves blocks needs a tier C source to read them from")
        self.slices = [ExpertSlices.of_layer(model, i) for i in range(args.n_layers)]
        self.expert_nbytes = max(self.slices[i].expert_nbytes for i in self.layers) if self.layers else 0
        self.capacity = budget_bytes // self.expert_nbytes if self.layers else 0
        if self.layers and self.capacity < args.n_experts_used:
            raise ValueError(f"a RAM budget for experts of {format_bytes(budget_bytes)} holds {self.capacity} experts "
                             f"of {format_bytes(self.expert_nbytes)}; a token needs {args.n_experts_used} at once "
                             f"(at least {format_bytes(args.n_experts_used * self.expert_nbytes)})")
        self.budget_bytes = budget_bytes
        self.total_experts = len(self.layers) * args.n_experts
        self.use = use if use is not None else ExpertUse.empty(args.n_layers, args.n_experts)
        if use is not None and len(self.layers) < args.n_layers:  # the other blocks' experts are not ours to preload
            mask = np.zeros((args.n_layers, 1))
            mask[self.layers] = 1.0
            use = ExpertUse(use.counts * mask, use.tokens)
        self.residency = ExpertResidency(max(1, min(self.capacity, self.total_experts)), policy, use)
        self._held: dict[tuple[int, int], tuple[PackedLinear, PackedLinear]] = {}
        self._tables: dict[int, ExpertTable] = {}  # per layer: the held experts for a decode row's one call
        # the held experts' bytes: one slot each in a huge-page arena of the capacity (a decode streams
        # them as fast as the packed engine's huge-page copy; the budget bounds the mapping)
        slots = min(self.capacity, self.total_experts)
        try:
            self._slots = HugePageSlots(slots, self.expert_nbytes) if slots else None
        except OSError as err:
            raise ValueError(f"a RAM budget for experts of {format_bytes(budget_bytes)} ({slots} experts of "
                             f"{format_bytes(self.expert_nbytes)}) cannot be mapped: {err.strerror or err}; "
                             "lower --ram-budget") from None
        self._slot_of: dict[tuple[int, int], int] = {}
        self.stats = ExpertStats()

    @property
    def held(self) -> int:
        return len(self._held)

    def describe(self) -> str:
        if not self.total_experts:
            return "experts: every block's are in VRAM; none is read from tier C"
        share = min(self.capacity, self.total_experts) / self.total_experts
        return (f"experts: {self.total_experts} of {format_bytes(self.expert_nbytes)}; RAM holds "
                f"{min(self.capacity, self.total_experts)} ({share:.0%}), the rest read from tier C "
                f"({self.source.description}) when routed to; kept by {self.residency.policy}")

    def preload(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Reads the most used experts of the past statistics (the `use` given) into RAM, up to the
        capacity, a layer's at a time; progress(done, total) after each layer. Returns how many."""
        keys = self.residency.preload()
        by_layer: dict[int, list[int]] = {}
        for layer, expert in keys:
            by_layer.setdefault(layer, []).append(expert)
        for done, (layer, experts) in enumerate(sorted(by_layer.items()), 1):
            self._read(layer, experts)
            if progress is not None:
                progress(done, len(by_layer))
        return len(keys)

    def note_routing(self, layer: int, chosen: np.ndarray) -> None:
        """Counts a pass's routings (chosen: (tokens, used) expert ids) in the router statistics."""
        self.use.add(layer, chosen.ravel(), tokens=chosen.shape[0] if layer == 0 else 0)

    def ensure(self, layer: int, experts: Iterable[int], uses: Iterable[int] | None = None) -> None:
        """Brings `experts` of `layer` into RAM (the missing ones in one batch of reads), each routed to
        by uses[i] tokens (default 1); the policy drops others beyond the capacity, never one of these."""
        wanted = [int(e) for e in experts]
        missing, dropped = self.residency.admit(layer, wanted, uses)
        self.stats.hits += len(wanted) - len(missing)
        self.stats.misses += len(missing)
        for key in dropped:
            del self._held[key]
            self._tables[key[0]].drop(key[1])
            self._slots.give(self._slot_of.pop(key))  # type: ignore[union-attr]
        self.stats.evictions += len(dropped)
        if missing:
            self._read(layer, missing)

    def _read(self, layer: int, experts: list[int]) -> None:
        s = self.slices[layer]
        buffers = []
        gate_end, up_end = s.nbytes[0], s.nbytes[0] + s.nbytes[1]
        for e in experts:
            slot, place = self._slots.take()  # type: ignore[union-attr]
            self._slot_of[(layer, e)] = slot
            buffers.append([place[:gate_end], place[gate_end:up_end], place[up_end:up_end + s.nbytes[2]]])
        began = time.perf_counter()
        self.source.read_async([r for e in experts for r in s.ranges(e)], [b for bufs in buffers for b in bufs]).wait()
        self.stats.read_seconds += time.perf_counter() - began
        self.stats.bytes_read += len(experts) * s.expert_nbytes
        (gr, gc), (ur, uc), (dr, dc) = s.shapes
        table = self._tables.get(layer)
        if table is None:
            table = self._tables[layer] = ExpertTable(self.args.n_experts, s.types, gr, gc, self.threads)
        for e, (gate, up, down) in zip(experts, buffers, strict=True):
            self._held[(layer, e)] = (PackedLinear([(gate, s.types[0], gr, gc), (up, s.types[1], ur, uc)], self.threads),
                                      PackedLinear([(down, s.types[2], dr, dc)], self.threads))
            table.hold(e, gate, up, down)

    def row(self, layer: int, x: np.ndarray, experts: np.ndarray) -> np.ndarray:
        """(k, dim): the held `experts` of `layer` on one row x (dim,), in one native call (the bits
        of their products one by one: infer.cpu_kernels.ExpertTable)."""
        return self._tables[layer](x, experts)

    def products(self, layer: int, expert: int) -> tuple[PackedLinear, PackedLinear]:
        held = self._held.get((layer, expert))
        if held is None:
            self.ensure(layer, [expert])
            held = self._held[(layer, expert)]
        return held


class _ExpertProducts:
    """A layer's gate_up or down products by expert id, taken from the cache (MixtureOfExperts
    indexes them)."""

    def __init__(self, cache: ExpertCache, layer: int, which: int) -> None:
        self.cache, self.layer, self.which = cache, layer, which

    def __len__(self) -> int:
        return self.cache.args.n_experts

    def __getitem__(self, expert: int) -> PackedLinear:
        return self.cache.products(self.layer, int(expert))[self.which]


class TieredMixtureOfExperts(MixtureOfExperts):
    """A block's experts from an ExpertCache: after routing, the pass's experts are brought in at
    once, or, when a pass (a prompt) routes to more of them than the cache holds, in groups that fit,
    each group computed before the next is read."""

    cache: ExpertCache
    layer: int
    native_row: bool = False  # whether the glu is the native SwiGLU that ExpertTable's call applies

    def routed(self, h: np.ndarray, glu: Glu, exact: bool = False) -> np.ndarray:
        chosen, weights = self.route(h, exact)
        self.cache.note_routing(self.layer, chosen)
        outs = np.empty((*chosen.shape, h.shape[1]), np.float32)
        experts, uses = np.unique(chosen, return_counts=True)
        room = self.cache.capacity
        for start in range(0, len(experts), room):
            group = experts[start : start + room]
            self.cache.ensure(self.layer, group, uses[start : start + room])
            self.run_experts(outs, h, chosen, group, glu)
        return weighted_sum(outs, weights, exact)

    def run_experts(self, outs: np.ndarray, h: np.ndarray, chosen: np.ndarray, experts: np.ndarray, glu: Glu) -> None:
        if len(h) == 1 and self.native_row:  # a decode row: the token's experts in one call, as the
            wanted = set(experts.tolist())    # all-RAM packed engine's row_experts
            slots = [s for s, e in enumerate(chosen[0].tolist()) if e in wanted]
            outs[0, slots] = self.cache.row(self.layer, h[0], chosen[0, slots])
            return
        super().run_experts(outs, h, chosen, experts, glu)

    @property
    def nbytes(self) -> int:
        return self.router.nbytes + (self.shared.nbytes if self.shared is not None else 0)


class TieredExpertWeights(PackedWeights):
    """The packed engine's weights with their experts from an ExpertCache."""

    expert_cache: ExpertCache
    copies_experts = False  # the cache holds what the RAM budget allows, not a copy of every expert

    def warm(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Before the first pass: the most used experts of past runs read into RAM (progress(done,
        total) by layer); the rest of the model stays in the file's mapping."""
        self.expert_cache.preload(progress)

    def _experts(self, i: int) -> MixtureOfExperts:
        cache = self.expert_cache
        moe = TieredMixtureOfExperts(self._linear(tensor_name(i, "ffn_gate_inp")),  # type: ignore[arg-type]
                                     _ExpertProducts(cache, i, 0), _ExpertProducts(cache, i, 1),  # type: ignore[arg-type]
                                     self.args.n_experts_used, self.args.expert_weights_norm, self._shared_expert(i),
                                     **self._expert_biases(i))  # type: ignore[arg-type]
        moe.cache, moe.layer = cache, i
        moe.native_row = self.args.arch_table.activation == "silu" and self.args.n_experts_used <= cpu_kernels.MAX_SLOTS
        return moe


class TieredExpertBlocks(TieredExpertWeights):
    """The blocks whose feed-forward the CPU computes beside the GPU (infer.tiers.cpu_tier.CpuExperts),
    their experts from an ExpertCache: the rest of the model is the GPU's, so nothing is copied to
    huge pages."""

    copies_to_huge_pages = False


def tiered_weights(model: GGUFModel, args: ModelArgs, source: StorageSource | None, ram_budget: int,
                   threads: int | None = None, policy: str = DEFAULT_POLICY, use: ExpertUse | None = None,
                   layers: Sequence[int] | None = None) -> Any:
    """Packed weights whose experts live in an ExpertCache of `ram_budget` bytes over `source`, kept by
    `policy`, seeded by the router statistics `use`. layers: only these blocks' experts, for the GPU
    engine's CPU blocks (TieredExpertBlocks); default every block, for the CPU engine."""
    weights = TieredExpertWeights(model, args, threads=threads) if layers is None else \
        TieredExpertBlocks(model, args, threads=threads)
    weights.expert_cache = ExpertCache(model, args, source, ram_budget, threads, policy, use, layers)
    return weights
