"""Sampler: each filter on hand-made distributions, llama.cpp's repetition-penalty rule, greedy,
seeds, and the frequencies temperature sampling produces."""

from __future__ import annotations

import math

import numpy as np
import pytest

from infer.sampler import (
    Sampler,
    SamplerConfig,
    apply_count_penalties,
    apply_repeat_penalty,
    log_probabilities,
    min_p_filter,
    top_k_filter,
    top_p_filter,
)

# probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 hidden at scrambled ids
PROBS = {7: 0.5, 2: 0.25, 9: 0.125, 0: 0.0625, 4: 0.0625}


def _logits(probs: dict[int, float], size: int = 10, offset: float = 3.0) -> np.ndarray:
    logits = np.full(size, -np.inf, dtype=np.float32)
    for token, p in probs.items():
        logits[token] = math.log(p) + offset  # the offset must not matter
    return logits


def _config(**overrides: float | int | None) -> SamplerConfig:
    """Everything off except what the test names."""
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, seed=1)
    return SamplerConfig(**{**base, **overrides})


def test_greedy_is_argmax_whatever_the_seed() -> None:
    rng = np.random.default_rng(0)
    for seed in range(20):
        logits = rng.normal(size=1000).astype(np.float32)
        assert Sampler(_config(temperature=0.0, seed=seed)).sample(logits) == int(np.argmax(logits))


def test_greedy_takes_the_first_of_equal_maxima() -> None:
    logits = np.array([0.0, 5.0, 1.0, 5.0], dtype=np.float32)
    assert Sampler(_config(temperature=0.0)).sample(logits) == 1


def test_no_filter_keeps_the_softmax() -> None:
    ids, probs = Sampler(_config()).distribution(_logits(PROBS))
    assert dict(zip(ids.tolist()[:5], probs[:5].round(6).tolist(), strict=True)) == PROBS
    assert probs[5:].sum() == 0


def test_top_k_keeps_the_k_most_likely() -> None:
    ids, probs = Sampler(_config(top_k=2)).distribution(_logits(PROBS))
    assert ids.tolist() == [7, 2]
    np.testing.assert_allclose(probs, [2 / 3, 1 / 3])


def test_top_p_keeps_the_prefix_that_reaches_p() -> None:
    # 0.5 + 0.25 = 0.75 reaches 0.7: two tokens; 0.8 needs the third (0.875)
    assert Sampler(_config(top_p=0.7)).distribution(_logits(PROBS))[0].tolist() == [7, 2]
    assert Sampler(_config(top_p=0.8)).distribution(_logits(PROBS))[0].tolist() == [7, 2, 9]
    # the most likely token alone already reaches a small p
    assert Sampler(_config(top_p=0.1)).distribution(_logits(PROBS))[0].tolist() == [7]


def test_min_p_drops_tokens_below_a_fraction_of_the_best() -> None:
    # relative to the best (0.5): 0.25 -> 0.5, 0.125 -> 0.25, 0.0625 -> 0.125
    assert Sampler(_config(min_p=0.3)).distribution(_logits(PROBS))[0].tolist() == [7, 2]
    assert Sampler(_config(min_p=0.2)).distribution(_logits(PROBS))[0].tolist() == [7, 2, 9]
    assert Sampler(_config(min_p=0.6)).distribution(_logits(PROBS))[0].tolist() == [7]


def test_filters_on_sorted_candidates() -> None:
    ids = np.array([5, 3, 1, 0])
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1], dtype=np.float32))
    assert top_k_filter(ids, logits, 3)[0].tolist() == [5, 3, 1]
    assert top_k_filter(ids, logits, 0)[0].tolist() == [5, 3, 1, 0]
    assert top_p_filter(ids, logits, 0.75)[0].tolist() == [5, 3, 1]
    assert min_p_filter(ids, logits, 0.5)[0].tolist() == [5, 3, 1]


def test_temperature_reshapes_the_distribution() -> None:
    _, cold = Sampler(_config(temperature=0.5)).distribution(_logits(PROBS))
    _, hot = Sampler(_config(temperature=2.0)).distribution(_logits(PROBS))
    # p_i ∝ p_i^(1/T)
    expected_cold = np.array([0.5, 0.25, 0.125, 0.0625, 0.0625]) ** 2
    expected_hot = np.array([0.5, 0.25, 0.125, 0.0625, 0.0625]) ** 0.5
    np.testing.assert_allclose(cold[:5], expected_cold / expected_cold.sum(), rtol=1e-5)
    np.testing.assert_allclose(hot[:5], expected_hot / expected_hot.sum(), rtol=1e-5)


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = np.array([2.0, -2.0, 3.0, -1.0, 0.5], dtype=np.float32)
    out = apply_repeat_penalty(logits, history=[0, 1, 1, 1, 4], penalty=2.0, last_n=64)
    np.testing.assert_allclose(out, [1.0, -4.0, 3.0, -1.0, 0.25])
    assert logits[0] == 2.0  # the input is left alone


