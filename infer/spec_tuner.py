"""The draft tree's shape, chosen from the run's own measurements.

A `ModelDrafter` tree is the draft's greedy chain of `depth` tokens with, at each depth, the draft's
next `width - 1` candidates as leaf siblings of the chain node (1 + depth * width nodes). Deeper
chains pay a draft step per token; wider ones only verification rows, which a streamed or
memory-bound pass holds for almost nothing. Which shape wins depends on the pair, the text and the
machine (issue 24 measured, 2026-12-03, the real Qwen pair on the H200: on code a 16 x 4 tree
accepted 10.6 tokens a pass against 7.9 for a chain of 10; on prose and questions 4 x 4 beat the
best chain by a fifth), so the tuner measures:

- how often the accepted path reached each chain depth, among the passes whose chain offered it;
- where the chain failed, the draft rank of the target's token, as far as the leaves offered saw it;
- the draft's seconds against its depth (a line: a drafting round has costs of its own besides its
  steps, the feeding of what the target accepted and the trip of the chosen ids to the host, 2.5 ms
  against 1.1 ms a step on the H200 on 2026-12-03; charged to the steps, they made depth look dear
  and the tuner settle on shallow trees), and the verify pass's seconds against its node count
  (another line).

Expected tokens per pass for depth D and width W:

    E(D, W) = 1 + sum_{d<=D} q_d + s(W) * sum_{d<=D} (q_{d-1} - q_d)

with q_d the chance the chain reaches depth d (q_0 = 1) and s(W) the chance a leaf of rank 1..W-1
holds the target's token once the chain failed. Depths and ranks not yet offered continue the last
measured step-to-step ratio. Every `every` passes the shape maximising E / seconds is taken, within
`max_depth`, `min_width`..`max_width` and `max_nodes` (the tree the verification buffers were planned
for). A best-first tree (infer/draft_tree.py) has no leaves: its passes report no leaf and its width
stays fixed (min_width = max_width), so the tuner picks its depth.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np


class ShapeTuner:
    def __init__(self, depth: int, max_depth: int = 32, width: int = 1, max_width: int | None = None,
                 max_nodes: int | None = None, every: int = 8, min_width: int = 1) -> None:
        self.max_depth = max_depth
        self.max_width = max(width, max_width or width)
        self.min_width = min(min_width, width)  # a drafter whose width is not leaves (best-first): min = max
        self.max_nodes = max_nodes or 1 + max_depth * self.max_width
        if depth < 1 or width < 1 or 1 + depth * width > self.max_nodes:
            raise ValueError(f"a {depth} x {width} draft tree does not fit {self.max_nodes} nodes")
        self.depth, self.width, self.every = depth, width, every
        self.offered: Counter = Counter()  # depth d -> passes whose chain offered d
        self.reached: Counter = Counter()  # depth d -> passes whose accepted chain reached d
        self.rank_offered: Counter = Counter()  # rank r -> chain failures where a leaf of rank r was offered
        self.rank_hits: Counter = Counter()  # rank r -> of those, the target's token was that leaf
        self.draft_steps = 0
        self.draft_seconds = 0.0
        self.drafts: list[tuple[int, float]] = []  # (depth, seconds) of the latest passes' drafting
        self.verify: list[tuple[int, float]] = []  # (nodes, seconds) of the latest passes
        self.passes = 0

    def observe(self, depth: int, width: int, nodes: int, chain: int, leaf_rank: int, draft_seconds: float,
                verify_seconds: float) -> None:
        """One pass: a chain of `depth` with `width - 1` leaves a depth, of which the target kept
        `chain` chain tokens and then (leaf_rank > 0) the leaf of that draft rank."""
        for d in range(1, depth + 1):
            self.offered[d] += 1
        for d in range(1, chain + 1):
            self.reached[d] += 1
        if chain < depth:  # the chain failed at depth chain + 1: the leaves there saw the target's token or not
            for r in range(1, width):
                self.rank_offered[r] += 1
            if leaf_rank:
                self.rank_hits[leaf_rank] += 1
        self.draft_steps += depth
        self.draft_seconds += draft_seconds
        self.drafts = [*self.drafts[-255:], (depth, draft_seconds)]
        self.verify = [*self.verify[-255:], (nodes, verify_seconds)]
        self.passes += 1
        if self.passes % self.every == 0:
            self.depth, self.width = self.best()[:2]

    def chain_reach(self, depth: int) -> list[float]:
        """[q_0, q_1, ..., q_depth]: the chance the accepted chain reaches each depth."""
        q, p, ratio = [1.0], 1.0, 0.0
        for d in range(1, depth + 1):
            if self.offered[d]:
                now = self.reached[d] / self.offered[d]
                ratio = now / p if p > 0 else 0.0
                p = now
            else:  # beyond what was offered: the last measured step-to-step acceptance
                p *= ratio
            q.append(p)
        return q

    def leaf_share(self, width: int) -> float:
        """s(width): the chance one of the leaves of ranks 1..width-1 holds the target's token when the
        chain failed."""
        total, last, ratio = 0.0, None, 0.5
        for r in range(1, width):
            if self.rank_offered[r]:
                h = self.rank_hits[r] / self.rank_offered[r]
                if last:
                    ratio = min(1.0, h / last)
            else:  # a rank never offered: the last measured rank's share, shrinking as it did
                h = (last or 0.0) * ratio
            total += h
            last = h
        return min(total, 1.0)

    def expected_tokens(self, depth: int, width: int) -> float:
        q = self.chain_reach(depth)
        fails = sum(q[d - 1] - q[d] for d in range(1, depth + 1))
        return 1.0 + sum(q[1:]) + self.leaf_share(width) * fails

    def draft_line(self) -> tuple[float, float]:
        """(fixed, per step) seconds of drafting a chain: the line through the latest passes' (depth,
        seconds) once they offered two depths and it rises with depth; else all of it per step."""
        fixed, step = _line(self.drafts)
        if step > 0 and fixed >= 0:
            return fixed, step
        return 0.0, (self.draft_seconds / self.draft_steps if self.draft_steps else 0.0)

    def seconds(self, depth: int, width: int) -> float:
        return self._seconds(depth, width, self._lines())

    def _lines(self) -> tuple[tuple[float, float], tuple[float, float]]:
        """The drafting line and the verify line (fit once for every shape compared)."""
        return self.draft_line(), _line(self.verify)

    @staticmethod
    def _seconds(depth: int, width: int, lines: tuple[tuple[float, float], tuple[float, float]]) -> float:
        (fixed, step), (intercept, slope) = lines
        return fixed + depth * step + intercept + max(slope, 0.0) * (1 + depth * width)

    def shapes(self) -> list[tuple[int, int]]:
        return [(d, w) for d in range(1, self.max_depth + 1) for w in range(self.min_width, self.max_width + 1)
                if 1 + d * w <= self.max_nodes]

    def best(self) -> tuple[int, int, float]:
        """(depth, width, expected tokens per second) of the best shape."""
        lines = self._lines()
        rates = [(d, w, self.expected_tokens(d, w) / max(self._seconds(d, w, lines), 1e-9)) for d, w in self.shapes()]
        return max(rates, key=lambda r: r[2])

    def describe(self) -> str:
        d, w, rate = self.best()
        fixed, step = self.draft_line()
        return (f"{d} x {w} (expected {self.expected_tokens(d, w):.2f} tokens per pass in "
                f"{self.seconds(d, w) * 1e3:.1f} ms: draft {fixed * 1e3:.2f} ms + {step * 1e3:.2f} ms per step, "
                f"{rate:.1f} tok/s; from {self.passes} passes)")


def _line(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (x, seconds) points; with fewer than two
    distinct x, (mean, 0)."""
    if len({x for x, _ in points}) < 2:
        return (float(np.mean([t for _, t in points])) if points else 0.0), 0.0
    slope, intercept = np.polyfit(np.array([x for x, _ in points], float), np.array([t for _, t in points], float), 1)
    return float(intercept), float(slope)


def chain_and_leaf(parents: Sequence[int], path: Sequence[int]) -> tuple[int, int]:
    """(chain tokens kept, draft rank of the leaf kept after them or 0) of an accepted `path` through
    a ModelDrafter tree, whose nodes at each depth are the chain node then the leaves by rank."""
    last = path[-1]
    if len(path) < 2:
        return 0, 0
    siblings = [n for n, p in enumerate(parents) if p == parents[last]]
    rank = siblings.index(last)
    return (len(path) - 2, rank) if rank else (len(path) - 1, 0)
