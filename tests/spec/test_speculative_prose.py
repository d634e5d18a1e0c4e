"""Speculation on the CPU keeps plain decoding's text on prose and questions (issue 29, defect 13):
the kind of prompt on which the float32 engine's speculative text drifted (4 of 20 identical with
--lookup). Speculation on the CPU runs the exact engine (the CLI refuses it without --exact, see
test_cli_spec.py); these prompts are this test's own, not the other tests', 48 tokens each, greedy
with both drafters and sampled with a seed (the draws of a speculative pass are the plain sampler's
draws, so the seeded text is the same)."""

from __future__ import annotations

import pytest

from infer.api import LLM
from infer.engine import Engine, greedy
from infer.sampler import Sampler, SamplerConfig
from infer.speculative import LookupDrafter, ModelDrafter, Speculator
from tests.oracle.assets import smollm2_path

pytestmark = pytest.mark.slow
CTX, TOKENS = 256, 48
PROMPTS = [
    "Why does bread go stale faster in the fridge?",
    "Write a short note to a neighbour about a parcel left at your door.",
    "The ferry left the harbour an hour late, and the passengers",
    "What is the difference between a comet and an asteroid?",
    "Describe the smell of a forest after the rain.",
    "How did people keep food cold before refrigerators were invented?",
]
SAMPLED = SamplerConfig(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05)


@pytest.fixture(scope="module")
def models() -> tuple[LLM, LLM]:
    target, draft = smollm2_path("Q8_0"), smollm2_path("Q4_0")
    if not (target.exists() and draft.exists()):
        pytest.skip("SmolLM2 Q8_0/Q4_0 missing: run scripts/fetch-models.sh")
    return LLM.load(target, ctx_size=CTX, exact=True), LLM.load(draft, ctx_size=CTX)


def plain(llm: LLM, ids: list[int], choose) -> list[int]:  # noqa: ANN001
    return list(Engine(llm.transformer, CTX).generate(ids, TOKENS, choose, llm.tokenizer.is_eog))


def speculative(llm: LLM, ids: list[int], drafter, nodes: int, choose) -> tuple[list[int], float]:  # noqa: ANN001
    run = Speculator(llm.transformer, drafter, nodes, CTX)
    out = list(run.generate(ids, TOKENS, choose, llm.tokenizer.is_eog))
    return out, run.stats.tokens_per_pass


def test_greedy_speculative_text_is_the_plain_text(models: tuple[LLM, LLM]) -> None:
    target, draft = models
    per_pass = []
    for prompt in PROMPTS:
        ids = target.tokenize(prompt)
        want = plain(target, ids, greedy)
        got, lookup_rate = speculative(target, ids, LookupDrafter(max_ngram=3, depth=8), 9, greedy)
        assert got == want, (prompt, target.detokenize(got), target.detokenize(want))
        drafter = ModelDrafter(draft.transformer, CTX, depth=4, width=2, cache=draft.engine.cache)
        got, model_rate = speculative(target, ids, drafter, 9, greedy)
        assert got == want, (prompt, target.detokenize(got), target.detokenize(want))
        per_pass.append(model_rate)
    assert max(per_pass) > 1.0  # the draft did get tokens accepted: the trees were really verified


@pytest.mark.parametrize("seed", [11, 12])
def test_seeded_sampled_speculative_text_is_the_plain_text(models: tuple[LLM, LLM], seed: int) -> None:
    target, draft = models
    for prompt in PROMPTS[seed - 11::2]:
        ids = target.tokenize(prompt)
        config = SamplerConfig(**{**SAMPLED.__dict__, "seed": seed})
        want = plain(target, ids, Sampler(config).sample)
        drafter = ModelDrafter(draft.transformer, CTX, depth=4, width=2, cache=draft.engine.cache)
        got, _ = speculative(target, ids, drafter, 9, Sampler(config).sample)
        assert got == want, (prompt, target.detokenize(got), target.detokenize(want))
