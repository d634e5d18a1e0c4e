"""Each CUDA kernel against a NumPy reference on fresh random inputs: the products bit for bit
against the canonical sum (infer/gpu/reference.py) for every weight type and every kernel shape
(N from 1 to 512), the others within a bound per kernel; no NaN, and every output element written
(outputs are poisoned with NaN first); rows computed alone, in a batch and as tree nodes give the
same bits. The seed of each test's inputs is printed, so a failure can be replayed."""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from infer.arch import ModelArgs
from infer.gpu import layout
from infer.layers import Rope
from infer.synth import random_blocks

cupy = pytest.importorskip("cupy")
from infer.gpu import attention as attn  # noqa: E402
from infer.gpu import ops, products  # noqa: E402

pytestmark = pytest.mark.gpu
T = GGMLQuantizationType
TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]


@pytest.fixture
def rng() -> np.random.Generator:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    return np.random.default_rng(seed)


def _tensor(rng: np.random.Generator, ggml_type: int, rows: int, cols: int) -> np.ndarray:
    block, _ = GGML_QUANT_SIZES[T(ggml_type)]
    if ggml_type == T.BF16:
        values = (rng.standard_normal(rows * cols) * 0.05).astype(np.float32)
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    return random_blocks(ggml_type, rows * cols // block, rng, 1.0 / np.sqrt(cols)).reshape(-1)


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


def _poisoned(shape: tuple[int, ...] | int, dtype: object = np.float32) -> cupy.ndarray:
    return cupy.full(shape, np.nan, dtype=dtype)


def _matrix(rng: np.random.Generator, ggml_type: int, rows: int, cols: int) -> tuple[ops.GpuMatrix, np.ndarray]:
    """A random matrix on the GPU and its weights as GGUF defines them (float64, for references)."""
    raw = _tensor(rng, ggml_type, rows, cols)
    m = ops.upload_matrix(raw, ggml_type, rows, cols)
    return m, layout.reconstruct(layout.repack(raw, ggml_type, rows, cols), m.fmt, rows, cols).astype(np.float64)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: T(t).name)
