"""Which experts a tier keeps (issue 26): the bookkeeping of an expert cache, apart from its bytes.

`ExpertUse` counts routings per (layer, expert): the router statistics that rank experts by expected
use. It is filled online as tokens are routed, saved beside the model's other caches when a run ends
and loaded by the next run of the same routers, which then starts with the most used experts in RAM
and can say what hit rate to expect (the share of past routings that the held experts took).

`ExpertResidency` decides, for a layer's routed experts, which are missing and which held ones make
room. Two policies:
- "lru": the least recently used goes first;
- "lfru" (the default): a frequency that fades, so an expert used often stays over one used once
  lately. Each use adds 2 ** (clock / half_life) to its key's score (the clock counts routings; each
  token routed to an expert is a use, so an expert a prompt's tokens share weighs what it serves), so
  a use counts twice as much as one half_life routings older, and the lowest score leaves first: a long
  half-life ranks by frequency (LFU), a short one by recency (LRU). Past router statistics enter as
  a weak prior at the clock's start: as many units in all as the cache holds experts.
`bench.expert_cache` replays routings of several skews through both and reports their hit rates.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

POLICIES = ("lfru", "lru")
DEFAULT_POLICY = "lfru"
# The fading of "lfru", in routings per capacity: a held expert's uses count half as much after
# this many times the cache's size of routings (bench.expert_cache picked it, docs/STREAMING.md).
HALF_LIFE_CAPACITIES = 16.0
_RESCALE_AT = 2.0 ** 60  # a use's increment beyond this: every score is divided down (far from overflow)

Key = tuple[int, int]  # (layer, expert)


@dataclass
class ExpertUse:
    """Routings per (layer, expert) over `tokens` routed tokens (summed over layers' routings)."""

    counts: np.ndarray  # (n_layers, n_experts) float64
    tokens: int = 0

    @classmethod
    def empty(cls, n_layers: int, n_experts: int) -> ExpertUse:
        return cls(np.zeros((n_layers, n_experts), np.float64))

    def add(self, layer: int, experts: Iterable[int], tokens: int = 0) -> None:
        np.add.at(self.counts[layer], np.asarray(list(experts), np.int64), 1.0)
        self.tokens += tokens

    @property
    def routings(self) -> float:
        return float(self.counts.sum())

    def hottest(self, n: int) -> list[Key]:
        """The n most used (layer, expert) keys, most used first (ties: lower layer, lower expert)."""
        flat = self.counts.ravel()
        n = min(n, int(np.count_nonzero(flat)))
        order = np.lexsort((np.arange(flat.size), -flat))[:n]
        return [divmod(int(i), self.counts.shape[1]) for i in order]  # type: ignore[misc]

    def expected_hit_rate(self, capacity: int) -> float:
        """The share of the counted routings that the `capacity` most used experts took: the hit rate
        of a cache that holds them, if routing goes on as counted."""
        total = self.routings
        if not total:
            return 0.0
        flat = np.sort(self.counts.ravel())[::-1]
        return float(flat[:capacity].sum() / total)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_name(path.name + ".tmp")
        with open(staged, "wb") as f:  # a file object: np.savez would append .npz to a path
            np.savez(f, counts=self.counts, tokens=np.int64(self.tokens))
        staged.replace(path)  # a crash mid-write leaves the previous statistics, not half a file

    @classmethod
    def load(cls, path: Path, n_layers: int, n_experts: int) -> ExpertUse | None:
        """The statistics saved at `path`, or None when there are none or they are not of this shape
        or not readable (they are a hint: a run without them is correct, only colder)."""
        try:
            with np.load(path) as data:
                counts, tokens = np.asarray(data["counts"], np.float64), int(data["tokens"])
        except (OSError, KeyError, ValueError):
            return None
        if counts.shape != (n_layers, n_experts) or not np.all(np.isfinite(counts)) or np.any(counts < 0):
            return None
        return cls(counts, tokens)


def default_use_path(digest: str) -> Path:
    """Where the statistics of the routers named `digest` are kept: under NVMEDIRECT_CACHE (default
    ~/.cache/nvmedirect), in expert-use/."""
    base = os.environ.get("NVMEDIRECT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "nvmedirect")
    return Path(base) / "expert-use" / f"{digest}.npz"


def routers_digest(router_bytes: Sequence[np.ndarray]) -> str:
    """A name for a model's routing: the SHA-256 of its routers' bytes (the same routers route alike,
    whatever the file is called or where it lies)."""
    h = hashlib.sha256()
    for r in router_bytes:
        h.update(np.ascontiguousarray(r).view(np.uint8).data)
    return h.hexdigest()[:24]


class ExpertResidency:
    """The (layer, expert) keys held under `capacity`, by `policy`; `admit` returns what to read and
    what to drop. `use`: past router statistics, which `preload` takes the hottest of and which seed
    "lfru"'s scores (this run's routings are the caller's to count)."""

    def __init__(self, capacity: int, policy: str = DEFAULT_POLICY, use: ExpertUse | None = None,
                 half_life: float | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown expert cache policy {policy!r}: one of {', '.join(POLICIES)}")
        if capacity < 1:
            raise ValueError("an expert cache holds at least one expert")
        self.capacity, self.policy, self.use = capacity, policy, use
        self.half_life = half_life or HALF_LIFE_CAPACITIES * capacity
        self._held: OrderedDict[Key, None] = OrderedDict()  # "lru": least recent first
        self._score: dict[Key, float] = {}  # "lfru": every key ever used
        self._heap: list[tuple[float, int, Key]] = []  # "lfru": (score, serial, key) of held keys, stale ones skipped
        self._serial = 0
        self._clock = 0  # routings so far
        self._base = 0.0  # the clock at which a use adds 1 (moved on as the scores are divided down)
        if use is not None and use.routings:
            # past statistics as a weak prior: as many units in all as the cache holds experts, so
            # they order the preloaded experts but a few uses in this run outweigh them (counted at
            # full weight, a stale ranking from another text held the cache for hundreds of tokens:
            # 83% decode hits against 98% without it on the synthetic 30B)
            prior = use.counts * (self.capacity / use.routings)
            for (layer, expert), n in np.ndenumerate(prior):
                if n:
                    self._score[(layer, expert)] = float(n)

    def __contains__(self, key: Key) -> bool:
        return key in self._held

    def __len__(self) -> int:
        return len(self._held)

    def keys(self) -> list[Key]:
        return list(self._held)

    def preload(self) -> list[Key]:
        """The keys of the past statistics' most used experts, up to the capacity, taken in as held
        (the caller reads them); empty without statistics."""
        if self.use is None:
            return []
        taken = [k for k in self.use.hottest(self.capacity) if k not in self._held][: self.capacity - len(self._held)]
        for key in taken:
            self._hold(key)
        return taken

    def admit(self, layer: int, experts: Iterable[int], uses: Iterable[int] | None = None) -> tuple[list[int], list[Key]]:
        """A layer's routed experts (distinct), each routed to by uses[i] tokens of the pass (default
        1): (the experts to read, the held keys to drop). Every routed expert is held afterwards, even
        past the capacity when a pass needs more at once; none of them is dropped."""
        wanted = [int(e) for e in experts]
        counts = [1] * len(wanted) if uses is None else [int(n) for n in uses]
        if len(set(wanted)) != len(wanted) or len(counts) != len(wanted):
            raise ValueError("admit takes distinct experts and one count of uses for each")
        missing = [e for e in wanted if (layer, e) not in self._held]
        for e, n in zip(wanted, counts, strict=True):  # used in the order routed, read or not
            if (layer, e) not in self._held:
                self._hold((layer, e))
            self._touch((layer, e), n)
        keep = {(layer, e) for e in wanted}
        return missing, self._evict(keep)

    # -- policies

    def _touch(self, key: Key, uses: int = 1) -> None:
        self._clock += uses
        if self.policy == "lru":
            if key in self._held:
                self._held.move_to_end(key)
            return
        unit = 2.0 ** ((self._clock - self._base) / self.half_life)
        if unit > _RESCALE_AT:
            unit = self._rescale()
        self._score[key] = self._score.get(key, 0.0) + uses * unit
        if key in self._held:
            self._push(key)

    def _hold(self, key: Key) -> None:
        self._held[key] = None
        if self.policy == "lfru":
            self._push(key)

    def _push(self, key: Key) -> None:
        self._serial += 1
        heapq.heappush(self._heap, (self._score.get(key, 0.0), self._serial, key))

    def _evict(self, keep: set[Key]) -> list[Key]:
        dropped: list[Key] = []
        if self.policy == "lru":
            while len(self._held) > max(self.capacity, len(keep)):
                victim = next(k for k in self._held if k not in keep)
                del self._held[victim]
                dropped.append(victim)
            return dropped
        skipped: list[tuple[float, int, Key]] = []
        while len(self._held) > max(self.capacity, len(keep)):
            score, serial, key = heapq.heappop(self._heap)
            if key not in self._held or score != self._score.get(key, 0.0):
                continue  # dropped already, or used since: a newer entry stands for it
            if key in keep:
                skipped.append((score, serial, key))
                continue
            del self._held[key]
            dropped.append(key)
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        if len(self._heap) > 4 * len(self._held) + 64:  # stale entries pile up: rebuild
            self._heap = [(self._score.get(k, 0.0), 0, k) for k in self._held]
            heapq.heapify(self._heap)
        return dropped

    def _rescale(self) -> float:
        """Divides every score by the same power of two (exact, so the order is kept) and moves the
        clock's base on by as many half-lives; returns the current use's increment."""
        halvings = math.floor((self._clock - self._base) / self.half_life)
        self._score = {k: math.ldexp(s, -halvings) for k, s in self._score.items()}
        self._base += halvings * self.half_life
        self._heap = [(self._score.get(k, 0.0), 0, k) for k in self._held]
        heapq.heapify(self._heap)
        return 2.0 ** ((self._clock - self._base) / self.half_life)
