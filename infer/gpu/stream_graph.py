"""A streamed model's pass as one CUDA graph: the ring's copies, the repacks and every layer's
kernels captured once per row bucket and ring phase, then launched with one call.

Why: queueing a streamed pass costs the host about 580 runtime calls with Python between them
(about 6.5 ms of a 7.2 ms pass for the real Qwen pair's target, session 34's trace), so nothing else
the host must queue (a draft's steps beside the pass: infer/draft_ahead.py) can start until the pass
is nearly over. Captured, the pass costs the host one launch.

What the capture holds (infer.tiers.pipeline's GpuTransport): the compute stream's waits on each
piece's arrival, the repacks, the releases, and the copy stream's refills behind them, the next
pass's first pieces included; the copy stream joins back at the end, so a graph ends after its
copies. A piece copied before the capture began is ordered by a wait outside it (a wait inside a
capture may not name an event recorded outside). The ring's Python count moves on by a pass at
each replay (StreamRing.skip_pass). Slots repeat with the pass's first slot, so a graph is kept
per (row bucket, first slot).

Only where every piece comes from tier B (a tier C read waits on the host), no layer is left to the
CPU tier, no block of experts is the CPU's, and the model is not a view skipping layers. Off unless
NVMEDIRECT_STREAM_GRAPH=1: the bits are the per-layer path's on the NumPy stand-in of CuPy and on an
H100 (session 36), and it cut a small model's streamed step from 17-18 ms of host time to 2.1 ms,
but the real Qwen pair's pass is bound by the link, where it gained nothing (docs/PERFORMANCE.md,
session 36).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from infer.gpu.model import GpuTransformer
    from infer.gpu.passes import PassShape

KIND = "streamed pass"  # the graphs' key kind (GraphCache.drop)


def enabled() -> bool:
    return os.environ.get("NVMEDIRECT_STREAM_GRAPH", "0") == "1"


def can_capture(model: GpuTransformer) -> bool:
    """The model's passes can run as one graph (module docstring)."""
    weights = model.weights
    return (enabled() and hasattr(weights, "capturable") and weights.capturable()  # type: ignore[attr-defined]
            and model.cpu_tier is None and model.cpu_experts is None and model.gpu_experts is None
            and not model.skip)


def run_pass(model: GpuTransformer, shape: PassShape) -> None:
    """Every layer of the pass in the index, as one graph on model.stream (captured first if this
    bucket and phase have none)."""
    weights = model.weights
    key = (KIND, shape, weights.pass_phase())  # type: ignore[attr-defined]
    if key in model.graphs:
        weights.ring.skip_pass()  # type: ignore[attr-defined]
    else:
        weights.transport.begin_capture(model.stream)  # type: ignore[attr-defined]
    model.graphs.replay(key, None, lambda: _launches(model, shape))
    weights.transport.after_graph(model.stream)  # type: ignore[attr-defined]


def _launches(model: GpuTransformer, shape: PassShape) -> None:
    weights = model.weights
    try:
        for capturable, items in model._segments:
            if capturable:
                model._launch(items, shape)
                continue
            for i in items:
                model._layer(i, weights.layer(i), shape)
    finally:
        weights.transport.end_capture(model.stream)  # type: ignore[attr-defined]