def test_repack_matches_numpy_layout(rng: np.random.Generator, ggml_type: int) -> None:
    rows, cols = 48, 1024
    raw = _tensor(rng, ggml_type, rows, cols)
    m = ops.upload_matrix(raw, ggml_type, rows, cols)
    want = np.frombuffer(layout.repack(raw, ggml_type, rows, cols), np.uint8)
    got = cupy.asnumpy(m.buffer)
    lay = m.layout
    for offset, size in zip(lay.offsets, lay.sizes, strict=True):  # padding between planes is undefined
        if size:
            np.testing.assert_array_equal(got[offset : offset + size], want[offset : offset + size])


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: T(t).name)
def test_upload_in_runs_of_rows_gives_the_same_planes(rng: np.random.Generator, ggml_type: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A matrix whose GGUF bytes cross in runs of 256 rows (ops.UPLOAD_CHUNK_BYTES) repacks into the
    planes the whole upload makes, Q/K/V-style stacked parts included."""
    rows, cols = 600, 512
    parts = [(_tensor(rng, ggml_type, rows, cols), rows), (_tensor(rng, ggml_type, 256, cols), 256)]
    whole = ops.upload_stacked(parts, ggml_type, cols)
    monkeypatch.setattr(ops, "UPLOAD_CHUNK_BYTES", 1)
    assert len(ops._in_chunks(parts)) == 4
    runs = ops.upload_stacked(parts, ggml_type, cols)
    got, want = cupy.asnumpy(runs.buffer), cupy.asnumpy(whole.buffer)
    for offset, size in zip(whole.layout.offsets, whole.layout.sizes, strict=True):
        if size:
            np.testing.assert_array_equal(got[offset : offset + size], want[offset : offset + size])


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: T(t).name)
def test_dequantize_and_embed(rng: np.random.Generator, ggml_type: int) -> None:
    rows, cols = 40, 512
    raw = _tensor(rng, ggml_type, rows, cols)
    m = ops.upload_matrix(raw, ggml_type, rows, cols)
    w = layout.reconstruct(layout.repack(raw, ggml_type, rows, cols), m.fmt, rows, cols)
    out = _poisoned(rows * cols, cupy.float16)
    ops.dequantize(m, out)
    np.testing.assert_array_equal(cupy.asnumpy(out).reshape(rows, cols), w.astype(np.float16))
    ids = np.array([3, 0, rows - 1, 3, rows, -1], np.int32)  # the last two are out of range -> zeros
    emb = _poisoned((len(ids), cols))
    ops.embed(m, cupy.asarray(ids), len(ids), emb)
    got = cupy.asnumpy(emb)
    np.testing.assert_allclose(got[:4], w[ids[:4]], rtol=1e-6, atol=1e-7)
    assert not got[4:].any()
    scale = float(np.sqrt(np.float32(640)))  # Gemma's sqrt(width): each value times it, rounded once
    ops.embed(m, cupy.asarray(ids), len(ids), emb, scale)
    np.testing.assert_array_equal(cupy.asnumpy(emb)[:4], got[:4] * np.float32(scale))


def test_rmsnorm(rng: np.random.Generator) -> None:
    rows, n = 5, 4096
    x = rng.standard_normal((rows, n)).astype(np.float32) * 3
    w = rng.standard_normal(n).astype(np.float32)
    y, y16 = _poisoned((rows, n)), _poisoned((rows, n), cupy.float16)
    ops.rmsnorm(cupy.asarray(x), cupy.asarray(w), 1e-5, rows, n, y=y, y16=y16)
    want = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=1, keepdims=True) + 1e-5) * w
    assert _rel(cupy.asnumpy(y), want) < 1e-6
    assert _rel(cupy.asnumpy(y16).astype(np.float32), want) < 1e-3


ACTS = ["f32", "f16", "bf16", "q8_0", "q8_k"]


@pytest.mark.parametrize("act", ACTS)
def test_round_act_is_the_cpu_rounding(rng: np.random.Generator, act: str) -> None:
    from infer.quants import round_activations

    rows, n = 3, 4096
    x = (rng.standard_normal((rows, n)) * rng.choice([0.01, 1, 300], (rows, 1))).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block
    x[1, 5], x[1, 9] = 7.0, -7.0  # equal magnitudes of opposite sign: the first decides the q8_k scale
    y, y16 = _poisoned((rows, n)), _poisoned((rows, n), cupy.float16)
    ops.round_act(cupy.asarray(x), y, rows, n, act, y16=y16)
    want = round_activations(x, act)
    np.testing.assert_array_equal(cupy.asnumpy(y), want)
    np.testing.assert_array_equal(cupy.asnumpy(y16), want.astype(np.float16))


def _rows_are_rmsnorm_rounded(got: np.ndarray, x: np.ndarray, w: np.ndarray, eps: float, act: str,
                              ulps: int = 8) -> bool:
    """Each row of `got` is exactly round_activations((x / s) * w) for a float32 s within `ulps` of the
    exact root of mean(x^2) + eps. The kernel adds the squares in another order than NumPy, so its
    float32 s may differ from NumPy's by an ulp or a few (a float32 sum of n positive terms is off by
    at most ~log2(n) * 2^-24 relative in tree order: <= 8 ulps of s for n <= 8192); one ulp of s moves
    every value of the row, so bit equality with NumPy's s fails for whole rows (run 3: 25% of the
    values) although nothing is wrong. A wrong count, eps outside the root (10-20 ulps at these
    inputs) or a wrong group in the rounding is no candidate."""
    from infer.quants import round_activations

    for r in range(x.shape[0]):
        s = np.float32(np.sqrt(np.mean(x[r].astype(np.float64) ** 2) + eps))
        for _ in range(ulps):
            s = np.nextafter(s, np.float32(0))
        for _ in range(2 * ulps + 1):
            if np.array_equal(got[r], round_activations(((x[r] / s) * w)[None], act)[0]):
                break
            s = np.nextafter(s, np.float32(np.inf))
        else:
            return False
    return True


@pytest.mark.parametrize("n", [2048, 8192, 896, 900], ids=["registers", "registers-max", "registers-part-warp", "general"])
@pytest.mark.parametrize("act", ACTS)
def test_rmsnorm_rounded(rng: np.random.Generator, act: str, n: int) -> None:
    from infer.model import rms_norm
    from infer.quants import round_activations

    if n % {"q8_0": 32, "q8_k": 256}.get(act, 1):
        pytest.skip(f"{act} rounds blocks of {32 if act == 'q8_0' else 256}")
    rows = 4
    x = rng.standard_normal((rows, n)).astype(np.float32) * 2
    w = rng.standard_normal(n).astype(np.float32)
    y, y16 = _poisoned((rows, n)), _poisoned((rows, n), cupy.float16)
    ops.rmsnorm(cupy.asarray(x), cupy.asarray(w), 1e-5, rows, n, y=y, y16=y16, act=act)
    want = round_activations(rms_norm(x, w, 1e-5), act)
    got = cupy.asnumpy(y)
    assert _rel(got, want) < 1e-3
    assert _rows_are_rmsnorm_rounded(got, x, w, 1e-5, act)
    # y16: the values before rounding, as float16 (the prompt products' input)
    assert _rows_are_rmsnorm_rounded(cupy.asnumpy(y16).astype(np.float32), x, w, 1e-5, "f16")
    if act in ("q8_0", "q8_k"):  # the 8-bit form of one row
        int8 = ops.Int8Act.zeros(1, n, act)
        y1 = _poisoned(n)
        ops.rmsnorm(cupy.asarray(x[0]), cupy.asarray(w), 1e-5, 1, n, y=y1, act=act, int8=int8)
        q, scale, qsum = (cupy.asnumpy(a) for a in (int8.xq, int8.xs, int8.xsum))
        group = 32 if act == "q8_0" else 256
        np.testing.assert_array_equal(q.astype(np.float32) * np.repeat(scale, group), cupy.asnumpy(y1))
        np.testing.assert_array_equal(qsum, q.astype(np.int32).reshape(-1, 32).sum(1))


@pytest.mark.parametrize("act", ["q8_0", "q8_k", "f16", "bf16"])
def test_rmsnorm_with_its_unrounded_values_is_the_two_launches(rng: np.random.Generator, act: str) -> None:
    """rmsnorm8 writing the float32 values beside their rounding (a mixture of experts' router input
    beside the experts' 8-bit one) gives the bits of rmsnorm to float32 then round_act."""
    rows, n = 5, 2048
    x = cupy.asarray(rng.standard_normal((rows, n)).astype(np.float32) * 2)
    w = cupy.asarray(rng.standard_normal(n).astype(np.float32))
    y, raw = _poisoned((rows, n)), _poisoned((rows, n))
    int8 = ops.Int8Act.zeros(rows, n, act) if act in ops.EIGHT_BIT else None
    ops.rmsnorm(x, w, 1e-6, rows, n, y=y, act=act, int8=int8, y_unrounded=raw)
    base, want = _poisoned((rows, n)), _poisoned((rows, n))
    ops.rmsnorm(x, w, 1e-6, rows, n, y=base)
    int8_want = ops.Int8Act.zeros(rows, n, act) if act in ops.EIGHT_BIT else None
    ops.round_act(base, want, rows, n, act, int8=int8_want)
    np.testing.assert_array_equal(cupy.asnumpy(raw), cupy.asnumpy(base))
    np.testing.assert_array_equal(cupy.asnumpy(y), cupy.asnumpy(want))
    if int8 is not None:
        for got_part, want_part in zip((int8.xq, int8.xs, int8.xsum), (int8_want.xq, int8_want.xs, int8_want.xsum), strict=True):
            np.testing.assert_array_equal(cupy.asnumpy(got_part), cupy.asnumpy(want_part))
    with pytest.raises(ValueError, match="only in one pass"):
        ops.rmsnorm(x[:, :900].copy(), w[:900].copy(), 1e-6, rows, 900, y=y, act="f16", y_unrounded=raw)


def _args(neox: bool, n_heads: int, n_kv: int, head_dim: int) -> ModelArgs:
    return ModelArgs(arch="qwen2" if neox else "llama", n_layers=1, dim=n_heads * head_dim, ffn_dim=64,
                     n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, vocab_size=32, context_length=4096,
                     norm_eps=1e-5, rope_base=10000.0, rope_dim=head_dim, rope_neox=neox)


@pytest.mark.parametrize("vocab", [151936, 151941, 1000])  # unrolled loads, with a tail, tail only
def test_argmax_rows_against_numpy(rng: np.random.Generator, vocab: int) -> None:
    """Every row's arg-max, maximum and NaN/+inf count against NumPy; ties to the lowest id and NaN
    never chosen (sample_token's rule), rows of only -inf give id 0."""
    rows = 13
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    logits[np.arange(rows), rng.integers(vocab, size=rows)] = 9.0
    logits[1] = 0.0
    logits[1, [i for i in (7, 900, 9000, 100000, vocab - 1) if i < vocab]] = 1.0  # tie: 7
    logits[2] = 0.0
    logits[2, vocab - 1] = 1.0  # the maximum in the last element (the tail loop)
    logits[3, [3, 50, vocab - 2]] = np.nan
    logits[4, 0] = np.inf
    logits[5] = -np.inf
    ids, maxima, bad = cupy.full(rows, -1, cupy.int32), cupy.full(rows, np.nan, cupy.float32), cupy.full(rows, -1, cupy.int32)
    ops.argmax_rows(cupy.asarray(logits), rows, vocab, ids, maxima, bad)
    clean = np.where(np.isnan(logits), -np.inf, logits)
    want = np.argmax(clean, axis=1)
    assert (cupy.asnumpy(ids) == want).all() and int(ids[1]) == 7 and int(ids[2]) == vocab - 1 and int(ids[5]) == 0
    assert (cupy.asnumpy(maxima) == clean[np.arange(rows), want]).all()
    assert list(cupy.asnumpy(bad)) == [0, 0, 0, 3, 1] + [0] * (rows - 5)


def test_top_rows_is_the_hosts_top_k(rng: np.random.Generator) -> None:
    """ops.top_rows (a draft tree's runners-up on the device) gives speculative.top_k's ids and order
    on random rows, ties to the lower id."""
    from infer.speculative import top_k

    rows, vocab, k = 9, 151936, 5
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    logits[2, [11, 70000, 5, 151935]] = 9.0  # a four-way tie at the top
    logits[3] = np.round(logits[3], 1)  # many ties everywhere
    got = cupy.asnumpy(ops.top_rows(cupy.asarray(logits), rows, k))
    assert got.tolist() == [top_k(row, k).tolist() for row in logits]
    assert got[2, :4].tolist() == [5, 11, 70000, 151935]


def _int8_reference(x: np.ndarray, act: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The int8 values, scales and sums per 32 that round_activations' q8_0/q8_k rounding implies."""
    from infer.quants import round_activations

    group = 32 if act == "q8_0" else 256
    rounded = round_activations(x, act).reshape(-1, group)
    blocks = x.reshape(-1, group)
    if act == "q8_0":
        scale = (np.abs(blocks).max(1) / np.float32(127)).astype(np.float16).astype(np.float32)
    else:
        extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(1)[:, None], 1)[:, 0]
        scale = np.where(extreme != 0, np.float32(1) / (np.float32(-127) / extreme), 0).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale[:, None] != 0, np.rint(rounded / scale[:, None]), 0).astype(np.int32)
    return q.reshape(-1).astype(np.int8), scale, q.reshape(-1, 32).sum(1).astype(np.int32)


@pytest.mark.parametrize("act", ["q8_0", "q8_k"])
def test_round_act_int8_form(rng: np.random.Generator, act: str) -> None:
    n = 4096
    x = (rng.standard_normal(n) * 3).astype(np.float32)
    int8 = ops.Int8Act.zeros(1, n, act)
    y = _poisoned(n)
    ops.round_act(cupy.asarray(x), y, 1, n, act, int8=int8)
    q, scale, qsum = _int8_reference(x, act)
    np.testing.assert_array_equal(cupy.asnumpy(int8.xq), q)
    np.testing.assert_array_equal(cupy.asnumpy(int8.xs), scale)
    np.testing.assert_array_equal(cupy.asnumpy(int8.xsum), qsum)




