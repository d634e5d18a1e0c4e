"""A ready streaming engine from a parsed model and a StreamingConfig:
`build_streaming_engine(model, config, ctx_size, device)`.

    session = build_streaming_engine(GGUFModel(path), StreamingConfig(enabled=True, vram_budget="24GB"),
                                     ctx_size=2048, device="gpu")
    print(session.report())
    outputs = session.engine.generate(prompts, 32, greedy)
    session.close()

Budget problems raise infer.tiers.budget.BudgetError with one line giving the minimum (the CLI
turns it into exit code 2).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from infer.arch import check_model, refuse_cpu_only, rope_freq_factors
from infer.gguf_file import GGUFModel
from infer.streaming import StreamingEngine
from infer.tiers.budget import DEVICE_MARGIN, BudgetError, Budgets, VramAccount, compute_budgets, free_vram
from infer.tiers.config import StreamingConfig
from infer.tiers.plan import (  # noqa: F401 - planner_tensors re-exported for callers
    Plan,
    PlanError,
    Tensor,
    Tier,
    format_bytes,
    make_plan,
    minimum_vram,
    planner_tensors,
)
from infer.tiers.report import Bandwidths, render_moved, render_plan
from infer.tiers.tier_b import HostTier, choose_mode
from infer.tiers.tier_c import StorageSource, open_source

__all__ = ["StreamingConfig", "StreamingSession", "build_streaming_engine", "planner_tensors"]

DEMO_RESIDENT_SHARE = 0.4  # --streaming on a model that fits: share of layer bytes kept in tier A
DEMO_RAM_SHARE = 0.3  # ... and in tier B; the rest goes to tier C
STORAGE_SAMPLE = 256 << 20  # bytes of tier C read at start-up to measure the storage


@dataclass
class StreamingSession:
    """A streaming engine with its plan and the objects that must be closed after use."""

    engine: StreamingEngine
    plan: Plan
    budgets: Budgets
    weights: Any
    paths: dict[str, str]
    bandwidths: Bandwidths | None
    account: VramAccount | None = None  # the device's (GPU runs)
    closers: list[Callable[[], None]] = field(default_factory=list)
    source: StorageSource | None = None  # tier C's, if the plan streams from storage

    def problem(self) -> str | None:
        """Why tier C can no longer be read (its device was taken away), or None."""
        return getattr(self.source, "failure", None) if self.source is not None else None

    def report(self) -> str:
        head = (f"budgets: VRAM {format_bytes(self.budgets.vram_total)} ({self.budgets.vram_source}) - KV cache "
                f"{format_bytes(self.budgets.kv_cache)} - activations {format_bytes(self.budgets.activations)}; "
                f"RAM {format_bytes(self.budgets.ram_total)} ({self.budgets.ram_source})")
        if self.account is not None:
            head += "\n" + self.account.render()
        return head + "\n" + render_plan(self.plan, self.bandwidths, self.paths)

    warm_unit = "tensor"  # what warm's progress counts

    def warm(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Before the first pass: the CPU's tier A dequantized (GPU weights have nothing to warm);
        progress(done, total) as it goes."""
        warm = getattr(self.weights, "warm", None)
        if warm is not None:
            warm(progress)

    def moved_report(self) -> str:
        s = self.engine.stats
        moved = {Tier(k): v for k, v in s.bytes_moved.items()}
        return render_moved(moved, s.prefill_passes + s.decode_passes, s.prompt_tokens + s.generated_tokens)

    def close(self) -> None:
        for close in reversed(self.closers):
            close()
        self.closers = []


def _demo_budgets(tensors: list[Tensor], slots: int, scratch: bool) -> tuple[int, int]:
    """Weight budgets that put some layers in each tier (--streaming on a model that would fit)."""
    layer_bytes = sum(t.device_nbytes for t in tensors if t.layer is not None and not t.is_vector)
    raw_layer_bytes = sum(t.nbytes for t in tensors if t.layer is not None and not t.is_vector)
    vram = minimum_vram(tensors, slots, scratch) + int(DEMO_RESIDENT_SHARE * layer_bytes)
    return vram, int(DEMO_RAM_SHARE * raw_layer_bytes)


