"""Each CUDA kernel against a NumPy reference on fresh random inputs: relative error within a bound
per kernel, no NaN, and every output element written (outputs are poisoned with NaN first).
The seed of each test's inputs is printed, so a failure can be replayed."""

from __future__ import annotations

import os

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from infer.gpu import kernels, layout
from infer.model import ModelArgs, Rope
from infer.synth import random_blocks

cupy = pytest.importorskip("cupy")
from infer.gpu import ops  # noqa: E402

pytestmark = pytest.mark.gpu
T = GGMLQuantizationType
TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]
# float32 accumulation over a few thousand products: far under 1e-4 relative
GEMV_BOUND = 2e-5


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


@pytest.mark.parametrize("shape", [(257, 4096), (64, 14336), (7, 256)], ids=str)
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: T(t).name)
def test_gemv(rng: np.random.Generator, ggml_type: int, shape: tuple[int, int]) -> None:
    rows, cols = shape
    m, w = _matrix(rng, ggml_type, rows, cols)
    x = rng.standard_normal(cols).astype(np.float32)
    y = _poisoned(rows)
    ops.gemv(m, cupy.asarray(x), y)
    got = cupy.asnumpy(y)
    want = w @ x
    assert np.isfinite(got).all()
    assert _rel(got, want) < GEMV_BOUND
    # fused epilogue: y = residual + W x + bias, in place on the residual
    bias = rng.standard_normal(rows).astype(np.float32)
    res = rng.standard_normal(rows).astype(np.float32)
    r = cupy.asarray(res)
    ops.gemv(m, cupy.asarray(x), r, bias=cupy.asarray(bias), residual=r)
    assert _rel(cupy.asnumpy(r), want + bias + res) < GEMV_BOUND


@pytest.mark.parametrize("ggml_type", [T.F16, T.Q8_0, T.Q4_K, T.Q6_K, T.Q5_0], ids=lambda t: T(t).name)
def test_gemv_swiglu(rng: np.random.Generator, ggml_type: int) -> None:
    rows, cols = 300, 2048
    (gate, wg), (up, wu) = (_matrix(rng, ggml_type, rows, cols) for _ in range(2))
    x = rng.standard_normal(cols).astype(np.float32)
    y = _poisoned(rows)
    ops.gemv_swiglu(gate, up, cupy.asarray(x), y)
    g, u = wg @ x, wu @ x
    assert _rel(cupy.asnumpy(y), g / (1 + np.exp(-g)) * u) < 1e-4


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
    np.testing.assert_array_equal(cupy.asnumpy(y16), got.astype(np.float16))
    if act in ("q8_0", "q8_k"):  # the 8-bit form of one row
        int8 = ops.int8_buffers(n, act)
        y1 = _poisoned(n)
        ops.rmsnorm(cupy.asarray(x[0]), cupy.asarray(w), 1e-5, 1, n, y=y1, act=act, int8=int8)
        q, scale, qsum = (cupy.asnumpy(a) for a in int8)
        group = 32 if act == "q8_0" else 256
        np.testing.assert_array_equal(q.astype(np.float32) * np.repeat(scale, group), cupy.asnumpy(y1))
        np.testing.assert_array_equal(qsum, q.astype(np.int32).reshape(-1, 32).sum(1))


def _args(neox: bool, n_heads: int, n_kv: int, head_dim: int) -> ModelArgs:
    return ModelArgs(arch="qwen2" if neox else "llama", n_layers=1, dim=n_heads * head_dim, ffn_dim=64,
                     n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, vocab_size=32, context_length=4096,
                     norm_eps=1e-5, rope_base=10000.0, rope_dim=head_dim, rope_neox=neox, rope_linear_scale=1.0)