@pytest.mark.parametrize(("act", "ggml_type"), [("q8_0", T.Q8_0), ("q8_k", T.Q4_K)])
def test_a_nan_activation_makes_its_products_nan(rng: np.random.Generator, act: str, ggml_type: int) -> None:
    """A NaN among a row's activations makes its 8-bit group's scale NaN (and every group's, after an
    RMSNorm of the row), so every product that reads the row is NaN and the logits' check refuses it;
    the other groups and rows round as before. Until 2026-12-05 the NaN lost every comparison and was
    rounded to a finite int8: NaN activations became finite, wrong logits."""
    from infer.quants import activation_format

    assert activation_format(ggml_type) == act
    rows, n, group, bad = 40, 4096, 32 if act == "q8_0" else 256, 300
    x = (rng.standard_normal((rows, n)) * 3).astype(np.float32)
    x[0, bad] = np.nan
    round8 = ops.Int8Act.zeros(rows, n, act)
    ops.round_act(cupy.asarray(x), _poisoned((rows, n)), rows, n, act, int8=round8)
    scale = cupy.asnumpy(round8.xs).reshape(rows, -1)
    assert np.isnan(scale[0, bad // group])
    clean = x.copy()
    clean[0, bad // group * group:(bad // group + 1) * group] = 1.0  # a finite group in the NaN's place
    want = _int8_reference(clean.reshape(-1), act)[1].reshape(rows, -1)
    others = np.arange(scale.shape[1]) != bad // group
    np.testing.assert_array_equal(scale[0, others], want[0, others])
    np.testing.assert_array_equal(scale[1:], want[1:])
    norm8 = ops.Int8Act.zeros(rows, n, act)
    weight = cupy.asarray(rng.standard_normal(n).astype(np.float32))
    ops.rmsnorm(cupy.asarray(x), weight, 1e-5, rows, n, y=_poisoned((rows, n)), act=act, int8=norm8)
    norm_scale = cupy.asnumpy(norm8.xs).reshape(rows, -1)
    assert np.isnan(norm_scale[0]).all() and np.isfinite(norm_scale[1:]).all()
    m = ops.upload_matrix(_tensor(rng, ggml_type, 64, n), ggml_type, 64, n)
    for x8 in (round8, norm8):
        for count in (1, 2, rows):  # qgemv and (for many rows) qmm
            y = _poisoned((count, 64))
            products.product([m], x8, y, count)
            got = cupy.asnumpy(y)
            assert np.isnan(got[0]).all(), (count, products.uses_qmm(m.fmt, n, count))
            assert np.isfinite(got[1:]).all()


# ---------------------------------------------------------------- products: the canonical sum, bit for bit
QUANT_TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]
# every kernel shape: qgemv v1/v2/v4 (and its groups of 4 beyond), qmm n1/n2/n4/n8 with partial tiles
NS = [1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64, 65, 130]


def _activations(rng: np.random.Generator, n: int, cols: int, act: str) -> tuple[np.ndarray, ...]:
    """n random rows in act's 8-bit form (values, scales, sums per 32), some rows scaled far apart."""
    x = (rng.standard_normal((n, cols)) * rng.choice([0.01, 1.0, 50.0], (n, 1))).astype(np.float32)
    q, scale, qsum = _int8_reference(x.reshape(-1), act)
    return q.reshape(n, cols), scale.reshape(n, -1), qsum.reshape(n, -1)


def _device_int8(q: np.ndarray, scale: np.ndarray, qsum: np.ndarray, act: str) -> ops.Int8Act:
    return ops.Int8Act(cupy.asarray(q.reshape(-1)), cupy.asarray(scale.reshape(-1)), cupy.asarray(qsum.reshape(-1)),
                       q.shape[1], act)


def _quant_shape(ggml_type: int) -> list[tuple[int, int]]:
    """(rows, cols): rows not a multiple of the 64-row tiles; cols the 8B's widths, and for the 32-value
    formats a width that is no whole 256 (SmolLM2's 576) and one of 32 * odd (no q8 tensor-core path)."""
    if ggml_type in (T.Q4_K, T.Q5_K, T.Q6_K):
        return [(200, 4096), (72, 14336)]
    return [(200, 4096), (136, 576), (40, 96)]


@pytest.mark.parametrize("ggml_type", QUANT_TYPES, ids=lambda t: T(t).name)
def test_products_are_the_canonical_sum_for_every_row_count(rng: np.random.Generator, ggml_type: int) -> None:
    from infer.gpu.reference import canonical_product
    from infer.quants import activation_format

    act = activation_format(ggml_type)
    for rows, cols in _quant_shape(ggml_type):
        raw = _tensor(rng, ggml_type, rows, cols)
        planar = layout.repack(raw, ggml_type, rows, cols)
        m = ops.upload_matrix(raw, ggml_type, rows, cols)
        q, scale, qsum = _activations(rng, max(NS), cols, act)
        x8 = _device_int8(q, scale, qsum, act)
        want = canonical_product(planar, m.fmt, rows, cols, q, scale, qsum)
        scratch = cupy.zeros(products.SPLIT_SCRATCH_BYTES // 4, cupy.float32)
        for n in NS:
            for split in (None, scratch):  # whole K in one block, and split into groups where blocks are few
                y = _poisoned((n, rows))
                products.product([m], x8, y, n, scratch=split)
                got = cupy.asnumpy(y)
                assert np.isfinite(got).all(), (rows, cols, n)
                np.testing.assert_array_equal(got, want[:n], err_msg=f"{rows}x{cols}, {n} rows, "
                                              f"{'qmm' if products.uses_qmm(m.fmt, cols, n) else 'qgemv'}, "
                                              f"split {split is not None}")


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q5_1, T.Q4_K, T.Q6_K], ids=lambda t: T(t).name)
@pytest.mark.parametrize(("n", "per_warp"), [(1, 1), (1, 2), (1, 4), (4, 1), (4, 4), (40, 1), (512, 1)])
def test_product_of_stacked_parts_with_bias_and_residual(rng: np.random.Generator, ggml_type: int, n: int,
                                                         per_warp: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three matrices of one format as one launch (rows per part not multiples of the tile), plus a
    bias and the residual in place on a strided output: each part's rows are its own product, with
    any number of weight rows a qgemv warp (a warp's rows across the parts' edges)."""
    from infer.gpu.reference import canonical_product
    from infer.quants import activation_format

    monkeypatch.setenv("NVMEDIRECT_QGEMV_ROWS", str(per_warp))

    act, cols = activation_format(ggml_type), 1024
    parts = [(100, _tensor(rng, ggml_type, 100, cols)), (37, _tensor(rng, ggml_type, 37, cols)),
             (70, _tensor(rng, ggml_type, 70, cols))]
    mats = [ops.upload_matrix(raw, ggml_type, r, cols) for r, raw in parts]
    rows = sum(r for r, _ in parts)
    q, scale, qsum = _activations(rng, n, cols, act)
    want = np.concatenate([canonical_product(layout.repack(raw, ggml_type, r, cols), mats[0].fmt, r, cols, q, scale,
                                             qsum) for r, raw in parts], axis=1)
    ldy = rows + 11
    bias = rng.standard_normal(rows).astype(np.float32)
    res = rng.standard_normal((n, ldy)).astype(np.float32)
    for split in (None, cupy.zeros(products.SPLIT_SCRATCH_BYTES // 4, cupy.float32)):
        y = cupy.asarray(res)
        products.product(mats, _device_int8(q, scale, qsum, act), y.reshape(-1), n, ldy=ldy, bias=cupy.asarray(bias),
                         residual=y.reshape(-1), scratch=split)
        got = cupy.asnumpy(y)
        np.testing.assert_array_equal(got[:, :rows], (want + bias[None]) + res[:, :rows])
        np.testing.assert_array_equal(got[:, rows:], res[:, rows:])  # the gap between rows untouched


@pytest.mark.parametrize("ggml_type", [T.F16, T.BF16, T.F32], ids=lambda t: T(t).name)
@pytest.mark.parametrize("n", [1, 3, 70])
def test_float_products_are_the_canonical_sum(rng: np.random.Generator, ggml_type: int, n: int) -> None:
    from infer.gpu.reference import canonical_product

    rows, cols = 130, 576
    raw = _tensor(rng, ggml_type, rows, cols)
    m = ops.upload_matrix(raw, ggml_type, rows, cols)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    y = _poisoned((n, rows))
    products.product([m], cupy.asarray(x), y, n)
    np.testing.assert_array_equal(cupy.asnumpy(y), canonical_product(layout.repack(raw, ggml_type, rows, cols),
                                                                     m.fmt, rows, cols, x=x))


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q4_K, T.Q6_K, T.F16], ids=lambda t: T(t).name)
def test_products_follow_the_exact_sum(rng: np.random.Generator, ggml_type: int) -> None:
    """The canonical float32 sum is within float32 rounding of the exact (float64) product."""
    from infer.quants import activation_format

    rows, cols = 64, 14336
    m, w = _matrix(rng, ggml_type, rows, cols)
    act = activation_format(ggml_type)
    if m.fmt in layout.FLOAT_FORMATS:
        x = rng.standard_normal((3, cols)).astype(np.float32)
        y = _poisoned((3, rows))
        products.product([m], cupy.asarray(x), y, 3)
        want = x.astype(np.float64) @ w.T
    else:
        q, scale, qsum = _activations(rng, 3, cols, act)
        group = 32 if act == "q8_0" else 256
        xv = (q.astype(np.float64).reshape(3, -1, group) * scale[:, :, None]).reshape(3, cols)
        y = _poisoned((3, rows))
        products.product([m], _device_int8(q, scale, qsum, act), y, 3)
        want = xv @ w.T
    assert _rel(cupy.asnumpy(y), want) < 2e-5


# ---------------------------------------------------------------- prompt products (pmm.cu)
PMM_NS = [1, 7, 32, 33, 64, 100, 128, 200, 512]


def _pmm_shape(ggml_type: int) -> list[tuple[int, int]]:
    """(rows, cols): rows no multiple of the 128-row tile; the 8B's widths, and 576 (SmolLM2) for the
    32-value formats."""
    if ggml_type in (T.Q4_K, T.Q5_K, T.Q6_K):
        return [(200, 4096), (72, 14336)]
    return [(200, 4096), (136, 576)]


@pytest.mark.parametrize("ggml_type", QUANT_TYPES, ids=lambda t: T(t).name)
def test_prompt_products_follow_their_float16_operands(rng: np.random.Generator, ggml_type: int) -> None:
    """pmm against float64 products of the float16 weights (infer.gpu.reference.prompt_weights, the
    dequantization the kernel defines) and float16 inputs: float32 sums within 1e-4 of the sum of the
    terms' magnitudes (tensor-core accumulation, K up to 14336: any wrong index is off by O(1)); and
    every row the same bits for any N, any token tile and 64 or 128 rows a block (one order per
    output)."""
    from infer.gpu.reference import prompt_product

    for rows, cols in _pmm_shape(ggml_type):
        raw = _tensor(rng, ggml_type, rows, cols)
        m = ops.upload_matrix(raw, ggml_type, rows, cols)
        x = (rng.standard_normal((max(PMM_NS), cols)) * rng.choice([0.01, 1.0, 50.0], (max(PMM_NS), 1)))
        x16 = x.astype(np.float16)
        want = prompt_product(layout.repack(raw, ggml_type, rows, cols), m.fmt, rows, cols, x16)
        scale = np.abs(x16.astype(np.float64)) @ np.abs(_prompt_weights64(m, raw, ggml_type)).T  # sum of |terms|
        first = None  # the bits of the largest N: every smaller N and every tile must give them
        for n in sorted(PMM_NS, reverse=True):
            for tile, block_rows in [(t, b) for t in products.PMM_TILES for b in products.PMM_BLOCK_ROWS]:
                y = _poisoned((n, rows))
                products.prompt_product([m], cupy.asarray(x16[:n]), y, n, tile=tile, block_rows=block_rows)
                got = cupy.asnumpy(y)
                where = f"{rows}x{cols}, {n} rows, tile {tile} x {block_rows}"
                assert np.isfinite(got).all(), where
                err = np.abs(got - want[:n]) / np.maximum(scale[:n], 1e-30)
                assert err.max() < 1e-4, (where, float(err.max()))
                if first is None:
                    first = got
                np.testing.assert_array_equal(got, first[:n], err_msg=where)


def _prompt_weights64(m: ops.GpuMatrix, raw: np.ndarray, ggml_type: int) -> np.ndarray:
    from infer.gpu.reference import prompt_weights

    return prompt_weights(layout.repack(raw, ggml_type, m.rows, m.cols), m.fmt, m.rows, m.cols).astype(np.float64)


@pytest.mark.parametrize("ggml_type", QUANT_TYPES, ids=lambda t: T(t).name)
def test_prompt_weights_are_the_kernels(rng: np.random.Generator, ggml_type: int) -> None:
    """The kernel's float16 weights bit for bit: a product with one-hot inputs reads them back."""
    rows, cols = 130, 256
    raw = _tensor(rng, ggml_type, rows, cols)
    m = ops.upload_matrix(raw, ggml_type, rows, cols)
    y = _poisoned((cols, rows))
    products.prompt_product([m], cupy.asarray(np.eye(cols, dtype=np.float16)), y, cols)
    want = _prompt_weights64(m, raw, ggml_type)
    np.testing.assert_array_equal(cupy.asnumpy(y).T, want.astype(np.float32))


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q5_1, T.Q4_K, T.Q6_K], ids=lambda t: T(t).name)
@pytest.mark.parametrize("n", [1, 40, 512])
def test_prompt_product_of_stacked_parts_with_bias_and_residual(rng: np.random.Generator, ggml_type: int,
                                                                n: int) -> None:
    """Three matrices as one launch, a bias and the residual in place on a strided output: each
    part's rows are its own product (the same bits as alone), the gap between rows untouched."""
    cols = 1024
    parts = [(100, _tensor(rng, ggml_type, 100, cols)), (37, _tensor(rng, ggml_type, 37, cols)),
             (70, _tensor(rng, ggml_type, 70, cols))]
    mats = [ops.upload_matrix(raw, ggml_type, r, cols) for r, raw in parts]
    rows = sum(r for r, _ in parts)
    x16 = cupy.asarray(rng.standard_normal((n, cols)).astype(np.float16))
    alone = []
    for m in mats:
        y = _poisoned((n, m.rows))
        products.prompt_product([m], x16, y, n)
        alone.append(cupy.asnumpy(y))
    want = np.concatenate(alone, axis=1)
    ldy = rows + 11
    bias = rng.standard_normal(rows).astype(np.float32)
    res = rng.standard_normal((n, ldy)).astype(np.float32)
    y = cupy.asarray(res)
    products.prompt_product(mats, x16, y.reshape(-1), n, ldy=ldy, bias=cupy.asarray(bias), residual=y.reshape(-1))
    got = cupy.asnumpy(y)
    np.testing.assert_array_equal(got[:, :rows], (want + bias[None]) + res[:, :rows])
    np.testing.assert_array_equal(got[:, rows:], res[:, rows:])


