"""The expert cache's bookkeeping (infer.tiers.expert_policy): which experts stay under each policy,
the router statistics and their file, and bench.expert_cache's replay. Pure Python: the bytes are
tests/tiers/test_experts.py's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from infer.tiers.expert_policy import ExpertResidency, ExpertUse, default_use_path, routers_digest


def _random_trace(n: int, layers: int = 3, experts: int = 12, used: int = 2, seed: int = 0) -> list[tuple[int, list[int]]]:
    rng = np.random.default_rng(seed)
    skew = 1.0 / np.arange(1, experts + 1)
    p = skew / skew.sum()
    return [(int(rng.integers(layers)), [int(e) for e in rng.choice(experts, used, replace=False, p=p)]) for _ in range(n)]


def _replay(cache: ExpertResidency, trace: list[tuple[int, list[int]]]) -> list[tuple[list[int], list[tuple[int, int]]]]:
    return [cache.admit(layer, experts) for layer, experts in trace]


def test_lru_drops_the_least_recently_used() -> None:
    cache = ExpertResidency(5, "lru")
    assert cache.admit(1, [3, 7, 9, 11]) == ([3, 7, 9, 11], [])
    assert cache.admit(1, [7, 3]) == ([], [])
    missing, dropped = cache.admit(1, [0, 1])
    assert missing == [0, 1] and dropped == [(1, 9)]
    assert cache.keys() == [(1, 11), (1, 7), (1, 3), (1, 0), (1, 1)]


def test_lfru_keeps_an_often_used_expert_over_recent_one_offs() -> None:
    lfru, lru = ExpertResidency(3, "lfru"), ExpertResidency(3, "lru")
    for cache in (lfru, lru):
        for _ in range(6):
            cache.admit(0, [5])
        for e in (1, 2, 3, 4):  # one-offs, each used once after the favourite
            cache.admit(0, [e])
    assert (0, 5) in lfru and (0, 5) not in lru
    assert len(lfru) == len(lru) == 3


@pytest.mark.parametrize("policy", ["lfru", "lru"])
def test_a_pass_keeps_all_its_experts_even_beyond_the_capacity(policy: str) -> None:
    cache = ExpertResidency(4, policy)
    cache.admit(0, [0, 1, 2, 3])
    missing, dropped = cache.admit(1, [0, 1, 2, 3, 4, 5])  # a prompt routes to 6 experts of layer 1
    assert missing == [0, 1, 2, 3, 4, 5] and sorted(dropped) == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert all((1, e) in cache for e in range(6))
    _, dropped = cache.admit(1, [0])  # back within the capacity, never dropping the pass's own
    assert len(dropped) == 2 and (1, 0) in cache and len(cache) == 4


def test_lfru_with_a_short_half_life_is_lru_and_its_scores_stay_finite() -> None:
    """A half-life of half a routing makes each use outweigh all earlier ones (1/4 + 1/16 + ... < 1),
    so the order is recency; 20,000 routings take 2 ** 40000 past float range, which the scores'
    division by powers of two keeps them inside."""
    trace = _random_trace(20_000)
    assert _replay(ExpertResidency(7, "lfru", half_life=0.5), trace) == _replay(ExpertResidency(7, "lru"), trace)


def test_lfru_drops_the_lowest_score_and_with_a_long_half_life_the_least_used() -> None:
    """The heap's choices equal a full scan for the lowest score (each use adds 2 ** (tick / half-life));
    with a half-life far beyond the trace that is the lowest count (LFU)."""
    half_life = 1e6
    trace = _random_trace(3000, seed=1)
    cache = ExpertResidency(6, "lfru", half_life=half_life)
    score: dict[tuple[int, int], float] = {}
    count: dict[tuple[int, int], int] = {}
    held: set[tuple[int, int]] = set()
    tick = 0
    for t, (layer, experts) in enumerate(trace):
        keys = [(layer, e) for e in experts]
        for k in keys:  # each use its own tick, in the order routed
            tick += 1
            score[k] = score.get(k, 0.0) + 2.0 ** (tick / half_life)
            count[k] = count.get(k, 0) + 1
        held |= set(keys)
        want = []
        while len(held) > 6:
            victim = min((k for k in held if k not in keys), key=lambda k: score[k])
            assert all(count[victim] <= count[k] for k in held if k not in keys)
            held.remove(victim)
            want.append(victim)
        _, dropped = cache.admit(layer, experts)
        assert sorted(dropped) == sorted(want), t
    assert set(cache.keys()) == held


def test_router_statistics_rank_preload_and_predict() -> None:
    use = ExpertUse.empty(2, 4)
    for experts in ([0, 1], [0, 1], [0, 2], [0, 3]):
        use.add(1, experts, tokens=1)
    use.add(0, [2])
    assert use.tokens == 4 and use.routings == 9
    assert use.hottest(3) == [(1, 0), (1, 1), (0, 2)]  # 4, 2, then the lower layer of the 1s
    assert use.expected_hit_rate(2) == pytest.approx(6 / 9)
    assert use.expected_hit_rate(100) == 1.0
    cache = ExpertResidency(3, "lfru", use)
    assert cache.preload() == [(1, 0), (1, 1), (0, 2)]
    missing, dropped = cache.admit(1, [3])  # a newcomer: the least used preloaded one makes room
    assert missing == [3] and dropped == [(0, 2)]
    assert ExpertResidency(3, "lru").preload() == []


def test_past_statistics_give_way_to_this_runs_routing() -> None:
    """Preloaded experts of heavy past use are displaced once a new text uses others: the statistics
    are a prior worth the cache's size in routings, not their full count (which would evict each new
    expert for the other, a miss every time)."""
    use = ExpertUse.empty(1, 8)
    use.add(0, [0] * 100 + [1] * 100, tokens=100)
    cache = ExpertResidency(2, "lfru", use)
    assert cache.preload() == [(0, 0), (0, 1)]
    results = [cache.admit(0, [e])[0] for e in (5, 6, 5, 6)]
    assert results == [[5], [6], [], []]


def test_a_pass_weighs_each_expert_by_the_tokens_routed_to_it() -> None:
    cache = ExpertResidency(2, "lfru")
    cache.admit(0, [1, 2], uses=[5, 1])  # a prompt: expert 1 served five tokens, expert 2 one
    assert cache.admit(0, [3]) == ([3], [(0, 2)])
    with pytest.raises(ValueError, match="distinct experts"):
        cache.admit(0, [4, 4])
    with pytest.raises(ValueError, match="one count of uses for each"):
        cache.admit(0, [4, 5], uses=[1])


def test_router_statistics_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use = ExpertUse.empty(3, 5)
    use.add(2, [4, 4, 1], tokens=3)
    path = tmp_path / "deep" / "stats.npz"
    use.save(path)
    back = ExpertUse.load(path, 3, 5)
    assert back is not None and back.tokens == 3 and np.array_equal(back.counts, use.counts)
    assert ExpertUse.load(path, 3, 6) is None  # another model's shape
    assert ExpertUse.load(tmp_path / "missing.npz", 3, 5) is None
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    assert ExpertUse.load(tmp_path / "junk.npz", 3, 5) is None
    routers = [np.arange(6, dtype=np.float32), np.ones(3, np.float32)]
    name = routers_digest(routers)
    assert name == routers_digest([r.copy() for r in routers]) and name != routers_digest(routers[:1])
    monkeypatch.setenv("NVMEDIRECT_CACHE", str(tmp_path))
    assert default_use_path(name) == tmp_path / "expert-use" / f"{name}.npz"


def test_unknown_policy_and_empty_cache_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown expert cache policy 'mru'"):
        ExpertResidency(3, "mru")
    with pytest.raises(ValueError, match="at least one"):
        ExpertResidency(0)


def test_the_hit_rate_bench_replays_every_trace() -> None:
    from bench.expert_cache import main, uniform_trace, zipf_trace

    rng = np.random.default_rng(0)
    skewed = zipf_trace(4, 16, 2, 400, 1.0, rng)
    flat = uniform_trace(4, 16, 2, 400, rng)
    from bench.expert_cache import replay

    # a skewed router is cached better than a uniform one, and lfru beats lru on it
    assert replay(skewed, (4, 16, 2), 16, "lfru") > replay(flat, (4, 16, 2), 16, "lfru") + 0.1
    assert replay(skewed, (4, 16, 2), 16, "lfru") > replay(skewed, (4, 16, 2), 16, "lru")
    assert main(["--layers", "2", "--experts", "8", "--used", "2", "--tokens", "40", "--shares", "0.5",
                 "--zipf", "1", "--drift", "10"]) == 0