@pytest.mark.parametrize("neox", [False, True], ids=["adjacent", "neox"])
def test_rope_store(rng: np.random.Generator, neox: bool) -> None:
    n_heads, n_kv, hd, max_ctx, n = 8, 2, 64, 300, 7
    args = _args(neox, n_heads, n_kv, hd)
    rope = Rope(args, None)
    cos, sin = rope.angles(np.arange(max_ctx))
    positions = np.array(sorted(rng.choice(max_ctx, n, replace=False)), np.int32)
    q = rng.standard_normal((n, n_heads, hd)).astype(np.float32)
    k = rng.standard_normal((n, n_kv, hd)).astype(np.float32)
    v = rng.standard_normal((n, n_kv, hd)).astype(np.float32)
    qd = cupy.asarray(q)
    kc, vc = _poisoned((n_kv, max_ctx, hd), cupy.float16), _poisoned((n_kv, max_ctx, hd), cupy.float16)
    ops.rope_store(qd, cupy.asarray(k), cupy.asarray(v), cupy.asarray(cos), cupy.asarray(sin),
                   cupy.asarray(positions), n, n_heads, n_kv, hd, hd // 2, neox, kc, vc, max_ctx)
    c, s = cos[positions], sin[positions]
    np.testing.assert_allclose(cupy.asnumpy(qd), rope.apply(q, c, s), rtol=1e-5, atol=1e-5)
    kc_h, vc_h = cupy.asnumpy(kc), cupy.asnumpy(vc)
    # float16 of the rotated key; the GPU may fuse a multiply-add, so allow one float16 step
    np.testing.assert_allclose(kc_h[:, positions].transpose(1, 0, 2).astype(np.float32),
                               rope.apply(k, c, s).astype(np.float16).astype(np.float32), rtol=2e-3, atol=2e-3)
    np.testing.assert_array_equal(vc_h[:, positions].transpose(1, 0, 2), v.astype(np.float16))
    others = np.setdiff1d(np.arange(max_ctx), positions)
    assert np.isnan(kc_h[:, others].astype(np.float32)).all()  # nothing else written


def _attention_ref(q: np.ndarray, keys: np.ndarray, values: np.ndarray, group: int) -> np.ndarray:
    """q (H, D); keys/values (kv, S, D) -> (H, D): query and probabilities rounded to float16 like the
    kernels (and the CPU engine), the rest in float64."""
    q = q.astype(np.float16).astype(np.float64)
    out = np.empty_like(q)
    for h in range(q.shape[0]):
        kk, vv = keys[h // group].astype(np.float64), values[h // group].astype(np.float64)
        s = kk @ q[h] / np.sqrt(q.shape[1])
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()).astype(np.float16).astype(np.float64) @ vv
    return out


CHUNK = kernels.DEFAULT_DEFINES["ATTN_CHUNK"]  # positions per attention split


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
@pytest.mark.parametrize("kv_len", [1, 63, 64, 65, 255, 256, 257, 1000, 2048])
@pytest.mark.parametrize("heads", [(8, 8), (9, 3), (32, 8), (14, 2), (64, 8), (32, 2)], ids=str)
def test_attention_decode(rng: np.random.Generator, kv_len: int, heads: tuple[int, int], fused: bool) -> None:
    n_heads, n_kv = heads
    hd = {9: 64, 14: 96}.get(n_heads, 128)  # 96: dimension pairs that do not divide the threads
    max_ctx = 512 if fused else 2048
    if kv_len > max_ctx or (fused and not ops.attention_fused_fits(n_heads, n_kv, hd, max_ctx, "f32")):
        pytest.skip("beyond the fused kernel's cache size")
    n_splits = -(-max_ctx // CHUNK)
    keys = rng.standard_normal((n_kv, max_ctx, hd)).astype(np.float16)
    values = rng.standard_normal((n_kv, max_ctx, hd)).astype(np.float16)
    q = (rng.standard_normal((n_heads, hd)) * 2).astype(np.float32)
    out = _poisoned(n_heads * hd)
    scores = _poisoned(n_heads * max_ctx)
    part_o, part_ml = _poisoned(n_heads * n_splits * hd, np.float64), _poisoned(n_heads * n_splits * 2, np.float64)
    ops.attention_decode(cupy.asarray(q), cupy.asarray(keys), cupy.asarray(values),
                         cupy.asarray(np.array([kv_len - 1], np.int32)), n_heads, n_kv, hd, max_ctx, n_splits,
                         scores, part_o, part_ml, out, fused=fused)
    got = cupy.asnumpy(out).reshape(n_heads, hd)
    want = _attention_ref(q, keys[:, :kv_len], values[:, :kv_len], n_heads // n_kv)
    assert np.isfinite(got).all()
    # float16 probabilities: a float32 difference in a score can move one by a float16 step
    assert _rel(got, want) < 2e-4


@pytest.mark.parametrize("act", ["f16", "q8_0", "q8_k"])
@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
def test_attention_decode_rounds_its_output(rng: np.random.Generator, act: str, fused: bool) -> None:
    """The output rounded for the output projection (and its 8-bit form) is the float32 output of
    the same kernels rounded as infer.quants does (the split sums are deterministic)."""
    from infer.quants import round_activations

    n_heads, n_kv, hd, max_ctx, kv_len = 32, 8, 128, 512, 300
    n_splits = -(-max_ctx // CHUNK)
    keys = cupy.asarray(rng.standard_normal((n_kv, max_ctx, hd)).astype(np.float16))
    values = cupy.asarray(rng.standard_normal((n_kv, max_ctx, hd)).astype(np.float16))
    q = cupy.asarray((rng.standard_normal((n_heads, hd)) * 2).astype(np.float32))
    pos = cupy.asarray(np.array([kv_len - 1], np.int32))
    outs = {}
    int8 = ops.int8_buffers(n_heads * hd, act) if act != "f16" else None
    for fmt in ("f32", act):
        outs[fmt] = _poisoned(n_heads * hd)
        ops.attention_decode(q, keys, values, pos, n_heads, n_kv, hd, max_ctx, n_splits, _poisoned(n_heads * max_ctx),
                             _poisoned(n_heads * n_splits * hd, np.float64), _poisoned(n_heads * n_splits * 2, np.float64),
                             outs[fmt], act=fmt, int8=int8 if fmt == act else None, fused=fused)
    got, base = cupy.asnumpy(outs[act]), cupy.asnumpy(outs["f32"])
    np.testing.assert_array_equal(got, round_activations(base[None], act)[0])
    if int8 is not None:
        xq, scale, qsum = (cupy.asnumpy(a) for a in int8)
        np.testing.assert_array_equal(xq.astype(np.float32) * np.repeat(scale, 32 if act == "q8_0" else 256), got)
        np.testing.assert_array_equal(qsum, xq.astype(np.int32).reshape(-1, 32).sum(1))


def test_swiglu(rng: np.random.Generator) -> None:
    n = 5000
    g, u = (rng.standard_normal(n).astype(np.float32) * 4 for _ in range(2))
    out = _poisoned(n)
    ops.swiglu(cupy.asarray(g), cupy.asarray(u), out, n)
    assert _rel(cupy.asnumpy(out), g / (1 + np.exp(-g.astype(np.float64))) * u) < 1e-6


@pytest.mark.parametrize("vocab", [128256, 151941, 1000])  # unrolled loads, with a tail, tail only
def test_sample_argmax_and_state(rng: np.random.Generator, vocab: int) -> None:
    logits = rng.standard_normal(vocab).astype(np.float32)
    logits[rng.integers(vocab)] = 10.0
    tok, pos = cupy.asarray(np.array([-5], np.int32)), cupy.asarray(np.array([41], np.int32))
    tokens = cupy.full(100, -1, cupy.int32)
    ops.sample_token(cupy.asarray(logits), vocab, 0.0, 0, tok, pos, tokens)
    want = int(np.argmax(logits))
    assert int(tok[0]) == want and int(tokens[42]) == want and int(pos[0]) == 42
    ties = np.zeros(vocab, np.float32)
    ties[[i for i in (7, 900, 9000, 100000, vocab - 1) if i < vocab]] = 1.0
    ops.sample_token(cupy.asarray(ties), vocab, 0.0, 0, tok, pos, tokens)
    assert int(tok[0]) == 7  # lowest id among equal maxima, as numpy.argmax
    ties[:vocab - 1] = 0.0  # the maximum in the last element (the tail loop)
    ops.sample_token(cupy.asarray(ties), vocab, 0.0, 0, tok, pos, tokens)
    assert int(tok[0]) == vocab - 1


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


def test_sample_temperature_follows_softmax() -> None:
    logits = np.array([0.0, 1.0, 2.0, 0.5, -1.0], np.float32)
    temperature, n = 0.8, 4000
    d_logits = cupy.asarray(logits)
    tok, pos = cupy.zeros(1, cupy.int32), cupy.zeros(1, cupy.int32)
    tokens = cupy.zeros(n + 2, cupy.int32)
    for _ in range(n):  # one draw per position
        ops.sample_token(d_logits, len(logits), temperature, 1234, tok, pos, tokens)
    draws = cupy.asnumpy(tokens[1 : n + 1])
    p = np.exp(logits / temperature)
    p /= p.sum()
    counts = np.bincount(draws, minlength=len(logits))
    sigma = np.sqrt(n * p * (1 - p))
    assert (np.abs(counts - n * p) < 5 * sigma).all(), (counts, n * p)


@pytest.mark.parametrize("accumulate", [False, True])
def test_matmul_f16_float32_result(rng: np.random.Generator, accumulate: bool) -> None:
    t, k, n = 77, 512, 300
    x = rng.standard_normal((t, k)).astype(np.float16)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float16)
    base = rng.standard_normal((t, n)).astype(np.float32)
    out = cupy.asarray(base) if accumulate else _poisoned((t, n))
    ops.matmul_f16(cupy.asarray(x), cupy.asarray(w), out, accumulate=accumulate)
    want = x.astype(np.float64) @ w.astype(np.float64).T + (base if accumulate else 0)
    gemm_ex = ops._gemm_ex_works == [True]
    print("cuBLAS GemmEx path" if gemm_ex else "cupy.matmul fallback (float16 result)")
    assert _rel(cupy.asnumpy(out), want) < (1e-4 if gemm_ex else 2e-3)


@pytest.mark.parametrize("ggml_type", [T.F16, T.Q8_0, T.Q4_K, T.Q6_K, T.Q5_1], ids=lambda t: T(t).name)
def test_stacked_upload_is_the_concatenated_matrix(rng: np.random.Generator, ggml_type: int) -> None:
    cols, parts_rows = 1024, [96, 32, 32]
    raws = [_tensor(rng, ggml_type, r, cols) for r in parts_rows]
    m = ops.upload_stacked([(raw, r) for raw, r in zip(raws, parts_rows, strict=True)], ggml_type, cols)
    rows = sum(parts_rows)
    w = layout.reconstruct(layout.repack(np.concatenate(raws), ggml_type, rows, cols), m.fmt, rows, cols)
    x = rng.standard_normal(cols).astype(np.float32)
    y = _poisoned(rows)
    ops.gemv(m, cupy.asarray(x), y)
    assert _rel(cupy.asnumpy(y), w.astype(np.float64) @ x) < GEMV_BOUND


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
@pytest.mark.parametrize("neox", [False, True], ids=["adjacent", "neox"])
@pytest.mark.parametrize("kv_len", [1, 256, 300])
def test_attention_decode_rotates_and_stores_the_new_token(rng: np.random.Generator, neox: bool, kv_len: int,
                                                           fused: bool) -> None:
    n_heads, n_kv, hd, max_ctx = 8, 2, 64, 512
    n_splits, p = -(-max_ctx // CHUNK), kv_len - 1
    rope = Rope(_args(neox, n_heads, n_kv, hd), None)
    cos, sin = rope.angles(np.arange(max_ctx))
    keys = rng.standard_normal((n_kv, max_ctx, hd)).astype(np.float16)
    values = rng.standard_normal((n_kv, max_ctx, hd)).astype(np.float16)
    q, k, v = (rng.standard_normal((1, h, hd)).astype(np.float32) for h in (n_heads, n_kv, n_kv))
    kc, vc = cupy.asarray(keys), cupy.asarray(values)
    out, scores = _poisoned(n_heads * hd), _poisoned(n_heads * max_ctx)
    part_o, part_ml = _poisoned(n_heads * n_splits * hd, np.float64), _poisoned(n_heads * n_splits * 2, np.float64)
    ops.attention_decode(cupy.asarray(q), kc, vc, cupy.asarray(np.array([p], np.int32)), n_heads, n_kv, hd, max_ctx,
                         n_splits, scores, part_o, part_ml, out, fused=fused,
                         rope=(cupy.asarray(k), cupy.asarray(v), cupy.asarray(cos), cupy.asarray(sin), hd // 2, neox))
    c, s = cos[[p]], sin[[p]]
    keys[:, p] = rope.apply(k, c, s)[0].astype(np.float16)
    values[:, p] = v[0].astype(np.float16)
    got_k = cupy.asnumpy(kc)
    np.testing.assert_array_equal(got_k[:, p], keys[:, p])
    np.testing.assert_array_equal(cupy.asnumpy(vc)[:, p], values[:, p])
    np.testing.assert_array_equal(np.delete(got_k, p, axis=1), np.delete(keys, p, axis=1))  # nothing else
    want = _attention_ref(rope.apply(q, c, s)[0], keys[:, :kv_len], values[:, :kv_len], n_heads // n_kv)
    assert _rel(cupy.asnumpy(out).reshape(n_heads, hd), want) < 2e-4


@pytest.mark.parametrize("act", ["f32", "f16", "q8_0", "q8_k"])
@pytest.mark.parametrize("heads", [(8, 8, 128), (32, 8, 128), (9, 3, 64), (14, 2, 96), (64, 8, 128)], ids=str)
def test_fused_attention_equals_the_split_kernels(rng: np.random.Generator, act: str, heads: tuple[int, int, int]) -> None:
    """Both compute every sum in double and normalise before the float16 rounding of the
    probabilities, so their outputs (and 8-bit forms) are the same floats."""
    n_heads, n_kv, hd = heads
    max_ctx = 384
    if not ops.attention_fused_fits(n_heads, n_kv, hd, max_ctx, act):
        pytest.skip("the fused kernel does not take this shape and format")
    n_splits = -(-max_ctx // CHUNK)
    keys = cupy.asarray(rng.standard_normal((n_kv, max_ctx, hd)).astype(np.float16))
    values = cupy.asarray(rng.standard_normal((n_kv, max_ctx, hd)).astype(np.float16))
    q = cupy.asarray((rng.standard_normal((n_heads, hd)) * 2).astype(np.float32))
    for kv_len in (1, 70, 384):
        pos = cupy.asarray(np.array([kv_len - 1], np.int32))
        results = []
        for fused in (False, True):
            out = _poisoned(n_heads * hd)
            int8 = ops.int8_buffers(n_heads * hd, act) if act in ("q8_0", "q8_k") else None
            ops.attention_decode(q, keys, values, pos, n_heads, n_kv, hd, max_ctx, n_splits, *ops.attention_work(
                n_heads, hd, max_ctx)[:3], out, act=act, int8=int8, fused=fused)
            results.append([cupy.asnumpy(out)] + ([cupy.asnumpy(a) for a in int8] if int8 else []))
        split, fused_result = results
        assert np.isfinite(fused_result[0]).all()
        for a, b in zip(split, fused_result, strict=True):
            np.testing.assert_array_equal(a, b)


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
    int8 = ops.int8_buffers(n, act)
    y = _poisoned(n)
    ops.round_act(cupy.asarray(x), y, 1, n, act, int8=int8)
    q, scale, qsum = _int8_reference(x, act)
    np.testing.assert_array_equal(cupy.asnumpy(int8[0]), q)
    np.testing.assert_array_equal(cupy.asnumpy(int8[1]), scale)
    np.testing.assert_array_equal(cupy.asnumpy(int8[2]), qsum)


INT8_TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]


@pytest.mark.parametrize("shape", [(257, 4096), (64, 14336)], ids=str)
@pytest.mark.parametrize("ggml_type", INT8_TYPES, ids=lambda t: T(t).name)
def test_gemv8_on_8bit_activations(rng: np.random.Generator, ggml_type: int, shape: tuple[int, int]) -> None:
    from infer.quants import activation_format, round_activations

    rows, cols = shape
    m, w = _matrix(rng, ggml_type, rows, cols)
    act = activation_format(ggml_type)
    x = rng.standard_normal(cols).astype(np.float32)
    int8 = ops.int8_buffers(cols, act)
    ops.round_act(cupy.asarray(x), cupy.empty(cols, cupy.float32), 1, cols, act, int8=int8)
    want = w @ round_activations(x, act).astype(np.float64)
    y = _poisoned(rows)
    ops.gemv8(m, int8, y)
    assert _rel(cupy.asnumpy(y), want) < GEMV_BOUND
    # the fused SwiGLU form, this matrix as the gate and another as up (loaded in pairs: a swap shows)
    m_up, w_up = _matrix(rng, ggml_type, rows, cols)
    want_up = w_up @ round_activations(x, act).astype(np.float64)
    out = _poisoned(rows)
    ops.gemv8_swiglu(m, m_up, int8, out)
    assert _rel(cupy.asnumpy(out), want / (1 + np.exp(-want)) * want_up) < 1e-4


# ---------------------------------------------------------------- many vectors / a token tree's nodes
@pytest.mark.parametrize("vectors", [1, 3, 8, 13])
@pytest.mark.parametrize("ggml_type", [T.F16, T.Q8_0, T.Q4_0, T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: T(t).name)
def test_gemv_many_vectors_are_each_alone(rng: np.random.Generator, ggml_type: int, vectors: int) -> None:
    """gemv/gemv8 (and their SwiGLU forms) over V input vectors give each vector's output bit for
    bit as a launch for that vector alone (infer/gpu/tree.py relies on it), with a strided output
    (ldy), bias and residual."""
    from infer.quants import activation_format

    rows, cols = 96, 2048
    m, _ = _matrix(rng, ggml_type, rows, cols)
    up, _ = _matrix(rng, ggml_type, rows, cols)
    act = activation_format(ggml_type)
    x = cupy.asarray(rng.standard_normal((vectors, cols)).astype(np.float32))
    bias = cupy.asarray(rng.standard_normal(rows).astype(np.float32))
    residual = cupy.asarray(rng.standard_normal((vectors, rows + 5)).astype(np.float32))
    int8 = ops.int8_buffers(vectors * cols, act) if act in ("q8_0", "q8_k") else None
    if int8 is not None:
        ops.round_act(x, cupy.empty_like(x), vectors, cols, act, int8=int8)
    many = residual.copy()
    ops.gemv(m, x, many, bias=bias, residual=many, vectors=vectors, ldy=rows + 5)
    many_sw = _poisoned((vectors, rows))
    ops.gemv_swiglu(m, up, x, many_sw, vectors=vectors)
    if int8 is not None:
        many8 = residual.copy()
        ops.gemv8(m, int8, many8, bias=bias, residual=many8, vectors=vectors, ldy=rows + 5)
        many8_sw = _poisoned((vectors, rows))
        ops.gemv8_swiglu(m, up, int8, many8_sw, vectors=vectors)
    for v in range(vectors):
        alone = residual[v].copy()
        ops.gemv(m, x[v], alone, bias=bias, residual=alone)
        np.testing.assert_array_equal(cupy.asnumpy(many[v]), cupy.asnumpy(alone))
        alone_sw = _poisoned(rows)
        ops.gemv_swiglu(m, up, x[v], alone_sw)
        np.testing.assert_array_equal(cupy.asnumpy(many_sw[v]), cupy.asnumpy(alone_sw))
        if int8 is not None:
            one = ops.int8_rows(int8, cols, act, v, v + 1)
            alone8 = residual[v].copy()
            ops.gemv8(m, one, alone8, bias=bias, residual=alone8)
            np.testing.assert_array_equal(cupy.asnumpy(many8[v]), cupy.asnumpy(alone8))
            alone8_sw = _poisoned(rows)
            ops.gemv8_swiglu(m, up, one, alone8_sw)
            np.testing.assert_array_equal(cupy.asnumpy(many8_sw[v]), cupy.asnumpy(alone8_sw))
    np.testing.assert_array_equal(cupy.asnumpy(many[:, rows:]), cupy.asnumpy(residual[:, rows:]))  # ldy gap untouched


@pytest.mark.parametrize("act", ["f32", "q8_0"])
@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
@pytest.mark.parametrize("base", [1, 63, 200])
def test_tree_attention_is_the_decode_step_of_each_path(rng: np.random.Generator, fused: bool, base: int,
                                                         act: str) -> None:
    """Tree attention (grid z = node, spans of ancestor slots) gives node j, bit for bit, the decode
    attention at its position over a cache holding the prefix and its path contiguously."""
    n_heads, n_kv, hd, max_ctx = 16, 4, 128, 320
    if fused and not ops.attention_fused_fits(n_heads, n_kv, hd, max_ctx, act):
        pytest.skip("the fused kernel does not take this shape")
    parents = np.array([-1, 0, 0, 1, 3, 2, 0, 4, 4])
    n = len(parents)
    keys = rng.standard_normal((n_kv, max_ctx, hd)).astype(np.float16)
    values = rng.standard_normal((n_kv, max_ctx, hd)).astype(np.float16)
    q = (rng.standard_normal((n, n_heads * hd)) * 2).astype(np.float32)
    spans, positions = ops.tree_spans(parents, base)
    n_splits = -(-max_ctx // CHUNK)
    out = _poisoned((n, n_heads * hd))
    int8 = ops.int8_buffers(n * n_heads * hd, act) if act == "q8_0" else None
    ops.attention_decode(cupy.asarray(q), cupy.asarray(keys), cupy.asarray(values), cupy.asarray(positions), n_heads,
                         n_kv, hd, max_ctx, n_splits, *ops.attention_work(n_heads, hd, max_ctx, n), out, act=act,
                         int8=int8, fused=fused, tree=spans)
    anc = cupy.asnumpy(spans.anc)
    for j in range(n):
        depth = int(positions[j]) - base
        k1, v1 = keys.copy(), values.copy()  # the path laid out as plain decoding would have it
        k1[:, base : base + depth + 1] = keys[:, anc[j, : depth + 1]]
        v1[:, base : base + depth + 1] = values[:, anc[j, : depth + 1]]
        alone = _poisoned(n_heads * hd)
        one8 = ops.int8_buffers(n_heads * hd, act) if act == "q8_0" else None
        ops.attention_decode(cupy.asarray(q[j]), cupy.asarray(k1), cupy.asarray(v1),
                             cupy.asarray(np.array([positions[j]], np.int32)), n_heads, n_kv, hd, max_ctx, n_splits,
                             *ops.attention_work(n_heads, hd, max_ctx), alone, act=act, int8=one8, fused=fused)
        np.testing.assert_array_equal(cupy.asnumpy(out[j]), cupy.asnumpy(alone))
        if int8 is not None:
            for a, b in zip(ops.int8_rows(int8, n_heads * hd, act, j, j + 1), one8, strict=True):
                np.testing.assert_array_equal(cupy.asnumpy(a), cupy.asnumpy(b))
