"""The next round's draft, made while the target verifies this round's tree (issues 24 and 27).

A speculative round is a draft (depth decode steps of the draft model) and then one verification
pass of the target. When the target is streamed, that pass waits on the link and the GPU's cores
idle through it; on prose the draft's steps were a third of a round (docs/SPECULATIVE.md). So while
the target verifies a chain-with-leaves tree, the draft goes on from every node where the target's
walk can end with the whole draft taken: the chain's last token, and each leaf (the walk stops at a
leaf). Each such branch gets `steps` greedy tokens with their runners-up, all branches in one draft
pass a step on the draft's own stream (GpuTransformer.draft_branches: the branches in slots of their
own past the sequence's, so its cache is untouched).

After the pass, if the walk ended at one of those nodes and the token the target chose after it is
the branch's first token (54% of the real pair's rounds on prose at 4 x 4, 63% on code), the
branch's next tokens are exactly the chain the draft would draft from there: the same tokens at the
same positions after the same context, so the same rows and bits. The next tree is
taken from them without a draft step, and is the tree drafting would have made: the text, the trees
and the passes are those of drafting without it; only the time moves. When the branch holds fewer
steps than the next chain is deep, the chain continues from its end.

On the CPU nothing runs beside the target's pass, so `host_branches` (the same branches, one after
the other, through the draft's cache) only serves the tests. Off by default (ModelDrafter's `ahead`,
NVMEDIRECT_DRAFT_AHEAD=1): the real pair's rounds got slower with it, launched after the target's
pass was queued (H200, session 33: prose 1.99x -> 1.32x) and before it (H100, session 35: prose
2.00x -> 1.85x, code 3.54x -> 3.24x). Queueing a streamed pass and the branches' steps both take
the host's time, so one waits for the other (docs/SPECULATIVE.md).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from infer.engine import Cache, Model
from infer.layers import tree_depths

if TYPE_CHECKING:
    from infer.speculative import ModelDrafter, Tree

# branches drafted ahead: a pass of up to 4 rows runs on the GEMV-shaped products (products.QGEMV_MAX)
# at about a one-row pass's cost; 16-row passes took 1.75-2.2 ms against 0.84 (H100, session 34's trace)
MAX_BRANCHES = 4
MAX_STEPS = 6  # steps a branch: the draft's ~1 ms a step against a verification pass of ~7.5 ms (H200, streamed 1.5B)


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name, "")
    if not text:
        return default
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{name}={text!r}: a whole number of at least 1")
    return int(text)


def branch_nodes(parents: Sequence[int], max_branches: int = MAX_BRANCHES) -> list[int]:
    """The nodes of a chain-with-leaves tree (ModelDrafter._tree's order: each depth's chain node,
    then its leaves) where the target's walk ends having taken the draft's token: the chain's last
    node, then the leaves by rank (the runners-up first), shallow before deep within a rank; at most
    `max_branches`."""
    depths = tree_depths(parents)
    chain, leaves = [0], []  # leaves: (rank, depth, node)
    rank_at: dict[int, int] = {}
    for node in range(1, len(parents)):
        parent = parents[node]
        rank = rank_at.get(parent, 0)
        rank_at[parent] = rank + 1
        if rank == 0 and parent == chain[-1]:
            chain.append(node)
        else:
            leaves.append((rank, int(depths[node]), node))
    if len(chain) == 1:
        return []
    return [chain[-1], *(node for _, _, node in sorted(leaves))][:max_branches]


@dataclass
class Ahead:
    """The branches drafted during a pass: the tree's context, its nodes and their results."""

    context: list[int]  # the target's context when the tree was drafted (the root follows it)
    tree: Tree
    nodes: list[int]  # tree nodes whose branches were drafted
    results: Any  # ranked() -> (branches, steps, width) ids
    width: int


