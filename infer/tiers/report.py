"""The plan, printed: the tier of every tensor kind in every layer, bytes per tier, the data path
each streamed tensor takes, and the pass time predicted from bandwidths measured at start-up.
For --benchmark, the bytes actually moved per tier per pass and per token.

A pass is bound by the slowest of three things running at once: the link carrying tier B and C
bytes to the device, the storage reading tier C bytes into staging, and the compute. The
prediction is the larger of the first two (compute is measured, not predicted).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from infer.tiers.plan import Plan, Tier, format_bytes

KIND_ORDER = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@dataclass(frozen=True)
class Bandwidths:
    """Bytes per second measured at start-up (0 when not measured)."""

    host_to_device: float
    storage_read: float
    source: str  # how they were measured

    def pass_seconds(self, plan: Plan) -> float:
        streamed = plan.bytes_in(Tier.RAM) + plan.bytes_in(Tier.STORAGE)
        link = streamed / self.host_to_device if self.host_to_device > 0 else 0.0
        storage = plan.bytes_in(Tier.STORAGE) / self.storage_read if self.storage_read > 0 else 0.0
        return max(link, storage)


def measure_host_to_device(nbytes: int = 256 << 20, repeats: int = 3) -> float:
    """Pinned host -> device copy bandwidth (B/s), best of `repeats` timed with CUDA events. The
    device buffer is a transient (memory.transient_pool): left in the engine's pool, its 256 MiB
    stayed there as a free block that the plan's buffers fragmented, and a plan with little room
    left then failed to grow (the streamed 70B's verify at 24 GB, 2026-12-03)."""
    import cupy
    import cupyx

    from infer.gpu.memory import transient_pool

    host = cupyx.empty_pinned((nbytes,), dtype=np.uint8)
    best = 0.0
    with transient_pool():
        dev = cupy.empty(nbytes, dtype=cupy.uint8)
        stream = cupy.cuda.Stream(non_blocking=True)
        for _ in range(repeats + 1):  # the first copy warms up
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            cupy.cuda.runtime.memcpyAsync(dev.data.ptr, host.ctypes.data, nbytes, cupy.cuda.runtime.memcpyHostToDevice,
                                          stream.ptr)
            stop.record(stream)
            stop.synchronize()
            best = max(best, nbytes / (cupy.cuda.get_elapsed_time(start, stop) / 1e3))
        del dev
    return best


def measure_host_copy(nbytes: int = 64 << 20) -> float:
    """memcpy bandwidth of this host (B/s): the CPU simulation's stand-in for the link."""
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros_like(src)  # touched first: page faults are not memcpy
    best = 0.0
    for _ in range(3):
        began = time.perf_counter()
        dst[:] = src
        best = max(best, nbytes / max(time.perf_counter() - began, 1e-9))
    return best


def measure_storage_read(source: object, ranges: list[tuple[int, int]]) -> float:
    """Read bandwidth of a tier C source over `ranges`, all in flight together (B/s)."""
    from nvmedirect.host_memory import pinned_empty

    total = sum(n for _, n in ranges)
    buffer = pinned_empty(total)
    views, at = [], 0
    for _, n in ranges:
        views.append(buffer[at: at + n])
        at += n
    began = time.perf_counter()
    source.read_async(ranges, views).wait()  # type: ignore[attr-defined]
    return total / max(time.perf_counter() - began, 1e-9)


def tier_map(plan: Plan) -> list[str]:
    """One line per layer tensor kind: its tier letter in each layer (A, B or C)."""
    kinds = [k for k in KIND_ORDER if any(t.kind == k for t in plan.tensors)]
    lines = []
    for kind in kinds:
        letters = []
        for i in range(plan.n_layers):
            tiers = [plan.tier[t.name] for t in plan.tensors if t.layer == i and t.kind == kind]
            letters.append(tiers[0].value if tiers else ".")
        lines.append(f"  {kind:<12} {''.join(letters)}")
    return lines


def render_plan(plan: Plan, bandwidths: Bandwidths | None = None, paths: dict[str, str] | None = None) -> str:
    out = [f"placement plan: {plan.n_layers} layers, VRAM budget for weights {format_bytes(plan.vram_budget)}, "
           f"RAM budget {format_bytes(plan.ram_budget)}"]
    for tier in Tier:
        tensors = plan.tensors_in(tier)
        out.append(f"  tier {tier.label:<12} {len(tensors):5d} tensors {format_bytes(plan.bytes_in(tier)):>12}")
    if plan.slot_nbytes:
        out.append(f"  ring: {plan.n_slots} slots x {format_bytes(plan.slot_nbytes)}, layer scratch "
                   f"{format_bytes(plan.scratch_nbytes)}; VRAM used by weights {format_bytes(plan.vram_used)}")
    out.append("  layer tiers (one letter per layer; norms and globals are always A):")
    out.extend(tier_map(plan))
    if paths:
        counts: dict[str, int] = {}
        for p in paths.values():
            counts[p] = counts.get(p, 0) + 1
        out.append("  data paths: " + ", ".join(f"{p} x{n}" for p, n in sorted(counts.items())))
    out.append(f"  streamed per pass: {format_bytes(plan.streamed_nbytes)}")
    if bandwidths is not None and plan.streamed_nbytes:
        seconds = bandwidths.pass_seconds(plan)
        out.append(f"  predicted pass time {seconds * 1e3:.1f} ms (link {bandwidths.host_to_device / 1e9:.1f} GB/s, "
                   f"storage {bandwidths.storage_read / 1e9:.2f} GB/s; {bandwidths.source})")
    out.extend(f"  note: {n}" for n in plan.notes)
    return "\n".join(out)


def render_moved(moved: dict[Tier, int], passes: int, tokens: int) -> str:
    """Bytes each tier actually moved, per pass and per token."""
    parts = []
    for tier, nbytes in sorted(moved.items(), key=lambda kv: kv[0].value):
        per_pass = nbytes / passes if passes else 0
        per_token = nbytes / tokens if tokens else 0
        parts.append(f"tier {tier.value}: {format_bytes(nbytes)} total, {format_bytes(int(per_pass))}/pass, "
                     f"{format_bytes(int(per_token))}/token")
    return "bytes moved: " + ("; ".join(parts) if parts else "none (all resident)")
