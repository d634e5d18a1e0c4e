"""The generation loop: requests share forward passes over one model.

Every generation that runs many sequences is a `Request` to a `Scheduler`: the server's clients
(infer/server/scheduler.py runs it on a thread) and `--batch`/`--prompts` (infer/streaming.py runs
it to the end). A step is one pass: one new token of every request that is decoding, a drafted tree
of every speculative one (infer.spec_serve: one pass verifies all their trees) and a chunk of the
prompt of every request still prefilling (about `prefill_chunk` prompt rows a pass, shared
evenly), so a long prompt never stalls the running sequences. A request holds one of `slots` KV
caches of `ctx_size` positions, made once (the memory plans count them); the rest wait. A cache
given back keeps its prompt's prefix for a later request (infer.cache_pool).

    scheduler = Scheduler(model, ctx_size=2048, slots=4)
    requests = [Request(prompt, max_tokens=32, sampler=as_sampler(greedy)) for prompt in prompts]
    scheduler.run(requests)           # or submit() and step() from a serving thread
    outputs = [r.generated for r in requests]
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from infer.cache_pool import CachePool, common_prefix, split_invariant
from infer.engine import Cache, DeviceArgmax, DeviceGreedy, Model
from infer.request import Event, Request, TokenLogprob, as_sampler, greedy_bias, stop_at
from infer.sampler import NOTHING_LEFT, NonFiniteLogits, log_probabilities
from infer.spec_serve import can_speculate, draft_together
from infer.speculative import Speculator, Tree
from infer.tokenizer import StreamDecoder, Tokenizer

__all__ = ["Event", "Request", "Scheduler", "Stats", "TokenLogprob", "as_sampler", "common_prefix", "split_invariant"]


@dataclass
class Stats:
    """Counters the server's /metrics reports and the offline batch's summary reads."""

    requests_finished: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    passes: int = 0
    pass_seconds: float = 0.0
    prompt_passes: int = 0  # passes that held prompt rows
    prompt_pass_seconds: float = 0.0
    last_batch_rows: int = 0
    last_batch_sequences: int = 0
    finish_reasons: collections.Counter = field(default_factory=collections.Counter)
    prefix_hits: int = 0  # admitted requests that reused a cached prefix
    prefix_tokens: int = 0  # prompt tokens they did not run again
    draft_tokens: int = 0  # tree nodes drafted for speculative requests (roots not counted)
    accepted_tokens: int = 0  # of those, the ones the target kept


class Scheduler:
    """Runs passes of `model.forward_batch` for the submitted requests. `lock`: a Condition the
    serving thread shares with the request side (submit and cancel come from another thread); it is
    held while lists change and notified when a cache is given back."""

    def __init__(self, model: Model, ctx_size: int, slots: int, tokenizer: Tokenizer | None = None,
                 prefill_chunk: int = 512, prefix_cache: bool | None = None,
                 on_pass: Callable[[float, int, int], None] | None = None,
                 on_admit: Callable[[int, int], None] | None = None,
                 lock: threading.Condition | None = None, caches: Sequence[Cache] | None = None,
                 device_runs: bool = True, speculation: Callable[[Cache], Speculator] | None = None) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, not {slots}")
        if ctx_size <= 0:
            raise ValueError(f"context size must be positive, not {ctx_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.ctx_size = ctx_size
        self.slots = slots
        self.prefill_chunk = prefill_chunk
        self.on_pass = on_pass
        self.on_admit = on_admit  # (prompt tokens reused from a cache, prompt tokens to run) per request
        # the speculator of a cache (infer.spec_serve.DraftPool): requests that can speculate do there
        self.speculation = speculation
        self._lock = lock
        self._guard = lock if lock is not None else contextlib.nullcontext()
        self._device_argmax = isinstance(model, DeviceArgmax)  # greedy steps bring back choices, not logits
        # a lone greedy request decodes on the device, its ids coming back 16 at a time
        self._device_greedy = device_runs and isinstance(model, DeviceGreedy)
        if caches is not None and len(caches) != slots:
            raise ValueError(f"{len(caches)} caches for {slots} slots")
        # `caches`: the caller's (planned in its budget)
        self.pool = CachePool(caches if caches is not None else [model.new_cache(ctx_size) for _ in range(slots)],
                              split_invariant(model) if prefix_cache is None else prefix_cache)
        self.waiting: collections.deque[Request] = collections.deque()
        self.active: list[Request] = []
        self.stats = Stats()

    # -- requests in ---------------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        """Queue a request (the caller holds the lock when there is one)."""
        self._check(request)
        self.waiting.append(request)

    def _check(self, request: Request) -> None:
        if not request.prompt:
            raise ValueError("a prompt has no tokens")
        if len(request.prompt) > self.ctx_size:
            raise ValueError(f"a prompt of {len(request.prompt)} tokens exceeds the context size {self.ctx_size} "
                             "(raise -c)")
        if self.tokenizer is not None:
            request.decoder = StreamDecoder(self.tokenizer, special=request.special_text)

    def run(self, requests: Sequence[Request]) -> None:
        """Submit `requests` and step until every request in the scheduler has finished."""
        for request in requests:
            self.submit(request)
        while self.step():
            pass

    def run_one(self, request: Request, shared: int = 0) -> Iterator[int]:
        """One request on an idle scheduler, in its least recently used cache, whose first `shared`
        positions the caller knows to hold the prompt's (its own prefix reuse: a chat's turns).
        Yields every chosen id as it comes (a stop id too); closing the iterator cancels it."""
        if not self.idle:
            raise RuntimeError("run_one needs an idle scheduler")
        self._check(request)
        cache = self.pool.oldest()
        self._place(request, cache, shared if 0 <= shared < len(request.prompt) and cache.can_rewind(shared) else 0)
        chosen: list[int] = []
        told = request.on_token

        def hear(token: int) -> None:
            chosen.append(token)
            if told is not None:
                told(token)

        request.on_token = hear
        try:
            while request.cache is not None and self.step():
                yield from chosen
                chosen.clear()
            yield from chosen
        finally:
            if request.cache is not None:  # the caller stopped early
                request.cancelled = True
                self.retire_cancelled()

    @property
    def free(self) -> list[Cache]:
        """The free caches, least recently used first."""
        return self.pool.free

    @property
    def prefix_cache(self) -> bool:
        return self.pool.prefix_cache

    @property
    def idle(self) -> bool:
        return not self.active and not self.waiting

    # -- one pass ------------------------------------------------------------------------------
    def step(self) -> bool:
        """Admit what fits, run one pass over the active requests and emit what it chose. False when
        there was nothing to run."""
        with self._guard:
            self.retire_cancelled()
            self.admit()
            requests = list(self.active)
        if not requests:
            return False
        solo = self._solo(requests)
        if solo is not None:
            self._device_run(solo)
            return True
        self._pass(requests)
        return True

    def admit(self) -> None:
        while self.waiting and self.pool:
            request = self.waiting.popleft()
            if request.cancelled:
                continue
            cache, shared = self.pool.take(request.prompt)
            self.stats.prefix_hits += shared > 0
            self.stats.prefix_tokens += shared
            if self.on_admit is not None:
                self.on_admit(shared, len(request.prompt) - shared)
            self._place(request, cache, shared)

    def _place(self, request: Request, cache: Cache, shared: int) -> None:
        """`request` becomes active in `cache`, whose first `shared` positions hold its prompt's."""
        cache.length = request.prompt_done = shared
        request.cache = cache
        if self.speculation is not None and request.speculator is None and can_speculate(request):
            request.speculator = self.speculation(cache)
        self.active.append(request)

    def retire_cancelled(self) -> None:
        for request in [r for r in self.active if r.cancelled]:
            self._release(request)
        self.waiting = collections.deque(r for r in self.waiting if not r.cancelled)

    def _release(self, request: Request) -> None:
        self.active.remove(request)
        if request.cache is not None:
            self.pool.give_back(request.cache, request.prompt)
            request.cache = None
        if self._lock is not None:
            self._lock.notify_all()

    def _pass(self, requests: list[Request]) -> None:
        """A token of each decoding request, a drafted tree of each speculative one, prompt chunks of
        the prefilling ones: one pass."""
        # a speculative request runs its prompt but the last token as prompt rows; the last token is
        # its first tree's root
        head = {id(r): len(r.prompt) - (r.speculator is not None) for r in requests}
        drafting = [r for r in requests if r.speculator is not None and r.prompt_done >= head[id(r)]]
        decoding = [r for r in requests if r.speculator is None and r.prompt_done == len(r.prompt)]
        prefilling = [r for r in requests if r.prompt_done < head[id(r)]]
        # what each speculative request's cache holds: its tree's context, for drafting and the walk
        contexts = [(r.prompt + r.generated)[: r.cache.length] for r in drafting]  # type: ignore[union-attr]
        trees = self._draft(drafting, contexts, len(decoding) + len(prefilling), bool(prefilling))
        nodes = sum(len(tree.tokens) for tree, _ in trees)
        share = max(1, (self.prefill_chunk - len(decoding) - nodes) // max(1, len(prefilling)))
        room = getattr(self.model, "prompt_room", None)
        if trees and room is not None and prefilling:  # one pass holds it all (the GPU's capacity)
            share = min(share, room(len(decoding) + nodes + len(prefilling)) // len(prefilling))
            if share == 0:  # no room beside the trees: the prompts wait for the next pass
                prefilling, share = [], 1
        batch: list[tuple[np.ndarray, Cache]] = []
        prompt_rows: list[int] = []  # every prompt token but the prompt's last is a prompt row (docs/GPU.md)
        for r in decoding:
            batch.append((np.array([r.generated[-1]]), r.cache))  # type: ignore[arg-type]
            prompt_rows.append(0)
        for r in prefilling:
            chunk = r.prompt[r.prompt_done : min(head[id(r)], r.prompt_done + share)]
            batch.append((np.asarray(chunk), r.cache))  # type: ignore[arg-type]
            prompt_rows.append(len(chunk) - (r.prompt_done + len(chunk) == len(r.prompt)))
        for r, (tree, _) in zip(drafting, trees, strict=True):
            batch.append((np.asarray(tree.tokens), r.cache))  # type: ignore[arg-type]
            prompt_rows.append(0)
        began = time.perf_counter()
        ordered = [*decoding, *prefilling]
        # every choice greedy (biases allowed: ignore_eos is one) and no log-probability asked: only
        # the choices come back from the device
        biases = [greedy_bias(r) for r in ordered] if self._device_argmax and not trees else [None]
        picks: list[tuple[int, float] | None] = [None] * len(ordered)
        logits: list[Any] = [None] * len(ordered)
        if all(b is not None for b in biases):
            picks[:] = self.model.forward_batch_argmax(batch, prompt_rows=prompt_rows,  # type: ignore[attr-defined]
                                                       bias=biases)
        elif trees:
            out = self.model.forward_batch(batch, prompt_rows=prompt_rows,  # type: ignore[call-arg]
                                           trees=[None] * len(ordered) + [np.asarray(t.parents) for t, _ in trees])
            logits[:], scored = out[: len(ordered)], out[len(ordered) :]
        else:
            logits[:] = self.model.forward_batch(batch, prompt_rows=prompt_rows)
        seconds = time.perf_counter() - began
        rows = sum(len(t) for t, _ in batch)
        self._count(seconds, rows, len(batch), prompt=bool(prefilling))
        self.stats.last_batch_rows, self.stats.last_batch_sequences = rows, len(batch)
        for r in prefilling:
            r.prompt_done = min(head[id(r)], r.prompt_done + share)
        settled = [self._settle(r, context, tree, draft_s, nodes_logits, seconds) for r, context, (tree, draft_s),
                   nodes_logits in zip(drafting, contexts, trees, scored if trees else [], strict=True)]
        with self._guard:
            for r, out, pick in zip(ordered, logits, picks, strict=True):
                if r.cancelled or r.prompt_done < len(r.prompt):
                    continue
                self._emit(r, out, pick)
            for r, tokens in zip(drafting, settled, strict=True):
                for token in tokens:
                    if r.cache is None or r.cancelled:
                        break
                    self._emit(r, None, (token, 0.0))

    def _draft(self, requests: list[Request], contexts: list[list[int]], others: int,
               prompts: bool) -> list[tuple[Tree, float]]:
        """The trees of the speculative requests' next steps (with each one's drafting seconds), each
        within its share of what the model's pass holds beside `others` sequences (at most half of
        it when `prompts` are prefilling: their chunks need room too)."""
        if not requests:
            return []
        capacity = getattr(self.model, "capacity", None)
        if capacity:
            limit = max(1, ((capacity // 2 if prompts else capacity) - others) // len(requests))
        else:
            limit = 1 << 30
        steps = []
        for r, context in zip(requests, contexts, strict=True):
            root = r.prompt[-1] if r.prompt_done < len(r.prompt) else r.generated[-1]
            steps.append((r.speculator, context, root, r.cache, r.max_tokens - len(r.generated), limit))
        return draft_together(steps)  # type: ignore[arg-type]

    def _settle(self, request: Request, context: list[int], tree: Tree, draft_s: float, logits: Any,
                seconds: float) -> list[int]:
        """A verified tree over `context` (what the request's cache held): the cache keeps the path
        the target accepts; the path's tokens and the target's next choice are the next tokens."""
        request.prompt_done = len(request.prompt)
        try:
            tokens = request.speculator.settle(tree, logits, request.cache, request.sampler.sample, context,
                                               draft_s, seconds)
        except NonFiniteLogits:
            raise  # the model is broken: every request fails
        except ValueError as err:  # this request's own choice (its biases) is impossible
            with self._guard:
                self._refuse(request, err)
            return []
        self.stats.draft_tokens += len(tree.tokens) - 1
        self.stats.accepted_tokens += len(tokens) - 1
        return tokens

    def _solo(self, requests: list[Request]) -> Request | None:
        """The request that may decode on the device (CUDA-graph steps, only ids come back): alone,
        nobody waiting, a plain arg-max (no bias, penalty or grammar), no log-probabilities."""
        if not self._device_greedy or len(requests) != 1 or self.waiting:
            return None
        request = requests[0]
        if request.top_logprobs is not None or request.speculator is not None \
                or not getattr(request.sampler, "argmax_only", False):
            return None
        return request

    def _device_run(self, request: Request) -> None:
        """A lone greedy request: its prompt but the last token as prompt rows (a chunk a step), then
        the device decodes from the last prompt token (or the last generated one) until the request
        ends or another arrives. These are the calls the single-sequence GPU path always made."""
        head = len(request.prompt) - 1
        began = time.perf_counter()
        if request.prompt_done < head:
            chunk = request.prompt[request.prompt_done : min(head, request.prompt_done + self.prefill_chunk)]
            self.model.prefill(np.asarray(chunk), request.cache)  # type: ignore[arg-type]
            request.prompt_done += len(chunk)
            self._count(time.perf_counter() - began, len(chunk), 1, prompt=True)
            return
        feed = request.prompt[-1:] if request.prompt_done == head else request.generated[-1:]
        request.prompt_done = len(request.prompt)
        room = self.ctx_size - len(request.prompt) + 1 - len(request.generated)
        steps = self.model.generate_iter(np.asarray(feed), request.cache,  # type: ignore[attr-defined]
                                         min(request.max_tokens - len(request.generated), room),
                                         stop=request.stop_ids)
        try:
            for fresh in steps:
                seconds, began = time.perf_counter() - began, time.perf_counter()
                self._count(seconds, len(fresh), 1, passes=len(fresh))
                with self._guard:
                    for token in fresh:
                        if request.cache is None or request.cancelled:
                            break
                        self._emit(request, None, (token, 0.0))
                if request.cache is None or request.cancelled or self.waiting:
                    break
        finally:
            steps.close()  # the cache holds what the device ran (decode_iter keeps its length current)

    def _count(self, seconds: float, rows: int, sequences: int, prompt: bool = False, passes: int = 1) -> None:
        """A pass (or `passes` device steps) of `seconds` over `rows` rows of `sequences` sequences;
        `prompt`: it held prompt rows."""
        self.stats.passes += passes
        self.stats.pass_seconds += seconds
        if prompt:
            self.stats.prompt_passes += passes
            self.stats.prompt_pass_seconds += seconds
        if self.on_pass:
            self.on_pass(seconds, rows, sequences)

    def fail_all(self, message: str) -> None:
        """The model failed: every request in flight or waiting gets the error (caller holds the lock)."""
        for request in [*self.active, *self.waiting]:
            request.push(Event(error=message))
        self.active, self.waiting = [], collections.deque()
        if self._lock is not None:
            self._lock.notify_all()

    def _refuse(self, request: Request, err: ValueError) -> None:
        request.finish_reason, request.error = "error", f"generation cannot go on: {err}"
        request.push(Event(error=request.error, status=400))
        self._release(request)

    def _emit(self, request: Request, logits: np.ndarray | None, pick: tuple[int, float] | None = None) -> None:
        """Samples (or takes the device's greedy `pick`: id and value) and sends the request's next text."""
        try:
            if pick is None:
                token = int(request.sampler.sample(logits, request.prompt + request.generated))  # type: ignore[arg-type]
            elif pick[1] == -np.inf:
                raise ValueError(NOTHING_LEFT)
            else:
                token = pick[0]
        except NonFiniteLogits:
            raise  # the model is broken: every request fails
        except ValueError as err:  # this request's own choice (its grammar, its biases) is impossible
            self._refuse(request, err)
            return
        if request.first_token is None:
            request.first_token = time.perf_counter()
        if request.on_token is not None:
            request.on_token(token)
        finish = None
        decoder = request.decoder
        if token in request.stop_ids:
            finish = "stop"
        else:
            request.generated.append(token)
            if decoder is not None:
                request.text += decoder.push(token)
            if request.top_logprobs is not None:
                logprob, top = log_probabilities(logits, token, request.top_logprobs)
                text = self.tokenizer.token_bytes  # type: ignore[union-attr]
                request.logprobs.append(TokenLogprob(text(token), logprob, [(text(i), lp) for i, lp in top]))
            # the cache holds the prompt and all but the last generated token, which the next pass feeds
            if len(request.generated) >= request.max_tokens or len(request.prompt) + len(request.generated) > self.ctx_size:
                finish = "length"
            if getattr(getattr(request.sampler, "constraint", None), "finished", False):
                finish = "stop"  # the grammar is complete: nothing may follow
        cut = stop_at(request.text, request.stop)
        if cut is not None:
            request.text, finish = request.text[:cut], "stop"
        elif finish is not None and decoder is not None:
            request.text += decoder.flush()
        # hold back what could still become a stop string
        hold = 0 if finish else max((len(s) - 1 for s in request.stop), default=0)
        upto = max(request.sent, len(request.text) - hold)
        piece, request.sent = request.text[request.sent : upto], upto
        if finish is None:
            if piece:
                request.push(Event(piece))
            return
        request.finish_reason = finish
        request.push(Event(piece, finish))
        self.stats.requests_finished += 1
        self.stats.prompt_tokens += len(request.prompt)
        self.stats.generated_tokens += len(request.generated)
        self.stats.finish_reasons[finish] += 1
        self._release(request)

