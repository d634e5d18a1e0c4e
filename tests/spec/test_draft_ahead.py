"""Drafting the next round during the target's pass (infer/draft_ahead.py) on the CPU engine: the
branches are where a walk can end having taken the draft's token, a branch's rows are the chain the
draft drafts from there, and speculation with it gives the same text, trees and passes as without,
with trees taken from the branches."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest

from infer.draft_ahead import MAX_BRANCHES, MAX_STEPS, DraftAhead, branch_nodes, host_branches
from infer.engine import greedy
from infer.gguf_file import GGUFModel
from infer.model import load_transformer
from infer.speculative import ModelDrafter, Speculator, Tree
from tests.oracle.assets import smollm2_path

CTX = 256


def pair() -> tuple[object, object, object]:
    target_path, draft_path = smollm2_path("Q8_0"), smollm2_path("Q4_0")
    if not (target_path.exists() and draft_path.exists()):
        pytest.skip("SmolLM2 Q8_0/Q4_0 missing: run scripts/fetch-models.sh")
    from infer.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(GGUFModel(target_path).metadata)
    return load_transformer(GGUFModel(target_path), exact=True), load_transformer(GGUFModel(draft_path)), tokenizer


class Run(NamedTuple):
    tokens: list[int]
    trees: list[tuple[list[int], list[int]]]  # (tokens, parents) of every tree proposed
    passes: int
    ahead: DraftAhead | None


def with_and_without_ahead(target: object, draft: object, prompt: list[int], n: int, depth: int, width: int,
                           ctx: int = CTX, steps: int = MAX_STEPS, early: bool = True) -> dict[bool, Run]:
    """Greedy speculation of n tokens after `prompt` with a depth x width ModelDrafter on `draft`,
    without (False) and with (True) drafting ahead (`steps` a branch; `early`: DraftAhead's)."""
    runs = {}
    for ahead in (False, True):
        drafter = ModelDrafter(draft, ctx, depth, width, ahead=ahead)  # type: ignore[arg-type]
        if ahead:
            drafter.ahead = DraftAhead(max_steps=steps, early=early)
        trees: list[tuple[list[int], list[int]]] = []
        propose = drafter.propose

        def record(context: list[int], root: int, size: int, propose=propose, trees=trees) -> Tree:  # noqa: ANN001
            tree = propose(context, root, size)
            trees.append((list(tree.tokens), list(tree.parents)))
            return tree

        drafter.propose = record  # type: ignore[method-assign]
        spec = Speculator(target, drafter, 1 + depth * width, ctx)  # type: ignore[arg-type]
        runs[ahead] = Run(list(spec.generate(list(prompt), n, greedy)), trees, spec.stats.passes, drafter.ahead)
    return runs


def test_branch_nodes_are_the_chains_end_then_the_leaves_by_rank() -> None:
    # a 3 x 3 chain-with-leaves tree: depth d's chain node, then its two leaves
    parents = [-1, 0, 0, 0, 1, 1, 1, 4, 4, 4]
    assert branch_nodes(parents, 16) == [7, 2, 5, 8, 3, 6, 9]
    assert branch_nodes(parents) == [7, 2, 5, 8][:MAX_BRANCHES]
    assert branch_nodes(parents, 3) == [7, 2, 5]
    assert branch_nodes([-1, 0, 1]) == [2]  # a chain: its end
    assert branch_nodes([-1]) == []


def test_a_branch_is_the_chain_the_draft_drafts_from_there() -> None:
    """host_branches' rows for a branch at position p equal ModelDrafter's own chain after the
    same tokens, and the cache still holds the tokens before the earliest branch."""
    _, draft, tokenizer = pair()
    ids = tokenizer.encode("The quick brown fox jumps over")
    cache = draft.new_cache(CTX)
    branches = [(int(ids[-1]), len(ids) - 1), (int(ids[-3]), len(ids) - 3), (int(ids[-2]), len(ids) - 2)]
    results, kept = host_branches(draft, cache, ids[:-1], 0, branches, 4, 3)
    got = results.ranked()
    assert kept == len(ids) - 3 and cache.length == kept
    for b, (token, pos) in enumerate(branches):
        alone = ModelDrafter(draft, CTX, 4, 3)
        alone.cache.length = 0
        draft.forward(np.asarray(ids[:-1]), alone.cache)  # the positions before the branch as host_branches fed them
        alone.cache.length = pos
        want = alone._chain(np.asarray([token]), 4, 3)
        assert np.array_equal(got[b], want), b


@pytest.mark.parametrize(("depth", "width", "steps", "early"), [(4, 2, 6, True), (3, 3, 2, True), (6, 1, 6, False)])
def test_speculation_drafting_ahead_makes_the_same_trees_and_text(depth: int, width: int, steps: int,
                                                                  early: bool) -> None:
    """With the branches drafted ahead (here one after the other on the CPU) the speculator emits
    the target's own greedy text, with the trees and passes of drafting without them, and takes
    trees from the branches (fewer steps a branch than the chain is deep: the chain continues)."""
    target, draft, tokenizer = pair()
    hits = 0
    for text in ["The capital of France is", "def add(a, b):\n    return", "1, 2, 3, 4, 5,"]:
        ids = tokenizer.encode(text)
        runs = with_and_without_ahead(target, draft, ids, 32, depth, width, steps=steps, early=early)
        assert runs[True].tokens == runs[False].tokens, text
        assert runs[True].trees == runs[False].trees and runs[True].passes == runs[False].passes, text
        ahead_stats = runs[True].ahead
        assert ahead_stats is not None
        assert ahead_stats.launched >= runs[True].passes - 1, (text, ahead_stats.as_dict())
        assert ahead_stats.tokens <= ahead_stats.hits * (steps - 1)
        hits += ahead_stats.hits
    assert hits > 0


def test_a_stale_or_foreign_context_takes_nothing() -> None:
    """Branches are drafted when the speculator asks (draft_ahead: its pass queued), and take()
    gives rows only for the context the tree was drafted after, extended by a path of the tree
    that ends at a branch, and only once."""
    _, draft, tokenizer = pair()
    ids = tokenizer.encode("One, two, three, four,")
    drafter = ModelDrafter(draft, CTX, 3, 2, ahead=True)
    drafter.ahead = DraftAhead(early=False)
    tree = drafter.propose(ids[:-1], ids[-1], 7)
    ahead = drafter.ahead
    assert ahead is not None and ahead.pending is None  # drafted ahead once the target's pass is queued
    drafter.draft_ahead()
    assert ahead.pending is not None
    chain = [tree.tokens[n] for n in (1, 3, 5)]
    end_rows = ahead.pending.results.ranked()[0]
    guess = int(end_rows[0, 0])
    context = [*ids, *chain]  # the whole chain taken, then the target chose `guess`
    other = (guess + 1) % 1000
    assert ahead.take(context, other, 2) is None  # the target chose another token
    assert ahead.take(context, guess, 2) is None  # taken once: nothing pending any more
    drafter.propose(ids[:-1], ids[-1], 7)
    drafter.draft_ahead()
    assert ahead.take([7, *context[1:]], guess, 2) is None  # not the context the tree followed
    drafter.propose(ids[:-1], ids[-1], 7)
    drafter.draft_ahead()
    rows = ahead.take(context, guess, 2)
    assert rows is not None and np.array_equal(rows, end_rows[1:, :2])


def test_early_branches_are_launched_as_the_tree_is_drafted(monkeypatch: pytest.MonkeyPatch) -> None:
    """DraftAhead's early (the default): the branches are launched inside propose, before the
    target's pass is queued, and the speculator's draft_ahead then has nothing left to launch; the
    environment chooses the moment, the branches and the steps, and a wrong value is one clear error."""
    _, draft, tokenizer = pair()
    ids = tokenizer.encode("One, two, three, four,")
    for name in ("NVMEDIRECT_DRAFT_AHEAD_WHEN", "NVMEDIRECT_DRAFT_AHEAD_BRANCHES", "NVMEDIRECT_DRAFT_AHEAD_STEPS"):
        monkeypatch.delenv(name, raising=False)
    drafter = ModelDrafter(draft, CTX, 3, 2, ahead=True)
    ahead = drafter.ahead
    assert ahead is not None and ahead.early and ahead.max_branches == MAX_BRANCHES and ahead.max_steps == MAX_STEPS
    drafter.propose(ids[:-1], ids[-1], 7)
    assert ahead.pending is not None and ahead.launched == 1
    pending = ahead.pending
    drafter.draft_ahead()
    assert ahead.pending is pending and ahead.launched == 1
    assert len(pending.nodes) == min(4, MAX_BRANCHES)  # a 3 x 2 tree: the chain's end and a leaf at each depth
    monkeypatch.setenv("NVMEDIRECT_DRAFT_AHEAD_BRANCHES", "1")
    monkeypatch.setenv("NVMEDIRECT_DRAFT_AHEAD_STEPS", "2")
    monkeypatch.setenv("NVMEDIRECT_DRAFT_AHEAD_WHEN", "queued")
    few = DraftAhead()
    assert (few.max_branches, few.max_steps, few.early) == (1, 2, False)
    monkeypatch.setenv("NVMEDIRECT_DRAFT_AHEAD_WHEN", "soon")
    with pytest.raises(ValueError, match="drafted or queued"):
        DraftAhead()
    monkeypatch.setenv("NVMEDIRECT_DRAFT_AHEAD_WHEN", "drafted")
    monkeypatch.setenv("NVMEDIRECT_DRAFT_AHEAD_BRANCHES", "0")
    with pytest.raises(ValueError, match="at least 1"):
        DraftAhead()
