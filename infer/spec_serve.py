"""Speculation inside the generation loop (infer.scheduler): the trees of every speculative request
of a pass are drafted together and verified in that ONE target pass, beside the other requests'
decode tokens and prompt chunks (a streamed pass costs about the same for 1 row or hundreds).

`DraftPool` gives each KV cache of a server its own speculator (a model drafter keeps a draft KV
cache per slot, in step with what the target accepted there); `draft_together` drafts the pass's
trees, a draft pass per depth for all requests whose drafters share a draft model.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence

from infer.engine import Cache, Model
from infer.speculative import Drafter, ModelDrafter, Speculator, Tree


class DraftPool:
    """Speculators for the caches of a scheduler: one per cache, made when a request first runs in
    it. `make_drafter` builds a drafter (a ModelDrafter with a draft KV cache of its own, or a shared
    LookupDrafter); trees of up to `tree_size` nodes."""

    def __init__(self, target: Model, make_drafter: Callable[[], Drafter], tree_size: int, ctx_size: int) -> None:
        if tree_size < 1:
            raise ValueError(f"the draft tree needs at least one node, not {tree_size}")
        self.target, self.make_drafter, self.tree_size, self.ctx_size = target, make_drafter, tree_size, ctx_size
        self._speculators: dict[int, Speculator] = {}

    def __call__(self, cache: Cache) -> Speculator:
        speculator = self._speculators.get(id(cache))
        if speculator is None:
            speculator = Speculator(self.target, self.make_drafter(), self.tree_size, self.ctx_size)
            self._speculators[id(cache)] = speculator
        return speculator


def can_speculate(request: object) -> bool:
    """Whether a request's steps may be drafted trees: its tokens are then the same (greedy) or drawn
    from the same distribution (sampled: one draw per emitted token, as without a draft). Not with
    log-probabilities (a tree's walk does not report them) or a grammar (its state follows each
    draw, and a finished grammar must end the walk)."""
    sampler = getattr(request, "sampler", None)
    return getattr(request, "top_logprobs", None) is None and getattr(sampler, "constraint", None) is None


def draft_together(steps: Sequence[tuple[Speculator, list[int], int, Cache, int, int]]) -> list[tuple[Tree, float]]:
    """The trees of several requests' next steps, each (speculator, context, root, target cache,
    tokens left, node limit), with the seconds each took to draft. Model drafters on one draft model
    draft together (ModelDrafter.propose_many: a draft pass per depth for all of them); the rest
    one at a time."""
    out: list[tuple[Tree, float] | None] = [None] * len(steps)
    groups: dict[int, list[int]] = defaultdict(list)
    for i, (speculator, *_rest) in enumerate(steps):
        drafter = speculator.drafter
        if type(drafter) is ModelDrafter:
            groups[id(drafter.draft)].append(i)
        else:
            groups[-1 - i].append(i)  # on its own
    for members in groups.values():
        began = time.perf_counter()
        if len(members) == 1:
            speculator, context, root, cache, left, limit = steps[members[0]]
            trees = [speculator.draft(context, root, cache, left, limit)]
        else:
            sizes = [max(1, min(steps[i][0].tree_budget(steps[i][3], steps[i][4]), steps[i][5])) for i in members]
            trees = ModelDrafter.propose_many([steps[i][0].drafter for i in members],  # type: ignore[misc]
                                              [steps[i][1] for i in members], [steps[i][2] for i in members], sizes)
        seconds = (time.perf_counter() - began) / len(members)
        for i, tree in zip(members, trees, strict=True):
            out[i] = (tree, seconds)
    return out  # type: ignore[return-value]
