"""Token trees on the GPU engine (resident and streamed weights): one tree pass gives each node, bit
for bit, the logits of a plain pass over its path (its tokens in one pass, or a decode step each),
accepting a path keeps its keys and values, speculative generation accepts an exact draft's whole
chain, and greedy speculation with a draft that is often wrong emits exactly plain generation.

Run on the H200:  .venv/bin/python -m pytest -v tests/gpu/test_speculative_gpu.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from infer.engine import greedy
from infer.gguf_file import GGUFModel
from infer.speculative import ModelDrafter, Speculator, Tree
from infer.synth import Shape, write_model

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu
SHAPE = Shape(n_layers=6, dim=512, ffn_dim=1536, n_heads=8, n_kv_heads=2, vocab_size=2000, context_length=1024)
CTX = 512


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("spec") / "m-q4_k_m.gguf"
    write_model(p, SHAPE, "q4_k_m", seed=8)
    return p


def _models(path: Path):  # noqa: ANN202
    from infer.gpu import load_gpu_transformer
    from infer.tiers.session import StreamingConfig, build_streaming_engine

    yield "resident", load_gpu_transformer(GGUFModel(path), CTX), lambda: None
    session = build_streaming_engine(GGUFModel(path), StreamingConfig(enabled=True), CTX, "gpu", measure=False)
    yield "streamed", session.engine.model, session.close


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_tree_pass_equals_each_path(path: Path) -> None:
    rng = np.random.default_rng(2)
    prompt = rng.integers(3, SHAPE.vocab_size, 40)
    parents = [-1] + [int(rng.integers(max(0, i - 4), i)) for i in range(1, 24)]
    tree = Tree([int(t) for t in rng.integers(3, SHAPE.vocab_size, 24)], parents)
    for name, model, close in _models(path):
        try:
            cache = model.new_cache(CTX)
            model.forward(prompt, cache)
            got = model.forward_tree(np.array(tree.tokens), np.array(tree.parents), cache)
            for node in range(len(tree.tokens)):  # the path's tokens in one pass after the prompt
                ref = model.new_cache(CTX)
                model.forward(prompt, ref)
                want = model.forward(np.array([tree.tokens[i] for i in _path(parents, node)]), ref)
                np.testing.assert_array_equal(got[node], want, err_msg=f"{name} node {node}")
            deepest = max(range(len(parents)), key=lambda i: len(_path(parents, i)))
            kept = _path(parents, deepest)
            cache.accept(kept)
            nxt = model.forward(np.array([9]), cache)
            ref = model.new_cache(CTX)
            want = model.forward(np.concatenate([prompt, [tree.tokens[i] for i in kept], [9]]), ref)
            np.testing.assert_array_equal(nxt, want, err_msg=name)
            assert cache.length == len(prompt) + len(kept) + 1, name
        finally:
            close()


def _path(parents: list[int], node: int) -> list[int]:
    out = [node]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out[::-1]


def test_speculative_generation_on_the_gpu(path: Path) -> None:
    """A draft with the target's own weights (another engine on the same file) has its whole chain
    accepted every pass: its logits are the target's, bit for bit."""
    from infer.gpu import load_gpu_transformer

    target = load_gpu_transformer(GGUFModel(path), CTX)
    draft = load_gpu_transformer(GGUFModel(path), CTX)
    prompt = list(np.random.default_rng(5).integers(3, SHAPE.vocab_size, 20))
    spec = Speculator(target, ModelDrafter(draft, CTX, depth=4, width=2), 9, CTX)
    out = list(spec.generate(prompt, 30, greedy))
    print(f"GPU speculation: {spec.stats.tokens_per_pass:.2f} tokens per pass")
    assert len(out) == 30 and spec.stats.passes == 6 and spec.stats.tokens_per_pass == 5.0


