"""Perplexity the way llama.cpp's `llama-perplexity` measures it.

The token stream is cut into chunks of `ctx` tokens (the tail that does not fill a chunk is
dropped). Each chunk is evaluated from an empty cache, its first token replaced by BOS when the
model adds one, and only the second half is scored: the logits at position j predict token j + 1
for j in [ctx/2, ctx - 1). Perplexity is exp of the mean negative log-likelihood over all chunks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    mean_nll: float
    scored_tokens: int
    chunks: int
    ctx: int
    chunk_perplexities: tuple[float, ...]

    def as_dict(self) -> dict[str, object]:
        return {"perplexity": self.perplexity, "mean_nll": self.mean_nll, "scored_tokens": self.scored_tokens,
                "chunks": self.chunks, "ctx": self.ctx, "chunk_perplexities": list(self.chunk_perplexities)}


def chunk_nll(logits: np.ndarray, chunk: Sequence[int]) -> np.ndarray:
    """Negative log-likelihoods of the scored second half of one chunk, float64."""
    ctx = len(chunk)
    first = ctx // 2
    scored = logits[first : ctx - 1].astype(np.float64)
    targets = np.asarray(chunk[first + 1 : ctx])
    peak = scored.max(axis=1, keepdims=True)
    log_norm = np.log(np.exp(scored - peak).sum(axis=1)) + peak[:, 0]
    return log_norm - scored[np.arange(len(targets)), targets]


def perplexity(tokens: Sequence[int], ctx: int, all_logits: Callable[[list[int]], np.ndarray],
               bos_id: int | None = None, max_chunks: int | None = None,
               progress: Callable[[int, int, float], None] | None = None) -> PerplexityResult:
    """`all_logits(chunk)` evaluates one chunk from an empty context and returns (ctx, vocab) logits.
    `bos_id`: the id that replaces each chunk's first token (None: the model adds no BOS)."""
    if ctx < 4 or ctx % 2:
        raise ValueError(f"context must be an even number of at least 4 tokens, not {ctx}")
    n_chunks = len(tokens) // ctx
    if max_chunks is not None:
        n_chunks = min(n_chunks, max_chunks)
    if n_chunks < 1:
        raise ValueError(f"{len(tokens)} tokens do not fill one chunk of {ctx}; use a longer text or a smaller context")
    total, count, per_chunk = 0.0, 0, []
    for i in range(n_chunks):
        chunk = list(tokens[i * ctx : (i + 1) * ctx])
        if bos_id is not None:
            chunk[0] = bos_id
        nll = chunk_nll(all_logits(chunk), chunk)
        total += float(nll.sum())
        count += len(nll)
        per_chunk.append(math.exp(float(nll.mean())))
        if progress is not None:
            progress(i + 1, n_chunks, math.exp(total / count))
    mean = total / count
    return PerplexityResult(math.exp(mean), mean, count, n_chunks, ctx, tuple(per_chunk))