def test_repeat_penalty_only_looks_at_the_window() -> None:
    logits = np.array([2.0, 2.0, 2.0], dtype=np.float32)
    out = apply_repeat_penalty(logits, history=[0, 1, 2], penalty=2.0, last_n=2)
    np.testing.assert_allclose(out, [2.0, 1.0, 1.0])
    np.testing.assert_allclose(apply_repeat_penalty(logits, [0, 1, 2], 2.0, last_n=0), logits)
    np.testing.assert_allclose(apply_repeat_penalty(logits, [0, 1, 2], 2.0, last_n=-1), [1.0, 1.0, 1.0])


def test_repeat_penalty_changes_the_greedy_choice() -> None:
    logits = np.array([1.0, 3.0, 2.0], dtype=np.float32)
    sampler = Sampler(_config(temperature=0.0, repeat_penalty=2.0))
    assert sampler.sample(logits, history=[]) == 1
    assert sampler.sample(logits, history=[1]) == 2  # 3.0 / 2 = 1.5 < 2.0


def test_same_seed_same_tokens_different_seed_different_tokens() -> None:
    rng = np.random.default_rng(3)
    steps = [rng.normal(size=500).astype(np.float32) for _ in range(64)]

    def run(seed: int) -> list[int]:
        sampler = Sampler(_config(temperature=1.5, seed=seed))
        return [sampler.sample(logits) for logits in steps]

    assert run(42) == run(42)
    assert run(42) != run(43)


def test_temperature_sampling_frequencies_follow_the_distribution() -> None:
    sampler = Sampler(_config(temperature=1.0, seed=1234))
    logits = _logits(PROBS)
    draws = 20000
    counts = np.bincount([sampler.sample(logits) for _ in range(draws)], minlength=10)
    for token, p in PROBS.items():
        sigma = math.sqrt(draws * p * (1 - p))
        assert abs(counts[token] - draws * p) < 5 * sigma, (token, counts[token], draws * p)
    assert counts[[1, 3, 5, 6, 8]].sum() == 0  # impossible tokens never drawn


def test_default_config_is_llama_cpp_like_and_filters_apply_together() -> None:
    config = SamplerConfig()
    assert (config.temperature, config.top_k, config.top_p, config.min_p) == (0.8, 40, 0.95, 0.05)
    logits = np.linspace(10, 0, 1000).astype(np.float32)
    ids, probs = Sampler(config).distribution(logits)
    assert ids.size <= 40 and ids.tolist() == sorted(ids.tolist())  # descending logits = ascending ids
    assert math.isclose(probs.sum(), 1.0)


@pytest.mark.parametrize(
    "field, value",
    [("temperature", -0.1), ("top_k", -1), ("top_p", 0.0), ("top_p", 1.5), ("min_p", 2.0),
     ("repeat_penalty", 0.0), ("repeat_last_n", -2)],
)
def test_bad_config_is_one_line_error(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field) as err:
        SamplerConfig(**{field: value})
    assert "\n" not in str(err.value)