def test_verify_tree_is_each_path_decoded(path: Path) -> None:
    """verify_tree gives every node, bit for bit, the logits of decode steps along its path,
    resident and streamed; accepting a path keeps its keys."""
    rng = np.random.default_rng(3)
    prompt = rng.integers(3, SHAPE.vocab_size, 40)
    parents = [-1] + [int(rng.integers(max(0, i - 4), i)) for i in range(1, 33)]
    tree = Tree([int(t) for t in rng.integers(3, SHAPE.vocab_size, 33)], parents)
    for name, model, close in _models(path):
        try:
            cache = model.new_cache(CTX)
            model.forward(prompt, cache)
            got = model.verify_tree(np.array(tree.tokens), np.array(tree.parents), cache).to_host()
            for node in range(len(parents)):
                ref = model.new_cache(CTX)
                model.forward(prompt, ref)
                for i in _path(parents, node):
                    want = model.forward(np.array([tree.tokens[i]]), ref)
                np.testing.assert_array_equal(got[node], want, err_msg=f"{name} node {node}")
            kept = _path(parents, max(range(len(parents)), key=lambda i: len(_path(parents, i))))
            cache.accept(kept)
            nxt = model.forward(np.array([9]), cache)
            ref = model.new_cache(CTX)
            model.forward(prompt, ref)
            for t in [*(tree.tokens[i] for i in kept), 9]:
                want = model.forward(np.array([t]), ref)
            np.testing.assert_array_equal(nxt, want, err_msg=name)
        finally:
            close()


def test_speculative_greedy_is_plain_generation(path: Path) -> None:
    """Greedy speculation emits exactly the tokens of the engine's own generate (device arg-max),
    resident and streamed, with a draft that is often wrong (the model without two of its layers),
    and the draft chain computed on the device equals the host loop."""
    from infer.gpu import load_gpu_transformer
    from infer.layerskip import skipping

    draft = skipping(load_gpu_transformer(GGUFModel(path), CTX), {1, 3})
    rng = np.random.default_rng(11)
    prompts = [list(rng.integers(3, SHAPE.vocab_size, n)) for n in (20, 7, 33)]
    for name, model, close in _models(path):
        try:
            for prompt in prompts:
                cache = model.new_cache(CTX)
                want = model.generate(np.asarray(prompt), cache, 48)
                spec = Speculator(model, ModelDrafter(draft, CTX, depth=6, width=3), 19, CTX)
                got = list(spec.generate(prompt, 48, greedy))
                assert got == want, (name, prompt[:3])
                print(f"{name}: {spec.stats.tokens_per_pass:.2f} tokens per pass, identical")
        finally:
            close()
    for width in (1, 4):
        a, b = draft.new_cache(CTX), draft.new_cache(CTX)
        ids = draft.draft_chain(np.asarray(prompts[0]), a, 5, width)
        host = ModelDrafter(draft, CTX, 5, width, cache=b)  # (it empties the cache it is given)
        draft.forward(np.asarray(prompts[0][:-1]), b)  # as draft_chain feeds a prompt: one pass
        np.testing.assert_array_equal(ids, host._chain(np.asarray(prompts[0][-1:]), 5, width))
        assert a.length == b.length


def test_best_first_trees_and_the_shape_tuner_keep_plain_generation(path: Path) -> None:
    """The best-first drafter (its tree passes and top children on the device) and the shape tuner
    (depth and width of a ModelDrafter tree) leave greedy speculation exactly plain generation,
    resident and streamed; the device's top children equal the host's on the same rows."""
    from infer.draft_tree import BestFirstDrafter, top_children
    from infer.gpu import load_gpu_transformer
    from infer.layerskip import skipping
    from infer.spec_tuner import ShapeTuner

    draft = skipping(load_gpu_transformer(GGUFModel(path), CTX), {1, 3})
    rng = np.random.default_rng(12)
    prompts = [list(rng.integers(3, SHAPE.vocab_size, n)) for n in (20, 9)]
    cache = draft.new_cache(CTX)
    draft.forward(np.asarray(prompts[0][:-1]), cache)
    logits = draft.verify_tree(np.array([prompts[0][-1], 5, 9, 11]), np.array([-1, 0, 0, 2]), cache)
    ids, logp = logits.top_children([0, 2, 3], 4)
    want_ids, want_logp = top_children(logits.to_host(), [0, 2, 3], 4)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(logp, want_logp, atol=1e-4)
    for name, model, close in _models(path):
        try:
            for prompt in prompts:
                want = model.generate(np.asarray(prompt), model.new_cache(CTX), 40)
                best = Speculator(model, BestFirstDrafter(draft, CTX, 4, 4), 17, CTX)
                assert list(best.generate(prompt, 40, greedy)) == want, (name, "best-first")
                tuner = ShapeTuner(4, 16, 4, 8, 65, every=2)
                tuned = Speculator(model, ModelDrafter(draft, CTX, 4, 4), 65, CTX, tuner)
                assert list(tuned.generate(prompt, 40, greedy)) == want, (name, "tuned")
                print(f"{name}: best-first {best.stats.tokens_per_pass:.2f}, tuned {tuner.depth} x {tuner.width} "
                      f"{tuned.stats.tokens_per_pass:.2f} tokens per pass, identical")
        finally:
            close()


