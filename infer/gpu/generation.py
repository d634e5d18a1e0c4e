"""Generation on the device: decode steps queued back to back, each sampling its rows' next tokens
into their caches' histories and moving the rows on without the host (`sample_rows` with
`advance`), so only token ids come back. A mixin of GpuTransformer (infer/gpu/model.py): the loops
run the model's passes (`_run_layers`, `_run_head`) over rows laid out in its pass index. Generation
is not the layer recipe's job; the recipe does not know these loops exist."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import cupy
import numpy as np

from infer.arch import ModelArgs
from infer.gpu import ops
from infer.gpu.cache import GpuKVCache
from infer.gpu.passes import PassShape, Row, bucket_of, sequence_rows
from infer.layers import check_batch

if TYPE_CHECKING:
    from infer.gpu.passes import PassIndex


class DeviceGeneration:
    """queue_steps, draft_chain, generate(_iter) and decode_batch/decode_iter of a GpuTransformer."""

    args: ModelArgs
    capacity: int
    logits_rows: int
    logits: cupy.ndarray
    index: PassIndex
    passes: int
    stream: cupy.cuda.Stream

    def _run_layers(self) -> None: ...  # the model's (GpuTransformer)

    def _run_head(self, m: int, sample: bool = False, advance: bool = False) -> None: ...

    def forward(self, tokens: np.ndarray, cache: GpuKVCache, all_logits: bool = False,
                prompt: bool = False) -> np.ndarray: ...

    def prefill_batch(self, batch: Sequence[tuple[np.ndarray, GpuKVCache]]) -> None: ...

    def _decode_rows(self, rows: Sequence[Row], steps: int, each: Callable[[int], None] | None = None,
                     lead: Sequence[Row] = ()) -> None:
        """Queues `steps` decode steps of `rows` (each row's token at its position, history on):
        each step samples every row's next token into its cache's history and moves the row on.
        `lead`: rows of tokens fed before the rows' own (their sequences' earlier positions), in the
        first step's pass beside them (a pass of a few rows costs about one of one row), so they
        need no pass of their own."""
        if len(rows) > self.logits_rows:
            raise ValueError(f"{len(rows)} sequences decoded together exceed the {self.logits_rows} logits rows "
                             "planned (load with batch=...)")
        for row in rows:
            row.cache.wrote(row.slot + steps)
        carry = 0
        if lead and steps:  # the sampled rows first: after the step their next tokens sit in rows 0..len(rows)
            self._steps([*rows, *lead], len(rows), 1, each)
            if steps == 1:
                return
            # as sample_rows moves them: a row with a span of its own keeps its base
            rows = [replace(r, pos=r.pos + 1, slot=r.slot + 1, base=r.base + (r.anc is None)) for r in rows]
            steps, carry = steps - 1, len(rows)
            each = None if each is None else (lambda step, each=each: each(step + 1))
        self._steps(rows, len(rows), steps, each, carry)

    def _steps(self, rows: Sequence[Row], sampled: int, steps: int, each: Callable[[int], None] | None,
               carry: int = 0) -> None:
        """`steps` passes of `rows`, the first `sampled` of them sampled and moved on each time
        (`carry`: PassIndex.fill's)."""
        n = bucket_of(len(rows), self.capacity)
        self.index.fill([*rows, *[None] * (n - len(rows))], PassShape(n), range(sampled), carry)
        self.passes += 1
        for step in range(steps):
            self._run_layers()
            self._run_head(sampled, sample=True, advance=True)
            if each is not None:
                each(step)

    def queue_steps(self, cache: GpuKVCache, token: int, n: int, temperature: float = 0.0, seed: int = 0) -> None:
        """Queues n decode steps from `token` at position cache.length, each sampling the next token on
        the device (cache.tokens[p + 1] for the step at position p); nothing is waited for and
        cache.length is not advanced (the caller reads cache.tokens)."""
        p = cache.length
        with self.stream:
            self._decode_rows([Row(cache, int(token), p, p, p + 1, None, True, float(temperature), int(seed))], n)

    def draft_chain(self, tokens: np.ndarray, cache: GpuKVCache, depth: int, width: int) -> np.ndarray:
        """The draft side of speculation, queued on the device with one wait at the end: `tokens`
        fed at cache.length (all but the last in the first step's pass), then `depth` greedy decode steps, each
        picking its next token on the device. Returns (depth, width) ids: column 0 the chain, the
        others each step's runners-up (one sort of all steps' logits at the end). The cache then
        holds `tokens` and the chain's first depth - 1 tokens (cache.length counts them)."""
        return self.draft_chains([(tokens, cache)], depth, width)[0]

    def draft_chains(self, feeds: Sequence[tuple[np.ndarray, GpuKVCache]], depth: int, width: int) -> list[np.ndarray]:
        """draft_chain for several sequences of the draft at once (a server's requests): their
        tokens fed together, then `depth` decode steps of all of them, one wait at the end."""
        feeds = [(np.asarray(t, dtype=np.int64).reshape(-1), c) for t, c in feeds]
        if not feeds or any(len(t) == 0 for t, _ in feeds) or depth < 1 or width < 1:
            raise ValueError("draft_chain needs tokens, depth >= 1 and width >= 1")
        check_batch(feeds, self.args.vocab_size)
        for tokens, cache in feeds:
            if cache.length + len(tokens) + depth - 1 > cache.max_tokens:
                raise ValueError(f"context full: {cache.length} + {len(tokens)} + {depth - 1} exceed {cache.max_tokens}")
        m = len(feeds)
        lead = [row for t, c in feeds for row in sequence_rows(c, t[:-1], c.length)]
        if m + len(lead) > self.capacity:  # the fed tokens do not fit the first step's pass: a pass of their own
            self._passes([(t[:-1], c) for t, c in feeds if len(t) > 1], False, None, logits=False)  # type: ignore[attr-defined]
            feeds, lead = [(t[-1:], c) for t, c in feeds], []
        starts = [c.length + len(t) - 1 for t, c in feeds]  # positions of the last fed tokens; the chains follow them
        with self.stream:
            steps = top = None
            if width > 1 and m + depth * m <= self.logits_rows:  # each step's logits (step d, sequence i: row
                steps = self.logits[m : m + depth * m]               # d * m + i) in the head's spare rows, ranked after
            elif width > 1:  # no planned room for them (a copy of depth * m rows of the vocabulary would overrun
                top = cupy.empty((depth, m, width), cupy.int32)  # the budget): each step's few best ids as it comes

            def keep(d: int) -> None:
                if steps is not None:
                    steps[d * m : (d + 1) * m] = self.logits[:m]
                elif top is not None:  # the step's tokens are sampled: its rows may be overwritten
                    top[d] = ops.top_rows(self.logits[:m], m, width)

            rows = [Row(c, int(t[-1]), p, p, p + 1, None, True) for (t, c), p in zip(feeds, starts, strict=True)]
            self._decode_rows(rows, depth, keep, lead)
            chains = [c.tokens[p + 1 : p + 1 + depth] for (_, c), p in zip(feeds, starts, strict=True)]
            if steps is None and top is None:
                ids = [cupy.asnumpy(chain, stream=self.stream).astype(np.int64)[:, None] for chain in chains]
            else:
                if steps is not None:
                    top = ops.top_rows(steps, depth * m, width).reshape(depth, m, width)
                assert top is not None
                for i, chain in enumerate(chains):  # the chain as the device step chose it (ties: the same token)
                    top[:, i, 0] = chain
                host = cupy.asnumpy(top, stream=self.stream).astype(np.int64)
                ids = [host[:, i, :] for i in range(m)]
        self.stream.synchronize()
        for tokens, cache in feeds:
            cache.length += len(tokens) + depth - 1  # the fed tokens and the chain's first depth - 1
        return ids

    def draft_branches(self, cache: GpuKVCache, lead: Sequence[int], branches: Sequence[tuple[int, int]], steps: int,
                       width: int) -> BranchDraft:
        """The draft's side of drafting ahead (infer/draft_ahead.py), queued on the draft's stream
        with no wait: `lead` fed at cache.length (the sequence's next tokens; the cache counts them),
        then for each branch (token, position p: it sees the cache's positions before p) `steps`
        greedy decode steps in slots of its own past the sequence's, all branches in one pass a
        step (`lead` rides in the first). The handle's ranked() gives (branches, steps, width) ids:
        row t of a branch the draft's `width` likeliest tokens after its t-th token, column 0 the
        one the step chose. The sequence's slots past cache.length are left as they were."""
        n, start = len(branches), cache.length
        scratch = start + len(lead)  # the branches' slots: past the sequence's (a branch b, step t: scratch + b * steps + t)
        if not n or steps < 1 or width < 1 or scratch + n * steps > cache.max_tokens:
            raise ValueError(f"{n} branches of {steps} steps do not fit the cache after {scratch} tokens")
        if n > self.logits_rows or n + len(lead) > self.capacity:
            raise ValueError(f"{n} branches and {len(lead)} tokens exceed a pass of {self.capacity} rows")
        check_batch([(np.asarray([t for t, _ in branches], np.int64), cache)], self.args.vocab_size)
        with self.stream:
            chosen = cupy.empty(n * steps, cupy.int32)  # branch b's step t: [b * steps + t]
            ranked = cupy.empty((steps, n, width), cupy.int32) if width > 1 else None
            rows = []
            for b, (token, pos) in enumerate(branches):
                slots = np.arange(scratch + b * steps, scratch + (b + 1) * steps, dtype=np.int32)
                # sample_rows writes the step at position q to [q + 1]: branch b's row of `chosen`
                at = chosen.data.ptr + 4 * (b * steps - pos - 1)
                rows.append(Row(cache, int(token), int(pos), int(slots[0]), int(pos), slots, True, history_at=at))

            def keep(step: int) -> None:
                if ranked is not None:
                    ranked[step] = ops.top_rows(self.logits[:n], n, width)

            self._decode_rows(rows, steps, keep, sequence_rows(cache, lead, start))
            cache.length = scratch
            done = cupy.cuda.Event(disable_timing=True)
            done.record(self.stream)
        return BranchDraft(chosen.reshape(n, steps), ranked, done)

    def generate(self, prompt: np.ndarray, cache: GpuKVCache, n_new: int, temperature: float = 0.0, seed: int = 0,
                 stop: set[int] | frozenset[int] = frozenset(), check_every: int = 16,
                 on_tokens: Callable[[list[int]], None] | None = None) -> list[int]:
        """Prefill the prompt, then decode up to n_new tokens on the device; stops after a token in
        `stop`. The last sampled token is not yet in the cache (cache.length counts the tokens
        processed)."""
        out: list[int] = []
        for fresh in self.generate_iter(prompt, cache, n_new, temperature, seed, stop, check_every):
            out.extend(fresh)
            if on_tokens:
                on_tokens(fresh)
        return out

    def generate_iter(self, prompt: np.ndarray, cache: GpuKVCache, n_new: int, temperature: float = 0.0,
                      seed: int = 0, stop: set[int] | frozenset[int] = frozenset(),
                      check_every: int = 16) -> Iterator[list[int]]:
        """generate() as it goes: yields the new tokens in lists of up to `check_every` (the steps
        queued between two looks at the sampled ids). cache.length is final once exhausted."""
        prompt = np.asarray(prompt, dtype=np.int64).reshape(-1)
        if len(prompt) == 0:
            raise ValueError("generate needs at least one prompt token")
        out = self.decode_iter([prompt], [cache], n_new, temperature, seed, stop, check_every)
        for fresh in out:
            if fresh[0]:
                yield fresh[0]

    def decode_batch(self, prompts: Sequence[np.ndarray], caches: Sequence[GpuKVCache], n_new: int,
                     temperature: float = 0.0, seed: int = 0, stop: set[int] | frozenset[int] = frozenset(),
                     check_every: int = 16) -> list[list[int]]:
        """Each prompt (at its cache's next positions) prefilled, then up to n_new tokens of every
        sequence decoded together, one pass a step, sampled on the device; a sequence stops after a
        token in `stop`. Each sequence's tokens are those it gets alone (same seed)."""
        outs: list[list[int]] = [[] for _ in prompts]
        for fresh in self.decode_iter(prompts, caches, n_new, temperature, seed, stop, check_every):
            for s, toks in enumerate(fresh):
                outs[s].extend(toks)
        return outs

    def decode_iter(self, prompts: Sequence[np.ndarray], caches: Sequence[GpuKVCache], n_new: int,
                    temperature: float = 0.0, seed: int = 0, stop: set[int] | frozenset[int] = frozenset(),
                    check_every: int = 16) -> Iterator[list[list[int]]]:
        """decode_batch as it goes: per look at the device, each sequence's new tokens."""
        prompts = [np.asarray(p, dtype=np.int64).reshape(-1) for p in prompts]
        if any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs at least one prompt token")
        if len(prompts) > self.capacity:
            raise ValueError(f"{len(prompts)} sequences exceed the pass capacity of {self.capacity}")
        check_batch(list(zip(prompts, caches, strict=True)), self.args.vocab_size)
        if n_new <= 0:
            return
        for p, c in zip(prompts, caches, strict=True):
            if c.length + len(p) + n_new - 1 > c.max_tokens:
                raise ValueError(f"context full: {c.length} + {len(p)} + {n_new} tokens exceed {c.max_tokens}")
        heads = [(p[:-1], c) for p, c in zip(prompts, caches, strict=True) if len(p) > 1]
        if heads:  # prompt rows; each prompt's last token is its first decode step
            self.prefill_batch(heads)
        # per sequence: the token the next step processes, its position, tokens produced
        state = [[int(p[-1]), c.length, 0] for p, c in zip(prompts, caches, strict=True)]
        live = list(range(len(prompts)))
        while live:
            steps = min(check_every, *(n_new - state[s][2] for s in live))
            rows = [Row(caches[s], state[s][0], state[s][1], state[s][1], state[s][1] + 1, None, True,
                        float(temperature), int(seed)) for s in live]
            with self.stream:
                self._decode_rows(rows, steps)
                news = [cupy.asnumpy(caches[s].tokens[state[s][1] + 1 : state[s][1] + 1 + steps], stream=self.stream)
                        for s in live]
            self.stream.synchronize()
            fresh: list[list[int]] = [[] for _ in prompts]
            for s, new in zip(live, news, strict=True):
                toks = [int(t) for t in new]
                cut = next((j + 1 for j, t in enumerate(toks) if t in stop), None)
                if cut is not None:
                    toks = toks[:cut]
                fresh[s] = toks
                state[s][2] += len(toks)
                state[s][1] += len(toks)
                state[s][0] = toks[-1]
                caches[s].length = state[s][1]  # the tokens processed; the last sampled one is not
            live = [s for s in live if state[s][2] < n_new and not (fresh[s] and fresh[s][-1] in stop)]
            yield fresh


class BranchDraft:
    """draft_branches' results, on the device until asked for."""

    def __init__(self, chosen: cupy.ndarray, ranked: cupy.ndarray | None, done: cupy.cuda.Event) -> None:
        self.chosen, self._ranked, self.done = chosen, ranked, done

    def ranked(self) -> np.ndarray:
        """(branches, steps, width) int64 ids (waits for the draft's stream to get there)."""
        self.done.synchronize()
        chosen = cupy.asnumpy(self.chosen).astype(np.int64)
        if self._ranked is None:
            return chosen[:, :, None]
        out = cupy.asnumpy(self._ranked).astype(np.int64).transpose(1, 0, 2).copy()
        out[:, :, 0] = chosen  # the token each step chose (ties: the same one)
        return out
