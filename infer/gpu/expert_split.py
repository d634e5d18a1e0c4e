"""Decode with blocks on the CPU, split by pick (issue 26): each token's first `slots` picks in a
block whose experts the CPU holds are computed on the GPU from their experts' slices fetched over
the link (infer.gpu.expert_stream.ExpertStream.fetch), while the CPU computes the other picks from
RAM; the CPU's outputs cross to the device and moe_combine adds all k in the picks' order. Which
side computes a pick depends only on its rank, so a row's bits do not depend on its pass; with every
pick on the GPU a decode step is bit for bit the run with every expert in VRAM (tests: check_split).

Off unless NVMEDIRECT_EXPERT_GPU_SLOTS is set (choose_gpu_slots): on the
H100 host of 2026-12-06 3 of 8 picks decoded the 30B-A3B at 8 GB at 34.3 tok/s against 53.1 without,
a fetch's fixed costs above the CPU time it saves (docs/PERFORMANCE.md, session 28). Its buffers
(a few hundred KiB of VRAM, page-locked host rows) exist only when it is on.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import cupy
import numpy as np

from infer.arch import ModelArgs
from infer.gpu import products
from infer.gpu.experts import STACKS, GpuExperts, combine, route
from infer.gpu.weights import runs
from infer.quants import activation_format

if TYPE_CHECKING:
    from infer.tiers.cpu_tier import CpuExperts

F32 = cupy.float32


def choose_gpu_slots(args: ModelArgs) -> tuple[int, str]:
    """How many of a token's picks in the CPU's blocks the GPU computes, their experts fetched over
    the link while the CPU computes the rest (PickSplit), and the line that says so.
    None by default: on the H100 host of 2026-12-06 three of eight (what one pick's costs, CPU 0.047
    ms and link 0.084 ms, suggested) decoded the 30B-A3B at 8 GB at 34.3 tok/s against 53.1 with
    none, the fixed costs of a fetch (a wait for the picks, a copy and a repack per slice) larger than
    the CPU's share they save (docs/PERFORMANCE.md). NVMEDIRECT_EXPERT_GPU_SLOTS=g sets one."""
    k = args.n_experts_used
    forced = os.environ.get("NVMEDIRECT_EXPERT_GPU_SLOTS")
    if forced is None:
        return 0, ""
    try:
        g = max(0, min(k, int(forced)))
    except ValueError:
        raise ValueError(f"NVMEDIRECT_EXPERT_GPU_SLOTS takes a count of picks (0 to {k}), not {forced!r}") from None
    return g, f"{g} of a token's {k} picks in the CPU's blocks fetched to the GPU (NVMEDIRECT_EXPERT_GPU_SLOTS)"


def pinned_rows(rows: int, cols: int) -> np.ndarray:
    """A float32 (rows, cols) host array in page-locked memory (a copy to or from the device is async)."""
    import cupyx

    return cupyx.empty_pinned((rows, cols), np.float32)


