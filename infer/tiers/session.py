"""The entry point that turns the streaming options (flags.py: `@streaming_options` gives a
`StreamingConfig`) into a ready engine: `build_streaming_engine(model_path, config, ctx_size, device)`.

    @click.command()
    @streaming_options
    def main(..., streaming: StreamingConfig) -> None:
        session = build_streaming_engine(model, streaming, ctx_size=2048, device="gpu")
        print(session.report())
        outputs = session.engine.generate(prompts, 32, greedy)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import click

from infer.gguf_file import GGUFModel
from infer.model import ModelArgs, Transformer
from infer.streaming import StreamingEngine
from infer.tiers.budget import DEVICE_MARGIN, BudgetError, Budgets, compute_budgets
from infer.tiers.flags import StreamingConfig, streaming_options  # noqa: F401 - re-exported for callers
from infer.tiers.plan import (
    Plan,
    PlanError,
    Tensor,
    Tier,
    format_bytes,
    make_plan,
    minimum_vram,
    tensors_from,
)
from infer.tiers.report import Bandwidths, render_moved, render_plan
from infer.tiers.tier_b import HostTier, choose_mode
from infer.tiers.tier_c import StorageSource, open_source

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
    closers: list[Callable[[], None]] = field(default_factory=list)

    def report(self) -> str:
        head = (f"budgets: VRAM {format_bytes(self.budgets.vram_total)} ({self.budgets.vram_source}) - KV cache "
                f"{format_bytes(self.budgets.kv_cache)} - activations {format_bytes(self.budgets.activations)}; "
                f"RAM {format_bytes(self.budgets.ram_total)} ({self.budgets.ram_source})")
        return head + "\n" + render_plan(self.plan, self.bandwidths, self.paths)

    def moved_report(self) -> str:
        s = self.engine.stats
        moved = {Tier(k): v for k, v in s.bytes_moved.items()}
        return render_moved(moved, s.prefill_passes + s.decode_passes, s.prompt_tokens + s.generated_tokens)

    def close(self) -> None:
        for close in reversed(self.closers):
            close()
        self.closers = []


def gpu_nbytes(info: Any) -> int:
    """Device bytes of a GGUF tensor on the GPU: its planar form for a matrix, float32 for a vector."""
    from infer.gpu.layout import format_of, plane_layout

    shape = tuple(info.shape)
    if len(shape) == 1:
        return int(shape[0]) * 4
    rows = 1
    for d in shape[:-1]:
        rows *= int(d)
    return plane_layout(format_of(info.ggml_type), rows, int(shape[-1])).nbytes


def planner_tensors(model: GGUFModel, device: str) -> list[Tensor]:
    """The model's tensors with device sizes for `device` (planar forms on the GPU)."""
    return tensors_from(model.tensors.values(), gpu_nbytes if device == "gpu" else None)


def require_resident_fit(model: GGUFModel, ctx_size: int, batch: int = 1, vram_budget: str | None = None) -> None:
    """For runs without --streaming on the GPU: stops with a one-line message suggesting
    --streaming when the weights, KV cache and activations exceed the VRAM budget (or free VRAM)."""
    args = ModelArgs.from_gguf(model)
    weights = sum(t.device_nbytes for t in planner_tensors(model, "gpu"))
    try:
        budgets = compute_budgets(args, ctx_size, batch, min(ctx_size, 512), 0, vram_budget or 10**18, "0")
    except BudgetError as err:
        raise click.ClickException(str(err)) from None
    overhead = budgets.vram_total - budgets.vram_for_weights
    available = budgets.vram_total if vram_budget else _free_vram()
    if weights + overhead > available:
        raise click.ClickException(
            f"{model.path.name} needs {format_bytes(weights + overhead)} of VRAM ({format_bytes(weights)} weights + "
            f"{format_bytes(overhead)} KV cache, activations and workspace) but "
            f"{'the budget is' if vram_budget else 'the GPU has'} {format_bytes(available)}: run with --streaming "
            "(or lower -c/--ctx-size)")


def _free_vram() -> int:
    from infer.tiers.budget import free_vram

    return free_vram()


def _demo_budgets(tensors: list[Tensor], slots: int, scratch: bool) -> tuple[int, int]:
    """Weight budgets that put some layers in each tier (--streaming on a model that would fit)."""
    layer_bytes = sum(t.device_nbytes for t in tensors if t.layer is not None and not t.is_vector)
    raw_layer_bytes = sum(t.nbytes for t in tensors if t.layer is not None and not t.is_vector)
    vram = minimum_vram(tensors, slots, scratch) + int(DEMO_RESIDENT_SHARE * layer_bytes)
    return vram, int(DEMO_RAM_SHARE * raw_layer_bytes)