# ---------------------------------------------------------------- norms, SwiGLU, rotary embedding
def test_rmsnorm_of_selected_rows(rng: np.random.Generator) -> None:
    """src_rows: output row i normalises input row src_rows[i] (the head's rows), with the bits of
    the same row normalised in place."""
    rows, n = 9, 2048
    x = cupy.asarray(rng.standard_normal((rows, n)).astype(np.float32))
    w = cupy.asarray(rng.standard_normal(n).astype(np.float32))
    whole = _poisoned((rows, n))
    ops.rmsnorm(x, w, 1e-5, rows, n, y=whole, act="q8_k", int8=ops.Int8Act.zeros(rows, n, "q8_k"))
    pick = np.array([7, 2, 2, 0], np.int32)
    part, int8 = _poisoned((4, n)), ops.Int8Act.zeros(4, n, "q8_k")
    ops.rmsnorm(x, w, 1e-5, 4, n, y=part, act="q8_k", int8=int8, src_rows=cupy.asarray(pick))
    np.testing.assert_array_equal(cupy.asnumpy(part), cupy.asnumpy(whole)[pick])
    q = cupy.asnumpy(int8.xq).reshape(4, n).astype(np.float32)
    np.testing.assert_array_equal(q * np.repeat(cupy.asnumpy(int8.xs).reshape(4, -1), 256, axis=1), cupy.asnumpy(part))


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("act", ["q8_0", "q8_k", "f16", "f32"])
def test_glu_round(rng: np.random.Generator, act: str, activation: str) -> None:
    """SiLU(gate) * up (or GELU(gate) * up, Gemma's GeGLU) of [gate | up] rows, in float32 within
    rounding of float64, and its 8-bit form exactly the rounding of those float32 values (the same
    bits as round_act on them)."""
    rows, n = 5, 14336
    gu = (rng.standard_normal((rows, 2 * n)) * 4).astype(np.float32)
    g, u = gu[:, :n].astype(np.float64), gu[:, n:].astype(np.float64)
    y = _poisoned((rows, n))
    glu_round = functools.partial(ops.glu_round, activation=activation)
    glu_round(cupy.asarray(gu), n, rows, "f32", y=y)
    floats = cupy.asnumpy(y)
    if activation == "silu":
        want = g / (1 + np.exp(-g)) * u
    else:
        want = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * g * (1 + 0.044715 * g * g))) * u
    assert _rel(floats, want) < 1e-6
    if act in ("q8_0", "q8_k"):
        int8 = ops.Int8Act.zeros(rows, n, act)
        glu_round(cupy.asarray(gu), n, rows, act, int8=int8)
        want = ops.Int8Act.zeros(rows, n, act)
        ops.round_act(cupy.asarray(floats), cupy.empty((rows, n), cupy.float32), rows, n, act, int8=want)
        for a, b in ((int8.xq, want.xq), (int8.xs, want.xs), (int8.xsum, want.xsum)):
            np.testing.assert_array_equal(cupy.asnumpy(a), cupy.asnumpy(b))
    elif act == "f16":
        y16 = _poisoned((rows, n))
        glu_round(cupy.asarray(gu), n, rows, act, y=y16)
        np.testing.assert_array_equal(cupy.asnumpy(y16), floats.astype(np.float16).astype(np.float32))
    # the float16 copy before rounding (the prompt products' input), beside any rounding
    half = _poisoned((rows, n), cupy.float16)
    int8 = ops.Int8Act.zeros(rows, n, act) if act in ("q8_0", "q8_k") else None
    glu_round(cupy.asarray(gu), n, rows, act, y=None if int8 else _poisoned((rows, n)), int8=int8, y16=half)
    np.testing.assert_array_equal(cupy.asnumpy(half), floats.astype(np.float16))


