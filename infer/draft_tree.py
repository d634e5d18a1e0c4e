"""A draft tree grown best-first: branches where the draft is unsure, not only leaves beside a chain.

`ModelDrafter` proposes the draft's greedy chain with its runners-up as leaves: once the target
takes a runner-up the pass ends there. Where the draft agrees with the target on 70% of tokens
(the Qwen2.5-Coder 0.5B/1.5B pair on prose and everyday questions, measured 2026-12-03), a chain is
mostly over after two or three tokens. `BestFirstDrafter` lets every kept node grow: at each of
`depth` steps the draft scores the tree grown so far in ONE tree pass (`verify_tree` on the GPU,
`forward_tree` on the CPU: a pass of a few dozen rows costs about one of one row on a GPU), and of
the children of the newest nodes the `width` most likely by the product of the draft's
probabilities along their path join the tree (as EAGLE-2 grows its trees). The tree has
1 + depth * width nodes; depth 1 is the draft's top `width` tokens after the root.

The target's verification does not care how a tree was made: the text is the target's own.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from infer.engine import Cache, Model
from infer.speculative import Tree, top_k


def top_children(logits: object, nodes: Sequence[int], k: int) -> tuple[np.ndarray, np.ndarray]:
    """((len(nodes), k) ids, their log-probabilities) of each node's k most likely next tokens, ties to
    the lower id. `logits`: a tree pass's rows on the host, or a GPU pass's (its own method)."""
    on_device = getattr(logits, "top_children", None)
    if on_device is not None:
        return on_device(nodes, k)
    rows = np.asarray(logits)[list(nodes)].astype(np.float64)
    peak = rows.max(axis=1, keepdims=True)
    logsum = peak[:, 0] + np.log(np.exp(rows - peak).sum(axis=1))
    ids = np.stack([top_k(row, k) for row in rows])
    return ids, (np.take_along_axis(rows, ids, axis=1) - logsum[:, None]).astype(np.float32)


class BestFirstDrafter:
    """A draft model's tree of up to 1 + depth * width nodes grown best-first (module docstring). The
    draft keeps its own cache in step with what the target accepted (rolled back to the common
    prefix); the tree passes leave it there."""

    def __init__(self, draft: Model, ctx_size: int, depth: int = 4, width: int = 4, cache: Cache | None = None) -> None:
        if depth < 1 or width < 1:
            raise ValueError(f"draft depth and width must be >= 1, not {depth} and {width}")
        self.draft, self.depth, self.width = draft, depth, width
        self.cache: Cache = cache if cache is not None else draft.new_cache(ctx_size)
        self.cache.length = 0
        self.fed: list[int] = []  # the tokens in the draft's cache
        # the draft's tree pass: the device's (logits stay there) or the CPU's
        self._tree_pass = getattr(draft, "verify_tree", None) or draft.forward_tree  # type: ignore[attr-defined]

    def reset(self) -> None:
        self.cache.length = 0
        self.fed = []

    def propose(self, context: Sequence[int], root: int, size: int) -> Tree:
        tokens, parents = [root], [-1]
        depth = min(self.depth, size - 1)
        if depth < 1:
            return Tree(tokens, parents)
        width = max(1, min(self.width, (size - 1) // depth))
        common = 0
        for a, b in zip(self.fed, context, strict=False):
            if a != b:
                break
            common += 1
        if not self.cache.can_rewind(common):  # a local layer's ring moved past the prefix's window
            common = 0
        self.cache.length = common
        if common < len(context):  # what the target accepted since: into the draft's cache, no logits read
            self.draft.prefill(np.asarray(context[common:]), self.cache)  # type: ignore[attr-defined]
        self.fed = list(context)
        scores = [0.0]  # log-probability of each node's path under the draft
        newest = [0]
        for _ in range(depth):
            logits = self._tree_pass(np.asarray(tokens), np.asarray(parents), self.cache)
            ids, logp = top_children(logits, newest, width)
            cand = [(scores[n] + float(logp[i, j]), i * width + j) for i, n in enumerate(newest) for j in range(width)]
            cand.sort(key=lambda c: (-c[0], c[1]))  # most likely first; ties: the earlier parent, the likelier child
            picked = []
            for score, flat in cand[:width]:
                i, j = divmod(flat, width)
                tokens.append(int(ids[i, j]))
                parents.append(newest[i])
                scores.append(score)
                picked.append(len(tokens) - 1)
            newest = picked
        return Tree(tokens, parents)

    def outcome(self, tree: Tree, path: Sequence[int]) -> tuple[int, int, int, int]:
        """(depth, width, tokens kept, 0) of a verified pass, as the shape tuner reads it."""
        depth = (len(tree.tokens) - 1) // max(1, sum(1 for p in tree.parents if p == 0))
        return depth, sum(1 for p in tree.parents if p == 0), len(path) - 1, 0
