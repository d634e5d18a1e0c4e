"""The session for a mixture-of-experts file under --streaming (issue 26): the packed CPU engine
with its experts tiered (infer.tiers.experts) over tier C, or the GPU engine with the experts of the
blocks its VRAM budget holds and the CPU computing the rest from the same tiered cache; the router
statistics read at start and written back at the end (infer.tiers.expert_policy), and the session
calls the streaming CLI and server use (report, moved_report, benchmark, close)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from infer.arch import ModelArgs, tensor_name
from infer.gguf_file import GGUFModel
from infer.tiers.expert_policy import ExpertUse, default_use_path, routers_digest
from infer.tiers.experts import STACKS, ExpertCache, ExpertSlices, TieredExpertWeights, tiered_weights
from infer.tiers.plan import format_bytes, span
from infer.tiers.tier_c import StorageSource


def router_statistics(model: GGUFModel, args: ModelArgs, setting: str | None) -> tuple[Path | None, ExpertUse | None]:
    """(where this model's router statistics are kept, those found there) for --expert-stats `setting`:
    None: the default file named after the routers; "off": (None, None)."""
    if setting == "off":
        return None, None
    if setting:
        path = Path(setting).expanduser()
    else:
        routers = [model.tensor(tensor_name(i, "ffn_gate_inp")).data for i in range(args.n_layers)]
        path = default_use_path(routers_digest(routers))
    return path, ExpertUse.load(path, args.n_layers, args.n_experts)


DEMO_EXPERT_SHARE = 0.25  # --streaming without --ram-budget: RAM holds this share of the experts
STORAGE_SAMPLE = 64 << 20  # bytes of experts read at start-up to measure tier C


@dataclass
class ExpertSession:
    """What build_streaming_engine gives for a mixture-of-experts model: the packed CPU engine with
    tiered experts, or the GPU engine whose CPU blocks take theirs from the cache, beside the
    streaming sessions' calls (report, moved_report, problem, close)."""

    engine: Any  # infer.streaming.StreamingEngine
    weights: TieredExpertWeights
    source: StorageSource | None  # None on the GPU when every block's experts are in VRAM
    storage_read: float  # tier C bytes/s, measured at start-up
    budget_note: str
    closers: list[Any]
    stats_path: Path | None = None  # where the router statistics are written back (None: --expert-stats off)
    stats_found: bool = False  # whether past statistics were read at start
    plan: Any = None  # no tensor plan: the expert is the unit (session.plan is the dense streamer's)
    bandwidths: Any = None
    account: Any = None  # the GPU engine's device memory plan (infer.gpu.memory), None on the CPU
    device: str = "cpu"

    @property
    def cache(self) -> ExpertCache:
        return self.weights.expert_cache

    def problem(self) -> str | None:
        return getattr(self.source, "failure", None)

    def report(self) -> str:
        mapped = sum(info.nbytes for info in self.weights.model.tensors.values()
                     if not any(info.name.endswith(f"{kind}.weight") for kind in STACKS))
        shared = "shared experts, " if self.weights.args.shared_ffn_dim else ""
        rest = f"({format_bytes(mapped)}: attention, routers, {shared}norms, embeddings, output)"
        if self.device == "gpu":
            on_gpu = getattr(self.engine.model.gpu_experts, "blocks", [])
            where = (f"the rest of the model {rest} is in VRAM, with the experts of {len(on_gpu)} of "
                     f"{self.weights.args.n_layers} blocks ({span(sorted(on_gpu))}) computed there" if on_gpu else
                     f"the rest of the model {rest} is in VRAM; the CPU computes every block's experts")
        else:
            where = f"the rest of the model {rest} is read from the file's mapping"
        storage = f"tier C measured at {self.storage_read / 1e9:.2f} GB/s at start-up" if self.storage_read else \
            "tier C not read (no expert is the CPU's)"
        lines = [self.budget_note, self.cache.describe(), self.statistics_note(), f"{where}; {storage}"]
        if self.account is not None:  # the GPU's plan: weights, the VRAM blocks' experts, KV cache, buffers
            lines.insert(0, self.account.render())
        return "\n".join(lines)

    def statistics_note(self) -> str:
        """What the router statistics say of this budget, and where they are kept."""
        cache = self.cache
        if not cache.total_experts:
            return "router statistics: not needed (no expert is the CPU's)"
        if self.stats_path is None:
            return "router statistics: off (--expert-stats off); experts are read as first routed to"
        if not self.stats_found:
            return (f"router statistics: none yet for these routers; gathered in this run and written to "
                    f"{self.stats_path} (the next run preloads the most used experts)")
        capacity = min(cache.capacity, cache.total_experts)
        ours = cache.residency.use  # the statistics of the blocks this cache serves
        return (f"router statistics: {cache.use.tokens} tokens routed in earlier runs ({self.stats_path}); the "
                f"{capacity} most used experts preloaded, expected hit rate {ours.expected_hit_rate(capacity):.0%} "
                "if routing goes on as before")

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
            "device": self.device, "pp_tokens": pp, "pp_tok_s": round(pp / pp_s, 2), "tg_tokens": tg,
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

    warm_unit = "layer"  # the preload reads a layer's experts at a time

    def warm(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Before the first pass: the most used experts of earlier runs read into RAM."""
        self.weights.warm(progress)

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
        if self.stats_path is not None and self.cache.use.routings:
            try:
                self.cache.use.save(self.stats_path)
            except OSError as err:  # a hint for the next run, not worth failing this one over
                print(f"note: router statistics not saved to {self.stats_path}: {err.strerror or err}", file=sys.stderr)
            self.stats_path = None  # once


def build_expert_session(model: GGUFModel, args: ModelArgs, config: Any, ctx_size: int, prefill_chunk: int,
                         exact: bool, device: str = "cpu", tree_nodes: int = 0,
                         planned: dict[str, int] | None = None, enforce_budget: bool = False) -> ExpertSession:
    """A mixture-of-experts model under --streaming: experts tiered by --ram-budget (default: a
    quarter of them) over --tier-c (file or nvme). On the CPU the packed engine takes every block's
    experts from the cache. On the GPU (`_gpu_transformer`) the model is resident with the experts of
    as many blocks as --vram-budget allows (config.experts places them as --n-cpu-moe does), and the
    CPU computes the other blocks' feed-forward with their experts from the cache."""
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
    transformer, on_cpu = (None, list(range(args.n_layers))) if device == "cpu" else \
        _gpu_transformer(model, ctx_size, config, prefill_chunk, planned, enforce_budget, tree_nodes)
    try:
        tiered = sum(slices[i].expert_nbytes * args.n_experts for i in on_cpu)
        if config.ram_budget:
            budget = parse_size(config.ram_budget)
            note = f"RAM budget for experts: {format_bytes(budget)} (--ram-budget) of {format_bytes(tiered)}"
        else:
            budget = int(DEMO_EXPERT_SHARE * tiered)
            note = (f"RAM budget for experts: {format_bytes(budget)} (demo: a quarter of {format_bytes(tiered)}; "
                    "--ram-budget sets it)")
        if not on_cpu:
            note = "RAM budget for experts: none needed (every block's experts are in VRAM)"
        elif len(on_cpu) < args.n_layers:
            note += f", the experts of the {len(on_cpu)} of {args.n_layers} blocks the CPU computes"
        stacks = [t for t in planner_tensors(model, "cpu") if any(t.name.endswith(f"{k}.weight") for k in STACKS)]
        options: dict[str, Any] = {"lba": config.nvme_lba} if config.tier_c == "nvme" and config.nvme_lba is not None else {}
        if config.read_queue_depth is not None:
            options["queue_depth"] = config.read_queue_depth
        # no expert the CPU's, none to read: tier C's file or device is not opened
        source = open_source(config.tier_c, model.path, stacks, config.nvme_device, **options) if on_cpu else None
    except BaseException:
        del transformer  # a GPU engine's device memory goes back with it
        raise
    try:
        from infer.arch import rope_freq_factors
        from infer.model import Transformer

        stats_path, use = router_statistics(model, args, getattr(config, "expert_stats", None))
        try:
            weights = tiered_weights(model, args, source, budget, use=use,
                                     layers=None if transformer is None else on_cpu)
        except ValueError as err:
            raise BudgetError(str(err)) from None
        kept, size = [], 0  # up to STORAGE_SAMPLE of the tiered experts, read as a pass's misses are
        for r in (r for i in on_cpu for e in range(args.n_experts) for r in slices[i].ranges(e)):
            if kept and size + r[1] > STORAGE_SAMPLE:
                break
            kept.append(r)
            size += r[1]
        storage = measure_storage_read(source, kept) if kept else 0.0
        if transformer is None:
            transformer = Transformer(args, weights, rope_freq_factors(model, args))
        elif transformer.cpu_experts is not None:
            transformer.cpu_experts.blocks = weights  # the CPU's blocks take their experts from the cache
        stats = weights.expert_cache.stats
        engine = StreamingEngine(transformer, ctx_size, prefill_chunk, bytes_moved=lambda: {"C": stats.bytes_read})
    except BaseException:
        if source is not None:
            source.close()
        raise
    return ExpertSession(engine, weights, source, storage, note, [source.close] if source is not None else [],
                         stats_path, use is not None,
                         account=getattr(transformer, "account", None), device=device)


def _gpu_transformer(model: GGUFModel, ctx_size: int, config: Any, prefill_chunk: int,
                     planned: dict[str, int] | None, enforce_budget: bool, tree_nodes: int) -> tuple[Any, list[int]]:
    """The GPU engine, resident, with the experts of the blocks --vram-budget holds in VRAM; (it, the
    blocks whose experts the CPU computes). Nothing streams the CPU's experts to the GPU: their bytes
    are the cache's, not the file's pages, which registering for the link would pin in RAM."""
    from infer.gpu import load_gpu_transformer

    gpu = load_gpu_transformer(model, ctx_size, config.vram_budget, prefill_chunk, batch=config.batch,
                               enforce_budget=enforce_budget, planned=planned, tree_nodes=tree_nodes,
                               experts=getattr(config, "experts", "auto"), expert_stream="off")
    return gpu, list(gpu.cpu_experts.layers) if gpu.cpu_experts is not None else []

