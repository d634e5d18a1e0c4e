"""The best-first draft tree (infer/draft_tree.py) on SmolLM2: each step keeps the children most
likely under the draft's path probabilities, as a brute force over every path finds them; and
speculation with it (and with the shape tuner) is still the target's own greedy text."""

from __future__ import annotations

import numpy as np
import pytest

from infer.draft_tree import BestFirstDrafter, top_children
from infer.engine import Engine, greedy
from infer.gguf_file import GGUFModel
from infer.model import load_transformer
from infer.spec_tuner import ShapeTuner
from infer.speculative import Speculator
from tests.oracle.assets import smollm2_path

CTX = 256
PROMPT = [1, 504, 3458, 282, 4649, 314, 253]


@pytest.fixture(scope="module")
def pair():  # noqa: ANN201
    target, draft = smollm2_path("Q8_0"), smollm2_path("Q4_0")
    if not (target.exists() and draft.exists()):
        pytest.skip("SmolLM2 Q8_0/Q4_0 missing: run scripts/fetch-models.sh")
    return load_transformer(GGUFModel(target), exact=True), load_transformer(GGUFModel(draft), exact=True)


def log_probs(model, tokens: list[int]) -> np.ndarray:  # noqa: ANN001
    logits = model.forward(np.asarray(tokens), model.new_cache(CTX)).astype(np.float64)
    return logits - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))


def test_each_step_keeps_the_likeliest_paths(pair) -> None:  # noqa: ANN001
    _, draft = pair
    depth, width = 3, 3
    tree = BestFirstDrafter(draft, CTX, depth, width).propose(PROMPT[:-1], PROMPT[-1], 1 + depth * width)
    assert len(tree.tokens) == 1 + depth * width
    # brute force: every node's path score from a fresh pass per path; each level is the best `width`
    # children of the level above
    score = {0: 0.0}
    paths = {0: [PROMPT[-1]]}
    level = [0]
    for d in range(depth):
        cand = []
        for n in level:
            lp = log_probs(draft, PROMPT[:-1] + paths[n])
            for t in np.argsort(-lp, kind="stable")[:width]:
                cand.append((score[n] + lp[t], n, int(t)))
        cand.sort(key=lambda c: -c[0])
        nodes = list(range(1 + d * width, 1 + (d + 1) * width))
        assert [(tree.parents[i], tree.tokens[i]) for i in nodes] == [(n, t) for _, n, t in cand[:width]]
        for i, (s, n, t) in zip(nodes, cand[:width], strict=True):
            score[i], paths[i] = s, paths[n] + [t]
        level = nodes


def test_top_children_are_the_top_k_with_their_log_probabilities() -> None:
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((4, 50)).astype(np.float32)
    rows[2, [3, 9]] = 5.0  # a tie: the lower id first
    ids, logp = top_children(rows, [2, 0], 3)
    assert ids[0, :2].tolist() == [3, 9]
    for r, node in enumerate([2, 0]):
        want = rows[node].astype(np.float64) - np.log(np.exp(rows[node].astype(np.float64)).sum())
        assert np.allclose(logp[r], want[ids[r]], atol=1e-6)
        assert set(ids[r]) == set(np.argsort(-rows[node], kind="stable")[:3])


def test_speculation_with_the_best_first_tree_is_plain_greedy(pair) -> None:  # noqa: ANN001
    target, draft = pair
    want = list(Engine(target, CTX).generate(PROMPT, 40, greedy))
    spec = Speculator(target, BestFirstDrafter(draft, CTX, 3, 2), 7, CTX)
    assert list(spec.generate(PROMPT, 40, greedy)) == want
    assert spec.stats.tokens_per_pass > 1.5
    tuner = ShapeTuner(depth=2, max_depth=6, width=3, every=2, min_width=3)  # the tuner picks the depth
    tuned = Speculator(target, BestFirstDrafter(draft, CTX, 2, 3), 19, CTX, tuner)
    assert list(tuned.generate(PROMPT, 40, greedy)) == want
    assert 1 <= tuner.depth <= 6 and tuner.width == 3 and tuner.passes == tuned.stats.passes
