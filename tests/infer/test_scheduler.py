"""infer.scheduler, the one generation loop: the Python API, `--batch` and the server are requests
to it. A lone greedy request on a model that decodes on its device (the GPU's CUDA-graph steps)
is handed to the device and taken back when another request arrives; a request's tokens do not
depend on the requests beside it. Exact (float64) sums on a synthetic model make those identities;
the device is a host stand-in with the GPU's generate_iter contract (the GPU's own decode loop is
tested in tests/gpu/)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from infer.engine import DeviceGreedy, Engine, greedy
from infer.gguf_file import GGUFModel
from infer.model import load_transformer
from infer.sampler import Sampler, SamplerConfig
from infer.scheduler import Request, Scheduler, as_sampler
from infer.synth import SHAPES, Shape, write_model

CTX = 96
PROMPTS = [[1, 5, 9, 200, 31, 7, 7, 40], [1, 300, 2, 8], [1] + list(range(100, 130))]


class HostGreedy:
    """A CPU model with generate_iter as infer/gpu/generation.py has it: the given tokens but the
    last as prompt rows, then up to n_new greedy steps in blocks of `check_every`, cut after a stop
    id; the cache holds what ran (the last chosen id is not in it) after every block."""

    def __init__(self, inner: Any) -> None:
        self.model, self.runs, self.steps = inner, 0, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def generate_iter(self, prompt: np.ndarray, cache: Any, n_new: int, temperature: float = 0.0, seed: int = 0,
                      stop: Any = frozenset(), check_every: int = 4) -> Iterator[list[int]]:
        self.runs += 1
        feed = [int(t) for t in np.asarray(prompt).reshape(-1)]
        if len(feed) > 1:
            self.model.prefill(np.asarray(feed[:-1]), cache)
        last, done = feed[-1], 0
        while done < n_new:
            block: list[int] = []
            while len(block) < check_every and done < n_new:
                last = int(np.argmax(self.model.forward(np.asarray([last]), cache)))
                self.steps += 1
                block.append(last)
                done += 1
                if last in stop:
                    break
            yield block
            if block[-1] in stop:
                return


@pytest.fixture(scope="module")
def exact(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("synth") / "tiny2-q8_0.gguf"
    write_model(path, Shape(**{**SHAPES["tiny"].__dict__, "n_layers": 2}), "q8_0", seed=3)
    return load_transformer(GGUFModel(Path(path)), exact=True)


def alone(model: Any, prompt: list[int], n: int, stop: frozenset[int] = frozenset()) -> list[int]:
    """The reference: one sequence, one token a step (infer.engine.Engine)."""
    return list(Engine(model, CTX).generate(prompt, n, greedy, stop.__contains__))


def test_a_lone_greedy_request_decodes_on_the_device(exact: Any) -> None:
    device = HostGreedy(exact)
    assert isinstance(device, DeviceGreedy)
    scheduler = Scheduler(device, CTX, 1)
    for prompt in PROMPTS:
        request = Request(prompt, 10, Sampler(SamplerConfig(temperature=0.0)))
        assert list(scheduler.run_one(request)) == alone(exact, prompt, 10)
        assert request.finish_reason == "length" and request.generated == alone(exact, prompt, 10)
    assert device.runs == 3 and device.steps == 30


def test_a_stop_id_ends_the_device_run_and_is_told(exact: Any) -> None:
    device = HostGreedy(exact)
    want = alone(exact, PROMPTS[0], 12)
    stop = frozenset({want[5]})
    request = Request(PROMPTS[0], 12, as_sampler(greedy), stop_ids=stop)
    got = list(Scheduler(device, CTX, 1).run_one(request))
    assert got == want[: want.index(want[5]) + 1] and request.finish_reason == "stop"
    assert request.generated == got[:-1]


def test_an_arrival_takes_the_device_run_back_into_shared_passes(exact: Any) -> None:
    """A runs alone on the device; when its fifth token comes B arrives: the device run ends at the
    block, both continue in shared passes, and each gets its tokens alone."""
    device = HostGreedy(exact)
    scheduler = Scheduler(device, CTX, 2)
    passes: list[int] = []
    scheduler.on_pass = lambda _s, _rows, sequences: passes.append(sequences)
    late = Request(PROMPTS[1], 9, as_sampler(greedy))
    first = Request(PROMPTS[0], 14, as_sampler(greedy))
    first.on_token = lambda _t: scheduler.submit(late) if len(first.generated) == 4 and late.cache is None \
        and not late.generated and late not in scheduler.waiting else None
    scheduler.run([first])
    assert first.generated == alone(exact, PROMPTS[0], 14) and late.generated == alone(exact, PROMPTS[1], 9)
    assert device.runs >= 2 and 2 in passes  # the device before and after, shared passes between
    assert scheduler.idle and len(scheduler.free) == 2


def test_sampled_and_biased_requests_stay_in_passes(exact: Any) -> None:
    device = HostGreedy(exact)
    sampled = Request(PROMPTS[0], 6, Sampler(SamplerConfig(temperature=0.8, seed=1)))
    biased = Request(PROMPTS[1], 6, Sampler(SamplerConfig(temperature=0.0, logit_bias=((5, 2.0),))))
    scheduler = Scheduler(device, CTX, 1)
    list(scheduler.run_one(sampled))
    list(scheduler.run_one(biased))
    assert device.runs == 0 and len(sampled.generated) == len(biased.generated) == 6


def test_requests_together_get_what_each_gets_alone(exact: Any) -> None:
    """Prompt chunks beside decode tokens (a 7-row budget splits the long prompt over passes)."""
    requests = [Request(p, 8, as_sampler(greedy)) for p in PROMPTS]
    Scheduler(exact, CTX, 3, prefill_chunk=7).run(requests)
    assert [r.generated for r in requests] == [alone(exact, p, 8) for p in PROMPTS]


def test_closing_the_stream_gives_the_cache_back(exact: Any) -> None:
    scheduler = Scheduler(exact, CTX, 1)
    request = Request(PROMPTS[2], 20, as_sampler(greedy))
    tokens = scheduler.run_one(request)
    assert len([next(tokens) for _ in range(3)]) == 3
    tokens.close()
    assert request.cancelled and scheduler.idle and len(scheduler.free) == 1
    again = Request(PROMPTS[2], 5, as_sampler(greedy))
    assert list(scheduler.run_one(again)) == alone(exact, PROMPTS[2], 5)


def test_a_speculative_request_beside_a_plain_one(exact: Any) -> None:
    """Speculation is a request too: its steps verify drafted trees (prompt lookup here) while the
    other request decodes in passes; both get their plain greedy tokens."""
    from infer.speculative import LookupDrafter, Speculator

    repetitive = [1] + [40, 41, 42, 43] * 6
    speculator = Speculator(exact, LookupDrafter(), 6, CTX)
    drafted = Request(repetitive, 16, as_sampler(greedy), speculator=speculator)
    plain = Request(PROMPTS[1], 12, as_sampler(greedy))
    Scheduler(exact, CTX, 2).run([drafted, plain])
    assert drafted.generated == alone(exact, repetitive, 16) and plain.generated == alone(exact, PROMPTS[1], 12)
    assert 0 < speculator.stats.passes <= 16 and speculator.stats.proposed > 0
