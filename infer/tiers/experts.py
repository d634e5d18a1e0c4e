"""Experts as the unit of placement (issue 26) on the CPU engine: a mixture-of-experts model whose
experts do not all fit the RAM budget keeps what fits in RAM and reads the rest from tier C (the
O_DIRECT file reader or the NVMe driver, infer.tiers.tier_c) when a token is routed to them. Only
routed experts move; everything else (attention, norms, routers, the output) stays in the mapped file
as the packed engine has it.

`ExpertCache` holds expert slices (an expert's gate, up and down rows of its layer's stacks) in RAM
buffers up to a byte budget, the least recently used evicted first; a layer's missing experts are read
in one batch of requests. Products run on the cached bytes with the native kernels, so a tiered run
computes what the all-RAM packed run computes, bit for bit. `tiered_weights` makes the packed
engine's weights take their experts from such a cache.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from infer.arch import ModelArgs, tensor_name
from infer.gguf_file import GGUFModel
from infer.moe import Glu, MixtureOfExperts, weighted_sum
from infer.packed_weights import PackedLinear, PackedWeights
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
    demand. `products(layer, expert)` -> (gate_up, down) packed products over the cached bytes."""

    def __init__(self, model: GGUFModel, args: ModelArgs, source: StorageSource, budget_bytes: int,
                 threads: int | None = None) -> None:
        if not args.n_experts:
            raise ValueError(f"{model.path.name} has no experts to tier")
        self.args, self.source, self.threads = args, source, threads
        self.slices = [ExpertSlices.of_layer(model, i) for i in range(args.n_layers)]
        self.expert_nbytes = max(s.expert_nbytes for s in self.slices)
        self.capacity = budget_bytes // self.expert_nbytes
        if self.capacity < args.n_experts_used:
            raise ValueError(f"a RAM budget for experts of {format_bytes(budget_bytes)} holds {self.capacity} experts "
                             f"of {format_bytes(self.expert_nbytes)}; a token needs {args.n_experts_used} at once "
                             f"(at least {format_bytes(args.n_experts_used * self.expert_nbytes)})")
        self.budget_bytes = budget_bytes
        self.total_experts = args.n_layers * args.n_experts
        self._held: OrderedDict[tuple[int, int], tuple[PackedLinear, PackedLinear]] = OrderedDict()
        self.stats = ExpertStats()

    @property
    def held(self) -> int:
        return len(self._held)

    def describe(self) -> str:
        share = min(self.capacity, self.total_experts) / self.total_experts
        return (f"experts: {self.total_experts} of {format_bytes(self.expert_nbytes)}; RAM holds "
                f"{min(self.capacity, self.total_experts)} ({share:.0%}), the rest read from tier C "
                f"({self.source.description}) when routed to")

    def ensure(self, layer: int, experts: Iterable[int]) -> None:
        """Brings `experts` of `layer` into RAM (the missing ones in one batch of reads), most recently
        used; evicts the least recently used beyond the capacity, never one of these."""
        wanted = [int(e) for e in experts]
        missing = [e for e in wanted if (layer, e) not in self._held]
        self.stats.hits += len(wanted) - len(missing)
        self.stats.misses += len(missing)
        for e in wanted:
            if (layer, e) in self._held:
                self._held.move_to_end((layer, e))
        if not missing:
            return
        s = self.slices[layer]
        buffers = [[np.empty(n, np.uint8) for n in s.nbytes] for _ in missing]
        began = time.perf_counter()
        self.source.read_async([r for e in missing for r in s.ranges(e)], [b for bufs in buffers for b in bufs]).wait()
        self.stats.read_seconds += time.perf_counter() - began
        self.stats.bytes_read += len(missing) * s.expert_nbytes
        for e, (gate, up, down) in zip(missing, buffers, strict=True):
            (gr, gc), (ur, uc), (dr, dc) = s.shapes
            self._held[(layer, e)] = (PackedLinear([(gate, s.types[0], gr, gc), (up, s.types[1], ur, uc)], self.threads),
                                      PackedLinear([(down, s.types[2], dr, dc)], self.threads))
        keep = {(layer, e) for e in wanted}
        while len(self._held) > max(self.capacity, len(keep)):
            victim = next(k for k in self._held if k not in keep)
            del self._held[victim]
            self.stats.evictions += 1

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

    def __call__(self, h: np.ndarray, glu: Glu, exact: bool = False) -> np.ndarray:
        chosen, weights = self.route(h, exact)
        outs = np.empty((*chosen.shape, h.shape[1]), np.float32)
        experts = np.unique(chosen)
        room = self.cache.capacity
        for start in range(0, len(experts), room):
            group = experts[start : start + room]
            self.cache.ensure(self.layer, group)
            self.run_experts(outs, h, chosen, group, glu)
        return weighted_sum(outs, weights, exact)

    @property
    def nbytes(self) -> int:
        return self.router.nbytes


