"""Choosing the next token from a logits vector.

Steps run in llama.cpp's default order: logit biases, then the penalties over the last
`repeat_last_n` tokens (repetition, then frequency and presence), then a constraint's mask (tokens a
grammar forbids), then top-k, top-p and min-p (all judged at temperature 1), then temperature, then
a draw from the softmax of what is left. Temperature 0 skips the filters and the draw: the token is the argmax
(of the penalized logits, which are the raw logits when repeat_penalty is 1). So does any
temperature below GREEDY_BELOW (1e-6): it could only split logits closer than a millionth, and
dividing by it would overflow (1e-320 gave NaN probabilities and garbage).

Defaults are llama.cpp's own (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, repetition
penalty 1.0 = off over the last 64 tokens); a seed of None draws a fresh one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from infer.errors import NonFiniteValues

GREEDY_BELOW = 1e-6  # temperatures under this are greedy (the module docstring says why)

@dataclass(frozen=True)
class SamplerConfig:
    temperature: float = 0.8   # 0 = greedy
    top_k: int = 40            # keep the k most likely tokens; 0 = off
    top_p: float = 0.95        # keep the most likely tokens whose probabilities sum to top_p; 1 = off
    min_p: float = 0.05        # drop tokens less likely than min_p times the most likely one; 0 = off
    repeat_penalty: float = 1.0  # >1 discourages tokens seen in the window; 1 = off
    repeat_last_n: int = 64    # window of the penalty in tokens; 0 = off, -1 = the whole history
    seed: int | None = None    # None = a different random sequence every run
    frequency_penalty: float = 0.0  # minus this times a token's count in the window; 0 = off
    presence_penalty: float = 0.0   # minus this from every token seen in the window; 0 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit); -inf bans it

    def __post_init__(self) -> None:
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0, not {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0, not {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], not {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], not {self.min_p}"),
            (self.repeat_penalty > 0, f"repeat_penalty must be > 0, not {self.repeat_penalty}"),
            (self.repeat_last_n >= -1, f"repeat_last_n must be >= -1, not {self.repeat_last_n}"),
            (math.isfinite(self.frequency_penalty), f"frequency_penalty must be finite, not {self.frequency_penalty}"),
            (math.isfinite(self.presence_penalty), f"presence_penalty must be finite, not {self.presence_penalty}"),
            (all(not math.isnan(b) and b != math.inf for _, b in self.logit_bias),
             "a logit bias must be a number or -inf"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalizes(self) -> bool:
        """True when a repetition, frequency or presence penalty is on (the choice depends on history)."""
        return (self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0) and self.repeat_last_n != 0

    @property
    def reshapes_logits(self) -> bool:
        """True when a choice is not made from the raw logits: a penalty or a bias is on."""
        return self.penalizes or bool(self.logit_bias)


def apply_repeat_penalty(logits: np.ndarray, history: Sequence[int], penalty: float, last_n: int) -> np.ndarray:
    """A copy of `logits` where every token that occurs in the last `last_n` ids of `history` is made
    less likely: a positive logit is divided by `penalty`, a negative one multiplied (llama.cpp's rule;
    dividing a negative logit would raise it). Each token is penalized once however often it occurs."""
    out = np.array(logits, dtype=np.float32, copy=True)
    if penalty == 1.0 or last_n == 0 or not history:
        return out
    window = history if last_n < 0 else history[-last_n:]
    seen = np.unique(np.asarray(window, dtype=np.int64))
    seen = seen[(seen >= 0) & (seen < out.size)]
    values = out[seen]
    out[seen] = np.where(values <= 0, values * penalty, values / penalty)
    return out


def apply_count_penalties(logits: np.ndarray, history: Sequence[int], frequency: float, presence: float,
                          last_n: int) -> np.ndarray:
    """`logits` (changed in place and returned) less frequency x count + presence for every token
    that occurs in the last `last_n` ids of `history` (llama.cpp's penalties sampler, as OpenAI's
    frequency_penalty and presence_penalty define them)."""
    if (frequency == 0.0 and presence == 0.0) or last_n == 0 or not history:
        return logits
    window = np.asarray(history if last_n < 0 else history[-last_n:], dtype=np.int64)
    window = window[(window >= 0) & (window < logits.size)]
    seen, counts = np.unique(window, return_counts=True)
    logits[seen] -= (counts * frequency + presence).astype(np.float32)
    return logits


def apply_logit_bias(logits: np.ndarray, bias: Sequence[tuple[int, float]]) -> np.ndarray:
    """`logits` (changed in place and returned) with each (token id, bias) added; ids outside the
    vocabulary are ignored (the server refuses them before)."""
    for token, value in bias:
        if 0 <= token < logits.size:
            logits[token] += np.float32(value)
    return logits


class Constraint(Protocol):
    """What limits the next token beyond the logits (a grammar): the tokens allowed now, and the
    token chosen, told back."""

    def allowed(self, vocab_size: int) -> np.ndarray: ...  # bool (vocab_size,)

    def accept(self, token: int) -> None: ...


def top_k_filter(ids: np.ndarray, logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Candidates sorted by logit, highest first, are cut to the first k (k = 0 keeps all)."""
    return (ids[:k], logits[:k]) if 0 < k < ids.size else (ids, logits)