def test_bad_logits_are_refused() -> None:
    with pytest.raises(ValueError, match="vector"):
        Sampler().sample(np.zeros((2, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="NaN"):
        Sampler().sample(np.array([0.0, np.nan], dtype=np.float32))


@pytest.mark.parametrize("temperature", [1e-320, 5e-324, 1e-30, 9.9e-7])
def test_a_temperature_below_the_threshold_is_greedy(temperature: float) -> None:
    """Issue 29: 1e-320 divided the logits into infinities (NaN probabilities, divide-by-zero
    warnings, a token unlike the greedy one). Below GREEDY_BELOW the choice is the arg-max."""
    import warnings

    from infer.sampler import GREEDY_BELOW

    assert temperature < GREEDY_BELOW
    rng = np.random.default_rng(3)
    for _ in range(50):
        logits = rng.normal(0, 4, 300).astype(np.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            sampler = Sampler(SamplerConfig(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, seed=1))
            assert sampler.config.greedy and sampler.sample(logits) == int(np.argmax(logits))


def test_a_temperature_at_the_threshold_still_samples() -> None:
    from infer.sampler import GREEDY_BELOW

    logits = np.zeros(4, np.float32)  # a four-way tie: a sampler draws all of them, greedy one
    sampler = Sampler(SamplerConfig(temperature=GREEDY_BELOW, top_k=0, top_p=1.0, min_p=0.0, seed=2))
    assert not sampler.config.greedy
    assert {sampler.sample(logits) for _ in range(200)} == {0, 1, 2, 3}


def test_the_cli_takes_a_tiny_temperature_as_greedy(tmp_path) -> None:  # noqa: ANN001
    import json
    import warnings

    from click.testing import CliRunner

    from infer.cli import main
    from infer.synth import SHAPES, write_model

    model = tmp_path / "tiny.gguf"
    write_model(model, SHAPES["tiny"], "q8_0", seed=3)
    runs = {}
    for temp in ("0", "1e-320"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            result = CliRunner().invoke(main, ["-m", str(model), "-p", "hello", "-n", "12", "--device", "cpu",
                                               "-t", temp, "--seed", "4", "--json"])
        assert result.exit_code == 0, result.output
        runs[temp] = json.loads(result.stdout)["ids"]
    assert runs["1e-320"] == runs["0"]


def test_frequency_and_presence_penalties_follow_llama_cpp() -> None:
    """logit - count x frequency - presence for every token seen in the window (llama.cpp's rule)."""
    logits = np.array([1.0, 2.0, -1.0, 0.5], dtype=np.float32)
    out = apply_count_penalties(logits.copy(), [1, 1, 1, 2, 0, 9], frequency=0.5, presence=0.25, last_n=5)
    np.testing.assert_allclose(out, [1.0 - 0.75, 2.0 - 1.0 - 0.25, -1.0 - 0.75, 0.5])  # 9: outside the vocabulary
    np.testing.assert_allclose(apply_count_penalties(logits.copy(), [1, 1], 0.5, 0.25, last_n=0), logits)


def test_logit_bias_bans_and_forces_and_everything_banned_is_an_error() -> None:
    logits = np.array([3.0, 2.0, 1.0], dtype=np.float32)
    assert Sampler(_config(temperature=0, logit_bias=((0, float("-inf")),))).sample(logits) == 1
    assert Sampler(_config(temperature=0, logit_bias=((2, 5.0),))).sample(logits) == 2
    for seed in range(20):  # a banned token is never drawn
        assert Sampler(_config(seed=seed, logit_bias=((1, float("-inf")),))).sample(logits) != 1
    everything = tuple((i, float("-inf")) for i in range(3))
    with pytest.raises(ValueError, match="every token is excluded"):
        Sampler(_config(temperature=0, logit_bias=everything)).sample(logits)
    assert not Sampler(_config(temperature=0, logit_bias=((2, 5.0),))).argmax_only
    assert not Sampler(_config(temperature=0, frequency_penalty=0.5)).argmax_only
    with pytest.raises(ValueError, match="logit bias"):
        SamplerConfig(logit_bias=((0, float("inf")),))


class _OnlyEven:
    """A constraint that allows even ids only and records what it is told."""

    def __init__(self) -> None:
        self.told: list[int] = []

    def allowed(self, vocab_size: int) -> np.ndarray:
        return np.arange(vocab_size) % 2 == 0

    def accept(self, token: int) -> None:
        self.told.append(token)


def test_a_constraint_bans_tokens_and_is_told_each_choice() -> None:
    logits = np.array([0.0, 5.0, 1.0, 4.0, 0.5], dtype=np.float32)
    constraint = _OnlyEven()
    greedy = Sampler(_config(temperature=0), constraint)
    assert not greedy.argmax_only and greedy.sample(logits) == 2
    drawn = Sampler(_config(seed=3), constraint)
    picks = [drawn.sample(logits) for _ in range(50)]
    assert set(picks) <= {0, 2, 4} and constraint.told == [2, *picks]


def test_log_probabilities_are_the_raw_distribution() -> None:
    logits = np.random.default_rng(1).normal(size=50).astype(np.float32)
    want = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum())
    value, top = log_probabilities(logits, 7, 3)
    assert value == pytest.approx(want[7], abs=1e-12)
    order = np.argsort(-want)[:3]
    assert [i for i, _ in top] == list(order) and [v for _, v in top] == pytest.approx(want[order], abs=1e-12)
    assert log_probabilities(logits, 7, 0)[1] == []


def test_the_greedy_fast_path_chooses_as_the_full_path() -> None:
    """sample() of a plain greedy sampler takes one arg-max pass; distribution() runs every step.
    Same choice on random rows, rows with ties (lowest id wins) and float64 rows that tie only in
    float32; the same refusals of NaN, +inf and a row that is all -inf."""
    from infer.sampler import NonFiniteLogits

    rng = np.random.default_rng(4)
    greedy = Sampler(_config(temperature=0))
    rows = [rng.normal(size=1000).astype(np.float32) for _ in range(20)]
    tied = rng.normal(size=1000).astype(np.float32)
    tied[[10, 500]] = tied.max() + 1
    near = np.zeros(1000)
    near[[3, 9]] = 1.0, 1.0 + 1e-12  # one float32 value
    for row in [*rows, tied, near]:
        assert greedy.sample(row) == int(greedy.distribution(row)[0][0])
    assert greedy.sample(tied) == 10 and greedy.sample(near) == 3
    for bad, error in ((np.nan, NonFiniteLogits), (np.inf, NonFiniteLogits)):
        row = rows[0].copy()
        row[42] = bad
        with pytest.raises(error):
            greedy.sample(row)
    with pytest.raises(ValueError, match="every token is excluded"):
        greedy.sample(np.full(10, -np.inf, dtype=np.float32))


def test_the_biased_greedy_fast_path_chooses_as_the_full_path() -> None:
    """A greedy sampler with a logit_bias (ignore_eos bans the end tokens) and no penalty also takes
    one arg-max pass, over a biased copy: the same choice as distribution() with bans, boosts that
    win, a bias given twice to one id (added in order), ties made by a bias; the same refusals (NaN,
    +inf even on a banned id, everything banned); the logits given are not changed."""
    from infer.sampler import NonFiniteLogits

    rng = np.random.default_rng(5)
    rows = [rng.normal(size=500).astype(np.float32) for _ in range(10)]
    top = int(np.argmax(rows[0]))
    biases = [((top, float("-inf")),), ((7, 3.5), (7, 0.25), (9, -1.0)), ((11, float(rows[0][top] - rows[0][11])),),
              ((1, float("-inf")), (2, float("-inf")), (400, 50.0))]
    for bias in biases:
        sampler = Sampler(_config(temperature=0, logit_bias=bias))
        assert sampler.biased_argmax_only and not sampler.argmax_only
        for row in rows:
            kept = row.copy()
            assert sampler.sample(row) == int(sampler.distribution(row)[0][0])
            assert np.array_equal(row, kept)
    assert not Sampler(_config(temperature=0, logit_bias=((1, 1.0),), repeat_penalty=1.1)).biased_argmax_only
    assert not Sampler(_config(temperature=0.7, logit_bias=((1, 1.0),))).biased_argmax_only
    banned = Sampler(_config(temperature=0, logit_bias=((42, float("-inf")),)))
    for bad in (np.nan, np.inf):
        row = rows[0].copy()
        row[42] = bad
        with pytest.raises(NonFiniteLogits):
            banned.sample(row)
    with pytest.raises(ValueError, match="every token is excluded"):
        Sampler(_config(temperature=0, logit_bias=tuple((i, float("-inf")) for i in range(4)))).sample(rows[0][:4])


def test_top_k_and_nucleus_without_sorting_the_vocabulary_are_the_sorted_prefixes() -> None:
    """_top_k_ids and _nucleus_ids (a server samples 128k logits per sequence per token) give what
    sorting the whole vocabulary gives: the same ids in the same order (ties to the lower id), on
    random rows, peaked rows, rows full of ties and rows with banned tokens."""
    from infer.sampler import _nucleus_ids, _top_k_ids

    rng = np.random.default_rng(6)
    rows = [rng.normal(scale=s, size=5000).astype(np.float32) for s in (0.5, 3.0, 12.0)]
    rows.append(np.round(rng.normal(size=5000), 1).astype(np.float32))  # many ties everywhere
    banned = rng.normal(size=5000).astype(np.float32)
    banned[rng.choice(5000, 4000, replace=False)] = -np.inf
    rows.append(banned)
    for row in rows:
        order = np.argsort(-row, kind="stable")
        for k in (1, 7, 40, 600, 4999):
            assert np.array_equal(_top_k_ids(row, k), order[:k])
        finite = order[: int(np.isfinite(row).sum())]
        for p in (0.05, 0.5, 0.9, 0.95, 0.999):
            want, _ = top_p_filter(finite, row[finite], p)
            got = _nucleus_ids(row, p)
            assert np.array_equal(got, want), (p, got.size, want.size)
