"""The public calls of a GPU model, over its passes: forward, forward_batch (sequences, prompt
chunks and token trees in one pass), forward_batch_argmax, prefill and verify_tree. A mixin: the
model supplies `run_pass` (one pass over its layers for rows laid out by infer.gpu.passes) and the
buffers it returns logits in. GpuTransformer runs a pass over the layers of one GPU; a pipeline
(infer.gpu.stages) runs it across the GPUs of a host, each a range of the layers."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import cupy
import numpy as np

from infer.arch import ModelArgs
from infer.gpu.cache import GpuKVCache
from infer.gpu.passes import Row, bucket_of, sequence_rows, tree_rows
from infer.gpu.tree import TreeLogits, greedy_choices
from infer.layers import check_batch


def check_tree(parents: Sequence[int] | np.ndarray, nodes: int) -> np.ndarray:
    """The parents of a token tree of `nodes` nodes as int64, checked: one root first (-1), then
    0 <= parents[i] < i."""
    parents = np.asarray(parents, dtype=np.int64).reshape(-1)
    if len(parents) != nodes or parents[0] != -1 or (parents[1:] >= np.arange(1, nodes)).any() \
            or (parents[1:] < 0).any():
        raise ValueError("a token tree needs one parent per node, parents[0] == -1 and 0 <= parents[i] < i")
    return parents


Call = TypeVar("Call", bound=Callable[..., Any])


def on_its_device(method: Call) -> Call:
    """A model's call made with its GPU current (the GPU of its logits: a pipeline's head's), so
    that what it allocates and launches lands there whatever GPU the caller has current."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        with cupy.cuda.Device(self.device_id):
            return method(self, *args, **kwargs)

    return call  # type: ignore[return-value]