class TieredExpertWeights(PackedWeights):
    """The packed engine's weights with their experts from an ExpertCache."""

    expert_cache: ExpertCache

    def _experts(self, i: int) -> MixtureOfExperts:
        cache = self.expert_cache
        moe = TieredMixtureOfExperts(self._linear(tensor_name(i, "ffn_gate_inp")),  # type: ignore[arg-type]
                                     _ExpertProducts(cache, i, 0), _ExpertProducts(cache, i, 1),  # type: ignore[arg-type]
                                     self.args.n_experts_used, self.args.expert_weights_norm)
        moe.cache, moe.layer = cache, i
        return moe


def tiered_weights(model: GGUFModel, args: ModelArgs, source: StorageSource, ram_budget: int,
                   threads: int | None = None) -> Any:
    """Packed weights whose experts live in an ExpertCache of `ram_budget` bytes over `source`."""
    weights = TieredExpertWeights(model, args, threads=threads)
    weights.expert_cache = ExpertCache(model, args, source, ram_budget, threads)
    return weights


DEMO_EXPERT_SHARE = 0.25  # --streaming without --ram-budget: RAM holds this share of the experts
STORAGE_SAMPLE = 64 << 20  # bytes of experts read at start-up to measure tier C


@dataclass
class ExpertSession:
    """What build_streaming_engine gives for a mixture-of-experts model on the CPU: the packed
    engine with tiered experts, beside the streaming sessions' calls (report, moved_report, problem,
    close)."""

    engine: Any  # infer.streaming.StreamingEngine
    weights: TieredExpertWeights
    source: StorageSource
    storage_read: float  # tier C bytes/s, measured at start-up
    budget_note: str
    closers: list[Any]
    plan: Any = None  # no tensor plan: the expert is the unit (session.plan is the dense streamer's)
    bandwidths: Any = None
    account: Any = None

    @property
    def cache(self) -> ExpertCache:
        return self.weights.expert_cache

    def problem(self) -> str | None:
        return getattr(self.source, "failure", None)

    def report(self) -> str:
        mapped = sum(info.nbytes for info in self.weights.model.tensors.values()
                     if not any(info.name.endswith(f"{kind}.weight") for kind in STACKS))
        return (f"{self.budget_note}\n{self.cache.describe()}\nthe rest of the model ({format_bytes(mapped)}: "
                f"attention, routers, norms, embeddings, output) is read from the file's mapping; tier C measured "
                f"at {self.storage_read / 1e9:.2f} GB/s at start-up")

    def benchmark(self, tg: int, pp: int = 64) -> dict[str, Any]:
        """`--benchmark`: pp prompt tokens, then tg decode steps, with decode set against the storage:
        tier C bytes a decoded token, the tok/s tier C alone allows at the start-up bandwidth
        (the storage roofline) and the share of it reached. The decode steps are fed the tokens of
        a random text, not the model's own choices: greedy decoding of random weights soon repeats
        itself, and its repeated routing would flatter the cache."""
        import resource

        model, cache = self.engine.model, self.cache
        text = np.random.default_rng(0).integers(3, self.weights.args.vocab_size, pp + tg)
        kv = model.new_cache(pp + tg + 1)
        began = time.perf_counter()
        model.forward(text[:pp], kv)
        pp_s = time.perf_counter() - began
        before = (cache.stats.bytes_read, cache.stats.hits, cache.stats.misses)
        began = time.perf_counter()
        for token in text[pp:]:
            model.forward(np.array([token]), kv)
        tg_s = time.perf_counter() - began
        read, hits, misses = (now - then for now, then in
                              zip((cache.stats.bytes_read, cache.stats.hits, cache.stats.misses), before, strict=True))
        per_token = read / tg if tg else 0.0
        result: dict[str, Any] = {
            "device": "cpu", "pp_tokens": pp, "pp_tok_s": round(pp / pp_s, 2), "tg_tokens": tg,
            "tg_tok_s": round(tg / tg_s, 2), "step_us": round(1e6 * tg_s / max(tg, 1), 1),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "experts_held": cache.held, "expert_capacity": cache.capacity, "experts_total": cache.total_experts,
            "decode_expert_hit_rate": round(hits / max(hits + misses, 1), 4), "tier_c_bytes_per_token": round(per_token),
            "storage_read_gbps": round(self.storage_read / 1e9, 3)}
        if per_token and self.storage_read:
            roofline = self.storage_read / per_token
            result["storage_roofline_tok_s"] = round(roofline, 3)
            result["decode_fraction_of_storage_roofline"] = round(tg / tg_s / roofline, 3)
        return result

    @staticmethod
    def render_benchmark(result: dict[str, Any]) -> str:
        from infer.benchmark import render

        text = render(result) + (f"\n  experts: {result['decode_expert_hit_rate']:.1%} of decode's routings hit RAM; "
                                 f"tier C {format_bytes(result['tier_c_bytes_per_token'])} a token")
        if "storage_roofline_tok_s" in result:
            text += (f" at {result['storage_read_gbps']} GB/s: storage roofline {result['storage_roofline_tok_s']} "
                     f"tok/s, decode at {result['decode_fraction_of_storage_roofline']:.0%} of it")
        return text

    def moved_report(self) -> str:
        s, stats = self.cache.stats, self.engine.stats
        tokens = stats.prompt_tokens + stats.generated_tokens
        return (f"experts: {s.hits} hits, {s.misses} misses ({s.hit_rate:.1%} hit), {s.evictions} evicted; tier C "
                f"read {format_bytes(s.bytes_read)} ({format_bytes(int(s.bytes_read / max(tokens, 1)))}/token) at "
                f"{s.read_gbps:.2f} GB/s while reading")

    def close(self) -> None:
        for close in reversed(self.closers):
            close()
        self.closers = []