def _budgets(args: Any, tensors: list[Tensor], config: StreamingConfig, ctx_size: int, prefill_chunk: int,
             on_gpu: bool, account: VramAccount | None, activations: int | None = None) -> tuple[Budgets, Plan]:
    staging = config.staging_buffers * max((t.nbytes for t in tensors if t.layer is not None), default=0)
    tokens_per_pass = max(prefill_chunk, config.batch)  # prefill passes share prefill_chunk rows (streaming.py)
    reserved = sum(account.reserved.values()) + account.planned_total if account is not None else None
    vram_total = account.budget if account is not None else config.vram_budget
    demo = config.vram_budget is None and config.ram_budget is None and (
        not on_gpu or sum(t.device_nbytes for t in tensors) < free_vram() - DEVICE_MARGIN)
    if demo:
        weights_vram, weights_ram = _demo_budgets(tensors, config.slots, on_gpu)
        big = compute_budgets(args, ctx_size, config.batch, tokens_per_pass, staging, 10**15, 10**15,
                              device=on_gpu, device_reserved=reserved, activations=activations)
        overhead = big.vram_total - big.vram_for_weights
        budgets = Budgets(weights_vram + overhead, weights_vram, weights_ram + staging, weights_ram, big.kv_cache,
                          big.activations, staging, "demo: the model fits, small budgets exercise every tier",
                          "demo", big.vram_reserved)
    else:
        budgets = compute_budgets(args, ctx_size, config.batch, tokens_per_pass, staging, vram_total,
                                  config.ram_budget, device=on_gpu, device_reserved=reserved, activations=activations)
        if account is not None:
            budgets = replace(budgets, vram_source=account.source)
    try:
        plan = make_plan(tensors, args.n_layers, budgets.vram_for_weights, budgets.ram_for_weights, config.slots,
                         layer_scratch=on_gpu)
    except PlanError as err:
        overhead = budgets.vram_total - budgets.vram_for_weights
        raise BudgetError(f"{err}; with the KV cache, activations and device reserve the VRAM budget must be at "
                          f"least {format_bytes(err.minimum + overhead)} (or lower -c/--batch)") from None
    return budgets, plan


def build_streaming_engine(model: GGUFModel | str | os.PathLike, config: StreamingConfig, ctx_size: int,
                           device: str = "cpu", prefill_chunk: int = 512, measure: bool = True,
                           match_llama_cpp: bool = True, enforce_budget: bool = False,
                           planned: dict[str, int] | None = None, tree_nodes: int = 0,
                           exact: bool = False) -> StreamingSession:
    """Plans, opens the tiers and returns a session whose engine streams as the plan says. `model`:
    the parsed file (a path is parsed here). enforce_budget (GPU): cap the device memory pool at the
    budget (one engine per process). planned: device memory already taken in the same budget (e.g.
    {"draft model": bytes}): the plan leaves it out and shows it. tree_nodes (GPU): the largest token
    tree a pass verifies (its logits are planned). match_llama_cpp: the CPU engine's rounding of the
    products' inputs (the GPU always rounds them as llama.cpp does). exact (CPU): float64 sums, as
    load_transformer(exact=True), so a pass's logits do not depend on how many tokens it holds."""
    if device not in ("cpu", "gpu"):
        raise ValueError(f"unknown device '{device}' (cpu, gpu)")
    if not isinstance(model, GGUFModel):
        model = GGUFModel(model)
    args = check_model(model)
    if device == "gpu":
        refuse_cpu_only(args, model.path, "the GPU engine", "run it with --device cpu (--streaming tiers its experts there)")
    if args.n_experts:  # the expert is the unit of placement (infer.tiers.experts, expert_session)
        from infer.tiers.expert_session import build_expert_session

        return build_expert_session(model, args, config, ctx_size, prefill_chunk, exact, device,  # type: ignore[return-value]
                                    tree_nodes, planned, enforce_budget)
    tensors = planner_tensors(model, device)
    on_gpu = device == "gpu"
    account = None
    if on_gpu:
        from infer.gpu import memory

        demo = config.vram_budget is None and config.ram_budget is None
        account = memory.new_account(None if demo else config.vram_budget, f"{model.path.name} streamed on the GPU")
        for name, nbytes in (planned or {}).items():
            account.plan(name, nbytes)  # in the pool, not this engine's: taken off before placing weights
    activations = None
    if on_gpu:
        from infer.gpu import gpu_pass_nbytes

        activations = gpu_pass_nbytes(model, args, max(prefill_chunk, config.batch), ctx_size,
                                      max(config.batch, tree_nodes))
    budgets, plan = _budgets(args, tensors, config, ctx_size, prefill_chunk, on_gpu, account, activations)
    if account is not None:
        account.budget = budgets.vram_total
        layout = args.kv_cache_layout(ctx_size, max(prefill_chunk, config.batch))
        kv_name = f"KV cache ({layout})" if layout else "KV cache"
        plan_streamed(account, plan, budgets.kv_cache, budgets.activations, kv_name)
    closers: list[Callable[[], None]] = []
    try:
        host, mode = _open_tier_b(model, plan, budgets, config)
        if host is not None:
            closers.append(host.close)
        c_tensors = plan.tensors_in(Tier.STORAGE)
        source: StorageSource | None = None
        if c_tensors:
            options: dict[str, Any] = {"lba": config.nvme_lba} if config.tier_c == "nvme" and config.nvme_lba is not None else {}
            if config.read_queue_depth is not None and config.tier_c != "mmap":
                options["queue_depth"] = config.read_queue_depth
            source = open_source(config.tier_c, model.path, c_tensors, config.nvme_device,
                                 gpu_doorbells=config.gpu_doorbells, notes=plan.notes, **options)
            closers.append(source.close)
        paths = tier_paths(plan, mode, config.tier_c)
        bandwidths = _measure(on_gpu, source, c_tensors) if measure else None
        factors = rope_freq_factors(model, args)
        if on_gpu:
            from infer.gpu import memory
            from infer.gpu.model import GpuTransformer
            from infer.tiers.pipeline import StreamedWeights

            if enforce_budget:
                memory.enforce(account)  # type: ignore[arg-type]
            from infer.gpu.model import LOGITS_ROWS

            weights: Any = StreamedWeights(model, args, plan, host, source, config.staging_buffers)
            closers.append(weights.close)
            transformer: Any = GpuTransformer(args, weights, factors, ctx_size, max(prefill_chunk, config.batch),
                                              logits_rows=max(LOGITS_ROWS, config.batch, tree_nodes))
            transformer.account = account
            if plan.streamed:
                from infer.tiers.cpu_tier import choose

                transformer.cpu_tier, line = choose(model, args, plan, host, config.cpu_tier,
                                                    bandwidths.host_to_device if bandwidths else 0.0,
                                                    transformer.capacity)
                plan.notes.append(line)
        else:
            from infer.model import Transformer
            from infer.packed_weights import native_products_requested
            from infer.tiers.cpu_sim import StreamingCpuWeights

            weights = StreamingCpuWeights(model, args, plan, host, source, n_staging=config.staging_buffers,
                                          match_llama_cpp=match_llama_cpp, exact=exact,
                                          packed=native_products_requested())
            closers.append(weights.close)
            transformer = Transformer(args, weights, factors, exact)
    except BaseException:
        for close in reversed(closers):
            close()
        raise
    engine = StreamingEngine(transformer, ctx_size, prefill_chunk,
                             bytes_moved=lambda: {k.value: v for k, v in weights.bytes_moved().items()})
    return StreamingSession(engine, plan, budgets, weights, paths, bandwidths, account, closers, source)