class DraftAhead:
    """A ModelDrafter's branches drafted ahead (module docstring): launch() after a tree is drafted,
    take() when the next one is asked for. Counts what it launched and what the next trees took.

    `early`: launched as soon as the tree is drafted, before the target's pass is queued (the
    drafter's propose), rather than once it is queued (the speculator's settle). Queueing a streamed
    pass holds the host for most of the pass (about 6.5 of 7.6 ms on the real pair, session 34), so
    branches launched after it start as the pass ends; launched before it, they run beside it on
    the draft's stream. None of the three arguments given: NVMEDIRECT_DRAFT_AHEAD_BRANCHES,
    NVMEDIRECT_DRAFT_AHEAD_STEPS and NVMEDIRECT_DRAFT_AHEAD_WHEN (drafted | queued) say."""

    def __init__(self, max_branches: int | None = None, max_steps: int | None = None,
                 early: bool | None = None) -> None:
        self.max_branches = _env_int("NVMEDIRECT_DRAFT_AHEAD_BRANCHES", MAX_BRANCHES) if max_branches is None \
            else max_branches
        self.max_steps = _env_int("NVMEDIRECT_DRAFT_AHEAD_STEPS", MAX_STEPS) if max_steps is None else max_steps
        if early is None:
            when = os.environ.get("NVMEDIRECT_DRAFT_AHEAD_WHEN", "drafted")
            if when not in ("drafted", "queued"):
                raise ValueError(f"NVMEDIRECT_DRAFT_AHEAD_WHEN={when!r}: drafted or queued")
            early = when == "drafted"
        self.early = early
        self.pending: Ahead | None = None
        self.launched = 0
        self.hits = 0  # trees taken (wholly or in part) from a branch
        self.tokens = 0  # chain tokens taken from branches

    def reset(self) -> None:
        self.pending = None

    def take(self, context: Sequence[int], root: int, width: int) -> np.ndarray | None:
        """(k, width) ranked rows of the next chain after `root` if the last pass's walk ended at a
        drafted branch whose first token is `root` (k >= 1 steps of it), else None."""
        ahead, self.pending = self.pending, None
        if ahead is None or width > ahead.width:
            return None
        n0 = len(ahead.context)
        if len(context) <= n0 or context[:n0] != ahead.context or context[n0] != ahead.tree.tokens[0]:
            return None
        node, children = 0, ahead.tree.children()
        for token in context[n0 + 1 :]:  # the path the target kept after the root
            node = next((c for c in children.get(node, []) if ahead.tree.tokens[c] == token), -1)
            if node < 0:
                return None
        if node not in ahead.nodes:
            return None
        rows = ahead.results.ranked()[ahead.nodes.index(node)]
        if int(rows[0, 0]) != root or len(rows) < 2:
            return None
        self.hits += 1
        self.tokens += len(rows) - 1
        return rows[1:, :width]

    def launch(self, drafter: ModelDrafter, context: Sequence[int], root: int, tree: Tree, depth: int,
               width: int) -> None:
        """Drafts ahead from `tree` (just proposed after context + root: depth x width) through
        the drafter's model and cache; the drafter's `fed` follows what its cache then holds."""
        self.pending = None
        nodes = branch_nodes(tree.parents, self.max_branches)
        if not nodes:
            return
        chain = [tree.tokens[n] for n in _chain(tree.parents)]
        n0 = len(context)
        want = [*context, root, *chain[1:-1]]  # what drafting the tree fed: the context, the root, the chain but its last
        depths = tree_depths(tree.parents)
        branches = [(tree.tokens[n], n0 + int(depths[n])) for n in nodes]
        steps = min(self.max_steps, depth + 1)  # the next chain's depth, and the guess of the target's token
        common = drafter.common_prefix(want)
        cache, model = drafter.cache, drafter.draft
        if len(want) + len(branches) * steps > cache.max_tokens:  # type: ignore[attr-defined]
            return  # near the end of the context: no slots to draft in
        cache.length = common
        drafter.fed = want[:common]
        on_device = getattr(model, "draft_branches", None)
        if on_device is not None:
            try:
                results = on_device(cache, want[common:], branches, steps, width)
            except ValueError:  # more rows than the draft's passes hold: draft as before
                return
            drafter.fed = want
        else:
            results, kept = host_branches(model, cache, want, common, branches, steps, width)
            drafter.fed = want[:kept]
        self.pending = Ahead(list(context), tree, nodes, results, width)
        self.launched += 1

    def as_dict(self) -> dict[str, int | bool]:
        return {"launched": self.launched, "hits": self.hits, "tokens": self.tokens,
                "max_branches": self.max_branches, "max_steps": self.max_steps, "early": self.early}


def _chain(parents: Sequence[int]) -> list[int]:
    """The chain's nodes from the root (each the first child of the one before)."""
    chain = [0]
    for node in range(1, len(parents)):
        if parents[node] == chain[-1]:
            chain.append(node)
    return chain


class HostBranches:
    """host_branches' results (already there)."""

    def __init__(self, ranked: np.ndarray) -> None:
        self._ranked = ranked

    def ranked(self) -> np.ndarray:
        return self._ranked


def host_branches(model: Model, cache: Cache, want: Sequence[int], common: int, branches: Sequence[tuple[int, int]],
                  steps: int, width: int) -> tuple[HostBranches, int]:
    """draft_branches on the CPU: the cache (holding want[:common]) is given want[common:], then each
    branch (token, position) is decoded through it from its position, the latest first so each
    finds the positions before it as they were. Returns the results and how much of `want` the
    cache still holds after (the earliest branch's position)."""
    from infer.speculative import top_k

    if common < len(want):  # as rows of a decode pass (not a prompt's), as the device feeds them
        model.forward(np.asarray(want[common:]), cache)
    out = np.full((len(branches), steps, width), -1, np.int64)  # -1: a branch the cache could not go back for
    kept = len(want)
    for b in sorted(range(len(branches)), key=lambda i: -branches[i][1]):
        token, pos = branches[b]
        if not cache.can_rewind(pos):  # type: ignore[attr-defined]
            kept = 0
            continue
        cache.length = pos
        kept = min(kept, pos)
        for t in range(steps):
            logits = np.asarray(model.forward(np.asarray([token]), cache))
            out[b, t] = top_k(logits, width)
            token = int(out[b, t, 0])
    cache.length = kept
    return HostBranches(out), kept