def build_expert_session(model: GGUFModel, args: ModelArgs, config: Any, ctx_size: int, prefill_chunk: int,
                         exact: bool) -> ExpertSession:
    """The CPU engine for a mixture-of-experts model under --streaming: experts tiered by
    --ram-budget (default: a quarter of them) over --tier-c (file or nvme)."""
    from infer.packed_weights import native_products_requested
    from infer.streaming import StreamingEngine
    from infer.tiers.budget import BudgetError, parse_size
    from infer.tiers.plan import planner_tensors
    from infer.tiers.report import measure_storage_read
    from infer.tiers.tier_c import open_source

    if exact or not native_products_requested():
        raise BudgetError("tiered experts run on the packed native engine: drop --exact and "
                          "NVMEDIRECT_CPU_PRODUCTS=numpy (or drop --streaming)")
    if config.tier_c == "mmap":
        raise BudgetError("--tier-c mmap reads through the page cache, which no RAM budget bounds: use file or nvme")
    slices = [ExpertSlices.of_layer(model, i) for i in range(args.n_layers)]
    all_experts = sum(s.expert_nbytes * args.n_experts for s in slices)
    if config.ram_budget:
        budget = parse_size(config.ram_budget)
        note = f"RAM budget for experts: {format_bytes(budget)} (--ram-budget) of {format_bytes(all_experts)}"
    else:
        budget = int(DEMO_EXPERT_SHARE * all_experts)
        note = (f"RAM budget for experts: {format_bytes(budget)} (demo: a quarter of {format_bytes(all_experts)}; "
                "--ram-budget sets it)")
    stacks = [t for t in planner_tensors(model, "cpu") if any(t.name.endswith(f"{k}.weight") for k in STACKS)]
    options: dict[str, Any] = {"lba": config.nvme_lba} if config.tier_c == "nvme" and config.nvme_lba is not None else {}
    if config.read_queue_depth is not None:
        options["queue_depth"] = config.read_queue_depth
    source = open_source(config.tier_c, model.path, stacks, config.nvme_device, **options)
    try:
        from infer.arch import rope_freq_factors
        from infer.model import Transformer

        try:
            weights = tiered_weights(model, args, source, budget)
        except ValueError as err:
            raise BudgetError(str(err)) from None
        kept, size = [], 0  # up to STORAGE_SAMPLE of experts, read as a pass's misses are
        for r in (r for s in slices for e in range(args.n_experts) for r in s.ranges(e)):
            if kept and size + r[1] > STORAGE_SAMPLE:
                break
            kept.append(r)
            size += r[1]
        storage = measure_storage_read(source, kept)
        transformer = Transformer(args, weights, rope_freq_factors(model, args))
        stats = weights.expert_cache.stats
        engine = StreamingEngine(transformer, ctx_size, prefill_chunk, bytes_moved=lambda: {"C": stats.bytes_read})
    except BaseException:
        source.close()
        raise
    return ExpertSession(engine, weights, source, storage, note, [source.close])
