"""The scheduler's free KV caches and the prefix each still holds (a prefix cache per slot).

A request holds one of `slots` KV caches of `ctx_size` positions, made once (the memory plans count
them). A cache given back keeps the prompt that ran in it (but its last token): a new request takes
the free cache whose tokens share the longest prefix with its prompt and runs only the rest (a chat
that resends its history, a shared system prompt), or else an unused one, or else the one unused
longest. On the GPU, with --exact on the CPU and on the CPU's packed native engine a prompt row's keys
and values do not depend on how the prompt was split into passes (docs/GPU.md, infer.packed_weights),
so reuse changes no answer; the NumPy engine's float32 sums do depend on it, so there the prefix
cache is off unless asked for (`split_invariant`).
"""

from __future__ import annotations

from collections.abc import Sequence

from infer.engine import Cache, Model


class CachePool:
    """Free caches, least recently used first, each with the tokens at its positions. `prefix_cache`:
    whether a request may reuse what a cache holds."""

    def __init__(self, caches: Sequence[Cache], prefix_cache: bool) -> None:
        self.free: list[Cache] = list(caches)
        self.prefix_cache = prefix_cache
        self._holds: dict[int, list[int]] = {}  # id(cache) -> the tokens at its positions, for a free cache

    def __len__(self) -> int:
        return len(self.free)

    def oldest(self) -> Cache:
        """The cache unused longest, forgetting what it holds."""
        cache = self.free.pop(0)
        self._holds.pop(id(cache), None)
        return cache

    def take(self, prompt: list[int]) -> tuple[Cache, int]:
        """(cache, shared): the free cache holding the longest prefix of `prompt` that it can rewind
        to (at most all but the prompt's last token, whose logits are needed), when that prefix is at
        least half of what the cache holds (llama-server's similarity rule: a short common opening,
        such as a chat template's, must not take the cache of another conversation); else an empty
        cache, else the least recently used one (shared 0)."""
        best, shared = None, 0
        if self.prefix_cache:
            for i, cache in enumerate(self.free):
                held = self._holds.get(id(cache), [])
                n = common_prefix(held, prompt, len(prompt) - 1)
                if n > shared and 2 * n >= len(held) and cache.can_rewind(n):
                    best, shared = i, n
        if best is None:
            empty = [i for i, cache in enumerate(self.free) if not self._holds.get(id(cache))]
            best = empty[0] if empty else 0
        cache = self.free.pop(best)
        self._holds.pop(id(cache), None)
        return cache, shared

    def give_back(self, cache: Cache, prompt: list[int]) -> None:
        """A request is done with `cache`, which ran `prompt`. Only the positions that ran as prompt
        rows are kept for reuse: the prompt but its last token. The last prompt token and the reply
        ran as decode rows, whose numbers a prompt row does not reproduce on the GPU (8-bit against
        float16 products, docs/GPU.md), and a later request that resends them runs them as prompt
        rows, as a server without the cache would: so the answers are the same with and without it."""
        self._holds[id(cache)] = prompt[: min(cache.length, len(prompt) - 1)]
        self.free.append(cache)


def split_invariant(model: Model) -> bool:
    """Whether a prompt row's numbers do not depend on how the prompt was split into passes: on the
    GPU, and on the CPU with exact (float64) sums or the packed native engine (infer.packed_weights);
    not with the NumPy engine's float32 BLAS products."""
    return model.device == "gpu" or bool(getattr(model, "exact", False)) or \
        bool(getattr(getattr(model, "weights", None), "batch_invariant", False))


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens a and b share, at most `limit`."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if n >= limit or x != y:
            break
        n += 1
    return n