def top_p_filter(ids: np.ndarray, logits: np.ndarray, p: float) -> tuple[np.ndarray, np.ndarray]:
    """Keep the shortest prefix of the sorted candidates whose probability sum reaches p."""
    if p >= 1.0:
        return ids, logits
    cumulative = np.cumsum(_softmax(logits))
    keep = int(np.searchsorted(cumulative, p, side="left")) + 1
    return ids[:keep], logits[:keep]


def min_p_filter(ids: np.ndarray, logits: np.ndarray, min_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Keep candidates whose probability is at least min_p times the top one's (compared in logits)."""
    if min_p <= 0.0:
        return ids, logits
    threshold = logits[0] + math.log(min_p)
    keep = max(1, int(np.count_nonzero(logits >= threshold)))
    return ids[:keep], logits[:keep]


def argmax_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, maxima, nonfinite) of each row of logits (n, vocab) by the GPU decode sampler's rule:
    the arg-max with ties to the lowest id and NaN never chosen, that value, and the row's count of
    NaN and +inf. The reference of the `argmax_rows` kernel and its host path (infer.gpu.tree)."""
    nan = np.isnan(rows)
    clean = np.where(nan, -np.inf, rows)
    ids = np.argmax(clean, axis=1)
    return ids, clean[np.arange(len(ids)), ids], (nan | np.isposinf(rows)).sum(axis=1)


NOTHING_LEFT = "every token is excluded (by logit_bias or a constraint): nothing can be chosen"


class NonFiniteLogits(NonFiniteValues):
    """The model produced NaN or +inf logits: its weights (or how they were read) are broken."""

    def __init__(self, logits: np.ndarray) -> None:
        nan, inf = int(np.isnan(logits).sum()), int(np.isposinf(logits).sum())
        super().__init__(f"the model produced non-finite logits ({nan} NaN and {inf} +inf of {logits.size}): "
                         "its weights are damaged or were read from the wrong place")


def log_probabilities(logits: np.ndarray, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of `token` under softmax(logits) (the model's distribution, before any
    penalty, filter or temperature) and the `top` most likely ids with theirs, most likely first."""
    scores = np.asarray(logits, dtype=np.float64)
    peak = scores.max()
    log_sum = peak + math.log(float(np.exp(scores - peak).sum()))
    best: list[tuple[int, float]] = []
    if top > 0:
        part = np.argpartition(-scores, min(top, scores.size) - 1)[:top]
        part = part[np.argsort(-scores[part], kind="stable")]
        best = [(int(i), float(scores[i] - log_sum)) for i in part]
    return float(scores[token] - log_sum), best


def _checked_argmax(logits: np.ndarray) -> int:
    """The greedy choice in one pass over the logits (a server samples a row per sequence per step):
    the arg-max of their float32 values, ties to the lowest id. NumPy's arg-max returns a NaN's
    position when there is one, and +inf is the largest value, so checking the chosen value alone
    catches what the full path refuses (NonFiniteLogits)."""
    logits = np.asarray(logits)
    if logits.ndim != 1 or logits.size == 0:
        raise ValueError(f"logits must be a non-empty vector, not an array of shape {logits.shape}")
    if logits.dtype != np.float32:  # the full path compares float32 copies: ties there are ties here
        logits = logits.astype(np.float32)
    token = int(np.argmax(logits))
    value = logits[token]
    if np.isnan(value) or np.isposinf(value):
        raise NonFiniteLogits(logits)
    if np.isneginf(value):
        raise ValueError(NOTHING_LEFT)
    return token


def _sorted_from(scores: np.ndarray, floor: float) -> np.ndarray:
    """The ids of the scores at or above `floor`, highest first, ties to the lower id."""
    pool = np.flatnonzero(scores >= floor)
    return pool[np.argsort(-scores[pool], kind="stable")]


