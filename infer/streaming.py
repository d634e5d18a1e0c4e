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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from infer.engine import Model, Throughput
from infer.request import Request, StopWhen, as_sampler
from infer.scheduler import Scheduler

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

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 choose: Chooser | Sequence[Chooser],
                 is_end: Callable[[int], bool] = lambda _: False,
                 on_token: Callable[[int, int], None] | None = None) -> list[list[int]]:
        """Up to `max_new_tokens` new ids per prompt (an end id is kept and stops its sequence;
        a full context stops it too), as requests to one infer.scheduler.Scheduler with a slot per
        prompt: a pass serves every live sequence, prompt chunks beside decode tokens.
        `choose(logits, history)` picks the next id: one function for all, or one per sequence
        (samplers with their own random state). on_token(sequence, id) hears of each id as soon
        as it is chosen (a streamed pass can take seconds: the CLI prints it then)."""
        choosers = list(choose) if isinstance(choose, Sequence) else [choose] * len(prompts)
        if len(choosers) != len(prompts):
            raise ValueError(f"{len(choosers)} choosers for {len(prompts)} prompts")
        self.stats = BatchStats(sequences=len(prompts))
        if not prompts or max_new_tokens <= 0:
            return [[] for _ in prompts]
        before = self._bytes_moved() if self._bytes_moved else {}
        # passes only (no device runs): a streamed model's steps are passes over the streamed weights
        scheduler = Scheduler(self.model, self.ctx_size, len(prompts), prefill_chunk=self.prefill_chunk,
                              prefix_cache=False, device_runs=False)
        outputs: list[list[int]] = [[] for _ in prompts]

        def heard(s: int) -> Callable[[int], None]:
            def token(t: int) -> None:
                outputs[s].append(t)
                if on_token is not None:
                    on_token(s, t)
            return token

        requests = [Request(list(p), max_new_tokens, as_sampler(c), stop_ids=StopWhen(is_end), on_token=heard(s))
                    for s, (p, c) in enumerate(zip(prompts, choosers, strict=True))]
        scheduler.run(requests)
        failed = [r.error for r in requests if r.error]
        if failed:
            raise ValueError(failed[0])
        run = scheduler.stats
        self.stats.prompt_tokens = sum(len(p) for p in prompts)
        self.stats.generated_tokens = sum(len(o) for o in outputs)
        self.stats.prefill_passes, self.stats.decode_passes = run.prompt_passes, run.passes - run.prompt_passes
        self.stats.prompt_seconds = run.prompt_pass_seconds
        self.stats.decode_seconds = run.pass_seconds - run.prompt_pass_seconds
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
