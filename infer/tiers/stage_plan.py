"""How a model's layers split across the GPUs of one host (issue 30; run by infer.gpu.stages): each
GPU a stage of contiguous layers, the first with the token embedding, the last with the output
norm and head. Device-neutral: the split is chosen from byte counts, each GPU's room and speed.

    split_layers   the ranges: every stage within its room, the slowest stage as fast as possible
    plan_stages    a GGUF model's ranges on a list of GPUs (its layers' device bytes and KV caches)
    parse_gpus, parse_budgets   --gpus 0,1 and --vram-budget per GPU
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from infer.arch import ModelArgs
from infer.gguf_file import GGUFModel
from infer.tiers.plan import Tensor, planner_tensors


@dataclass(frozen=True)
class Stage:
    """GPU `gpu` holds layers `layers` (and the embedding when they start at 0, the head when they
    end at the last)."""

    gpu: int
    layers: range


def parse_gpus(text: str) -> list[int]:
    """'0,1' -> [0, 1]: distinct device numbers, at least one."""
    try:
        gpus = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--gpus takes device numbers separated by commas (e.g. 0,1), not {text!r}") from None
    if not gpus or len(set(gpus)) != len(gpus) or min(gpus) < 0:
        raise ValueError(f"--gpus needs distinct device numbers >= 0 (e.g. 0,1), not {text!r}")
    return gpus


def parse_budgets(text: str | None, n: int) -> list[str | None]:
    """--vram-budget with --gpus: one size for every GPU ('24GB') or one per GPU ('24GB,20GB')."""
    if text is None:
        return [None] * n
    parts = [p.strip() for p in text.split(",")]
    if len(parts) == 1:
        return parts * n
    if len(parts) != n:
        raise ValueError(f"--vram-budget gives {len(parts)} sizes for {n} GPUs: give one, or one per GPU")
    return list(parts)


def split_layers(costs: Sequence[float], sizes: Sequence[int], rooms: Sequence[float],
                 speeds: Sequence[float] | None = None, head_cost: float = 0.0, head_size: int = 0,
                 link_speeds: Sequence[float] | None = None, embed_size: int = 0) -> list[range]:
    """Contiguous layer ranges, one per stage in order, every stage at least one layer: layer i
    costs costs[i] (bytes a pass reads) and takes sizes[i] bytes of its stage's room (rooms[k]:
    what stage k may hold for layers); the last stage also holds the head (head_cost, head_size),
    the first the token embedding's device copy (embed_size: where the output reuses it).
    Stage k's time is its cost over speeds[k]; the ranges make the slowest stage as fast as
    possible (ties: the earlier stages take more). ValueError when no split fits the rooms.
    link_speeds (a streamed model): a stage may hold more than its room; what its room does not
    hold streams each pass at link_speeds[k] (its GPU's link), the rest is read at speeds[k]."""
    n, s = len(costs), len(rooms)
    speeds = list(speeds) if speeds is not None else [1.0] * s
    if s < 1 or n < s:
        raise ValueError(f"{n} layers cannot make {s} stages of at least one layer each")
    cost_sum = np.concatenate([[0.0], np.cumsum(costs)])
    size_sum = np.concatenate([[0], np.cumsum(sizes)])
    inf = float("inf")

    def stage_time(k: int, a: int, b: int) -> float:
        last = k == s - 1
        size = size_sum[b] - size_sum[a] + (head_size if last else 0) + (embed_size if k == 0 else 0)
        cost = cost_sum[b] - cost_sum[a] + (head_cost if last else 0.0)
        if link_speeds is not None:  # the part past its room streams over its link (what is not there, all of it)
            over = min(size, max(0.0, size - rooms[k]))
            return (cost - over) / speeds[k] + over / link_speeds[k]
        if size > rooms[k]:
            return inf
        return cost / speeds[k]

    # best[k][b]: the slowest of stages 0..k over layers 0..b-1, stage k ending at b
    best = [[inf] * (n + 1) for _ in range(s)]
    cut = [[0] * (n + 1) for _ in range(s)]
    for b in range(1, n + 1):
        best[0][b] = stage_time(0, 0, b)
    for k in range(1, s):
        for b in range(k + 1, n + 1):
            for a in range(k, b):  # stage k takes layers a..b-1; the latest start wins ties (earlier stages take more)
                t = max(best[k - 1][a], stage_time(k, a, b))
                if t <= best[k][b]:
                    best[k][b], cut[k][b] = t, a
    if best[s - 1][n] == inf:
        raise ValueError("the layers do not fit the GPUs' budgets in any split")
    ranges, b = [], n
    for k in range(s - 1, 0, -1):
        a = cut[k][b]
        ranges.append(range(a, b))
        b = a
    ranges.append(range(0, b))
    return ranges[::-1]


def interleave(n_layers: int, gpus: int, chunk: int) -> list[list[int]]:
    """Each GPU's layers when runs of `chunk` layers take turns: GPU 0 the first run, GPU 1 the
    next, ... (a streamed model: while one GPU works through its run, the other's ring fills for
    its next one, so both links copy)."""
    shares: list[list[int]] = [[] for _ in range(gpus)]
    for c, start in enumerate(range(0, n_layers, chunk)):
        shares[c % gpus].extend(range(start, min(start + chunk, n_layers)))
    return shares


def interleave_chunk(layer_bytes: Sequence[int], rooms: Sequence[float], ring_bytes: int) -> int | None:
    """The run length at which streamed stages take turns: about a ring's worth of streamed bytes
    a run (the bytes past the GPUs' rooms spread over the layers); None when nothing streams or
    one run a GPU is already that short."""
    total = sum(layer_bytes)
    streamed = total - sum(max(0.0, r) for r in rooms)
    if streamed <= 0 or not layer_bytes:
        return None
    per_layer = streamed / len(layer_bytes)
    chunk = max(1, int(ring_bytes // per_layer))
    return chunk if chunk * len(rooms) < len(layer_bytes) else None


def layer_costs(model: GGUFModel, args: ModelArgs, tensors: Sequence[Tensor]) -> tuple[list[int], int, int]:
    """(each layer's device bytes, the head's, the first stage's token embedding's: where the output
    reuses it, the first stage holds a device copy too; else it stays in host memory)."""
    per_layer = [sum(t.device_nbytes for t in tensors if t.layer == i) for i in range(args.n_layers)]
    head = sum(t.device_nbytes for t in stage_tensors(list(tensors), model, [args.n_layers - 1], args.n_layers)
               if t.layer is None)
    embed = sum(t.device_nbytes for t in stage_tensors(list(tensors), model, [0], args.n_layers)
                if t.layer is None) if args.n_layers > 1 else 0
    return per_layer, head, embed


def plan_stages(model: GGUFModel, args: ModelArgs, gpus: Sequence[int], rooms: Sequence[float],
                context: int, prefill_chunk: int = 512, batch: int = 1,
                speeds: Sequence[float] | None = None) -> list[Stage]:
    """The stages of `model` on `gpus`: each GPU's `rooms` (bytes it may hold for its layers, their
    KV caches of `batch` sequences of `context` positions, and the head, after its pass buffers)
    and `speeds` (relative: its memory bandwidth) balance the split (split_layers) by the layers'
    device bytes (what a pass reads)."""
    tensors = planner_tensors(model, "gpu")
    per_layer, head, embed = layer_costs(model, args, tensors)
    kv = [args.kv_cache_nbytes(context, prefill_chunk, sequences=batch, layers=range(i, i + 1))
          for i in range(args.n_layers)]
    sizes = [w + c for w, c in zip(per_layer, kv, strict=True)]
    ranges = split_layers(per_layer, sizes, rooms, speeds, head_cost=head, head_size=head, embed_size=embed)
    return [Stage(g, r) for g, r in zip(gpus, ranges, strict=True)]



def stage_tensors(tensors: list[Tensor], model: GGUFModel, stage: Sequence[int], n_layers: int) -> list[Tensor]:
    """The planner's tensors a stage of `stage`'s layers holds: its blocks', the embedding with the
    first (or with the last, when the output reuses it), the output and its norm with the last."""
    from infer.arch import OUTPUT_NORM, TOKEN_EMBD, output_name

    first, last = 0 in stage, n_layers - 1 in stage
    head = {output_name(model), OUTPUT_NORM} if last else set()
    keep = head | ({TOKEN_EMBD} if first else set())
    return [t for t in tensors if (t.layer in stage if t.layer is not None else t.name in keep)]