class PassFront:
    """forward, forward_batch, forward_batch_argmax, prefill(_batch), prompt_room, verify_tree and
    forward_tree of a model whose `run_pass` runs one pass (rows, out_rows, to_host) and leaves
    device logits in `logits` (valid while `passes` has not moved), ordered on `stream`."""

    args: ModelArgs
    capacity: int
    logits_rows: int
    logits: cupy.ndarray
    stream: cupy.cuda.Stream
    passes: int
    device_id: int  # the GPU of the logits

    def run_pass(self, rows: Sequence[Row], out_rows: Sequence[int],
                 to_host: bool = True) -> np.ndarray | cupy.ndarray: ...  # the model's

    def forward(self, tokens: np.ndarray, cache: GpuKVCache, all_logits: bool = False,
                prompt: bool = False) -> np.ndarray:
        """As infer.model.Transformer.forward: NumPy float32 logits, (T, vocab) with all_logits,
        else (vocab,) of the last token. prompt: the tokens are (the end of) a prompt whose logits
        before the last nobody reads: all but the last run as prompt rows (docs/GPU.md)."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        prompt_rows = [len(tokens) - 1] if prompt else None
        return self.forward_batch([(tokens, cache)], all_logits, prompt_rows)[0]

    def prefill(self, tokens: np.ndarray, cache: GpuKVCache) -> None:
        """Appends prompt tokens whose logits nobody reads (prompt rows; no logits)."""
        self.prefill_batch([(np.asarray(tokens, dtype=np.int64).reshape(-1), cache)])

    @on_its_device
    def prefill_batch(self, batch: Sequence[tuple[np.ndarray, GpuKVCache]]) -> None:
        """prefill for several sequences, sharing passes."""
        self._passes(batch, False, [len(np.asarray(t).reshape(-1)) for t, _ in batch], logits=False)

    @on_its_device
    def forward_batch(self, batch: Sequence[tuple[np.ndarray, GpuKVCache]], all_logits: bool = False,
                      prompt_rows: Sequence[int] | None = None,
                      trees: Sequence[np.ndarray | None] | None = None) -> list[np.ndarray | TreeLogits]:
        """Each (tokens, cache) at its cache's next positions; per sequence the logits of its last
        token (vocab,) or of every token (T, vocab). prompt_rows[s]: how many of sequence s's first
        tokens are prompt rows (their logits, if returned, are the prompt products'). Passes of at
        most `capacity` rows, shared evenly by the sequences with tokens left. trees[s]: the parents
        of sequence s's tokens, a token tree verified as verify_tree does (then the whole batch is
        ONE pass: see _tree_pass)."""
        if trees is not None and any(t is not None for t in trees):
            return self._tree_pass(batch, prompt_rows, trees)
        return self._passes(batch, all_logits, prompt_rows)

    def prompt_room(self, canonical: int) -> int:
        """Prompt rows a pass with `canonical` other rows (decode tokens, tree nodes, prompts' last
        tokens) still holds: the canonical region is padded to a bucket (pass_layout)."""
        return max(0, self.capacity - bucket_of(min(max(1, canonical), self.capacity), self.capacity))

    def _tree_pass(self, batch: Sequence[tuple[np.ndarray, GpuKVCache]], prompt_rows: Sequence[int] | None,
                   trees: Sequence[np.ndarray | None]) -> list[np.ndarray | TreeLogits]:
        """forward_batch with token trees, in one pass (the caller keeps it within the capacity): the
        trees of several requests verified together beside decode tokens and prompt chunks. A tree's
        logits come as TreeLogits (on the device while the pass's logits fit its block: a greedy walk
        reads arg-maxes, not rows; valid until the next pass), a sequence's last token's on the host.
        A tree's cache keeps its length (cache.accept keeps a path); a sequence's grows."""
        sizes = check_batch(batch, self.args.vocab_size)
        prompt_rows = list(prompt_rows) if prompt_rows is not None else [0] * len(batch)
        if len(trees) != len(batch) or len(prompt_rows) != len(batch):
            raise ValueError(f"{len(trees)} trees and {len(prompt_rows)} prompt-row counts for {len(batch)} sequences")
        rows: list[Row] = []
        out_rows: list[int] = []
        spans: list[tuple[int, int]] = []  # per sequence: (first logits row, count)
        for (tokens, cache), n, prompt, parents in zip(batch, sizes, prompt_rows, trees, strict=True):
            tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
            first = len(rows)
            if parents is None:
                rows += sequence_rows(cache, tokens, cache.length, prompt)
                spans.append((len(out_rows), 1))
                out_rows.append(len(rows) - 1)
                continue
            parents = check_tree(parents, n)
            rows += tree_rows(cache, tokens.tolist(), parents)
            spans.append((len(out_rows), n))
            out_rows += range(first, first + n)
        if len(rows) > self.capacity:
            raise ValueError(f"a pass of {len(rows)} rows (token trees beside other sequences) exceeds the pass "
                             f"capacity of {self.capacity}")
        on_device = len(out_rows) <= self.logits_rows
        got = self.run_pass(rows, out_rows, to_host=not on_device)
        this = self.passes
        plain = [j0 for (j0, _), parents in zip(spans, trees, strict=True) if parents is None]
        rows_of = {j0: got[j0] for j0 in plain}  # the sequences' rows, to the host when on the device
        if on_device and plain:  # row by row: gathering them on the device first (got[plain]) is a copy of
            host = np.empty((len(plain), self.args.vocab_size), np.float32)  # their rows outside the plan,
            for i, j0 in enumerate(plain):  # which overran a speculative server's budget (session 39)
                cupy.asnumpy(got[j0], stream=self.stream, out=host[i])
            self.stream.synchronize()
            rows_of = dict(zip(plain, host, strict=True))
        out: list[np.ndarray | TreeLogits] = []
        for s, ((j0, count), parents) in enumerate(zip(spans, trees, strict=True)):
            if parents is None:
                batch[s][1].length += sizes[s]
                out.append(rows_of[j0])
            else:
                out.append(TreeLogits(got[j0 : j0 + count], self.stream, lambda: self.passes == this))
        return out

    @on_its_device
    def forward_batch_argmax(self, batch: Sequence[tuple[np.ndarray, GpuKVCache]],
                             prompt_rows: Sequence[int] | None = None,
                             bias: Sequence[Sequence[tuple[int, float]]] | None = None) -> list[tuple[int, float]]:
        """forward_batch's greedy choices: per sequence (token id, value) of the arg-max of its last
        token's logits with bias[s] added (infer.gpu.tree.greedy_choices), found on the device: a
        server step of 32 sequences brings back 384 bytes instead of 16 MB of logits."""
        if bias is not None and len(bias) != len(batch):
            raise ValueError(f"bias must give one list of (token id, value) per sequence: {len(bias)} for {len(batch)}")
        return self._passes(batch, False, prompt_rows, pick=bias or [()] * len(batch))  # type: ignore[return-value]

    def _passes(self, batch: Sequence[tuple[np.ndarray, GpuKVCache]], all_logits: bool,
                prompt_rows: Sequence[int] | None, logits: bool = True,
                pick: Sequence[Sequence[tuple[int, float]]] | None = None) -> list[np.ndarray]:
        sizes = check_batch(batch, self.args.vocab_size)
        prompt_rows = list(prompt_rows) if prompt_rows is not None else [0] * len(batch)
        if len(prompt_rows) != len(batch) or any(not 0 <= p <= n for p, n in zip(prompt_rows, sizes, strict=True)):
            raise ValueError("prompt_rows must give 0..len(tokens) per sequence")
        outputs: list[list[np.ndarray]] = [[] for _ in batch]
        done = [0] * len(batch)
        while True:
            live = [s for s in range(len(batch)) if done[s] < sizes[s]]
            if not live:
                break
            live = live[: self.capacity]
            # canonical rows beside prompt rows are padded to a bucket: room for that padding
            mixed = any(prompt_rows[s] > done[s] for s in live) and any(prompt_rows[s] < sizes[s] for s in live)
            share = max(1, (self.capacity - (len(live) - 1 if mixed else 0)) // len(live))
            rows: list[Row] = []
            wanted: list[tuple[int, int, int]] = []  # (sequence, first row, count) of logits rows
            out_rows: list[int] = []
            for s in live:
                tokens, cache = batch[s]
                part = np.asarray(tokens)[done[s] : done[s] + share]
                first = len(rows)
                rows += sequence_rows(cache, part, cache.length, max(0, prompt_rows[s] - done[s]))
                if not logits:
                    continue
                if all_logits:
                    wanted.append((s, len(out_rows), len(part)))
                    out_rows += range(first, first + len(part))
                elif done[s] + len(part) == sizes[s]:
                    wanted.append((s, len(out_rows), 1))
                    out_rows.append(len(rows) - 1)
            got = self.run_pass(rows, out_rows, to_host=pick is None)
            if pick is not None:  # the greedy choices only (forward_batch_argmax)
                got = greedy_choices(got, self.stream, [(j0, pick[s]) for s, j0, _ in wanted if pick[s]])
            for s in live:
                n = min(share, sizes[s] - done[s])
                batch[s][1].length += n
                done[s] += n
            for s, j0, count in wanted:
                outputs[s].append(got[j0 : j0 + count])
        if not logits:
            return []
        return [np.concatenate(out) if all_logits else out[-1][0] for out in outputs]

    @on_its_device
    def verify_tree(self, tokens: np.ndarray, parents: np.ndarray, cache: GpuKVCache) -> TreeLogits:
        """Logits of every node of a token tree (node i in cache slot cache.length + i, root's parent
        -1, parents[i] < i) in one pass; node i's logits are the bits plain decoding gets at its
        position after its path. cache.length stays; cache.accept keeps a path."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        check_batch([(tokens, cache)], self.args.vocab_size)
        parents = check_tree(parents, len(tokens))
        if cache.length + len(tokens) > cache.max_tokens:
            raise ValueError(f"context full: {cache.length} + {len(tokens)} tree nodes exceed {cache.max_tokens}")
        rows = tree_rows(cache, tokens.tolist(), parents)
        n = len(rows)
        logits = self.run_pass(rows, range(n), to_host=n > self.logits_rows)
        this = self.passes
        spare = self.logits[n:] if n < self.logits_rows else None
        return TreeLogits(logits, self.stream, lambda: self.passes == this, spare)

    def forward_tree(self, tokens: np.ndarray, parents: np.ndarray, cache: GpuKVCache) -> np.ndarray:
        """As infer.model.Transformer.forward_tree: verify_tree's logits on the host."""
        return self.verify_tree(tokens, parents, cache).to_host()
