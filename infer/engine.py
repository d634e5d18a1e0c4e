"""Running a Transformer over one sequence: batched prefill, one-token decode, and generation.

The engine owns the KV cache and the token ids it holds, so a follow-up prompt that extends what
was already processed (the next turn of a chat) only pays for its new tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from infer.arch import ModelArgs
from infer.layers import Cache


class Model(Protocol):
    """A forward pass over a KV cache: infer.model.Transformer (CPU) and infer.gpu.model.GpuTransformer
    (GPU), over resident or streamed weights."""

    args: ModelArgs
    device: str  # "cpu" or "gpu"

    def new_cache(self, max_tokens: int) -> Cache: ...

    def forward(self, tokens: np.ndarray, cache: Cache, all_logits: bool = False, prompt: bool = False
                ) -> np.ndarray: ...

    def prefill(self, tokens: np.ndarray, cache: Cache) -> None:
        """Appends prompt tokens whose logits nobody reads (the GPU runs them as prompt rows)."""

    def forward_batch(self, batch: Sequence[tuple[np.ndarray, Cache]], all_logits: bool = False,
                      prompt_rows: Sequence[int] | None = None) -> list[np.ndarray]: ...


@runtime_checkable
class DeviceGreedy(Protocol):
    """A model that decodes greedily on its own device (the GPU: CUDA-graph steps, only token ids
    come back to the host)."""

    def generate_iter(self, prompt: np.ndarray, cache: Cache, n_new: int, temperature: float = 0.0,
                      seed: int = 0, stop: frozenset[int] = frozenset(), check_every: int = 16
                      ) -> Iterator[list[int]]: ...


@runtime_checkable
class DeviceArgmax(Protocol):
    """A model that finds greedy choices where its logits are (the GPU: a server step brings back
    token ids, not rows of logits)."""

    def forward_batch_argmax(self, batch: Sequence[tuple[np.ndarray, Cache]],
                             prompt_rows: Sequence[int] | None = None,
                             bias: Sequence[Sequence[tuple[int, float]]] | None = None) -> list[tuple[int, float]]:
        """Per sequence (id, value) of the arg-max of its last logits plus its bias (-inf: none left)."""


# Prompt tokens per forward pass: bounds the attention score buffer (heads x batch x context).
PREFILL_BATCH = 512


@dataclass
class Throughput:
    """Token counts and wall-clock seconds of a prefill and a decode phase, and their rates."""

    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    generated_tokens: int = 0
    decode_seconds: float = 0.0

    @property
    def prompt_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0


@dataclass
class GenerationStats(Throughput):
    """Counts and timings of the last prefill and decode phases of one sequence."""

    stop_reason: str = ""  # "eog" (end-of-generation token), "length" or "context"

    def as_dict(self) -> dict[str, float | int | str]:
        return {
            "prompt_tokens": self.prompt_tokens, "prompt_seconds": round(self.prompt_seconds, 4),
            "prompt_tokens_per_second": round(self.prompt_tokens_per_second, 2),
            "generated_tokens": self.generated_tokens, "decode_seconds": round(self.decode_seconds, 4),
            "decode_tokens_per_second": round(self.decode_tokens_per_second, 2),
            "stop_reason": self.stop_reason,
        }


@dataclass
class Engine:
    """One sequence on one Transformer with a context of `ctx_size` tokens."""

    model: Model
    ctx_size: int
    prefill_batch: int = PREFILL_BATCH
    tokens: list[int] = field(default_factory=list)  # ids whose keys/values are in the cache
    stats: GenerationStats = field(default_factory=GenerationStats)

    def __post_init__(self) -> None:
        if self.ctx_size <= 0:
            raise ValueError(f"context size must be positive, not {self.ctx_size}")
        self.cache = self.model.new_cache(self.ctx_size)

    def reset(self) -> None:
        self.tokens = []
        self.cache.length = 0

    def _check_room(self, n_new: int) -> None:
        if len(self.tokens) + n_new > self.ctx_size:
            raise ContextFullError(
                f"{len(self.tokens)} cached + {n_new} new tokens exceed the context size {self.ctx_size} "
                "(raise -c/--ctx-size)")

    def evaluate(self, tokens: Sequence[int], all_logits: bool = False, prompt: bool = False) -> np.ndarray:
        """Appends `tokens` to the sequence (in batches of `prefill_batch`); returns the logits of
        the last one, or of every one (T, vocab) with all_logits. prompt: only the last one's
        logits are wanted, the others are prompt rows (docs/GPU.md)."""
        if not tokens:
            raise ValueError("no tokens to evaluate")
        self._check_room(len(tokens))
        if prompt and not all_logits:  # the chunks before the last as prompt rows, then the last chunk
            last = (len(tokens) - 1) // self.prefill_batch * self.prefill_batch
            self.append_prompt(tokens[:last])
            logits = self.model.forward(np.asarray(tokens[last:]), self.cache, prompt=True)
            self.tokens.extend(tokens[last:])
            return logits
        outputs = []
        for start in range(0, len(tokens), self.prefill_batch):
            chunk = list(tokens[start : start + self.prefill_batch])
            outputs.append(self.model.forward(np.asarray(chunk), self.cache, all_logits=all_logits))
            self.tokens.extend(chunk)
        return np.concatenate(outputs) if all_logits else outputs[-1]

    def append_prompt(self, tokens: Sequence[int]) -> None:
        """Appends prompt tokens whose logits nobody reads (prompt rows)."""
        if not tokens:
            return
        self._check_room(len(tokens))
        for start in range(0, len(tokens), self.prefill_batch):
            chunk = list(tokens[start : start + self.prefill_batch])
            self.model.prefill(np.asarray(chunk), self.cache)
            self.tokens.extend(chunk)

    def prefill(self, prompt: Sequence[int], logits: bool = True) -> np.ndarray | None:
        """Makes the sequence equal `prompt`, reusing the cached prefix they share; returns the
        logits after the last prompt token (None without `logits`: every token then runs as a
        prompt row, the last too, for a caller that runs the next token itself)."""
        if not prompt:
            raise ValueError("the prompt has no tokens")
        shared = 0
        for a, b in zip(self.tokens, prompt, strict=False):
            if a != b:
                break
            shared += 1
        if logits:
            shared = min(shared, len(prompt) - 1)  # the last prompt token is always run: its logits are needed
        if not self.cache.can_rewind(shared):  # a local layer's ring moved past the prefix's window
            shared = 0
        del self.tokens[shared:]
        self.cache.length = shared
        started = time.perf_counter()
        out = self.evaluate(prompt[shared:], prompt=True) if logits else self.append_prompt(prompt[shared:])
        self.stats.prompt_tokens = len(prompt) - shared
        self.stats.prompt_seconds = time.perf_counter() - started
        return out

    def decode_one(self, token: int) -> np.ndarray:
        """Appends one token; returns the logits for the next position."""
        return self.evaluate([token])

    def generate(self, prompt: Sequence[int], max_new_tokens: int,
                 choose: Callable[[np.ndarray, list[int]], int],
                 is_end: Callable[[int], bool] = lambda _: False) -> Iterator[int]:
        """Yields up to `max_new_tokens` ids, each picked by choose(logits, history so far). Stops
        after an id for which is_end() holds (that id is yielded too) or when the context is full."""
        self.stats = GenerationStats()
        logits = self.prefill(prompt)
        decode_started = time.perf_counter()
        self.stats.stop_reason = "length"
        for produced in range(max_new_tokens):
            token = int(choose(logits, self.tokens))
            self.stats.generated_tokens = produced + 1
            self.stats.decode_seconds = time.perf_counter() - decode_started
            yield token
            if is_end(token):
                self.stats.stop_reason = "eog"  # the end token itself is never evaluated
                return
            if produced + 1 == max_new_tokens:
                break
            if len(self.tokens) + 1 > self.ctx_size:
                self.stats.stop_reason = "context"
                return
            logits = self.decode_one(token)
        self.stats.decode_seconds = time.perf_counter() - decode_started


class ContextFullError(ValueError):
    """The sequence would grow past the context size."""


class ArgmaxChooser:
    """The greedy Chooser: the largest logit, ties to the lowest id. `argmax_only` tells
    infer.speculative.follow that it may read the choices from a verified tree's `row_argmax`
    (GPU: one kernel for all nodes, the decode step's rule) instead of copying each row it visits."""

    argmax_only = True

    def __call__(self, logits: np.ndarray, _history: Sequence[int]) -> int:
        return int(np.argmax(logits))


greedy = ArgmaxChooser()
