"""Speculative decoding with token trees: a drafter proposes a tree of likely continuations, the
target model scores every node of it in ONE pass (`forward_tree`: a tree attention mask, per-node
positions), and the longest path the target agrees with is kept. A streamed pass costs the same for
one token or hundreds (docs/STREAMING.md), so every token accepted beyond the first is free.

Verification samples from the target at each node and follows the tree while the drawn token is
one of the node's children (as SpecExec does for deterministic trees): the emitted tokens are
exactly what the target would emit alone, greedy or sampled, whatever the drafter proposes; a good
drafter only makes the paths longer. The target's KV cache keeps only the accepted path
(`cache.accept`).

Drafters: `ModelDrafter` (a small model with the same vocabulary: its greedy chain, each depth
with its runners-up as leaf siblings) and `LookupDrafter` (n-gram matches in the prompt and the
output so far, no model).
"""

from __future__ import annotations

import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from infer.draft_ahead import DraftAhead
from infer.engine import Cache, Model
from infer.layers import tree_depths
from infer.spec_tuner import ShapeTuner, chain_and_leaf

Chooser = Callable[[np.ndarray, list[int]], int]


@dataclass
class Tree:
    """Node 0 is the root: the token chosen last, not yet in the target's cache. parents[i] < i."""

    tokens: list[int]
    parents: list[int]

    def children(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = defaultdict(list)
        for node, parent in enumerate(self.parents):
            if parent >= 0:
                out[parent].append(node)
        return out


class Drafter(Protocol):
    def propose(self, context: Sequence[int], root: int, size: int) -> Tree:
        """A tree of at most `size` nodes whose root is `root`; `context` is what the target's cache holds."""


@dataclass
class SpecStats:
    """Passes, tokens per pass and acceptance of the last generate()."""

    passes: int = 0
    generated: int = 0
    proposed: int = 0  # draft nodes offered (roots not counted)
    accepted: int = 0  # draft tokens kept
    accepted_at_depth: Counter = field(default_factory=Counter)  # depth -> paths reaching it
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Accepted draft tokens + the one the target chose itself, per target pass."""
        return self.generated / self.passes if self.passes else 0.0

    def as_dict(self) -> dict[str, object]:
        return {"passes": self.passes, "generated_tokens": self.generated, "tokens_per_pass": round(self.tokens_per_pass, 3),
                "proposed": self.proposed, "accepted": self.accepted,
                "acceptance_by_depth": {d: round(n / self.passes, 3) for d, n in sorted(self.accepted_at_depth.items())},
                "draft_seconds": round(self.draft_seconds, 3), "verify_seconds": round(self.verify_seconds, 3)}


def follow(tree: Tree, logits: np.ndarray, choose: Chooser, history: list[int]) -> tuple[list[int], int]:
    """The path of nodes the target keeps (from the root) and the token it chose after the path's
    end: at each node the target's choice is drawn; if it is a child's token, the walk goes on.
    A chooser that is a plain arg-max (`argmax_only`), or an arg-max after a logit bias
    (`biased_argmax_only`: a server's greedy request with ignore_eos), reads every row's arg-max at
    once where the logits offer it (`row_argmax`, the bias added there) instead of fetching each row
    it visits; a row with NaN or +inf, or with every token excluded, still goes to the chooser (its
    error)."""
    children = tree.children()
    path, node = [0], 0
    seen = list(history) + [tree.tokens[0]]
    # the chooser, or the sampler whose bound `sample` it is (a request's)
    sampler = getattr(choose, "__self__", None)
    greedy = getattr(choose, "argmax_only", False) or getattr(sampler, "argmax_only", False)
    bias = () if greedy or not getattr(sampler, "biased_argmax_only", False) else sampler.config.logit_bias  # type: ignore[union-attr]
    row_argmax = getattr(logits, "row_argmax", None) if greedy or bias else None
    best = row_argmax(bias) if row_argmax is not None else None
    while True:
        if best is not None and best[2][node] == 0 and not np.isneginf(best[1][node]):
            token = int(best[0][node])
        else:
            token = int(choose(logits[node], seen))
        nxt = next((c for c in children.get(node, []) if tree.tokens[c] == token), None)
        if nxt is None:
            return path, token
        path.append(nxt)
        seen.append(token)
        node = nxt


class Speculator:
    """Generation on `target` with trees from `drafter` of up to `tree_size` nodes. With `tuner`
    (a drafter with depth, width and outcome(): ModelDrafter, BestFirstDrafter), the drafter's
    depth and width follow the tuner's choice."""

    def __init__(self, target: Model, drafter: Drafter, tree_size: int, ctx_size: int,
                 tuner: ShapeTuner | None = None) -> None:
        if tree_size < 1:
            raise ValueError(f"the draft tree needs at least one node, not {tree_size}")
        self.target, self.drafter, self.tree_size, self.ctx_size = target, drafter, tree_size, ctx_size
        self.tuner = tuner
        self.stats = SpecStats()
        stream = getattr(target, "stream", None)
        if stream is not None and getattr(getattr(drafter, "draft", None), "stream", None) is stream:
            # a view of the target (a self-draft) shares its stream and buffers: nothing can run
            # beside its pass, and branches would overwrite the tree's logits before the walk
            drafter.ahead = None  # type: ignore[attr-defined]
        reserve = getattr(target, "reserve_tree", None)
        if reserve is not None:  # the GPU's verification buffers, made once for the largest tree
            reserve(tree_size)

    def generate(self, prompt: Sequence[int], max_new_tokens: int, choose: Chooser,
                 is_end: Callable[[int], bool] = lambda _: False, cache: Cache | None = None) -> Iterator[int]:
        """Up to `max_new_tokens` ids after `prompt` (an end id is yielded, then generation stops), as
        a request to the generation loop (infer.scheduler): each of its steps a tree drafted
        (`draft`), verified in one target pass and walked (`settle`).
        `cache`: the target's KV cache to use (emptied first; default a new one)."""
        from infer.request import Request, StopWhen, as_sampler
        from infer.scheduler import Scheduler

        if not prompt:
            raise ValueError("the prompt has no tokens")
        if len(prompt) > self.ctx_size:
            raise ValueError(f"a prompt of {len(prompt)} tokens exceeds the context size {self.ctx_size}")
        self.stats = SpecStats()
        reset = getattr(self.drafter, "reset", None)
        if reset is not None:  # a new sequence: the draft's cache may hold another's tokens
            reset()
        scheduler = Scheduler(self.target, self.ctx_size, 1, caches=[cache] if cache is not None else None,
                              prefix_cache=False, device_runs=False)
        request = Request(list(prompt), max_new_tokens, as_sampler(choose), stop_ids=StopWhen(is_end),
                          speculator=self)
        for token in scheduler.run_one(request):
            self.stats.generated += 1
            yield token

    def tree_budget(self, cache: Cache, left: int) -> int:
        """Nodes the next tree may have: the configured (or tuned) size, within the positions the
        cache has left and the `left` + 1 tokens the request may still use."""
        size = self.tree_size
        if self.tuner is not None:
            self.drafter.depth = self.tuner.depth  # type: ignore[attr-defined]
            self.drafter.width = self.tuner.width  # type: ignore[attr-defined]
            size = 1 + self.tuner.depth * self.tuner.width
        return max(1, min(size, self.ctx_size - cache.length, left + 1))

    def draft(self, context: list[int], root: int, cache: Cache, left: int, limit: int | None = None) -> Tree:
        """The tree of the next step (at most `limit` nodes: the share of a pass it rides in)."""
        size = self.tree_budget(cache, left)
        return self.drafter.propose(context, root, size if limit is None else max(1, min(size, limit)))

    def settle(self, tree: Tree, logits: np.ndarray, cache: Cache, choose: Chooser, context: list[int],
               draft_s: float, verify_s: float) -> list[int]:
        """After the target's pass scored `tree` (its nodes' `logits`): the path the target keeps goes
        into the cache; returns its tokens after the root and the token chosen after it. The
        drafter's next tree is drafted ahead first (the pass is queued, not yet waited for)."""
        began = time.perf_counter()
        ahead = getattr(self.drafter, "draft_ahead", None)
        if ahead is not None:
            ahead()
            draft_s += time.perf_counter() - began
            began = time.perf_counter()
        path, chosen = follow(tree, logits, choose, context)
        cache.accept(path)  # type: ignore[attr-defined]
        verify_s += time.perf_counter() - began
        self.stats.draft_seconds += draft_s
        self.stats.verify_seconds += verify_s
        if self.tuner is not None:
            depth, width, kept, leaf = self.drafter.outcome(tree, path)  # type: ignore[attr-defined]
            self.tuner.observe(depth, width, len(tree.tokens), kept, leaf, draft_s, verify_s)
        self.stats.passes += 1
        self.stats.proposed += len(tree.tokens) - 1
        self.stats.accepted += len(path) - 1
        for depth in range(1, len(path)):
            self.stats.accepted_at_depth[depth] += 1
        return [*(tree.tokens[n] for n in path[1:]), chosen]


def tree_shape(depth: int, width: int, size: int) -> tuple[int, int]:
    """(depth, width) of a chain-with-siblings tree of at most `size` nodes (root included) for a
    drafter asked for `depth` x `width`: depth first, then as many siblings as still fit."""
    depth = min(depth, max(1, size - 1)) if size > 1 else 0
    width = min(width, max(1, (size - 1) // depth)) if depth else 0
    return depth, width


class ModelDrafter:
    """A draft model's greedy chain of `depth` tokens; at each depth the next `width - 1` most likely
    tokens are leaf siblings of the chain node (a tree of 1 + depth * width nodes). The draft keeps
    its own cache in step with what the target accepted (rolled back to the common prefix)."""

    def __init__(self, draft: Model, ctx_size: int, depth: int = 4, width: int = 2, cache: Cache | None = None,
                 ahead: bool | None = None) -> None:
        if depth < 1 or width < 1:
            raise ValueError(f"draft depth and width must be >= 1, not {depth} and {width}")
        self.draft, self.depth, self.width = draft, depth, width
        self.cache: Cache = cache if cache is not None else draft.new_cache(ctx_size)  # the draft's own KV cache
        self.cache.length = 0
        self.fed: list[int] = []  # the tokens in the draft's cache
        # the next tree drafted during the target's pass (infer/draft_ahead.py): off unless asked for
        # (NVMEDIRECT_DRAFT_AHEAD=1, on a draft with a stream of its own): it made the real pair's
        # rounds slower, launched late or early (infer/draft_ahead.py says by how much)
        if ahead is None:
            ahead = hasattr(draft, "draft_branches") and os.environ.get("NVMEDIRECT_DRAFT_AHEAD", "0") == "1"
        self.ahead: DraftAhead | None = DraftAhead() if ahead else None
        self._ahead_of: tuple | None = None  # (context, root, tree, depth, width) of the tree to draft ahead from

    def reset(self) -> None:
        """Forget the cache's contents (another sequence, or another drafter sharing it, ran)."""
        self.cache.length = 0
        self.fed = []
        self._ahead_of = None
        if self.ahead is not None:
            self.ahead.reset()

    def shape(self, size: int) -> tuple[int, int]:
        """(depth, width) of the tree for a budget of `size` nodes."""
        return tree_shape(self.depth, self.width, size)

    def outcome(self, tree: Tree, path: Sequence[int]) -> tuple[int, int, int, int]:
        """(depth, width, chain tokens kept, rank of the leaf kept after them or 0) of a verified
        pass, as the shape tuner reads it."""
        chain, leaf = chain_and_leaf(tree.parents, path)
        return int(tree_depths(tree.parents).max()), sum(1 for p in tree.parents if p == 0), chain, leaf

    def propose(self, context: Sequence[int], root: int, size: int) -> Tree:
        depth, width = self.shape(size)
        self._ahead_of = None
        if depth == 0:
            if self.ahead is not None:
                self.ahead.reset()
            return Tree([root], [-1])
        # the chain's first steps drafted during the last pass (infer/draft_ahead.py), if its walk ended where they began
        ranked = self.ahead.take(context, root, width) if self.ahead is not None else None
        ranked = np.zeros((0, width), np.int64) if ranked is None else ranked[:depth]
        if len(ranked) < depth:  # the chain (or its rest) drafted now
            chain = [int(r[0]) for r in ranked]
            fresh = self._rewind([*context, root, *chain[:-1]], chain[-1]) if chain else self._rewind(context, root)
            chain_step = getattr(self.draft, "draft_chain", None)
            if chain_step is not None:  # the whole chain on the device (GpuTransformer.draft_chain)
                rest = chain_step(fresh, self.cache, depth - len(ranked), width)
            else:
                rest = self._chain(fresh, depth - len(ranked), width)
            self.fed = [*self.fed, *(int(r[0]) for r in rest[:-1])]  # the draft's cache holds the chain but its last
            ranked = np.concatenate([ranked, rest])
        tree = self._tree(root, ranked)
        if self.ahead is not None and self.ahead.early:  # beside the target's pass (DraftAhead's early)
            self.ahead.launch(self, list(context), root, tree, depth, width)
        elif self.ahead is not None:  # once the target's pass is queued (draft_ahead: first the target's work)
            self._ahead_of = (list(context), root, tree, depth, width)
        return tree

    def draft_ahead(self) -> None:
        """Drafts the branches of the tree proposed last (infer/draft_ahead.py); Speculator.settle
        calls it once the target's pass over the tree is queued, before waiting for it."""
        if self.ahead is not None and self._ahead_of is not None:
            self.ahead.launch(self, *self._ahead_of)
        self._ahead_of = None

    def common_prefix(self, want: Sequence[int]) -> int:
        """How many of `want`'s first tokens the draft's cache holds and can go back to."""
        common = 0
        for a, b in zip(self.fed, want, strict=False):
            if a != b:
                break
            common += 1
        return common if self.cache.can_rewind(common) else 0  # a local layer's ring moved past the prefix's window

    def _rewind(self, context: Sequence[int], root: int) -> np.ndarray:
        """Rolls the draft's cache back to what it shares with `context` + root; returns the tokens
        to feed it from there (at least the root, whose logits are needed)."""
        want = [*context, root]
        common = self.common_prefix(want[:-1])  # the last token is always run: its logits are needed
        self.cache.length = common
        self.fed = want
        return np.asarray(want[common:])

    def _tree(self, root: int, ranked: np.ndarray) -> Tree:
        """The tree of a ranked chain (depth, width): the most likely token of each depth continues
        the chain, the others are its leaf siblings."""
        tokens, parents = [root], [-1]
        chain_parent = 0
        for row in ranked:
            chain = len(tokens)
            for token in row:
                tokens.append(int(token))
                parents.append(chain_parent)
            chain_parent = chain
        return Tree(tokens, parents)

    @staticmethod
    def propose_many(drafters: Sequence[ModelDrafter], contexts: Sequence[Sequence[int]], roots: Sequence[int],
                     sizes: Sequence[int]) -> list[Tree]:
        """propose() for several drafters of ONE draft model (each with its own cache): a draft pass
        over all of them per depth, instead of one per drafter and depth."""
        shapes = [d.shape(size) for d, size in zip(drafters, sizes, strict=True)]
        live = [i for i, (depth, _) in enumerate(shapes) if depth > 0]
        feeds = {i: drafters[i]._rewind(contexts[i], roots[i]) for i in live}
        model = drafters[0].draft
        chains = getattr(model, "draft_chains", None)
        if chains is not None:  # on the device, the drafters of one shape together (GpuTransformer.draft_chains)
            ranked = {}
            for shape in sorted({shapes[i] for i in live}):
                group = [i for i in live if shapes[i] == shape]
                for i, ids in zip(group, chains([(feeds[i], drafters[i].cache) for i in group], *shape), strict=True):
                    ranked[i] = ids
        else:
            ranked = {i: np.stack(rows) for i, rows in ModelDrafter._host_chains(model, drafters, feeds, shapes).items()}
        for i, rows in ranked.items():
            drafters[i].fed = [*drafters[i].fed, *(int(r[0]) for r in rows[:-1])]  # the cache holds the chain but its last
        for d in drafters:  # drafting together does not draft ahead (yet): nothing pending is taken
            if d.ahead is not None:
                d.ahead.reset()
        return [drafters[i]._tree(roots[i], ranked[i]) if i in ranked else Tree([roots[i]], [-1])
                for i in range(len(drafters))]

    @staticmethod
    def _host_chains(model: Model, drafters: Sequence[ModelDrafter], feeds: dict[int, np.ndarray],
                     shapes: Sequence[tuple[int, int]]) -> dict[int, list[np.ndarray]]:
        """The drafters' ranked chains (as _chain), a forward_batch of all of them per depth."""
        live = list(feeds)
        ranked: dict[int, list[np.ndarray]] = {i: [] for i in live}
        step = 0
        while live:
            logits = model.forward_batch([(feeds[i], drafters[i].cache) for i in live])
            for i, row in zip(live, logits, strict=True):
                ranked[i].append(top_k(np.asarray(row), shapes[i][1]))
                feeds[i] = np.asarray([ranked[i][-1][0]])
            step += 1
            live = [i for i in live if shapes[i][0] > step]
        return ranked

    def _chain(self, fresh: np.ndarray, depth: int, width: int) -> np.ndarray:
        """(depth, width): the `width` most likely tokens at each step of the greedy chain after
        `fresh` (fed from cache.length)."""
        logits = self.draft.forward(fresh, self.cache)
        rows = []
        for d in range(depth):
            rows.append(top_k(logits, width))
            if d + 1 < depth:
                logits = self.draft.forward(np.asarray([rows[-1][0]]), self.cache)
        return np.stack(rows)


def top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest logits, largest first (ties: lower id first), without sorting the vocabulary."""
    k = min(k, logits.size)
    if k < logits.size:  # every id above the k-th value, then the lowest ids of those equal to it
        kth = -np.partition(-logits, k - 1)[k - 1]
        above = np.flatnonzero(logits > kth)
        part = np.concatenate([above, np.flatnonzero(logits == kth)[: k - above.size]])
    else:
        part = np.arange(logits.size)
    return part[np.lexsort((part, -logits[part]))]


class LookupDrafter:
    """Prompt lookup: the continuation of the latest earlier occurrence of the context's last
    `n` tokens (longest n first, from `max_ngram` down to 1), as a chain below the root."""

    def __init__(self, max_ngram: int = 3, depth: int = 8) -> None:
        self.max_ngram, self.depth = max_ngram, depth

    def propose(self, context: Sequence[int], root: int, size: int) -> Tree:
        seq = [*context, root]
        chain = lookup(seq, self.max_ngram, min(self.depth, size - 1))
        return Tree([root, *chain], [-1, *range(len(chain))])


def lookup(seq: Sequence[int], max_ngram: int, limit: int) -> list[int]:
    """Up to `limit` tokens that followed the latest earlier occurrence of seq's last n tokens."""
    if limit <= 0:
        return []
    arr = np.asarray(seq)
    for n in range(min(max_ngram, len(seq) - 1), 0, -1):
        tail = arr[-n:]
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # starts 0 .. len - 1 - n
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return [int(t) for t in arr[start : start + limit]]
    return []