def _top_k_ids(scores: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k highest scores, highest first, ties to the lower id, without sorting the
    vocabulary: the k-th highest of every 8th score is at most the k-th highest of all, so the scores
    at or above it hold the top k (and every tie at its edge); only those are sorted."""
    sample = scores[:: 8]
    if sample.size <= k:
        return np.argsort(-scores, kind="stable")[:k]
    return _sorted_from(scores, np.partition(sample, sample.size - k)[sample.size - k])[:k]


def _nucleus_ids(scores: np.ndarray, p: float) -> np.ndarray:
    """top_p_filter over the whole vocabulary without sorting it: the shortest prefix of the scores,
    highest first (ties to the lower id), whose probability reaches p. The k highest scores (and their
    ties) are found by a partition, k growing until they hold the mass p; only they are sorted."""
    weights = np.exp(scores.astype(np.float64) - scores.max())  # banned tokens (-inf) weigh 0
    total = weights.sum()
    n, k = scores.size, 256
    while k < n:
        order = _sorted_from(scores, np.partition(scores, n - k)[n - k])
        if weights[order].sum() >= p * total:
            break
        k *= 8
    else:
        order = np.argsort(-scores, kind="stable")
    keep = int(np.searchsorted(np.cumsum(weights[order]) / total, p, side="left")) + 1
    return order[:keep]


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits.astype(np.float64) - logits.max())
    return shifted / shifted.sum()


class Sampler:
    """`sample(logits, history)` returns the next token id; the same seed gives the same choices."""

    def __init__(self, config: SamplerConfig | None = None, constraint: Constraint | None = None) -> None:
        self.config = config or SamplerConfig()
        self.constraint = constraint  # told every token sample() returns
        self._rng = np.random.default_rng(self.config.seed)

    def __call__(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        return self.sample(logits, history)

    @property
    def argmax_only(self) -> bool:
        """True when a choice is the plain arg-max of the logits (greedy, no repetition penalty):
        infer.speculative.follow may then take it from the device (ties to the lowest id either way)."""
        return self.config.greedy and not self.config.reshapes_logits and self.constraint is None

    @property
    def biased_argmax_only(self) -> bool:
        """True when a choice is the arg-max of the logits plus the logit_bias (greedy, no penalty, no
        constraint): a server may find it where the logits are (ignore_eos is a bias of -inf)."""
        return self.config.greedy and not self.config.penalizes and self.constraint is None

    def distribution(self, logits: np.ndarray, history: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """The candidates the draw picks from and their probabilities, most likely first."""
        cfg = self.config
        scores = self._penalized(logits, history)
        if cfg.greedy:
            return np.array([int(np.argmax(scores))]), np.ones(1)
        nucleus = not 0 < cfg.top_k < scores.size and cfg.top_p < 1.0
        if 0 < cfg.top_k < scores.size:
            ids = _top_k_ids(scores, cfg.top_k)  # only the k best are sorted
        elif nucleus:
            ids = _nucleus_ids(scores, cfg.top_p)  # top-p over the whole vocabulary: only the nucleus is sorted
        else:
            ids = np.argsort(-scores, kind="stable")
        kept = scores[ids]
        allowed = int(np.count_nonzero(np.isfinite(kept)))  # banned tokens (-inf) sort last
        ids, kept = ids[:allowed], kept[:allowed]
        ids, kept = top_k_filter(ids, kept, cfg.top_k)
        if not nucleus:
            ids, kept = top_p_filter(ids, kept, cfg.top_p)
        ids, kept = min_p_filter(ids, kept, cfg.min_p)
        return ids, _softmax(kept / cfg.temperature)

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        cfg = self.config
        if self.biased_argmax_only:  # a bias goes on a copy (NaN stays NaN, +inf banned becomes NaN: refused)
            if cfg.logit_bias:
                logits = apply_logit_bias(np.array(logits, np.float32, copy=True), cfg.logit_bias)
            return _checked_argmax(logits)
        if not cfg.greedy and not 0 < cfg.top_k < np.size(logits) and cfg.top_p >= 1.0 and cfg.min_p <= 0.0:
            # no filter: the draw runs over the whole vocabulary in id order, with no sort (OpenAI's
            # defaults; a sort of 128k logits per token costs a server several ms a sequence)
            scores = self._penalized(logits, history)
            weights = np.exp(((scores - scores.max()) / np.float32(cfg.temperature)).astype(np.float64))
            cumulative = np.cumsum(weights)  # a banned token weighs 0: the draw never lands on it
            token = int(np.searchsorted(cumulative, self._rng.random() * cumulative[-1], side="right"))
            if token >= scores.size:  # the draw rounded up to the total: the last token that weighs
                token = int(np.flatnonzero(weights)[-1])
        else:
            token = self._draw(*self.distribution(logits, history))
        if self.constraint is not None:
            self.constraint.accept(token)
        return token

    def _draw(self, ids: np.ndarray, probs: np.ndarray) -> int:
        if ids.size == 1:
            token = int(ids[0])
        else:
            index = int(np.searchsorted(np.cumsum(probs), self._rng.random() * probs.sum(), side="right"))
            token = int(ids[min(index, ids.size - 1)])
        return token

    def _penalized(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        logits = np.asarray(logits)
        if logits.ndim != 1 or logits.size == 0:
            raise ValueError(f"logits must be a non-empty vector, not an array of shape {logits.shape}")
        top = logits.max()  # NaN when any is NaN (one pass); -inf is a masked token, not a fault
        if np.isnan(top) or np.isposinf(top):
            raise NonFiniteLogits(logits)
        cfg = self.config
        scores = np.array(logits, dtype=np.float32, copy=True)
        apply_logit_bias(scores, cfg.logit_bias)
        if cfg.repeat_penalty != 1.0 and cfg.repeat_last_n != 0:
            scores = apply_repeat_penalty(scores, history, cfg.repeat_penalty, cfg.repeat_last_n)
        apply_count_penalties(scores, history, cfg.frequency_penalty, cfg.presence_penalty, cfg.repeat_last_n)
        if self.constraint is not None:
            scores[~self.constraint.allowed(scores.size)] = -np.inf
        if not np.isfinite(scores.max()):
            raise ValueError(NOTHING_LEFT)
        return scores
