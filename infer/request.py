"""A generation request to infer.scheduler: what it asks for (prompt, length, how to choose, when
to stop), what it has produced, and the events its consumer receives."""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from infer.engine import Cache
from infer.sampler import Sampler, SamplerConfig
from infer.tokenizer import StreamDecoder


class Chooser(Protocol):
    """What picks a request's next token: infer.sampler.Sampler, or anything with its `sample`."""

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int: ...


@dataclass
class TokenLogprob:
    """A generated token's bytes and log-probability, with the most likely alternatives'."""

    text: bytes
    logprob: float
    top: list[tuple[bytes, float]]


@dataclass
class Event:
    """What a request's consumer receives: text (maybe empty) and, last, the finish reason."""

    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    status: int = 500  # of an error: 500 when the engine failed, 400 when the request's own choice did
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of the tokens since the last event


@dataclass
class Request:
    """One generation. `stop_ids` end it without being kept (the server's rule); `on_token` hears
    every chosen id first, a stop id too. `deliver` gets its Events (text needs the scheduler's
    tokenizer); stop strings cut the text."""

    prompt: list[int]
    max_tokens: int
    sampler: Chooser
    stop_ids: Container[int] = frozenset()
    stop: list[str] = field(default_factory=list)
    deliver: Callable[[Event], None] | None = None
    on_token: Callable[[int], None] | None = None
    top_logprobs: int | None = None  # alternatives per token's log-probability; None: none asked
    speculator: Any = None  # infer.speculative.Speculator: each step verifies a drafted tree
    cache: Cache | None = None
    prompt_done: int = 0  # prompt tokens in the cache
    generated: list[int] = field(default_factory=list)
    text: str = ""  # decoded generated text
    sent: int = 0  # characters of `text` already sent
    finish_reason: str | None = None
    error: str | None = None  # why it ended with finish_reason "error"
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    decoder: StreamDecoder | None = None
    special_text: bool = False  # decode control tokens as their text (a reply whose markers are parsed after)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    logprobs_sent: int = 0

    def push(self, event: Event) -> None:
        event.logprobs, self.logprobs_sent = self.logprobs[self.logprobs_sent :], len(self.logprobs)
        if self.deliver is not None:
            self.deliver(event)


class StopWhen:
    """A predicate (`tokenizer.is_eog`) as the stop-id container a Request checks."""

    def __init__(self, is_stop: Callable[[int], bool]) -> None:
        self.is_stop = is_stop

    def __contains__(self, token: object) -> bool:
        return bool(self.is_stop(token))  # type: ignore[arg-type]


class ChooserSampler:
    """A bare `choose(logits, history) -> id` function as a request's sampler; an arg-max chooser
    (infer.engine.greedy) lets the device pick."""

    def __init__(self, choose: Callable[[np.ndarray, list[int]], int]) -> None:
        self.choose = choose
        self.argmax_only = self.biased_argmax_only = bool(getattr(choose, "argmax_only", False))
        self.config = SamplerConfig(temperature=0.0)

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        return int(self.choose(logits, list(history)))


def as_sampler(choose: Any) -> Chooser:
    """A Sampler (or its bound `sample`) as it is; any other chooser function wrapped."""
    owner = getattr(choose, "__self__", None)
    if isinstance(owner, Sampler) and getattr(choose, "__name__", "") in ("sample", "__call__"):
        return owner
    if isinstance(choose, Sampler):
        return choose
    return ChooserSampler(choose)


def greedy_bias(request: Request) -> Sequence[tuple[int, float]] | None:
    """The request's logit bias when its choice is a (biased) arg-max the device can make, else None."""
    sampler = request.sampler
    if request.top_logprobs is not None or not getattr(sampler, "biased_argmax_only", False):
        return None
    return sampler.config.logit_bias  # type: ignore[attr-defined]


def stop_at(text: str, stops: list[str]) -> int | None:
    """Where the first stop string starts in `text`, or None."""
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(found) if found else None


def describe(request: Request) -> dict[str, Any]:
    return {"prompt_tokens": len(request.prompt), "completion_tokens": len(request.generated),
            "total_tokens": len(request.prompt) + len(request.generated)}
