"""The packed path's layers in C (infer.cpu_layers through infer.cpu_kernels, native/cpu_layers.c)
against the NumPy reference.

RMSNorm and rope must give the reference's bits. Attention sums in its own fixed order (the
reference's products are OpenBLAS's, its exp NumPy's): it must stay within a bound derived below from
the reference's float16 rounding of the probabilities, and be bit-identical across the AVX2 and the
portable code, thread counts, and a prompt's rows against the same rows decoded one at a time. Kept
beside test_cpu_kernels.py (the products) for its length; each test prints its seed.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from infer import cpu_kernels, cpu_layers
from infer.layers import Rope
from infer.model import rms_norm

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason="CPU kernels not built (python native/build_cpu_kernels.py)")


def _implementations() -> list[str]:
    return ["avx2", "portable"] if cpu_kernels.cpu_has_avx2() else ["portable"]


def _bits(y: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(y).view(np.uint32)


def _wide(rng: np.random.Generator, shape: tuple[int, ...], spread: float = 8.0) -> np.ndarray:
    """Values over many binades (the order of a float sum then matters), as hidden states' outliers."""
    return (rng.standard_normal(shape) * np.exp(rng.uniform(-spread, spread, shape))).astype(np.float32)


# ---------------------------------------------------------------- RMSNorm and rope: the reference's bits

@pytest.mark.parametrize("cols", [1, 7, 8, 100, 128, 129, 576, 896, 4096, 8192 + 37, 20000])
def test_rms_norm_is_the_reference(rng: np.random.Generator, cols: int) -> None:
    """NumPy's pairwise double sum, its cast buffers of 8192 included (the C code repeats both)."""
    for rows in (1, 3):
        x, w = _wide(rng, (rows, cols)), rng.standard_normal(cols).astype(np.float32)
        for eps in (1e-5, 1e-6):
            assert np.array_equal(_bits(cpu_layers.rms_norm(x, w, eps)), _bits(rms_norm(x, w, eps)))


def test_rms_norm_of_heads_in_a_strided_view(rng: np.random.Generator) -> None:
    """Qwen3's and Gemma's per-head norms take the Q columns of a QKV product."""
    qkv = _wide(rng, (5, 9 * 64 + 2 * 3 * 64))
    q, w = qkv[:, : 9 * 64].reshape(5, 9, 64), rng.standard_normal(64).astype(np.float32)
    assert np.array_equal(_bits(cpu_layers.rms_norm(q, w, 1e-6)), _bits(rms_norm(q, w, 1e-6)))


def _rope(n_pairs: int, neox: bool, fma: bool) -> Rope:
    """What Rope.apply reads of a Rope (its angles come from the caller)."""
    return SimpleNamespace(n_pairs=n_pairs, args=SimpleNamespace(rope_neox=neox), fma=fma)  # type: ignore[return-value]


