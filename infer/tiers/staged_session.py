"""The streaming engine across the GPUs of one host (issue 30): the layers split in stages
(infer.tiers.stage_plan), each stage's tensors placed by its own plan in its GPU's budget (tier A
in its VRAM, the rest streamed through its own ring over its own link from pinned RAM or storage),
the stages joined as infer.gpu.stages joins them.

    session = build_streaming_stages(GGUFModel(path), StreamingConfig(enabled=True, vram_budget="24GB"),
                                     ctx_size=2048, gpus=[0, 1])

Each GPU's link carries only its own share's streamed bytes. While one GPU works, another
prefetches only what its ring holds (a few tensors), so with one run of layers a GPU the links
mostly take turns. Where the GPUs are distinct and the model streams, the shares are runs of about
a ring's worth of streamed bytes taking turns (stage_plan.interleave): while one GPU works through
its run, the other's ring fills for its next, so both links copy (issue 30's second bar; not
measured: no machine with two GPUs was lent). Tier B is a pinned copy per stage (a registered file
mapping is one per process); tier C is a file (an NVMe drive is one queue owner: not split yet).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from infer.arch import check_model, refuse_experts, rope_freq_factors
from infer.gguf_file import GGUFModel
from infer.streaming import StreamingEngine
from infer.tiers.budget import BudgetError, VramAccount, compute_budgets
from infer.tiers.config import StreamingConfig
from infer.tiers.plan import Plan, PlanError, Tier, format_bytes, make_plan, planner_tensors, span
from infer.tiers.report import render_plan
from infer.tiers.session import StreamingSession, plan_streamed, tier_paths
from infer.tiers.stage_plan import (
    interleave,
    interleave_chunk,
    layer_costs,
    parse_budgets,
    split_layers,
    stage_tensors,
)
from infer.tiers.tier_b import HostTier
from infer.tiers.tier_c import StorageSource, open_source

HBM_OVER_LINK = 40.0  # a GPU reads its VRAM ~40x faster than its PCIe link brings bytes (RTX 4090: ~1 TB/s, ~25 GB/s)


class StagedStreamingSession(StreamingSession):
    """A StreamingSession whose engine runs a pipeline of streamed stages: `stage_plans` (GPU,
    layers, plan, account) report each stage."""

    stage_plans: list[tuple[int, Sequence[int], Plan, VramAccount]]
    sources: list[StorageSource]  # every stage's tier C
    tier_c: str = "file"

    def problem(self) -> str | None:
        """Why a stage's tier C can no longer be read, or None."""
        return next((why for why in (getattr(s, "failure", None) for s in self.sources) if why), None)

    def report(self) -> str:
        n = len(self.stage_plans)
        lines = [f"{n} stage{'s' if n != 1 else ''}: " + ", ".join(
            f"GPU {g} layers {span(r)}" for g, r, _, _ in self.stage_plans)]
        for g, r, plan, account in self.stage_plans:
            lines += [f"-- stage on GPU {g} (layers {span(r)})", account.render(),
                      render_plan(plan, None, tier_paths(plan, "pinned", self.tier_c))]
        return "\n".join(lines)


