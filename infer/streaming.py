"""The streaming engine: one forward pass serves every token in flight.

A pass fetches each layer's weights once (from wherever the placement plan put them) and applies
them to all rows at once: the whole prompt chunk of every sequence in prefill, one new token of
every live sequence in decode. Attention runs per sequence over its own KV cache; the matrix
products of the layer run over the rows of all sequences together. So the bytes a pass streams are
paid once per step of the whole batch, which is where streaming wins (ANCHORS.md).

    engine = StreamingEngine(transformer, ctx_size=2048)
    outputs = engine.generate([prompt_a, prompt_b], max_new_tokens=32, choose=greedy)

Works with any model (infer.engine.Model): the CPU Transformer or the GPU one, over resident or
streamed weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from infer.engine import Cache, Model, Throughput

PREFILL_CHUNK = 512  # prompt rows per pass, shared by the sequences still in their prompt
Chooser = Callable[[np.ndarray, list[int]], int]


@dataclass
class BatchStats(Throughput):
    """Passes, tokens and seconds of the last generate(); bytes each tier moved."""

    sequences: int = 0
    prefill_passes: int = 0
    decode_passes: int = 0
    bytes_moved: dict[str, int] = field(default_factory=dict)  # per tier label, whole run


class StreamingEngine:
    """Many sequences on one model; every pass serves all of them."""

    def __init__(self, model: Model, ctx_size: int, prefill_chunk: int = PREFILL_CHUNK,
                 bytes_moved: Callable[[], dict[str, int]] | None = None) -> None:
        if ctx_size <= 0:
            raise ValueError(f"context size must be positive, not {ctx_size}")
        self.model = model
        self.ctx_size = ctx_size
        self.prefill_chunk = prefill_chunk
        self._bytes_moved = bytes_moved
        self.stats = BatchStats()

    def _pass(self, batch: list[tuple[np.ndarray, Cache]], prompt_rows: list[int] | None = None) -> list[np.ndarray]:
        return self.model.forward_batch(batch, prompt_rows=prompt_rows)

    def prefill(self, prompts: Sequence[Sequence[int]]) -> tuple[list[Cache], list[np.ndarray]]:
        """New caches holding each prompt; the logits after each prompt's last token. The prompts
        share passes: each pass takes about `prefill_chunk` rows, split evenly between the
        sequences whose prompt is not finished (it bounds the activations a pass needs)."""
        for p in prompts:
            if not p:
                raise ValueError("a prompt has no tokens")
            if len(p) > self.ctx_size:
                raise ValueError(f"a prompt of {len(p)} tokens exceeds the context size {self.ctx_size} (raise -c)")
        caches = [self.model.new_cache(self.ctx_size) for _ in prompts]
        last: list[np.ndarray | None] = [None] * len(prompts)
        started = time.perf_counter()
        done = [0] * len(prompts)  # prompt tokens already in each cache
        while True:
            live = [s for s, p in enumerate(prompts) if done[s] < len(p)]
            if not live:
                break
            share = max(1, self.prefill_chunk // len(live))  # a pass holds about prefill_chunk rows
            batch = [(np.asarray(prompts[s][done[s]:done[s] + share]), caches[s]) for s in live]
            # every prompt token but each prompt's last is a prompt row (docs/GPU.md)
            prompt_rows = [len(t) - (done[s] + len(t) == len(prompts[s])) for (t, _), s in zip(batch, live, strict=True)]
            for s, logits in zip(live, self._pass(batch, prompt_rows), strict=True):
                last[s] = logits
                done[s] = min(len(prompts[s]), done[s] + share)
            self.stats.prefill_passes += 1
        self.stats.prompt_tokens += sum(len(p) for p in prompts)
        self.stats.prompt_seconds += time.perf_counter() - started
        return caches, last  # type: ignore[return-value]

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 choose: Chooser | Sequence[Chooser],
                 is_end: Callable[[int], bool] = lambda _: False,
                 on_token: Callable[[int, int], None] | None = None) -> list[list[int]]:
        """Up to `max_new_tokens` new ids per prompt (an end id is kept and stops its sequence;
        a full context stops it too). One decode pass per step serves every live sequence.
        `choose(logits, history)` picks the next id: one function for all, or one per sequence
        (samplers with their own random state). on_token(sequence, id) hears of each id as soon
        as it is chosen (a streamed pass can take seconds: the CLI prints it then)."""
        choosers = list(choose) if isinstance(choose, Sequence) else [choose] * len(prompts)
        if len(choosers) != len(prompts):
            raise ValueError(f"{len(choosers)} choosers for {len(prompts)} prompts")
        self.stats = BatchStats(sequences=len(prompts))
        before = self._bytes_moved() if self._bytes_moved else {}
        caches, logits = self.prefill(prompts)
        histories = [list(p) for p in prompts]
        outputs: list[list[int]] = [[] for _ in prompts]
        live = list(range(len(prompts)))
        started = time.perf_counter()
        while live and max_new_tokens > 0:
            next_live, batch = [], []
            for s in live:
                token = int(choosers[s](logits[s], histories[s]))
                outputs[s].append(token)
                histories[s].append(token)
                self.stats.generated_tokens += 1
                if on_token is not None:
                    on_token(s, token)
                if is_end(token) or len(outputs[s]) >= max_new_tokens or caches[s].length + 1 > self.ctx_size:
                    continue
                next_live.append(s)
                batch.append((np.asarray([token]), caches[s]))
            live = next_live
            if batch:
                for s, out in zip(live, self._pass(batch), strict=True):
                    logits[s] = out
                self.stats.decode_passes += 1
        self.stats.decode_seconds = time.perf_counter() - started
        if self._bytes_moved:
            after = self._bytes_moved()
            self.stats.bytes_moved = {k: after[k] - before.get(k, 0) for k in after}
        return outputs


def read_prompts_file(path: str) -> list[str]:
    """One prompt per non-empty line (a literal backslash-n inside a line becomes a newline)."""
    with open(path, encoding="utf-8") as f:
        prompts = [line.rstrip("\n").replace("\\n", "\n") for line in f if line.strip()]
    if not prompts:
        raise ValueError(f"{path}: no prompts (one per line)")
    return prompts
