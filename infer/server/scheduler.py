"""Continuous batching: one thread runs passes over the model, each serving every active request.

A request is admitted when a KV cache is free (the server plans `max_batch` caches of `ctx_size`
positions in the VRAM budget and makes them at start-up) and waits in a bounded queue otherwise.
Each pass takes one new token of every request that is decoding and a chunk of the prompt of every
request that is still prefilling (the prompt rows of a pass are about `prefill_chunk`, shared
evenly), so long prompts never stall the running streams. Finished and cancelled requests give
their cache back at once. Generated text goes to each request's asyncio queue from this thread
(`loop.call_soon_threadsafe`).

A cache given back keeps the prompt that ran in it (but its last token) as a prefix cache: a new
request takes the free cache whose tokens share the longest prefix with its prompt and runs only the
rest (a chat that resends its history, a shared system prompt), or else the one unused longest. On
the GPU and with --exact on the CPU a prompt row's keys and values do not depend on how the prompt
was split into passes (docs/GPU.md), so reuse changes no answer; the CPU's float32 sums do depend on
it, so there the cache is off unless asked for.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from infer.engine import Cache, DeviceArgmax, Model
from infer.sampler import NOTHING_LEFT, NonFiniteLogits, Sampler, log_probabilities
from infer.tokenizer import StreamDecoder, Tokenizer


class QueueFull(Exception):
    """Every slot is busy and the waiting queue is full (the server answers 503)."""


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
class Job:
    prompt: list[int]
    max_tokens: int
    sampler: Sampler
    stop_ids: frozenset[int]
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cache: Cache | None = None
    prompt_done: int = 0  # prompt tokens in the cache
    generated: list[int] = field(default_factory=list)
    text: str = ""  # decoded generated text
    sent: int = 0  # characters of `text` already sent
    finish_reason: str | None = None
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    decoder: StreamDecoder | None = None
    top_logprobs: int | None = None  # alternatives per token's log-probability; None: none asked
    logprobs: list[TokenLogprob] = field(default_factory=list)
    logprobs_sent: int = 0

    def push(self, event: Event) -> None:
        event.logprobs, self.logprobs_sent = self.logprobs[self.logprobs_sent :], len(self.logprobs)
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


@dataclass
class Stats:
    """Counters the /metrics endpoint reports."""

    requests_finished: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    passes: int = 0
    pass_seconds: float = 0.0
    last_batch_rows: int = 0
    last_batch_sequences: int = 0
    finish_reasons: collections.Counter = field(default_factory=collections.Counter)
    prefix_hits: int = 0  # admitted requests that reused a cached prefix
    prefix_tokens: int = 0  # prompt tokens they did not run again


class Scheduler:
    """Runs `model.forward_batch` passes for the submitted jobs on its own thread."""

    def __init__(self, model: Model, tokenizer: Tokenizer, ctx_size: int, max_batch: int, queue_size: int,
                 prefill_chunk: int = 512, on_pass: Callable[[float, int, int], None] | None = None,
                 on_error: Callable[[BaseException], None] | None = None, prefix_cache: bool | None = None,
                 on_admit: Callable[[int, int], None] | None = None) -> None:
        if max_batch < 1 or queue_size < 0:
            raise ValueError(f"max_batch must be >= 1 and queue_size >= 0, not {max_batch} and {queue_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.ctx_size = ctx_size
        self.max_batch = max_batch
        self.queue_size = queue_size
        self.prefill_chunk = prefill_chunk
        self.on_pass = on_pass
        self.on_error = on_error  # told once when a pass fails, after every waiting client got the error
        self.prefix_cache = split_invariant(model) if prefix_cache is None else prefix_cache
        self._device_argmax = isinstance(model, DeviceArgmax)  # greedy steps bring back choices, not logits
        self.on_admit = on_admit  # (prompt tokens reused from a cache, prompt tokens to run) per request
        self.free: list[Cache] = [model.new_cache(ctx_size) for _ in range(max_batch)]  # least recently used first
        self._holds: dict[int, list[int]] = {}  # id(cache) -> the tokens at its positions, for a free cache
        self.waiting: collections.deque[Job] = collections.deque()
        self.active: list[Job] = []
        self.stats = Stats()
        self._cond = threading.Condition()
        self._stopping = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)
        self._thread.start()

    # -- the request side (event loop thread) ----------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._cond:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if len(self.active) + len(self.waiting) >= self.max_batch + self.queue_size:
                raise QueueFull(f"all {self.max_batch} slots are busy and {len(self.waiting)} requests wait")
            job.decoder = StreamDecoder(self.tokenizer)
            self.waiting.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """The client went away: the job's slot is freed before the next pass."""
        with self._cond:
            job.cancelled = True
            self._cond.notify()

    @property
    def busy_slots(self) -> int:
        return len(self.active)

    @property
    def queued(self) -> int:
        return len(self.waiting)

    def close(self, drain_seconds: float = 0.0) -> None:
        """Stops admitting; waits up to `drain_seconds` for the jobs in flight, then stops the thread."""
        deadline = time.monotonic() + drain_seconds
        with self._cond:
            while (self.active or self.waiting) and time.monotonic() < deadline and self.error is None:
                self._cond.wait(0.05)
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=30)

    # -- the model side (scheduler thread) -------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._retire_cancelled()
                    self._admit()
                    while not self.active and not self._stopping:
                        self._cond.wait()
                        self._retire_cancelled()
                        self._admit()
                    if self._stopping:
                        break
                    jobs = list(self.active)
                self._step(jobs)
        except BaseException as err:  # the model failed: every waiting client gets the error
            self.error = err
            with self._cond:
                for job in [*self.active, *self.waiting]:
                    job.push(Event(error=f"{type(err).__name__}: {err}"))
                self.active, self.waiting = [], collections.deque()
                self._cond.notify_all()
            if self.on_error is not None:
                self.on_error(err)

    def _admit(self) -> None:
        while self.waiting and self.free:
            job = self.waiting.popleft()
            if job.cancelled:
                continue
            cache, shared = self._take_cache(job.prompt)
            cache.length = job.prompt_done = shared
            job.cache = cache
            self.stats.prefix_hits += shared > 0
            self.stats.prefix_tokens += shared
            if self.on_admit is not None:
                self.on_admit(shared, len(job.prompt) - shared)
            self.active.append(job)

    def _take_cache(self, prompt: list[int]) -> tuple[Cache, int]:
        """The free cache holding the longest prefix of `prompt` that it can rewind to (at most all
        but the prompt's last token, whose logits are needed), when that prefix is at least half of
        what the cache holds (llama-server's similarity rule: a short common opening, such as a chat
        template's, must not take the cache of another conversation); else an empty cache, else the
        least recently used one."""
        best, shared = None, 0
        if self.prefix_cache:
            for i, cache in enumerate(self.free):
                held = self._holds.get(id(cache), [])
                n = _common_prefix(held, prompt, len(prompt) - 1)
                if n > shared and 2 * n >= len(held) and cache.can_rewind(n):
                    best, shared = i, n
        if best is None:
            empty = [i for i, cache in enumerate(self.free) if not self._holds.get(id(cache))]
            best = empty[0] if empty else 0
        cache = self.free.pop(best)
        self._holds.pop(id(cache), None)
        return cache, shared

    def _retire_cancelled(self) -> None:
        for job in [j for j in self.active if j.cancelled]:
            self._release(job)
        self.waiting = collections.deque(j for j in self.waiting if not j.cancelled)

    def _release(self, job: Job) -> None:
        self.active.remove(job)
        if job.cache is not None:
            # only the positions that ran as prompt rows are kept for reuse: the prompt but its last
            # token. The last prompt token and the reply ran as decode rows, whose numbers a prompt
            # row does not reproduce on the GPU (8-bit against float16 products, docs/GPU.md), and a
            # later request that resends them runs them as prompt rows, as a server without the
            # cache would: so the answers are the same with and without it
            self._holds[id(job.cache)] = job.prompt[: min(job.cache.length, len(job.prompt) - 1)]
            self.free.append(job.cache)
            job.cache = None
        self._cond.notify_all()

    def _step(self, jobs: list[Job]) -> None:
        """One pass: a token of each decoding job, prompt chunks of the prefilling ones."""
        decoding = [j for j in jobs if j.prompt_done == len(j.prompt)]
        prefilling = [j for j in jobs if j.prompt_done < len(j.prompt)]
        share = max(1, (self.prefill_chunk - len(decoding)) // max(1, len(prefilling)))
        batch: list[tuple[np.ndarray, Cache]] = []
        prompt_rows: list[int] = []  # every prompt token but the prompt's last is a prompt row (docs/GPU.md)
        for j in decoding:
            batch.append((np.array([j.generated[-1]]), j.cache))  # type: ignore[arg-type]
            prompt_rows.append(0)
        for j in prefilling:
            chunk = j.prompt[j.prompt_done : j.prompt_done + share]
            batch.append((np.asarray(chunk), j.cache))  # type: ignore[arg-type]
            prompt_rows.append(len(chunk) - (j.prompt_done + len(chunk) == len(j.prompt)))
        began = time.perf_counter()
        # every choice greedy (biases allowed: ignore_eos is one) and no log-probability asked: only
        # the choices come back from the device
        ordered = [*decoding, *prefilling]
        greedy = self._device_argmax and all(
            j.sampler.biased_argmax_only and j.top_logprobs is None for j in ordered)
        picks: list[tuple[int, float] | None] = [None] * len(batch)
        logits: list[np.ndarray | None] = [None] * len(batch)
        if greedy:
            picks[:] = self.model.forward_batch_argmax(  # type: ignore[union-attr]
                batch, prompt_rows=prompt_rows, bias=[j.sampler.config.logit_bias for j in ordered])
        else:
            logits[:] = self.model.forward_batch(batch, prompt_rows=prompt_rows)
        seconds = time.perf_counter() - began
        rows = sum(len(t) for t, _ in batch)
        self.stats.passes += 1
        self.stats.pass_seconds += seconds
        self.stats.last_batch_rows, self.stats.last_batch_sequences = rows, len(batch)
        if self.on_pass:
            self.on_pass(seconds, rows, len(batch))
        for j in prefilling:
            j.prompt_done = min(len(j.prompt), j.prompt_done + share)
        with self._cond:
            for j, out, pick in zip(ordered, logits, picks, strict=True):
                if j.cancelled or j.prompt_done < len(j.prompt):
                    continue
                self._emit(j, out, pick)

    def _emit(self, job: Job, logits: np.ndarray | None, pick: tuple[int, float] | None = None) -> None:
        """Samples (or takes the device's greedy `pick`: id and value) and sends the job's next text."""
        try:
            if pick is None:
                token = job.sampler.sample(logits, job.prompt + job.generated)
            elif pick[1] == -np.inf:
                raise ValueError(NOTHING_LEFT)
            else:
                token = pick[0]
        except NonFiniteLogits:
            raise  # the model is broken: every request fails
        except ValueError as err:  # this request's own choice (its grammar, its biases) is impossible
            job.finish_reason = "error"
            job.push(Event(error=f"generation cannot go on: {err}", status=400))
            self._release(job)
            return
        if job.first_token is None:
            job.first_token = time.perf_counter()
        finish = None
        if token in job.stop_ids:
            finish = "stop"
        else:
            job.generated.append(token)
            job.text += job.decoder.push(token)  # type: ignore[union-attr]
            if job.top_logprobs is not None:
                logprob, top = log_probabilities(logits, token, job.top_logprobs)
                text = self.tokenizer.token_bytes
                job.logprobs.append(TokenLogprob(text(token), logprob, [(text(i), lp) for i, lp in top]))
            # the cache holds the prompt and all but the last generated token, which the next pass feeds
            if len(job.generated) >= job.max_tokens or len(job.prompt) + len(job.generated) > self.ctx_size:
                finish = "length"
            constraint = job.sampler.constraint
            if getattr(constraint, "finished", False):  # the grammar is complete: nothing may follow
                finish = "stop"
        cut = _stop_at(job.text, job.stop)
        if cut is not None:
            job.text, finish = job.text[:cut], "stop"
        elif finish is not None:
            job.text += job.decoder.flush()  # type: ignore[union-attr]
        # hold back what could still become a stop string
        hold = 0 if finish else max((len(s) - 1 for s in job.stop), default=0)
        upto = max(job.sent, len(job.text) - hold)
        piece, job.sent = job.text[job.sent : upto], upto
        if finish is None:
            if piece:
                job.push(Event(piece))
            return
        job.finish_reason = finish
        job.push(Event(piece, finish))
        self.stats.requests_finished += 1
        self.stats.prompt_tokens += len(job.prompt)
        self.stats.generated_tokens += len(job.generated)
        self.stats.finish_reasons[finish] += 1
        self._release(job)


def split_invariant(model: Model) -> bool:
    """Whether a prompt row's numbers do not depend on how the prompt was split into passes: on the
    GPU, and on the CPU with exact (float64) sums; not with the CPU's float32 BLAS products."""
    return model.device == "gpu" or bool(getattr(model, "exact", False))


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens a and b share, at most `limit`."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if n >= limit or x != y:
            break
        n += 1
    return n


def _stop_at(text: str, stops: list[str]) -> int | None:
    """Where the first stop string starts in `text`, or None."""
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(found) if found else None


def describe(job: Job) -> dict[str, Any]:
    return {"prompt_tokens": len(job.prompt), "completion_tokens": len(job.generated),
            "total_tokens": len(job.prompt) + len(job.generated)}
