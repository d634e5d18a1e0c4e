"""The scheduler's greedy path: with a model that finds arg-maxes where its logits are (the GPU's
forward_batch_argmax), a step whose requests are all greedy brings back token ids; a step with a
request that needs logits (sampled, log-probabilities) fetches rows as before; the answers are the
same either way. SmolLM2 Q8_0 on the CPU with exact sums, wrapped with a host forward_batch_argmax
that counts its calls (the GPU's own is tested against Sampler.sample in tests/gpu/test_model.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from infer.engine import DeviceArgmax
from infer.gguf_file import GGUFModel
from infer.model import load_transformer
from infer.sampler import Sampler, SamplerConfig, apply_logit_bias, argmax_rows
from infer.server.scheduler import Job, Scheduler
from infer.tokenizer import Tokenizer
from tests.server.test_server import PROMPTS, model  # noqa: F401 - the model fixture

GREEDY = SamplerConfig(temperature=0.0)
SAMPLED = SamplerConfig(temperature=0.9, seed=5)


class HostArgmax:
    """A CPU model with forward_batch_argmax: the scheduler's DeviceArgmax path without a GPU."""

    def __init__(self, inner: Any) -> None:
        self.model, self.argmax_steps, self.logits_steps = inner, 0, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def forward_batch(self, batch: Sequence, all_logits: bool = False,
                      prompt_rows: Sequence[int] | None = None) -> list[np.ndarray]:
        self.logits_steps += 1
        return self.model.forward_batch(batch, all_logits, prompt_rows)

    def forward_batch_argmax(self, batch: Sequence, prompt_rows: Sequence[int] | None = None,
                             bias: Sequence[Sequence[tuple[int, float]]] | None = None) -> list[tuple[int, float]]:
        self.argmax_steps += 1
        rows = np.stack(self.model.forward_batch(batch, prompt_rows=prompt_rows))
        for row, pairs in zip(rows, bias or [()] * len(rows), strict=True):
            apply_logit_bias(row, pairs)
        ids, maxima, _ = argmax_rows(rows)
        return [(int(i), float(v)) for i, v in zip(ids, maxima, strict=True)]


Served = list[tuple[list[int], list[float], str | None]]


def _serve(served: Any, tokenizer: Tokenizer, requests: list[tuple[str, SamplerConfig, int | None]]) -> Served:
    """Each (prompt, sampling, top_logprobs) served together: its tokens, log-probabilities, error."""

    async def run() -> Served:
        loop = asyncio.get_running_loop()
        scheduler = Scheduler(served, tokenizer, ctx_size=128, max_batch=len(requests), queue_size=0)
        jobs = [Job(prompt=tokenizer.encode(p), max_tokens=10, sampler=Sampler(c), stop_ids=frozenset(), stop=[],
                    loop=loop, top_logprobs=top) for p, c, top in requests]
        try:
            for job in jobs:
                scheduler.submit(job)
            errors = []
            for job in jobs:
                while True:
                    event = await asyncio.wait_for(job.events.get(), 300)
                    if event.error is not None or event.finish_reason is not None:
                        errors.append(event.error)
                        break
        finally:
            scheduler.close()
        return [(job.generated, [t.logprob for t in job.logprobs], error) for job, error in zip(jobs, errors, strict=True)]

    return asyncio.run(run())


@pytest.fixture(scope="module")
def loaded(model: Path) -> tuple[Any, Tokenizer]:  # noqa: F811
    gguf = GGUFModel(model)
    return load_transformer(gguf, exact=True), Tokenizer.from_gguf(gguf.metadata)


def test_greedy_steps_bring_back_ids_and_answer_as_the_rows_do(loaded: tuple[Any, Tokenizer]) -> None:
    plain, tokenizer = loaded
    wrapped = HostArgmax(plain)
    assert isinstance(wrapped, DeviceArgmax) and not isinstance(plain, DeviceArgmax)
    requests = [(p, GREEDY, None) for p in PROMPTS[:4]]
    assert _serve(wrapped, tokenizer, requests) == _serve(plain, tokenizer, requests)
    assert wrapped.argmax_steps >= 10 and wrapped.logits_steps == 0


def test_biased_greedy_steps_bring_back_ids(loaded: tuple[Any, Tokenizer]) -> None:
    """ignore_eos (the end tokens banned) and a logit_bias keep a greedy step on the device path;
    a request whose every token is banned fails alone (as on the host path)."""
    plain, tokenizer = loaded
    wrapped = HostArgmax(plain)
    no_end = SamplerConfig(temperature=0.0, logit_bias=tuple((t, float("-inf")) for t in tokenizer.vocab.eog_ids))
    boosted = SamplerConfig(temperature=0.0, logit_bias=((tokenizer.encode(" the", add_bos=False)[0], 4.0),))
    nothing = SamplerConfig(temperature=0.0, logit_bias=tuple((t, float("-inf")) for t in range(tokenizer.vocab_size)))
    requests = [(PROMPTS[0], no_end, None), (PROMPTS[1], boosted, None), (PROMPTS[2], GREEDY, None),
                (PROMPTS[3], nothing, None)]
    got = _serve(wrapped, tokenizer, requests)
    assert got == _serve(plain, tokenizer, requests)
    assert wrapped.argmax_steps >= 10 and wrapped.logits_steps == 0
    assert [error is None for _, _, error in got] == [True, True, True, False]
    assert "every token is excluded" in got[3][2] and len(got[0][0]) == 10


def test_a_request_that_needs_logits_gets_rows(loaded: tuple[Any, Tokenizer]) -> None:
    plain, tokenizer = loaded
    wrapped = HostArgmax(plain)
    requests = [(PROMPTS[0], GREEDY, None), (PROMPTS[1], GREEDY, 3), (PROMPTS[2], SAMPLED, None)]
    got = _serve(wrapped, tokenizer, requests)
    assert got == _serve(plain, tokenizer, requests)
    assert len(got[1][1]) == len(got[1][0]) and wrapped.logits_steps >= 10 and got[1][2] is None