def test_norm_add(rng: np.random.Generator) -> None:
    """x += RMSNorm(t) * w per row (Gemma's post-norms), within float32 rounding of float64."""
    rows, n = 6, 640
    t = (rng.standard_normal((rows, n)) * 5).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    x = rng.standard_normal((rows, n)).astype(np.float32)
    out = cupy.asarray(x)
    ops.norm_add(cupy.asarray(t), cupy.asarray(w), out, rows, n, 1e-6)
    t64 = t.astype(np.float64)
    want = x + t64 / np.sqrt(np.mean(t64 * t64, axis=1, keepdims=True) + 1e-6) * w
    assert _rel(cupy.asnumpy(out), want) < 1e-6


class _Caches:
    """Random float16 caches (n_layers, n_kv, cap, D) for a few sequences, and the pass's row fields."""

    def __init__(self, rng: np.random.Generator, n_layers: int, n_kv: int, caps: list[int], hd: int) -> None:
        self.host = [(rng.standard_normal((n_layers, n_kv, c, hd)) * 0.5).astype(np.float16) for c in caps]
        self.vals = [(rng.standard_normal((n_layers, n_kv, c, hd))).astype(np.float16) for c in caps]
        self.k = [cupy.asarray(h) for h in self.host]
        self.v = [cupy.asarray(h) for h in self.vals]
        self.caps = caps

    def fields(self, rows: list[tuple[int, int, int, int, list[int] | None]]) -> attn.RowFields:
        """rows: (sequence, position, slot, base, ancestors' slots or None)."""
        anc, offs = [], []
        for _, _, _, _, a in rows:
            offs.append(-1 if a is None else len(anc))
            anc += a or []
        i32 = lambda v: cupy.asarray(np.array(v, np.int32))  # noqa: E731
        u64 = lambda v: cupy.asarray(np.array(v, np.uint64))  # noqa: E731
        return attn.RowFields(i32([r[1] for r in rows]), i32([r[2] for r in rows]), i32([r[3] for r in rows]),
                             i32(offs), i32(anc + [0]), u64([self.k[r[0]].data.ptr for r in rows]),
                             u64([self.v[r[0]].data.ptr for r in rows]), i32([self.caps[r[0]] for r in rows]))