def test_speculation_in_the_server_loop_is_plain_serving(path: Path) -> None:
    """Speculation as serve runs it (infer.spec_serve): 4 greedy requests, each drafting a tree (a
    one-layer draft of another seed: often wrong; prompt lookup), ONE pass verifying all trees beside
    a plain request's decode token and a prompt chunk: every reply is the non-speculative loop's."""
    from infer.gpu import load_gpu_transformer
    from infer.request import Request, as_sampler
    from infer.scheduler import Scheduler
    from infer.spec_serve import DraftPool
    from infer.speculative import LookupDrafter

    draft_file = path.parent / "draft-q4_k_m.gguf"
    write_model(draft_file, Shape(**{**SHAPE.__dict__, "n_layers": 1}), "q4_k_m", seed=9)
    draft = load_gpu_transformer(GGUFModel(draft_file), CTX, batch=4)
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, SHAPE.vocab_size, n)] for n in (40, 7, 90, 3)]
    prompts[1] = [11, 12, 13, 14] * 6  # something for prompt lookup to find
    for name, model, close in _models(path):
        try:
            plain = [Request(p, 24, as_sampler(greedy)) for p in prompts]
            Scheduler(model, CTX, 4, device_runs=False).run(plain)
            for drafter in (lambda: ModelDrafter(draft, CTX, depth=3, width=2), lambda: LookupDrafter(depth=6)):
                spec = [Request(p, 24, as_sampler(greedy)) for p in prompts]
                scheduler = Scheduler(model, CTX, 4, device_runs=False,
                                      speculation=DraftPool(model, drafter, 7, CTX))
                scheduler.run(spec)
                assert [r.generated for r in spec] == [r.generated for r in plain], name
                assert scheduler.stats.draft_tokens > 0
        finally:
            close()


def test_drafting_ahead_makes_the_trees_of_drafting_without(path: Path) -> None:
    """The branches drafted during the target's pass (infer/draft_ahead.py: draft_branches on the
    draft's stream, slots past the sequence's) are the host loop's rows and leave the draft's cache
    as it was; greedy speculation drafting ahead makes the trees, passes and text of drafting
    without, resident and streamed, with trees taken from the branches."""
    from infer.draft_ahead import host_branches
    from infer.gpu import load_gpu_transformer
    from infer.layerskip import skipping
    from tests.spec.test_draft_ahead import with_and_without_ahead

    draft = skipping(load_gpu_transformer(GGUFModel(path), CTX), {1, 3})
    rng = np.random.default_rng(13)
    want = [int(t) for t in rng.integers(3, SHAPE.vocab_size, 30)]
    branches = [(5, 30), (7, 28), (9, 25), (11, 26)]
    for width, lead in ((1, 0), (4, 3)):
        a, b, fresh = draft.new_cache(CTX), draft.new_cache(CTX), draft.new_cache(CTX)
        for cache in (a, b):
            draft.forward(np.asarray(want[: 30 - lead]), cache)
        got = draft.draft_branches(a, want[30 - lead :], branches, 6, width).ranked()
        expect, _ = host_branches(draft, b, want, 30 - lead, branches, 6, width)
        np.testing.assert_array_equal(got, expect.ranked())
        draft.forward(np.asarray(want), fresh)
        np.testing.assert_array_equal(draft.forward(np.array([3]), a), draft.forward(np.array([3]), fresh))
    prompts = [list(rng.integers(3, SHAPE.vocab_size, n)) for n in (20, 9)]
    for name, model, close in _models(path):
        try:
            for prompt in prompts:
                runs = with_and_without_ahead(model, draft, prompt, 40, 4, 3, CTX)
                assert runs[True].tokens == runs[False].tokens, (name, prompt[:3])
                assert runs[True].trees == runs[False].trees, (name, prompt[:3])
                stats = runs[True].ahead.as_dict()
                print(f"{name}: drafting ahead {stats}")
                assert stats["launched"] > 0
        finally:
            close()