def build_streaming_engine(model_path: str, config: StreamingConfig, ctx_size: int, device: str = "cpu",
                           prefill_chunk: int = 512, measure: bool = True, match_llama_cpp: bool = True
                           ) -> StreamingSession:
    """Plans, opens the tiers and returns a session whose engine streams as the plan says.
    Budget problems become click.ClickException with the minimum that would work."""
    if device not in ("cpu", "gpu"):
        raise ValueError(f"unknown device '{device}' (cpu, gpu)")
    model = GGUFModel(model_path)
    args = ModelArgs.from_gguf(model)
    tensors = planner_tensors(model, device)
    on_gpu = device == "gpu"
    staging = config.staging_buffers * max((t.nbytes for t in tensors if t.layer is not None), default=0)
    tokens_per_pass = max(prefill_chunk, config.batch)  # prefill passes share prefill_chunk rows (streaming.py)
    demo = config.vram_budget is None and config.ram_budget is None and not on_gpu
    try:
        if demo or (on_gpu and config.vram_budget is None and config.ram_budget is None and _fits(model, tensors)):
            weights_vram, weights_ram = _demo_budgets(tensors, config.slots, on_gpu)
            budgets = compute_budgets(args, ctx_size, config.batch, tokens_per_pass, staging, 10**15, 10**15,
                                      device=on_gpu)
            overhead = budgets.vram_total - budgets.vram_for_weights
            budgets = Budgets(weights_vram + overhead, weights_vram, weights_ram + staging, weights_ram,
                              budgets.kv_cache, budgets.activations, staging,
                              "demo: the model fits, small budgets exercise every tier", "demo")
        else:
            budgets = compute_budgets(args, ctx_size, config.batch, tokens_per_pass, staging,
                                      config.vram_budget, config.ram_budget, device=on_gpu)
        plan = make_plan(tensors, args.n_layers, budgets.vram_for_weights, budgets.ram_for_weights,
                         config.slots, layer_scratch=on_gpu)
    except BudgetError as err:
        raise click.ClickException(str(err)) from None
    except PlanError as err:
        overhead = budgets.kv_cache + budgets.activations + (DEVICE_MARGIN if on_gpu else 0)
        raise click.ClickException(
            f"{err}; with the KV cache and activations the VRAM budget must be at least "
            f"{format_bytes(err.minimum + overhead)} (or lower -c/--batch)") from None
    session_closers: list[Callable[[], None]] = []
    b_tensors = plan.tensors_in(Tier.RAM)
    mode = choose_mode(b_tensors, budgets.ram_for_weights, config.tier_b)
    host = None
    if b_tensors:
        try:
            host = HostTier(model_path, b_tensors, mode)
        except Exception as err:  # registration refused (limits, driver): the pinned copy always works
            if config.tier_b != "auto" or mode != "registered":
                raise
            plan.notes.append(f"registering the file mapping failed ({type(err).__name__}: {err}); tier B pinned")
            mode = "pinned"
            host = HostTier(model_path, b_tensors, mode)
    if host is not None:
        session_closers.append(host.close)
    c_tensors = plan.tensors_in(Tier.STORAGE)
    source: StorageSource | None = None
    if c_tensors:
        options: dict[str, Any] = {"lba": config.nvme_lba} if config.tier_c == "nvme" and config.nvme_lba is not None else {}
        if config.read_queue_depth is not None and config.tier_c != "mmap":
            options["queue_depth"] = config.read_queue_depth
        source = open_source(config.tier_c, model_path, c_tensors, config.nvme_device, **options)
        session_closers.append(source.close)
    paths = {t.name: _path(plan, t.name, mode, config.tier_c) for t in plan.tensors}
    bandwidths = _measure(on_gpu, source, c_tensors) if measure else None
    if on_gpu:
        from infer.tiers.gpu_forward import GpuStreamingModel
        from infer.tiers.pipeline import GpuStreamingWeights

        weights: Any = GpuStreamingWeights(model, args, plan, host, source, n_staging=config.staging_buffers)
        transformer: Any = GpuStreamingModel(args, weights, ctx_size)
    else:
        from infer.tiers.cpu_sim import StreamingCpuWeights

        weights = StreamingCpuWeights(model, args, plan, host, source, n_staging=config.staging_buffers,
                                      match_llama_cpp=match_llama_cpp)
        transformer = Transformer(args, weights, weights.rope_freq_factors())
    session_closers.append(weights.close)
    engine = StreamingEngine(transformer, ctx_size, prefill_chunk,
                             bytes_moved=lambda: {k.value: v for k, v in weights.bytes_moved().items()})
    return StreamingSession(engine, plan, budgets, weights, paths, bandwidths, session_closers)


def _fits(model: GGUFModel, tensors: list[Tensor]) -> bool:
    from infer.tiers.budget import free_vram

    return sum(t.device_nbytes for t in tensors) < free_vram() - DEVICE_MARGIN


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