def _attend(qkv: np.ndarray, shape: attn.AttentionShape, caches: _Caches, rows: list, layer: int,
            act: str = "f32", work_rows: int = 3, window: int = 0, scale: float | None = None,
            max_ctx: int | None = None) -> np.ndarray:
    """(work_rows 3 by default: several launches over the rows, the slices are part of what is tested;
    max_ctx: past every row's position, by default the largest cache's positions)"""
    n = len(rows)
    max_ctx = max_ctx or max(caches.caps)
    work = cupy.zeros(attn.attention_work_nbytes(shape, work_rows, max_ctx) // 4, cupy.float32)
    out = _poisoned((n, shape.n_heads * shape.head_dim))
    attn.attention(cupy.asarray(qkv), shape, layer, caches.fields(rows), n, max_ctx, work, work_rows, out, act,
                   window=window, scale=scale)
    return cupy.asnumpy(out)


@pytest.mark.parametrize("window", [1, 40, 512])
def test_attention_over_a_sliding_window(rng: np.random.Generator, window: int) -> None:
    """A sliding-window layer: a row at position p attends to positions p - window + 1 .. p only
    (chunks wholly before the window skipped, the rest masked), with the file's own scale; a
    token-tree row's span through its ancestors is windowed the same way."""
    from infer.gpu.reference import attention_reference

    hd, n_heads, n_kv = 256, 4, 1  # Gemma 3 270M's heads
    shape = attn.AttentionShape(n_heads, n_kv, hd, hd // 2, True)
    caches = _Caches(rng, 1, n_kv, [700, 300], hd)
    rows = [(0, 0, 0, 1, None), (0, 39, 39, 40, None), (0, 40, 40, 41, None), (1, 100, 100, 101, None),
            (0, 511, 511, 512, None), (0, 512, 512, 513, None), (0, 699, 699, 700, None),
            (1, 130, 140, 129, [135, 140])]  # a tree node at depth 1 under the node in slot 135
    qkv = rng.standard_normal((len(rows), shape.width)).astype(np.float32)
    got = _attend(qkv, shape, caches, rows, layer=0, window=window, scale=0.0625)
    for i, (seq, pos, _, base, anc) in enumerate(rows):
        span = list(range(pos + 1)) if anc is None else list(range(base)) + anc
        seen = span[max(0, pos + 1 - window):]
        q = qkv[i, : n_heads * hd].reshape(n_heads, hd).astype(np.float16).astype(np.float32)
        keys = caches.host[seq][0][:, seen].astype(np.float32)
        vals = caches.vals[seq][0][:, seen].astype(np.float32)
        want = attention_reference(q, keys, vals, 0.0625).reshape(-1)
        assert _rel(got[i], want) < 1e-5, (i, pos)


@pytest.mark.parametrize("hd", [128, 256])
def test_attention_over_a_ring(rng: np.random.Generator, hd: int) -> None:
    """A local layer's cache as a ring (infer/gpu/cache.py): slot s lies at s % positions, so a
    row at position 699 with a 100-token window reads its keys from a 164-position ring, and a tree
    node reads its ancestors' slots past the ring's end where they wrap; rope_rows stores a row's
    key and value at its slot modulo the ring."""
    from infer.gpu.reference import attention_reference

    n_heads, n_kv, window, ring = 4, 2, 100, 164
    shape = attn.AttentionShape(n_heads, n_kv, hd, hd // 2, True)
    caches = _Caches(rng, 2, n_kv, [ring, ring], hd)
    rows = [(0, 0, 0, 1, None), (0, 163, 163, 164, None), (0, 164, 164, 165, None), (1, 300, 300, 301, None),
            (0, 699, 699, 700, None), (1, 650, 660, 649, [655, 660])]  # a tree node under the node in slot 655
    qkv = rng.standard_normal((len(rows), shape.width)).astype(np.float32)
    got = _attend(qkv, shape, caches, rows, layer=1, window=window, max_ctx=700)  # positions past the ring
    for i, (seq, pos, _, base, anc) in enumerate(rows):
        span = list(range(pos + 1)) if anc is None else list(range(base)) + anc
        seen = [s % ring for s in span[max(0, pos + 1 - window):]]
        q = qkv[i, : n_heads * hd].reshape(n_heads, hd).astype(np.float16).astype(np.float32)
        keys = caches.host[seq][1][:, seen].astype(np.float32)
        vals = caches.vals[seq][1][:, seen].astype(np.float32)
        want = attention_reference(q, keys, vals, 1 / np.sqrt(hd)).reshape(-1)
        assert _rel(got[i], want) < 1e-5, (i, pos)
    # rope_rows writes the last two rows' keys and values at slots 699 % 164 and 660 % 164
    tables = [cupy.asarray(np.ones((700, hd // 2), np.float32)), cupy.asarray(np.zeros((700, hd // 2), np.float32))]
    attn.rope_rows(cupy.asarray(qkv[4:]), shape, *tables, 1, caches.fields(rows[4:]), 2)
    kv0 = (n_heads + n_kv) * hd  # the first value, after q and k
    for r, (seq, _, slot, _, _) in enumerate(rows[4:]):
        stored_k = cupy.asnumpy(caches.k[seq][1][:, slot % ring]).reshape(-1)
        stored_v = cupy.asnumpy(caches.v[seq][1][:, slot % ring]).reshape(-1)
        np.testing.assert_array_equal(stored_k, qkv[4 + r, n_heads * hd : kv0].astype(np.float16))
        np.testing.assert_array_equal(stored_v, qkv[4 + r, kv0 : kv0 + n_kv * hd].astype(np.float16))


@pytest.mark.parametrize(("heads", "hd"), [((8, 2), 128), ((14, 2), 64), ((16, 1), 64), ((4, 4), 256)], ids=str)
def test_attention_matches_the_exact_softmax(rng: np.random.Generator, heads: tuple[int, int], hd: int) -> None:
    """Rows of several sequences at positions across chunk (32) and block (128) boundaries, each over
    its own cache, against float64 attention of the float16 query over the cached keys and values."""
    from infer.gpu.reference import attention_reference

    n_heads, n_kv = heads
    shape = attn.AttentionShape(n_heads, n_kv, hd, hd // 2, False)
    caches = _Caches(rng, 2, n_kv, [700, 300], hd)
    rows = [(0, 0, 0, 1, None), (0, 31, 31, 32, None), (1, 32, 32, 33, None), (0, 63, 63, 64, None),
            (0, 127, 127, 128, None), (1, 128, 128, 129, None), (1, 255, 255, 256, None), (0, 256, 256, 257, None),
            (0, 699, 699, 700, None), (1, 130, 130, 131, None)]
    qkv = rng.standard_normal((len(rows), shape.width)).astype(np.float32)
    got = _attend(qkv, shape, caches, rows, layer=1)
    for i, (seq, pos, _, _, _) in enumerate(rows):
        q = qkv[i, : n_heads * hd].reshape(n_heads, hd).astype(np.float16).astype(np.float32)
        keys = caches.host[seq][1, :, : pos + 1].astype(np.float32)
        vals = caches.vals[seq][1, :, : pos + 1].astype(np.float32)
        want = attention_reference(q, keys, vals, 1 / np.sqrt(hd)).reshape(-1)
        assert _rel(got[i], want) < 1e-5, (i, pos)


def _prompt_attend(qkv: np.ndarray, shape: attn.AttentionShape, caches: _Caches, rows: list, layer: int,
                   window: int = 0) -> np.ndarray:
    out = _poisoned((len(rows), shape.n_heads * shape.head_dim), cupy.float16)
    attn.prompt_attention(cupy.asarray(qkv), shape, layer, caches.fields(rows), 0, len(rows), out, window=window)
    return cupy.asnumpy(out)


@pytest.mark.parametrize("hd", [64, 128])
def test_prompt_attention_over_a_window_and_a_ring(rng: np.random.Generator, hd: int) -> None:
    """The local layers' tensor-core prompt attention (attn_prompt_window_d*): a row at position p
    sees p - 99 .. p (a 100-token window), read from a ring of 164 positions (slot s at s % 164)
    for one sequence and from a cache of every position for another; prompt chunks meeting inside
    tiles of 16 rows, windows starting inside tiles of 64 keys; each chunk alone gives the same bits."""
    from infer.gpu.reference import attention_reference

    n_heads, n_kv, window = 8, 2, 100
    shape = attn.AttentionShape(n_heads, n_kv, hd, hd // 2, True)
    caches = _Caches(rng, 2, n_kv, [164, 700], hd)
    chunks = [[(0, p, p, p + 1, None) for p in range(600, 664)], [(1, p, p, p + 1, None) for p in range(30, 75)],
              [(1, p, p, p + 1, None) for p in range(450, 470)]]
    rows = [r for chunk in chunks for r in chunk]
    qkv = rng.standard_normal((len(rows), shape.width)).astype(np.float32)
    assert attn.prompt_attention_fits(shape, window=True)
    got = _prompt_attend(qkv, shape, caches, rows, layer=1, window=window)
    assert np.isfinite(got).all()
    for i, (seq, pos, _, _, _) in enumerate(rows):
        seen = [t % caches.caps[seq] for t in range(max(0, pos - window + 1), pos + 1)]
        q = qkv[i, : n_heads * hd].reshape(n_heads, hd).astype(np.float16).astype(np.float32)
        keys = caches.host[seq][1][:, seen].astype(np.float32)
        vals = caches.vals[seq][1][:, seen].astype(np.float32)
        want = attention_reference(q, keys, vals, 1 / np.sqrt(hd)).reshape(-1)
        assert _rel(got[i].astype(np.float64), want) < 5e-3, (i, pos)  # probabilities rounded to float16
    first = 0
    for chunk in chunks:
        alone = _prompt_attend(qkv[first : first + len(chunk)], shape, caches, chunk, layer=1, window=window)
        np.testing.assert_array_equal(alone, got[first : first + len(chunk)])
        first += len(chunk)


@pytest.mark.parametrize(("heads", "hd"), [((8, 2), 128), ((14, 2), 64), ((16, 1), 64), ((4, 4), 128)], ids=str)
def test_prompt_attention_matches_the_exact_softmax(rng: np.random.Generator, heads: tuple[int, int], hd: int) -> None:
    """The prompt rows' tensor-core attention (prompt_attention.cu) against float64 attention of the
    float16 query over slots 0..pos: prompt chunks of three sequences in one pass, meeting inside
    tiles of 16 rows, positions across tiles of 64 keys; and each chunk alone, at another offset in
    its tiles, gives the same bits."""
    from infer.gpu.reference import attention_reference

    n_heads, n_kv = heads
    shape = attn.AttentionShape(n_heads, n_kv, hd, hd // 2, False)
    caches = _Caches(rng, 2, n_kv, [300, 90, 700], hd)
    chunks = [[(0, p, p, p + 1, None) for p in range(0, 41)], [(1, p, p, p + 1, None) for p in range(60, 90)],
              [(2, p, p, p + 1, None) for p in range(500, 531)]]
    rows = [r for chunk in chunks for r in chunk]
    qkv = rng.standard_normal((len(rows), shape.width)).astype(np.float32)
    if not attn.prompt_attention_fits(shape):  # a warp per query head: 16 of them need more registers than
        with pytest.raises(ValueError, match="query heads per KV head"):  # an SM has (the H200, d64: 15)
            _prompt_attend(qkv, shape, caches, rows, layer=1)
        assert not attn.uses_prompt_attention(shape)
        return
    got = _prompt_attend(qkv, shape, caches, rows, layer=1)
    assert np.isfinite(got).all()
    for i, (seq, pos, _, _, _) in enumerate(rows):
        q = qkv[i, : n_heads * hd].reshape(n_heads, hd).astype(np.float16).astype(np.float32)
        keys = caches.host[seq][1, :, : pos + 1].astype(np.float32)
        vals = caches.vals[seq][1, :, : pos + 1].astype(np.float32)
        want = attention_reference(q, keys, vals, 1 / np.sqrt(hd)).reshape(-1)
        assert _rel(got[i].astype(np.float64), want) < 5e-3, (i, pos)  # probabilities rounded to float16
    first = 0
    for chunk in chunks:
        alone = _prompt_attend(qkv[first : first + len(chunk)], shape, caches, chunk, layer=1)
        np.testing.assert_array_equal(alone, got[first : first + len(chunk)])
        first += len(chunk)


def test_attention_of_a_row_is_the_same_bits_in_any_pass(rng: np.random.Generator) -> None:
    """A row's attention alone, among other sequences' rows, or as a token-tree node whose ancestors
    sit in other slots (its span mapped: SlotMap) is the same bits."""
    n_heads, n_kv, hd = 8, 2, 128
    shape = attn.AttentionShape(n_heads, n_kv, hd, hd // 2, False)
    caches = _Caches(rng, 1, n_kv, [600, 600], hd)
    # sequence 1 holds sequence 0's positions 0..399 and, at slots 500..519, its positions 400..419
    for arrays in (caches.host, caches.vals):
        arrays[1][:, :, :400] = arrays[0][:, :, :400]
        arrays[1][:, :, 500:520] = arrays[0][:, :, 400:420]
    caches.k[1].set(caches.host[1])
    caches.v[1].set(caches.vals[1])
    q = rng.standard_normal((1, shape.width)).astype(np.float32)
    alone = _attend(q, shape, caches, [(0, 419, 419, 420, None)], 0)
    others = rng.standard_normal((5, shape.width)).astype(np.float32)
    batch = np.concatenate([others[:2], q, others[2:]])
    mixed = _attend(batch, shape, caches, [(1, 3, 3, 4, None), (0, 100, 100, 101, None), (0, 419, 419, 420, None),
                                           (1, 599, 599, 600, None), (0, 418, 418, 419, None),
                                           (1, 64, 64, 65, None)], 0)
    node = _attend(batch, shape, caches, [(1, 3, 3, 4, None), (0, 100, 100, 101, None),
                                          (1, 419, 519, 400, list(range(500, 520))), (1, 599, 599, 600, None),
                                          (0, 418, 418, 419, None), (1, 64, 64, 65, None)], 0)
    np.testing.assert_array_equal(mixed[2], alone[0])
    np.testing.assert_array_equal(node[2], alone[0])


@pytest.mark.parametrize("group", [2, 4, 7])
def test_attention_of_a_row_does_not_depend_on_its_block_group(rng: np.random.Generator, group: int,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """attn_chunks blocks that take several rows (sharing the keys they copy when the rows read one
    cache through its own slots: a prompt) give each row the bits it gets in a block of its own,
    for prompt rows, tree nodes and rows of other sequences mixed in one launch."""
    n_heads, n_kv, hd = 8, 2, 128
    shape = attn.AttentionShape(n_heads, n_kv, hd, hd // 2, False)
    caches = _Caches(rng, 1, n_kv, [600, 600], hd)
    rows = [(0, p, p, p + 1, None) for p in range(290, 330)]  # a prompt chunk across chunk and block edges
    rows += [(1, 3, 3, 4, None), (1, 419, 519, 400, list(range(500, 520))), (0, 100, 100, 101, None)]
    rows += [(1, p, p, p + 1, None) for p in range(120, 133)]
    qkv = rng.standard_normal((len(rows), shape.width)).astype(np.float32)
    monkeypatch.setenv("NVMEDIRECT_ATTN_GROUP", "1")
    alone = _attend(qkv, shape, caches, rows, 0, work_rows=len(rows))
    monkeypatch.setenv("NVMEDIRECT_ATTN_GROUP", str(group))
    grouped = _attend(qkv, shape, caches, rows, 0, work_rows=len(rows))
    np.testing.assert_array_equal(grouped, alone)
    sliced = _attend(qkv, shape, caches, rows, 0, work_rows=11)
    np.testing.assert_array_equal(sliced, alone)


@pytest.mark.parametrize("position", [0, 64, 1000, 2000])
@pytest.mark.parametrize(("n_heads", "n_kv", "hd"), [(32, 4, 128), (14, 2, 64), (12, 2, 128), (28, 4, 128)])
def test_attention_of_a_row_does_not_depend_on_its_head_split(rng: np.random.Generator, position: int, n_heads: int,
                                                               n_kv: int, hd: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step over a short cache splits a KV head's query heads over blocks (the 30B-A3B's
    8 a KV head: up to 8 blocks of 1; the Qwen2.5 0.5B's 7 of size 64, the 1.5B's 6 and the 7B's 7
    of 128): each head gets the bits of the unsplit launch in every split, which the exact softmax
    checks."""
    from infer.gpu.reference import attention_reference

    group = n_heads // n_kv
    shape = attn.AttentionShape(n_heads, n_kv, hd, hd // 2, False)
    caches = _Caches(rng, 1, n_kv, [2048], hd)
    rows = [(0, position, position, position + 1, None)]
    qkv = rng.standard_normal((1, shape.width)).astype(np.float32)
    blocks = n_kv * -(-(position + 1) // 128)
    chosen = attn.head_splits(group, blocks, hd)
    assert chosen == max(s for s in attn.HEAD_SPLITS[hd] if group % s == 0 and (s == 1 or s * blocks <= 256))
    if (n_heads, hd, position) in ((32, 128, 0), (14, 64, 0), (12, 128, 64)):
        assert chosen == group  # a head a block over a short cache
    monkeypatch.setenv("NVMEDIRECT_ATTN_SPLITS", "1")
    whole = _attend(qkv, shape, caches, rows, 0, max_ctx=position + 1)
    for splits in [s for s in attn.HEAD_SPLITS[hd] if s > 1 and group % s == 0]:
        monkeypatch.setenv("NVMEDIRECT_ATTN_SPLITS", str(splits))
        split = _attend(qkv, shape, caches, rows, 0, max_ctx=position + 1)
        np.testing.assert_array_equal(split, whole, err_msg=f"{splits} parts")
    q = qkv[0, : n_heads * hd].reshape(n_heads, hd).astype(np.float16).astype(np.float32)
    keys = caches.host[0][0, :, : position + 1].astype(np.float32)
    vals = caches.vals[0][0, :, : position + 1].astype(np.float32)
    assert _rel(whole[0], attention_reference(q, keys, vals, 1 / np.sqrt(hd)).reshape(-1)) < 1e-5


@pytest.mark.parametrize("act", ["q8_0", "q8_k", "f16"])
def test_attention_rounds_its_output(rng: np.random.Generator, act: str) -> None:
    """The merge rounds each row to the output projection's format, its 8-bit form with it."""
    n_heads, n_kv, hd = 8, 2, 128
    shape = attn.AttentionShape(n_heads, n_kv, hd, hd // 2, False)
    caches = _Caches(rng, 1, n_kv, [300], hd)
    rows = [(0, 299, 299, 300, None), (0, 10, 10, 11, None)]
    qkv = cupy.asarray(rng.standard_normal((2, shape.width)).astype(np.float32))
    work = cupy.zeros(attn.attention_work_nbytes(shape, 2, 300) // 4, cupy.float32)
    plain, out = _poisoned((2, n_heads * hd)), _poisoned((2, n_heads * hd))
    attn.attention(qkv, shape, 0, caches.fields(rows), 2, 300, work, 2, plain, "f32")
    int8 = ops.Int8Act.zeros(2, n_heads * hd, act) if act != "f16" else None
    attn.attention(qkv, shape, 0, caches.fields(rows), 2, 300, work, 2, out, act, int8)
    from infer.quants import round_activations

    np.testing.assert_array_equal(cupy.asnumpy(out), round_activations(cupy.asnumpy(plain), act))
    if int8 is not None:
        q, scale, qsum = _int8_reference(cupy.asnumpy(plain).reshape(-1), act)
        np.testing.assert_array_equal(cupy.asnumpy(int8.xq), q)
        np.testing.assert_array_equal(cupy.asnumpy(int8.xs), scale)
        np.testing.assert_array_equal(cupy.asnumpy(int8.xsum), qsum)


@pytest.mark.parametrize(("neox", "qk_norm"), [(False, False), (True, False), (True, True)],
                         ids=["adjacent", "neox", "neox-qk-norm"])
def test_rope_rows(rng: np.random.Generator, neox: bool, qk_norm: bool) -> None:
    """q rotated in place; k rotated and v stored as float16 in each row's cache at its slot (layer 1);
    with q/k norms (Qwen3) each head RMS-normalised and scaled first, as the CPU engine does."""
    from infer.model import rms_norm

    n_heads, n_kv, hd, cap, eps = 8, 2, 64, 300, 1e-6
    args = _args(neox, n_heads, n_kv, hd)
    rope = Rope(args, None)
    shape = attn.AttentionShape(n_heads, n_kv, hd, rope.n_pairs, neox)
    cos, sin = rope.angles(np.arange(cap))
    caches = _Caches(rng, 2, n_kv, [cap, cap], hd)
    rows = [(0, 5, 5, 6, None), (1, 299, 299, 300, None), (0, 17, 200, 10, [200])]
    qkv = rng.standard_normal((len(rows), shape.width)).astype(np.float32)
    qkv[:, : n_heads * hd] *= 7.0  # norms far from 1, so that a missing normalisation shows
    q_norm, k_norm = (1 + 0.3 * rng.standard_normal((2, hd))).astype(np.float32) if qk_norm else (None, None)
    d = cupy.asarray(qkv)
    attn.rope_rows(d, shape, cupy.asarray(cos.astype(np.float32)), cupy.asarray(sin.astype(np.float32)), 1,
                  caches.fields(rows), len(rows), None if q_norm is None else cupy.asarray(q_norm),
                  None if k_norm is None else cupy.asarray(k_norm), eps)
    got = cupy.asnumpy(d)
    for i, (seq, pos, slot, _, _) in enumerate(rows):
        c, s_ = cos[pos], sin[pos]
        q = qkv[i, : n_heads * hd].reshape(n_heads, hd)
        k = qkv[i, n_heads * hd : (n_heads + n_kv) * hd].reshape(n_kv, hd)
        v = qkv[i, (n_heads + n_kv) * hd :].reshape(n_kv, hd)
        if qk_norm:
            q, k = rms_norm(q, q_norm, eps, exact=True), rms_norm(k, k_norm, eps, exact=True)
        np.testing.assert_allclose(got[i, : n_heads * hd].reshape(n_heads, hd), rope.apply(q[None], c[None], s_[None])[0],
                                   rtol=1e-5, atol=1e-5)
        kc, vc = cupy.asnumpy(caches.k[seq])[1, :, slot], cupy.asnumpy(caches.v[seq])[1, :, slot]
        np.testing.assert_allclose(kc.astype(np.float32), rope.apply(k[None], c[None], s_[None])[0].astype(np.float16).astype(
            np.float32), rtol=2e-3, atol=2e-3)
        np.testing.assert_array_equal(vc, v.astype(np.float16))
    untouched = cupy.asnumpy(caches.k[0])[0]
    np.testing.assert_array_equal(untouched, caches.host[0][0])  # layer 0 not written


# ---------------------------------------------------------------- sampling
def _sample_index(n: int, temps: list[float], seeds: list[int], positions: list[int], hist: list[cupy.ndarray | None],
                  anc_off: list[int] | None = None):
    i32 = lambda v: cupy.asarray(np.array(v, np.int32))  # noqa: E731
    return dict(out_rows=i32(list(range(n))), temps=cupy.asarray(np.array(temps, np.float32)),
                seeds=cupy.asarray(np.array(seeds, np.uint32)), tok=i32([-5] * n), pos=i32(positions),
                slot=i32(positions), base=i32([p + 1 for p in positions]), anc_off=i32(anc_off or [-1] * n),
                hist=cupy.asarray(np.array([0 if h is None else h.data.ptr for h in hist], np.uint64)))


@pytest.mark.parametrize("vocab", [128256, 151941, 1000])  # unrolled loads, with a tail, tail only
def test_sample_rows_argmax_history_and_advance(rng: np.random.Generator, vocab: int) -> None:
    logits = rng.standard_normal((3, vocab)).astype(np.float32)
    logits[0, rng.integers(vocab)] = 10.0
    logits[1] = 0.0
    logits[1, [i for i in (7, 900, 9000, 100000, vocab - 1) if i < vocab]] = 1.0  # ties: the lowest id
    logits[2] = 0.0
    logits[2, vocab - 1] = 1.0  # the maximum in the last element (the tail loop)
    hists = [cupy.full(100, -1, cupy.int32) for _ in range(2)]
    ix = _sample_index(3, [0.0] * 3, [0] * 3, [41, 7, 60], [hists[0], hists[1], None])
    ops.sample_rows(cupy.asarray(logits), 3, vocab, ix["out_rows"], ix["temps"], ix["seeds"], ix["tok"], ix["pos"],
                    ix["slot"], ix["base"], ix["anc_off"], ix["hist"], advance=True)
    want = [int(np.argmax(logits[0])), 7]
    assert int(hists[0][42]) == want[0] and int(hists[1][8]) == want[1]
    assert cupy.asnumpy(ix["tok"]).tolist() == [*want, -5]  # the row without a history does not move
    assert cupy.asnumpy(ix["pos"]).tolist() == [42, 8, 60] and cupy.asnumpy(ix["slot"]).tolist() == [42, 8, 60]
    assert cupy.asnumpy(ix["base"]).tolist() == [43, 9, 61]


def test_sample_rows_moves_a_row_with_a_span_of_its_own_without_its_base(rng: np.random.Generator) -> None:
    """A branch drafted ahead (anc_off >= 0: its positions past its base read slots from its span)
    moves on to its next position and slot; its base stays, beside a plain row whose base moves."""
    logits = rng.standard_normal((2, 1000)).astype(np.float32)
    hists = [cupy.full(100, -1, cupy.int32) for _ in range(2)]
    ix = _sample_index(2, [0.0] * 2, [0] * 2, [41, 7], hists, anc_off=[-1, 0])
    ops.sample_rows(cupy.asarray(logits), 2, 1000, ix["out_rows"], ix["temps"], ix["seeds"], ix["tok"], ix["pos"],
                    ix["slot"], ix["base"], ix["anc_off"], ix["hist"], advance=True)
    want = [int(np.argmax(row)) for row in logits]
    assert [int(hists[0][42]), int(hists[1][8])] == want and cupy.asnumpy(ix["tok"]).tolist() == want
    assert cupy.asnumpy(ix["pos"]).tolist() == [42, 8] and cupy.asnumpy(ix["slot"]).tolist() == [42, 8]
    assert cupy.asnumpy(ix["base"]).tolist() == [43, 8]


def test_sample_rows_temperature_follows_softmax() -> None:
    logits = np.array([0.0, 1.0, 2.0, 0.5, -1.0], np.float32)
    temperature, n = 0.8, 4000
    hist = cupy.zeros(n + 2, cupy.int32)
    ix = _sample_index(1, [temperature], [1234], [0], [hist])
    d_logits = cupy.asarray(logits[None])
    for _ in range(n):  # one draw per position: the row advances
        ops.sample_rows(d_logits, 1, len(logits), ix["out_rows"], ix["temps"], ix["seeds"], ix["tok"], ix["pos"],
                        ix["slot"], ix["base"], ix["anc_off"], ix["hist"], advance=True)
    draws = cupy.asnumpy(hist[1 : n + 1])
    p = np.exp(logits / temperature)
    p /= p.sum()
    counts = np.bincount(draws, minlength=len(logits))
    sigma = np.sqrt(n * p * (1 - p))
    assert (np.abs(counts - n * p) < 5 * sigma).all(), (counts, n * p)


def test_forced_rows_a_warp_and_head_splits_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweeps' overrides say what they take instead of launching a bad grid."""
    for bad in ("0", "9", "two"):
        monkeypatch.setenv("NVMEDIRECT_QGEMV_ROWS", bad)
        with pytest.raises(ValueError, match="NVMEDIRECT_QGEMV_ROWS"):
            products.qgemv_rows(2048)
    monkeypatch.setenv("NVMEDIRECT_QGEMV_ROWS", "3")
    assert products.qgemv_rows(2048) == 3
    monkeypatch.delenv("NVMEDIRECT_QGEMV_ROWS")
    assert [products.qgemv_rows(c) for c in (768, 2048, 4096)] == [4, 2, 1]
    for bad, hd in (("5", 128), ("3", 64), ("7", 256)):
        monkeypatch.setenv("NVMEDIRECT_ATTN_SPLITS", bad)
        with pytest.raises(ValueError, match="NVMEDIRECT_ATTN_SPLITS"):
            attn.head_splits(8, 4, hd)
    monkeypatch.setenv("NVMEDIRECT_ATTN_SPLITS", "8")
    assert attn.head_splits(8, 4) == 8 and attn.head_splits(6, 4) == 1
    monkeypatch.setenv("NVMEDIRECT_ATTN_SPLITS", "7")
    assert attn.head_splits(7, 4, 64) == 7 and attn.head_splits(8, 4, 64) == 1