class PickSplit:
    """The split of the CPU's blocks' picks for `experts` (a GpuExperts with an ExpertStream): its
    own routing buffers (the pass's streamed rows use the others meanwhile), page-locked host rows,
    and a side stream for the picks' trip to the host."""

    def __init__(self, experts: GpuExperts, slots: int, why: str) -> None:
        if experts.stream is None:
            raise ValueError("a split by pick fetches through an expert stream: none was made")
        self.experts, self.slots, self.why = experts, slots, why
        a, rows = experts.args, experts.rows
        pairs, d = rows * a.n_experts_used, a.dim
        self.split_ids = cupy.full(pairs, -1, cupy.int32)  # the GPU's picks (the CPU's: -1)
        self.split_logits = cupy.zeros((rows, a.n_experts), F32)
        self.split_route = (cupy.full(pairs, -1, cupy.int32), cupy.zeros(pairs, F32))  # ids, weights
        # page-locked: x rows and picks to the host, picks and the CPU's outputs back
        self.split_host = (pinned_rows(rows, d).reshape(-1), pinned_rows(pairs, 1).view(np.int32).reshape(-1),
                           pinned_rows(pairs, 1).view(np.int32).reshape(-1), pinned_rows(pairs, d))
        self.side = cupy.cuda.Stream(non_blocking=True)
        self.routed = cupy.cuda.Event(disable_timing=True)
        self.host_free = cupy.cuda.Event(disable_timing=True)  # never recorded: free at first

    def run(self, model: object, i: int, rows: int, cpu: CpuExperts, then: Callable[[], None] | None = None) -> None:
        """Block i's feed-forward (one whose experts the CPU holds) for model.x rows 0..rows: routed
        here; each row's first `slots` picks computed here, their experts fetched over the link
        (ExpertStream.fetch), while the CPU computes the other picks from RAM (`cpu`'s products);
        combined here in the picks' order. Which side computes a pick depends only on its rank, so
        a row's bits do not depend on the pass (the pass's other rows only change what is fetched).
        `then` (the pass's streamed prompt rows, on rows past `rows`) is queued right after the
        routing, so the device runs it while the host waits for the picks and the CPU computes;
        the routing's results have buffers of their own for that reason, and the norm is taken
        again after it (the same bits)."""
        E, stream, g = self.experts, model.stream, self.slots  # type: ignore[attr-defined]
        a = E.args
        k, d, e, n = a.n_experts_used, a.dim, a.n_experts, rows
        if n < 1:
            if then is not None:
                then()
            return
        L = model.weights.layer(i)  # type: ignore[attr-defined]
        router = E.stream.resident[(i, "ffn_gate_inp")]  # type: ignore[union-attr]
        stacks = E.stream.stacks  # type: ignore[union-attr]
        acts = [router.act, *(activation_format(stacks[(i, kind)].ggml_type) for kind in STACKS[:2])]
        xs = E.inputs.normed(model.x, L.ffn_norm, "ffn", acts, n)  # type: ignore[attr-defined]
        products.product([router], xs[router.act], self.split_logits, n, ldy=e)
        ids, weights = self.split_route
        route(self.split_logits, n, e, k, a.expert_weights_norm, model.index.d["live"], ids, weights)  # type: ignore[attr-defined]
        self.host_free.synchronize()  # the previous block's host rows have gone to the device
        host_x, host_ids, host_picks, host_outs = self.split_host
        self.routed.record(stream)
        self.side.wait_event(self.routed)  # the picks and rows to the host beside what `then` queues
        d2h = cupy.cuda.runtime.memcpyDeviceToHost
        cupy.cuda.runtime.memcpyAsync(host_x.ctypes.data, model.x.data.ptr, n * d * 4, d2h, self.side.ptr)  # type: ignore[attr-defined]
        cupy.cuda.runtime.memcpyAsync(host_ids.ctypes.data, ids.data.ptr, n * k * 4, d2h, self.side.ptr)
        if then is not None:
            then()
        self.side.synchronize()
        chosen = host_ids[: n * k].reshape(n, k).copy()
        mine = chosen[:, :g]
        B = E.stream.fetch(i, sorted({int(v) for v in mine[mine >= 0]}))  # type: ignore[union-attr]
        picks = host_picks[: n * k].reshape(n, k)
        picks[...] = chosen
        picks[:, g:] = -1  # the CPU's picks: no product here
        cupy.cuda.runtime.memcpyAsync(self.split_ids.data.ptr, picks.ctypes.data, n * k * 4,
                                      cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
        if then is not None:  # `then` used the normed inputs' buffers
            xs = E.inputs.normed(model.x, L.ffn_norm, "ffn", acts, n)  # type: ignore[attr-defined]
        pairs, gu = n * k, E.gu.reshape(-1)
        for parts, row0 in runs([B.gate, B.up]):
            products.expert_product(parts, e, xs[parts[0].act], self.split_ids, pairs, k, gu[row0 // e :], 2 * a.expert_ffn_dim)
        E.gated(E.gu, a.expert_ffn_dim, pairs, E.ff, B.down.act)
        products.expert_product([B.down], e, E.ff, self.split_ids, pairs, 1, E.outs, d)
        # meanwhile the CPU's picks, from the normed rows as the CPU computes them
        live = model.index.live_rows  # type: ignore[attr-defined]
        live = live[live < n]
        theirs = chosen[live].copy()
        theirs[:, :g] = -1
        if k > g and len(live):
            C = cpu.blocks.layer(i)
            h = cpu.blocks.native_layers.norm(host_x[: n * d].reshape(n, d)[live], C.ffn_norm, a.norm_eps)
            wanted = np.unique(theirs[:, g:])
            outs = np.zeros((len(live), k, d), np.float32)
            C.experts.run_experts(outs, h, theirs, wanted[wanted >= 0], cpu.blocks.native_layers.swiglu)  # type: ignore[union-attr]
            host = host_outs[: len(live) * (k - g)]
            host[...] = outs[:, g:].reshape(-1, d)
            for j, r in enumerate(live.tolist()):
                cupy.cuda.runtime.memcpyAsync(E.outs[r * k + g :].data.ptr, host[j * (k - g) :].ctypes.data,
                                              (k - g) * d * 4, cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
        self.host_free.record(stream)
        shared = gate = None
        if E.shared is not None:
            shared, gate = E.run_shared(B, xs, n)
        combine(E.outs, ids, weights, k, d, n, shared, gate, model.x)  # type: ignore[attr-defined]