def build_streaming_stages(model: GGUFModel, config: StreamingConfig, ctx_size: int, gpus: Sequence[int],
                           prefill_chunk: int = 512, enforce_budget: bool = False,
                           planned: dict[str, int] | None = None, tree_nodes: int = 0,
                           chunk: int | None = None) -> StagedStreamingSession:
    """The model split across `gpus` (config.vram_budget: one size for each GPU or one per GPU;
    config.ram_budget shared, each stage its share by its layers' bytes), each stage streamed as its
    plan says. planned: device memory already taken on the first GPU (a draft model). Budget
    problems raise BudgetError with the stage's numbers. chunk: runs of this many layers take
    turns between the GPUs (interleave); default: where the GPUs are distinct and the model
    streams, about a ring's worth of streamed bytes a run (interleave_chunk), else one run a GPU."""
    import cupy

    from infer.gpu import gpu_pass_nbytes, memory
    from infer.gpu.model import LOGITS_ROWS, GpuTransformer
    from infer.gpu.stages import PipelineTransformer, choose_link, missing_gpu
    from infer.tiers.pipeline import StreamedWeights

    args = check_model(model)
    refuse_experts(args, model.path, "the streaming engine across GPUs", "run it on one GPU")
    if config.tier_c == "nvme":
        raise BudgetError("--gpus with --tier-c nvme: one drive cannot feed several stages yet (use --tier-c file)")
    missing = missing_gpu(gpus)
    if missing:
        raise ValueError(missing)
    budgets = parse_budgets(config.vram_budget, len(gpus))
    if any(b is None for b in budgets):
        raise BudgetError("--streaming --gpus needs --vram-budget (one size for each GPU, or one per GPU)")
    rows = max(prefill_chunk, config.batch)
    tensors = planner_tensors(model, "gpu")
    per_layer, head, embed = layer_costs(model, args, tensors)
    hand = choose_link(gpus)  # first: NCCL's memory is then in each account (infer.gpu.stages.NcclLink)
    try:
        # streaming lets any range fit its GPU: the split balances each stage's time per pass, its
        # room's bytes read from VRAM and the rest copied over its link (HBM_OVER_LINK times slower)
        rooms = []
        for g, budget in zip(gpus, budgets, strict=True):
            with cupy.cuda.Device(g):
                account = memory.new_account(budget, "the split")
            rooms.append(account.pool_limit - gpu_pass_nbytes(model, args, rows, ctx_size, max(config.batch, tree_nodes))
                         - args.kv_cache_nbytes(ctx_size, rows, sequences=config.batch) // len(gpus))
        if chunk is None and len(set(gpus)) == len(gpus) > 1:
            slot = max((t.nbytes for t in tensors if t.layer is not None and not t.is_vector), default=0)
            chunk = interleave_chunk(per_layer, rooms, config.slots * slot)
        shares: list[Sequence[int]]
        if chunk:  # runs taking turns, so that both links copy (module docstring)
            shares = interleave(args.n_layers, len(gpus), chunk)
        else:
            shares = split_layers(per_layer, per_layer, rooms, head_cost=head, head_size=head, embed_size=embed,
                                  link_speeds=[1.0 / HBM_OVER_LINK] * len(gpus))
        staging = config.staging_buffers * max((t.nbytes for t in tensors if t.layer is not None), default=0)
        whole = compute_budgets(args, ctx_size, config.batch, rows, staging, 10**15, config.ram_budget)
        layer_raw = sum(t.nbytes for t in tensors if t.layer is not None and not t.is_vector)
        factors = rope_freq_factors(model, args)
        # every stage planned before any loads: where stages share a GPU (the stand-in of tests) a later
        # account would count an earlier stage's weights as another process's memory
        planned_stages: list[tuple[int, Sequence[int], Plan, VramAccount]] = []
        for k, (g, layers, budget) in enumerate(zip(gpus, shares, budgets, strict=True)):
            mine = stage_tensors(tensors, model, layers, args.n_layers)
            with cupy.cuda.Device(g):
                account = memory.new_account(budget, f"{model.path.name} streamed on GPU {g} (layers {span(layers)})")
            for name, nbytes in ((planned or {}).items() if k == 0 else ()):
                account.plan(name, nbytes)
            kv = args.kv_cache_nbytes(ctx_size, rows, sequences=config.batch, layers=layers) + 4 * config.batch * (ctx_size + 1)
            act = gpu_pass_nbytes(model, args, rows, ctx_size, max(config.batch, tree_nodes), layers)
            room = account.pool_limit - account.planned_total - kv - act
            share = sum(t.nbytes for t in mine if t.layer is not None and not t.is_vector) / max(layer_raw, 1)
            try:
                plan = make_plan(mine, args.n_layers, room, int(whole.ram_for_weights * share), config.slots,
                                 layer_scratch=True)
            except PlanError as err:
                raise BudgetError(f"GPU {g} (layers {span(layers)}): {err}; with its KV cache and pass "
                                  f"buffers its VRAM budget must be at least {format_bytes(err.minimum + kv + act)}") from None
            plan_streamed(account, plan, kv, act)
            planned_stages.append((g, layers, plan, account))
    except BaseException:
        hand.close()
        raise
    stages: list[GpuTransformer] = []
    closers: list[Callable[[], None]] = [hand.close]
    moved: list[Callable[[], dict]] = []
    sources: list[StorageSource] = []
    try:
        for g, layers, plan, account in planned_stages:
            with cupy.cuda.Device(g):
                if enforce_budget and len(set(gpus)) == len(gpus):  # each GPU's pool capped at its stage's plan
                    memory.enforce(account)
                b_tensors = plan.tensors_in(Tier.RAM)
                host = HostTier(model, b_tensors, "pinned") if b_tensors else None
                if host is not None:
                    closers.append(host.close)
                c_tensors = plan.tensors_in(Tier.STORAGE)
                source: StorageSource | None = None
                if c_tensors:
                    source = open_source(config.tier_c, model.path, c_tensors, None, notes=plan.notes)
                    closers.append(source.close)
                    sources.append(source)
                weights = StreamedWeights(model, args, plan, host, source, config.staging_buffers, layers=layers)
                closers.append(weights.close)
                moved.append(weights.bytes_moved)
                stage = GpuTransformer(args, weights, factors, ctx_size, rows,
                                       logits_rows=max(LOGITS_ROWS, config.batch, tree_nodes), layers=layers)
                stage.account = account
            stages.append(stage)
        pipeline = PipelineTransformer(stages, hand)
    except BaseException:
        for close in reversed(closers):
            close()
        raise

    def bytes_moved() -> dict[str, int]:
        total: dict[str, int] = {}
        for get in moved:
            for tier, n in get().items():
                total[tier.value] = total.get(tier.value, 0) + n
        return total

    engine = StreamingEngine(pipeline, ctx_size, prefill_chunk, bytes_moved=bytes_moved)
    session = StagedStreamingSession(engine, planned_stages[0][2], whole, stages[0].weights, {}, None,
                                     planned_stages[0][3], closers)
    session.stage_plans, session.sources, session.tier_c = planned_stages, sources, config.tier_c
    return session
