"""Drafting with the target's own layers (the seed's --self-spec and --skip-threshold), verified by
the whole target like any other draft, so the output stays the target's own.

- `--self-spec`: the draft is the target without its streamed layers (the resident ones only, as the
  seed drafted): a draft step reads nothing over PCIe. On a model that is all resident it is the
  whole model (every draft token accepted, nothing saved).
- `--skip-threshold T`: layers whose output is nearly their input on a calibration text (mean cosine
  similarity of the residual stream before and after the layer >= T) are left out of the draft; on
  a streamed model the streamed layers are left out too (a draft pass reads no streamed layer: the
  ring delivers them in pass order to the verification pass only). Calibrated on a text of many
  tokens, not on one token as the seed did.

The skipping model shares the target's weights (a shallow copy with `skip` set); it keeps its own
KV cache. docs/SPECULATIVE.md reports acceptance and perplexity cost.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

# Calibration text when none is given: prose and code, about 200 tokens for the Llama/Qwen vocabularies.
CALIBRATION_TEXT = (
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion, "
    "the members agreed to reduce travel costs and to invest the savings in training for new staff.\n\n"
    "def moving_average(values, window):\n"
    "    \"\"\"Return the averages of each run of `window` consecutive values.\"\"\"\n"
    "    if window <= 0:\n"
    "        raise ValueError('window must be positive')\n"
    "    total = sum(values[:window])\n"
    "    out = [total / window]\n"
    "    for i in range(window, len(values)):\n"
    "        total += values[i] - values[i - window]\n"
    "        out.append(total / window)\n"
    "    return out\n\n"
    "Rivers carry sediment from the mountains to the sea, and over thousands of years the deposits "
    "build wide plains where farming towns grew up along the banks."
)


def skipping(model: Any, skip: Iterable[int]) -> Any:
    """The model with layers `skip` left out, sharing its weights (CPU Transformer or GpuTransformer)."""
    skip = frozenset(int(i) for i in skip)
    bad = [i for i in skip if not 0 <= i < model.args.n_layers]
    if bad:
        raise ValueError(f"layers {bad} do not exist in a model of {model.args.n_layers} layers")
    if len(skip) == model.args.n_layers:
        raise ValueError("a draft needs at least one layer: every layer would be skipped")
    without = getattr(model, "without_layers", None)  # GPU: its own graph segments and graphs
    if without is not None:
        return without(skip)
    view = copy.copy(model)
    view.skip = skip
    return view


def streamed_layers(model: Any) -> set[int]:
    """Layers of `model` with any tensor streamed (GPU streaming engine); none elsewhere."""
    weights = getattr(model, "weights", None)
    resident = getattr(weights, "is_resident", None)
    if resident is None:
        return set()
    return {i for i in range(model.args.n_layers) if not resident(i)}


def layer_similarity(model: Any, tokens: Sequence[int]) -> np.ndarray:
    """Per layer, the mean over `tokens` of the cosine similarity between the residual stream
    entering the layer and leaving it (CPU Transformer: its own layer functions, one pass)."""
    ids = np.asarray(tokens, dtype=np.int64)
    if ids.size < 2:
        raise ValueError("calibration needs a text of at least two tokens")
    states: list[np.ndarray] = []
    model.forward_batch([(ids, model.new_cache(len(ids)))], hidden=states)
    sims = np.empty(model.args.n_layers)
    for i, (before, after) in enumerate(zip(states[:-1], states[1:], strict=True)):
        before, after = before.astype(np.float64), after.astype(np.float64)
        num = (before * after).sum(1)
        den = np.linalg.norm(before, axis=1) * np.linalg.norm(after, axis=1)
        sims[i] = float(np.mean(num / np.maximum(den, 1e-30)))
    return sims


def calibrate(similarity: np.ndarray, threshold: float) -> list[int]:
    """Layers whose similarity reaches `threshold` (never all of them)."""
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"--skip-threshold must be in (0, 1], not {threshold}")
    skip = [i for i, s in enumerate(similarity) if s >= threshold]
    if len(skip) == len(similarity):  # keep the layer that changes the stream most
        skip.remove(int(np.argmin(similarity)))
    return skip


def self_draft_layers(target: Any, similarity: np.ndarray | None, threshold: float | None,
                      resident_only: bool) -> set[int]:
    """The layers a self-draft leaves out: the streamed ones (--self-spec, and always with a
    threshold on a streamed model) and those the calibration marks."""
    skip = set(streamed_layers(target)) if resident_only or threshold is not None else set()
    if threshold is not None and similarity is not None:
        skip |= set(calibrate(similarity, threshold))
    if len(skip) >= target.args.n_layers:
        raise ValueError("every layer would be left out of the self-draft: nothing resident to draft with "
                         "(raise --vram-budget or lower --skip-threshold)")
    return skip