def plan_streamed(account: VramAccount, plan: Plan, kv_cache: int, activations: int, kv_name: str = "KV cache") -> None:
    """A streamed plan's device memory into its account (tier A, the ring, the layer scratch, the KV
    cache, the pass buffers), checked against the budget."""
    for name, nbytes in (("weights (tier A)", plan.bytes_in(Tier.VRAM)), ("ring slots", plan.n_slots * plan.slot_nbytes),
                         ("layer scratch", plan.scratch_nbytes), (kv_name, kv_cache), ("pass buffers", activations)):
        account.plan(name, nbytes)
    account.check(": lower -c/--ctx-size or --batch")


def tier_paths(plan: Plan, tier_b_mode: str, tier_c_kind: str) -> dict[str, str]:
    """How each of a plan's tensors reaches the device (the plan report's column)."""
    return {t.name: _path(plan, t.name, tier_b_mode, tier_c_kind) for t in plan.tensors}


def _open_tier_b(model: GGUFModel, plan: Plan, budgets: Budgets, config: StreamingConfig
                 ) -> tuple[HostTier | None, str]:
    b_tensors = plan.tensors_in(Tier.RAM)
    mode = choose_mode(b_tensors, budgets.ram_for_weights, config.tier_b)
    if not b_tensors:
        return None, mode
    try:
        return HostTier(model, b_tensors, mode), mode
    except Exception as err:  # registration refused (limits, driver): the pinned copy always works
        if config.tier_b != "auto" or mode != "registered":
            raise
        plan.notes.append(f"registering the file mapping failed ({type(err).__name__}: {err}); tier B pinned")
        return HostTier(model, b_tensors, "pinned"), "pinned"


def _path(plan: Plan, name: str, tier_b_mode: str, tier_c_kind: str) -> str:
    tier = plan.tier[name]
    if tier is Tier.VRAM:
        return "resident"
    if tier is Tier.RAM:
        return "registered-mmap copy" if tier_b_mode == "registered" else "pinned-RAM copy"
    return f"staged read ({tier_c_kind})"


def _measure(on_gpu: bool, source: StorageSource | None, c_tensors: list[Tensor]) -> Bandwidths:
    from infer.tiers.report import measure_host_copy, measure_host_to_device, measure_storage_read

    link = measure_host_to_device() if on_gpu else measure_host_copy()
    storage = 0.0
    if source is not None and c_tensors:
        sample, size = [], 0
        for t in c_tensors:  # up to 256 MiB of tier C tensors, read as a pass would
            if sample and size + t.nbytes > STORAGE_SAMPLE:
                break
            sample.append((t.offset, t.nbytes))
            size += t.nbytes
        storage = measure_storage_read(source, sample)
    how = "pinned H2D copy and a tier C read" if on_gpu else "host memcpy (CPU simulation) and a tier C read"
    return Bandwidths(link, storage, how)