def _angles(rng: np.random.Generator, n: int, n_pairs: int) -> tuple[np.ndarray, np.ndarray]:
    theta = rng.uniform(-100, 100, (n, n_pairs)).astype(np.float32)
    return np.cos(theta), np.sin(theta)


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("fma", [False, True])
@pytest.mark.parametrize(("head_dim", "rope_dim"), [(64, 64), (80, 80), (6, 6), (128, 64), (10, 4)])
def test_rope_is_the_reference(rng: np.random.Generator, neox: bool, fma: bool, head_dim: int, rope_dim: int) -> None:
    n, heads, kv_heads = 7, 5, 1
    qkv = _wide(rng, (n, (heads + 2 * kv_heads) * head_dim), 4.0)
    cos, sin = _angles(rng, n, rope_dim // 2)
    rope = _rope(rope_dim // 2, neox, fma)
    for x in (qkv[:, : heads * head_dim].reshape(n, heads, head_dim),  # rows strided, as in the engine
              np.ascontiguousarray(qkv[:1, heads * head_dim : (heads + 1) * head_dim].reshape(1, 1, head_dim))):
        want = Rope.apply(rope, x, cos[: len(x)], sin[: len(x)])
        got = cpu_layers.rope(x, cos[: len(x)], sin[: len(x)], rope.n_pairs, neox, fma)
        assert np.array_equal(_bits(got), _bits(want))


# ---------------------------------------------------------------- attention: a bound, then bit-identity

def test_exp_softmax_is_within_one_ulp(rng: np.random.Generator) -> None:
    x = np.concatenate([-rng.uniform(0, 87, 200_000), -rng.uniform(0, 1e-3, 1000),
                        [0.0, -0.0, -1e-30, -87.0, -0.5, -np.log(2)]]).astype(np.float32)
    got, want = cpu_layers.exp_softmax(x).astype(np.float64), np.exp(x.astype(np.float64))
    ulp = np.spacing(want.astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(got - want) / ulp) <= 1.0
    assert np.all(cpu_layers.exp_softmax(np.array([-87.01, -100, -np.inf], np.float32)) == 0)


def reference_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, first: int, start: int,
                        mask: np.ndarray | None, q_scale: float, scale: float,
                        sinks: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """infer.model.Transformer._attention's lines after the cache store (float32 numerics), q rotated:
    the output (T, heads * head_dim) and the float16 probabilities (kv, group, T, S) as float32;
    sinks (heads,): gpt-oss's logit per head in each softmax."""
    n, heads, hd = q.shape
    kv = keys.shape[1]
    if q_scale != 1.0:  # Gemma
        q = (q * np.float32(q_scale)).astype(np.float32)
    q = q.astype(np.float16).astype(np.float32).reshape(n, kv, heads // kv, hd).transpose(1, 2, 0, 3)
    scores = (q @ keys.astype(np.float32).transpose(1, 2, 0)[:, None]).astype(np.float32) * np.float32(scale)
    if mask is not None:
        scores[..., ~mask] = -np.inf
    else:
        scores[..., np.arange(first, first + len(keys))[None, :] > np.arange(start, start + n)[:, None]] = -np.inf
    top = scores.max(axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.astype(np.float32).reshape(kv, heads // kv, 1, 1)
        top = np.maximum(top, sink)
    exps = np.exp(scores - top)
    total = exps.sum(axis=-1, keepdims=True)
    if sinks is not None:
        total = total + np.exp(sink - top)
    probs = (exps / total).astype(np.float16).astype(np.float32)
    out = probs @ values.astype(np.float32).transpose(1, 0, 2)[:, None]
    return out.transpose(2, 0, 1, 3).reshape(n, heads * hd), probs


def _bound(q: np.ndarray, keys: np.ndarray, values: np.ndarray, probs: np.ndarray, scale: float) -> np.ndarray:
    """|ours - reference| per output. The two sum the scores, the exponentials and the weighted
    values in other orders, and use other exps: the float32 probabilities differ by a relative
    delta <= 2 (head_dim u max|q||k| scale + S u + 2u) (u = 2^-24), and rounding them to float16 can
    then move each by one float16 step more (<= 2^-10 p, or 2^-24 below the normal halves). Each
    weighted sum of S terms adds S u of its size on either side."""
    n, heads, hd = q.shape
    kv, s, u = keys.shape[1], keys.shape[0], 2.0**-24
    q16 = np.abs(q.astype(np.float16).astype(np.float64)).reshape(n, kv, heads // kv, hd).transpose(1, 2, 0, 3)
    k16 = np.abs(keys.astype(np.float64)).transpose(1, 2, 0)[:, None]
    delta = 2 * (hd * u * (q16 @ k16).max() * abs(scale) + (s + 1) * u + 2 * u)  # + 1: a sink's term
    v = np.abs(values.astype(np.float64)).transpose(1, 0, 2)[:, None]  # (kv, 1, S, hd)
    weighted = probs.astype(np.float64) @ v
    bound = 1.01 * (2.0**-10 + delta + 2 * s * u) * weighted + u * v.sum(axis=2, keepdims=True)
    return bound.transpose(2, 0, 1, 3).reshape(n, heads * hd)


CASES = {  # T rows, S slots, heads, KV heads, head_dim, what
    "decode": (1, 37, 9, 3, 64, "causal"), "decode, odd head_dim": (1, 21, 4, 2, 36, "causal"),
    "decode, head_dim 256": (1, 50, 4, 1, 256, "causal"), "prompt": (23, 23, 14, 2, 64, "causal"),
    "prompt after a cache": (11, 40, 6, 6, 32, "causal"), "ring window": (3, 17, 4, 2, 64, "window"),
    "token tree": (9, 30, 8, 2, 64, "tree"), "Gemma's scaled queries": (5, 12, 4, 1, 256, "gemma"),
}


def _case(rng: np.random.Generator, n: int, s: int, heads: int, kv: int, hd: int, what: str):  # noqa: ANN202
    """Inputs as the engine makes them: float32 queries, float16 slots, the first slot's position, the
    first row's and the mask (None: causal)."""
    q = _wide(rng, (n, heads, hd), 1.0)
    keys, values = (_wide(rng, (s, kv, hd), 1.0).astype(np.float16) for _ in range(2))
    first, start, mask = 0, s - n, None
    if what == "window":  # a local layer's ring: slots of positions first.., each row its window of 8
        first, start = 100, 100 + s - n
        pos = np.arange(first, first + s)[None, :]
        rows = np.arange(start, start + n)[:, None]
        mask = (pos <= rows) & (rows - pos < 8)
    elif what == "tree":  # the cache, then nodes that each see their ancestors (random parents)
        parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]
        mask = np.zeros((n, s), bool)
        mask[:, : s - n] = True
        for i, p in enumerate(parents):
            if p >= 0:
                mask[i, s - n : s - n + i] = mask[p, s - n : s - n + i]
            mask[i, s - n + i] = True
    return q, keys, values, first, start, mask


def _sinks(rng: np.random.Generator, heads: int, with_sinks: bool) -> np.ndarray | None:
    """gpt-oss's sinks: a logit per head, spread like the scores (some above them, some below), and
    head 0's far above every score, so that it takes nearly all of that head's probability (the sink
    is then the maximum the exponentials are taken from)."""
    if not with_sinks:
        return None
    sinks = rng.uniform(-3.0, 3.0, heads).astype(np.float32)
    sinks[0] = 30.0
    return sinks


@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("case", CASES)
def test_attention_is_within_the_bound_of_the_reference(rng: np.random.Generator, case: str, with_sinks: bool) -> None:
    n, s, heads, kv, hd, what = CASES[case]
    q, keys, values, first, start, mask = _case(rng, n, s, heads, kv, hd, what)
    sinks = _sinks(rng, heads, with_sinks)
    q_scale, scale = (np.float32(hd**-0.5), 1.0) if what == "gemma" else (1.0, float(np.float32(hd**-0.5)))
    n_pairs = hd // 4  # a partial rotation: the C code rotates q itself
    cos, sin = _angles(rng, n, n_pairs)
    rotated = Rope.apply(_rope(n_pairs, True, True), q, cos, sin)
    want, probs = reference_attention(rotated, keys, values, first, start, mask, q_scale, scale, sinks)
    bound = _bound(rotated * np.float32(q_scale), keys, values, probs, scale)
    for name in _implementations():
        cpu_kernels.set_implementation(name)
        attend = cpu_layers.Attention(heads, kv, hd, n_pairs, True, True, q_scale, scale, threads=2)
        got = attend(q, cos, sin, keys, values, first, start, mask, sinks)
        err = np.abs(got.astype(np.float64) - want)
        assert np.all(err <= bound), f"{name}: worst error {np.max(err / bound):.3g} x the bound"
        unrotated = cpu_layers.Attention(heads, kv, hd, 0, True, True, q_scale, scale, threads=1)
        assert np.array_equal(_bits(unrotated(rotated, None, None, keys, values, first, start, mask, sinks)), _bits(got))
    if sinks is not None:  # the sinks took a share: without them the output is another one
        plain, _ = reference_attention(rotated, keys, values, first, start, mask, q_scale, scale)
        assert np.max(np.abs(plain - want)) > 10 * np.max(bound)


@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("case", ["prompt", "decode, odd head_dim", "token tree", "ring window"])
def test_attention_is_the_same_everywhere(rng: np.random.Generator, case: str, with_sinks: bool) -> None:
    """The same bits on either code path, at any thread count, and for a row whether it rides with
    the others or is decoded alone over just the slots it sees, in order (a prompt's row over the
    slots up to it, a tree's node over the cache and its ancestors, a window's row over its window),
    or is masked causally by an explicit mask."""
    n, s, heads, kv, hd, what = CASES[case]
    q, keys, values, first, start, mask = _case(rng, n, s, heads, kv, hd, what)
    sinks = _sinks(rng, heads, with_sinks)
    scale = float(np.float32(hd**-0.5))
    results = []
    for name in _implementations():
        cpu_kernels.set_implementation(name)
        for threads in (1, 2, 3):
            results.append(cpu_layers.Attention(heads, kv, hd, 0, False, True, 1.0, scale, threads)(
                q, None, None, keys, values, first, start, mask, sinks))
    for got in results[1:]:
        assert np.array_equal(_bits(got), _bits(results[0]))
    attend = cpu_layers.Attention(heads, kv, hd, 0, False, True, 1.0, scale, threads=2)
    causal = np.arange(first, first + s)[None, :] <= np.arange(start, start + n)[:, None]
    seen = causal if mask is None else mask
    for t in range(n):  # row t alone, its slots gathered in order as the last positions of a cache
        slots = np.flatnonzero(seen[t])
        alone = attend(q[t : t + 1], None, None, keys[slots], values[slots], 0, len(slots) - 1, None, sinks)
        assert np.array_equal(_bits(alone[0]), _bits(results[0][t])), f"row {t}"
    if mask is None:
        assert np.array_equal(_bits(attend(q, None, None, keys, values, first, start, causal, sinks)),
                              _bits(results[0]))
