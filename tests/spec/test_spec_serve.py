"""Speculation inside the generation loop (infer.spec_serve): every speculative request of a pass
drafts a tree, and ONE target pass verifies all of them beside the other requests' decode tokens and
prompt chunks. Exact (float64) sums on synthetic models: each request gets what it gets alone,
greedy token for token, sampled draw for draw (one draw per emitted token, as without a draft)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from infer.engine import Engine, greedy
from infer.gguf_file import GGUFModel
from infer.model import load_transformer
from infer.sampler import Sampler, SamplerConfig
from infer.scheduler import Request, Scheduler, as_sampler
from infer.spec_serve import DraftPool, can_speculate
from infer.speculative import LookupDrafter, ModelDrafter
from infer.synth import SHAPES, Shape, write_model

CTX = 96
PROMPTS = [[1] + [40, 41, 42, 43] * 6, [1, 300, 2, 8], [1] + list(range(100, 130)), [1, 5, 9, 200, 31, 7, 7, 40]]


def _model(path: Path, layers: int) -> Any:
    write_model(path, Shape(**{**SHAPES["tiny"].__dict__, "n_layers": layers}), "q8_0", seed=3)
    return load_transformer(GGUFModel(path), exact=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """(target, a one-layer draft of the same vocabulary)."""
    folder = tmp_path_factory.mktemp("spec-serve")
    return _model(folder / "target.gguf", 2), _model(folder / "draft.gguf", 1)


def alone(model: Any, prompt: list[int], n: int) -> list[int]:
    return list(Engine(model, CTX).generate(prompt, n, greedy))


def _run(target: Any, pool: DraftPool | None, requests: list[Request]) -> list[tuple[int, int]]:
    """Runs the requests together on 4 slots; the (rows, sequences) of each pass."""
    passes: list[tuple[int, int]] = []
    Scheduler(target, CTX, 4, speculation=pool, on_pass=lambda _s, rows, seqs: passes.append((rows, seqs))).run(requests)
    return passes


@pytest.mark.parametrize("drafter", ["lookup", "self", "small"])
def test_one_pass_verifies_every_request_tree(models: tuple[Any, Any], drafter: str) -> None:
    target, small = models
    make = {"lookup": lambda: LookupDrafter(depth=5),
            "self": lambda: ModelDrafter(target, CTX, depth=3, width=2),  # the target drafting: all kept
            "small": lambda: ModelDrafter(small, CTX, depth=3, width=2)}[drafter]
    pool = DraftPool(target, make, 7, CTX)
    requests = [Request(p, 12, as_sampler(greedy)) for p in PROMPTS]
    passes = _run(target, pool, requests)
    assert [r.generated for r in requests] == [alone(target, p, 12) for p in PROMPTS]
    # after the prompts, passes held all four requests' trees (a model drafts 7 nodes for each; a
    # lookup finds continuations in the repetitive prompt only, the others' trees are their roots)
    assert any(seqs == 4 and rows >= (4 + 4 if drafter == "lookup" else 4 * 7) for rows, seqs in passes[1:])
    if drafter == "self":  # every drafted chain kept: far fewer passes than tokens
        assert len(passes) <= 1 + 12 // 3 + 1


def test_model_drafters_draft_together_as_they_would_alone(models: tuple[Any, Any]) -> None:
    """ModelDrafter.propose_many (a draft pass per depth for all) proposes the trees each drafter
    proposes on its own, and leaves each draft cache where propose leaves it."""
    _, small = models
    contexts = [PROMPTS[0], PROMPTS[2][:7], PROMPTS[3]]
    roots, sizes = [5, 6, 7], [7, 4, 1]
    one = [ModelDrafter(small, CTX, depth=3, width=2) for _ in contexts]
    many = [ModelDrafter(small, CTX, depth=3, width=2) for _ in contexts]
    for _ in range(2):  # the second time each drafter rewinds to what it holds
        want = [d.propose(c, r, n) for d, c, r, n in zip(one, contexts, roots, sizes, strict=True)]
        got = ModelDrafter.propose_many(many, contexts, roots, sizes)
        assert [(t.tokens, t.parents) for t in got] == [(t.tokens, t.parents) for t in want]
        assert [d.fed for d in many] == [d.fed for d in one]
        assert [d.cache.length for d in many] == [d.cache.length for d in one]
        contexts = [c + [r] for c, r in zip(contexts, roots, strict=True)]


def test_sampled_requests_draw_what_they_draw_without_a_draft(models: tuple[Any, Any]) -> None:
    """A seeded sampled request draws once per emitted token with or without speculation, from the
    same logits: the same text (the distribution is the target's, whatever the drafter)."""
    target, _ = models

    def requests() -> list[Request]:
        return [Request(p, 10, Sampler(SamplerConfig(temperature=0.8, top_k=20, seed=11 + i)))
                for i, p in enumerate(PROMPTS)]

    plain, drafted = requests(), requests()
    _run(target, None, plain)
    _run(target, DraftPool(target, lambda: ModelDrafter(target, CTX, depth=3, width=2), 7, CTX), drafted)
    assert [r.generated for r in drafted] == [r.generated for r in plain]
    assert all(r.speculator is not None for r in drafted)


def test_requests_that_cannot_speculate_decode_beside_the_trees(models: tuple[Any, Any]) -> None:
    """A request asking for log-probabilities decodes plainly in the same passes; its numbers and
    the speculative requests' tokens are what each gets alone."""
    target, _ = models
    pool = DraftPool(target, lambda: LookupDrafter(depth=5), 7, CTX)
    logged = Request(PROMPTS[1], 8, as_sampler(greedy), top_logprobs=2)
    others = [Request(p, 8, as_sampler(greedy)) for p in (PROMPTS[0], PROMPTS[2])]
    assert not can_speculate(logged) and all(can_speculate(r) for r in others)
    scheduler = Scheduler(target, CTX, 4, speculation=pool)
    scheduler.tokenizer = _Bytes()  # type: ignore[assignment]  # log-probabilities report token bytes
    scheduler.run([logged, *others])
    assert logged.speculator is None and all(r.speculator is not None for r in others)
    assert [r.generated for r in (logged, *others)] == [alone(target, p, 8) for p in (PROMPTS[1], PROMPTS[0], PROMPTS[2])]
    assert len(logged.logprobs) == 8


def test_a_tree_never_runs_past_the_context(models: tuple[Any, Any]) -> None:
    """Near the end of the context the trees shrink to the positions left; the reply ends at the
    context as plain decoding's does."""
    target, _ = models
    prompt = [1] + [40, 41, 42, 43] * 21  # 85 tokens of 96
    request = Request(prompt, 50, as_sampler(greedy))
    _run(target, DraftPool(target, lambda: LookupDrafter(depth=8), 9, CTX), [request])
    assert request.finish_reason == "length"
    assert request.generated == alone(target, prompt, CTX - len(prompt) + 1)[: len(request.generated)]
    assert len(prompt) + len(request.generated) == CTX + 1


class _Bytes:
    """The bytes of a token id (what log-probabilities report) for a model without a tokenizer."""

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        return str(token).encode()


def test_a_tree_pass_is_one_call_of_the_model(models: tuple[Any, Any]) -> None:
    """The trees, decode tokens and prompt chunks of a pass go to the model in one forward_batch."""
    target, _ = models
    calls: list[int] = []

    class Counting:
        def __getattr__(self, name: str) -> Any:
            return getattr(target, name)

        def forward_batch(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(sum(t is not None for t in kwargs.get("trees") or []))
            return target.forward_batch(batch, *args, **kwargs)

    counting = Counting()
    pool = DraftPool(counting, lambda: LookupDrafter(depth=5), 7, CTX)  # type: ignore[arg-type]
    requests = [Request(p, 6, as_sampler(greedy)) for p in PROMPTS[:3]]
    Scheduler(counting, CTX, 4, speculation=pool).run(requests)  # type: ignore[arg-type]
    assert max(calls) == 3  # three trees in one call
    assert [r.generated for r in requests] == [alone(target, p, 6) for p in PROMPTS[:3]]


def test_trees_and_prompt_chunks_share_a_pass_within_its_capacity(models: tuple[Any, Any]) -> None:
    """A model whose pass holds at most `capacity` rows (the GPU's, padded canonical rows first): the
    trees take their share, prompt chunks the room left (or wait a pass); no pass exceeds it, and
    every request still gets its tokens."""
    target, _ = models
    capacity, rows_seen = 48, []

    class Bounded:
        def __init__(self) -> None:
            self.capacity = capacity

        def __getattr__(self, name: str) -> Any:
            return getattr(target, name)

        def prompt_room(self, canonical: int) -> int:
            bucket = 1 << max(0, canonical - 1).bit_length()  # the canonical rows' bucket
            return max(0, capacity - min(bucket, capacity))

        def forward_batch(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("trees"):
                rows_seen.append(sum(len(t) for t, _ in batch))
            return target.forward_batch(batch, *args, **kwargs)

    bounded = Bounded()
    pool = DraftPool(bounded, lambda: ModelDrafter(target, CTX, depth=4, width=3), 13, CTX)  # type: ignore[arg-type]
    long_prompt = [1] + list(range(200, 260))
    requests = [Request(p, 10, as_sampler(greedy)) for p in (*PROMPTS[:3], long_prompt)]
    Scheduler(bounded, CTX, 4, speculation=pool).run(requests)  # type: ignore[arg-type]
    assert rows_seen and max(rows_seen) <= capacity
    assert [r.generated for r in requests] == [alone(target, r.prompt, 10) for r in requests]
