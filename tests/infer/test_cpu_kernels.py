"""The native quantized CPU kernels (infer/cpu_kernels.py, native/cpu_qdot.c) against NumPy.

Activation quantization must give exactly the values of infer.quants.round_activations (the repo's
emulation of llama.cpp's rounding). Products must match float64 references (exact GGUF weights times
the exact rounded activations) within a rounding bound derived below, and be bit-identical across
thread counts, token batches and the AVX2 / portable code paths. Each test prints its seed.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from infer import cpu_kernels, quants
from infer.synth import random_blocks

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason="CPU kernels not built (python native/build_cpu_kernels.py)")
T = GGMLQuantizationType
TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4]
U = 2.0**-24  # float32 unit roundoff


def _cols(ggml_type: int, blocks: int) -> int:
    """`blocks` blocks of a quantized type; float types get an odd length to exercise the lane tail."""
    block = GGML_QUANT_SIZES[T(ggml_type)][0]
    return blocks * block if block > 1 else 8 * blocks + 5


def _weights(rng: np.random.Generator, ggml_type: int, rows: int, cols: int) -> np.ndarray:
    block = GGML_QUANT_SIZES[T(ggml_type)][0]
    if ggml_type == T.BF16:
        values = (rng.standard_normal(rows * cols) * 0.05).astype(np.float32)
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    return random_blocks(ggml_type, rows * cols // block, rng, 1.0 / np.sqrt(cols)).reshape(-1)


def _activations(rng: np.random.Generator, n: int, cols: int) -> np.ndarray:
    # varied magnitudes per row and a few outliers, as hidden states have
    x = rng.standard_normal((n, cols)).astype(np.float32) * rng.uniform(0.01, 10, (n, 1)).astype(np.float32)
    x[:, rng.integers(0, cols, 3)] *= 20
    return x


# ---------------------------------------------------------------- activation quantization

def _decode_activations(xq: np.ndarray, fmt: str, cols: int) -> np.ndarray:
    """Quantized activation rows -> their exact values (float64), read from the GGML block bytes."""
    n = xq.shape[0]
    if fmt == "f32":
        return xq.view(np.float32).astype(np.float64)
    if fmt == "f16":
        return xq.view(np.float16).astype(np.float64)
    if fmt == "bf16":
        return (xq.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if fmt == "q8_0":
        blocks = xq.reshape(n, cols // 32, 34)
        d = blocks[:, :, 0:2].copy().view(np.float16).astype(np.float64)
        return (d * blocks[:, :, 2:].view(np.int8)).reshape(n, cols)
    blocks = xq.reshape(n, cols // 256, 292)
    d = blocks[:, :, 0:4].copy().view(np.float32).astype(np.float64)
    qs = blocks[:, :, 4:260].view(np.int8)
    bsums = blocks[:, :, 260:292].copy().view(np.int16)
    assert np.array_equal(bsums, qs.reshape(n, -1, 16, 16).sum(axis=3, dtype=np.int64)), "q8_K sums of 16"
    return (d * qs).reshape(n, cols)


def _awkward_rows(rng: np.random.Generator, cols: int) -> np.ndarray:
    """Rows that probe the rounding rules: zero blocks, ties, equal magnitudes of both signs, tiny and
    huge scales, values at float16's edges."""
    rows = [np.zeros(cols), np.full(cols, -3.0), rng.standard_normal(cols) * 1e-6,
            rng.standard_normal(cols) * 3e4, np.tile([-2.0, 2.0, 0.5, 1.5, 2.5, -0.5], cols)[:cols]]
    ties = np.arange(cols, dtype=np.float64) % 255 - 127
    ties[::37] = 127.0
    rows.append(ties / 127 * 2.5)  # x * inv lands on or near k + 1/2
    edges = np.array([65504, 65519, 65520, 70000, 6.1e-5, 6.0e-8, 2**-25, 3 * 2**-25, -(2**-25), 2.9e-8, -1e-45, 1e-40])
    rows.append(np.resize(edges, cols))
    return np.array(rows, dtype=np.float32)


@pytest.mark.parametrize("ggml_type", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_K], ids=lambda t: T(t).name)
def test_quantized_activations_are_the_python_emulation(rng: np.random.Generator, ggml_type: int) -> None:
    cols = 512
    x = np.concatenate([_activations(rng, 9, cols), _awkward_rows(rng, cols)])
    fmt = quants.activation_format(ggml_type)
    for name in _implementations():  # both roundings: the AVX2 one and the portable C
        cpu_kernels.set_implementation(name)
        _check_quantized(x, ggml_type, fmt, cols)


def _check_quantized(x: np.ndarray, ggml_type: int, fmt: str, cols: int) -> None:
    xq = cpu_kernels.quantize_activations(x, ggml_type)
    assert xq.shape == (len(x), cpu_kernels.activation_row_nbytes(ggml_type, cols))
    got = _decode_activations(xq, fmt, cols)
    with np.errstate(over="ignore"):  # values past float16's range become infinities, as intended
        want = quants.round_activations(x, fmt, exact=True)
        np.testing.assert_array_equal(got, want)
        if fmt == "f16":  # bit patterns too (signed zeros, subnormals, ties)
            np.testing.assert_array_equal(xq.view(np.uint16), x.astype(np.float16).view(np.uint16))
    if fmt == "q8_0":  # the stored scale is float16(amax / 127)
        amax = np.abs(x.reshape(len(x), -1, 32)).max(axis=2)
        scales = xq.reshape(len(x), -1, 34)[:, :, 0:2].copy().view(np.float16)[..., 0]
        np.testing.assert_array_equal(scales.view(np.uint16), (amax / np.float32(127)).astype(np.float16).view(np.uint16))


# ---------------------------------------------------------------- products against float64

def _min_part(raw: np.ndarray, ggml_type: int, rows: int, cols: int) -> np.ndarray | None:
    """The per-element offset term of types that have one (Q4_1/Q5_1: m; Q4_K/Q5_K: -dmin * m),
    found by dequantizing the blocks with their quantized values zeroed; None for other types."""
    zeroed = {T.Q4_1: [(4, 20)], T.Q5_1: [(4, 24)], T.Q4_K: [(16, 144)], T.Q5_K: [(16, 176)]}.get(T(ggml_type))
    if zeroed is None:
        return None
    _, size = GGML_QUANT_SIZES[T(ggml_type)]
    blocks = raw.reshape(-1, size).copy()
    for lo, hi in zeroed:
        blocks[:, lo:hi] = 0
    return quants.dequantize(blocks.reshape(-1), ggml_type, (rows, cols), np.float64)


def _error_bound(raw: np.ndarray, ggml_type: int, rows: int, cols: int, w: np.ndarray, xr: np.ndarray) -> np.ndarray:
    """Bound on |kernel - exact| per output.

    Integer block sums are exact, so the error is float32 rounding only: each block term is formed
    with at most 5 roundings (scale products, int->float, products, the min term's subtraction),
    each relative to the term's magnitude, and the terms are added one after another, each addition
    rounding relative to a partial sum no larger than M = sum of the terms' magnitudes. So
    |error| <= (n_terms + 5) * u * M to first order. For float weights the terms are the cols/8
    products per lane (each rounded once) plus a 3-level tree. M is sum |w||x|, plus, for types with
    an offset, twice the offset's magnitude (the scaled part |d*sc*q| <= |w| + |offset|).
    """
    block = GGML_QUANT_SIZES[T(ggml_type)][0]
    n_terms = cols // block if block > 1 else cols // 8 + 3 + 1
    magnitude = np.abs(xr) @ np.abs(w).T
    offset = _min_part(raw, ggml_type, rows, cols)
    if offset is not None:
        magnitude += 2 * (np.abs(xr) @ np.abs(offset).T)
    return (n_terms + 5) * U * magnitude


@pytest.mark.parametrize("n_tokens", [1, 3, 17])
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: T(t).name)
def test_products_match_float64_reference(rng: np.random.Generator, ggml_type: int, n_tokens: int) -> None:
    rows = 37  # not a multiple of the 8-row tiles nor of the threads
    cols = _cols(ggml_type, 3 if GGML_QUANT_SIZES[T(ggml_type)][0] == 256 else 11)
    raw = _weights(rng, ggml_type, rows, cols)
    x = _activations(rng, n_tokens, cols)
    y = cpu_kernels.matmul(raw, ggml_type, rows, cols, x, threads=2)
    assert y.shape == (n_tokens, rows) and y.dtype == np.float32
    w = quants.dequantize(raw, ggml_type, (rows, cols), np.float64)
    xr = quants.round_activations(x, quants.activation_format(ggml_type), exact=True)
    want = xr @ w.T
    bound = _error_bound(raw, ggml_type, rows, cols, w, xr)
    err = np.abs(y.astype(np.float64) - want)
    assert np.all(err <= bound), f"worst error {np.max(err / bound):.3g} x the bound"
    assert np.max(err) < 1e-4 * np.max(np.abs(want))  # and the bound itself is tight enough to matter


def test_q8_0_weights_of_minus_128(rng: np.random.Generator) -> None:
    """-128 (which GGUF files may hold) through the sign trick, against activations of +-127."""
    rows, cols = 9, 64
    raw = _weights(rng, T.Q8_0, rows, cols).reshape(-1, 34)
    raw[:, 2:] = np.uint8(0x80)
    x = np.where(rng.random((2, cols)) < 0.5, -1.0, 1.0).astype(np.float32)
    xr = quants.round_activations(x, "q8_0", exact=True)
    w = quants.dequantize(raw, T.Q8_0, (rows, cols), np.float64)
    want = xr @ w.T
    # the rounding bound, not a relative tolerance: +-1 activations against -128 weights cancel, so an
    # output may be near 0 while its terms are not (rtol=1e-6 failed ~10% of seeds)
    bound = _error_bound(raw.reshape(-1), T.Q8_0, rows, cols, w, xr)
    for name in _implementations():
        cpu_kernels.set_implementation(name)
        got = cpu_kernels.matmul(raw, T.Q8_0, rows, cols, x, threads=1).astype(np.float64)
        assert np.all(np.abs(got - want) <= bound), name


# Byte ranges of the quantized values (first) and, for the K-quants, of the sub-block scales (second).
_VALUE_BYTES = {T.Q8_0: [(2, 34)], T.Q4_0: [(2, 18)], T.Q4_1: [(4, 20)], T.Q5_0: [(2, 22)], T.Q5_1: [(4, 24)],
                T.Q4_K: [(16, 144), (4, 16)], T.Q5_K: [(16, 176), (4, 16)], T.Q6_K: [(0, 192), (192, 208)],
                T.MXFP4: [(1, 17)]}


@pytest.mark.parametrize("ggml_type", list(_VALUE_BYTES), ids=lambda t: T(t).name)
def test_extreme_values_are_exact(rng: np.random.Generator, ggml_type: int) -> None:
    """Weights at their extremes (every nibble 15 or 0, Q8_0 at 127 or -128, K-quant scales at their
    largest) against activations of +-127 in runs and alternations: the AVX2 products (maddubs
    saturates its int16 pair sums) must stay exact, so both paths agree and meet the float bound."""
    block, size = GGML_QUANT_SIZES[T(ggml_type)]
    rows, cols = 11, 2 * block if block == 256 else 8 * block
    raw = _weights(rng, ggml_type, rows, cols).reshape(rows, -1, size)
    values, *scales = _VALUE_BYTES[T(ggml_type)]
    fills = [0x7F, 0x80] if ggml_type == T.Q8_0 else [0xFF, 0x00]
    scale_fills = [0x7F, 0x80] if ggml_type == T.Q6_K else [0xFF]
    for i in range(rows):  # each row its own extreme (Q6_K: unsigned 63 or 0, i.e. +31 or -32)
        raw[i, :, values[0] : values[1]] = fills[i % 2]
        for lo, hi in scales:
            raw[i, :, lo:hi] = scale_fills[(i // 2) % len(scale_fills)]
    raw = raw.reshape(-1)
    signs = [np.ones(cols), -np.ones(cols), np.resize([1.0, -1.0], cols), np.resize([1.0, 1.0, -1.0, -1.0], cols),
             np.where(rng.random(cols) < 0.5, -1.0, 1.0)]
    x = np.array(signs, dtype=np.float32)
    fmt = quants.activation_format(ggml_type)
    xr = quants.round_activations(x, fmt, exact=True)
    assert np.array_equal(np.abs(xr / np.abs(xr).max(axis=1, keepdims=True)) * 127, np.full(xr.shape, 127.0))
    w = quants.dequantize(raw, ggml_type, (rows, cols), np.float64)
    want = xr @ w.T
    bound = _error_bound(raw, ggml_type, rows, cols, w, xr)
    results = {}
    for name in _implementations():
        cpu_kernels.set_implementation(name)
        for n in (1, len(x)):  # the one-token and the many-token kernels
            y = np.concatenate([cpu_kernels.matmul(raw, ggml_type, rows, cols, x[i : i + n], threads=1)
                                for i in range(0, len(x), n)])
            err = np.abs(y.astype(np.float64) - want)
            assert np.all(err <= bound), f"{name}, {n} token(s): worst error {np.max(err / bound):.3g} x the bound"
            results[name, n] = y
    for y in results.values():
        assert np.array_equal(_bits(y), _bits(results["portable", 1]))


# ---------------------------------------------------------------- bit-identity

def _implementations() -> list[str]:
    return [name for name, runs in (("avx512", cpu_kernels.cpu_has_avx512()), ("avx2", cpu_kernels.cpu_has_avx2()),
                                    ("portable", True)) if runs]


def _bits(y: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(y).view(np.uint32)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: T(t).name)
def test_results_do_not_depend_on_threads_or_batch(rng: np.random.Generator, ggml_type: int) -> None:
    rows, cols = 45, _cols(ggml_type, 2 if GGML_QUANT_SIZES[T(ggml_type)][0] == 256 else 8)
    raw = _weights(rng, ggml_type, rows, cols)
    x = _activations(rng, 17, cols)
    for name in _implementations():
        cpu_kernels.set_implementation(name)
        batch = cpu_kernels.matmul(raw, ggml_type, rows, cols, x, threads=1)
        for threads in (2, 3, 8):
            assert np.array_equal(_bits(cpu_kernels.matmul(raw, ggml_type, rows, cols, x, threads=threads)), _bits(batch))
        for t in range(17):
            alone = cpu_kernels.matmul(raw, ggml_type, rows, cols, x[t : t + 1], threads=2)
            assert np.array_equal(_bits(alone[0]), _bits(batch[t])), f"token {t} alone"
        middle = cpu_kernels.matmul(raw, ggml_type, rows, cols, x[4:7], threads=2)
        assert np.array_equal(_bits(middle), _bits(batch[4:7]))


@pytest.mark.skipif(not cpu_kernels.available() or not cpu_kernels.cpu_has_avx2(),
                    reason="this CPU lacks AVX2 (or F16C): only the portable path can run")
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: T(t).name)
def test_avx2_and_portable_paths_agree_bit_for_bit(rng: np.random.Generator, ggml_type: int) -> None:
    rows, cols = 29, _cols(ggml_type, 4 if GGML_QUANT_SIZES[T(ggml_type)][0] == 256 else 16)
    raw = _weights(rng, ggml_type, rows, cols)
    for n_tokens in (1, 3, 17):
        x = _activations(rng, n_tokens, cols)
        results = {}
        for name in ("avx2", "portable"):
            cpu_kernels.set_implementation(name)
            results[name] = cpu_kernels.matmul(raw, ggml_type, rows, cols, x, threads=2)
        assert np.array_equal(_bits(results["avx2"]), _bits(results["portable"])), f"{n_tokens} tokens"


def test_environment_variable_forces_the_portable_path() -> None:
    code = "from infer import cpu_kernels; print(cpu_kernels.implementation())"
    env = dict(os.environ, NVMEDIRECT_CPU_KERNELS="portable")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "portable"


# ---------------------------------------------------------------- fused products (the engine's)

FUSED = [T.Q5_0, T.Q8_0, T.Q6_K, T.Q4_K, T.F16, T.Q4_1]  # every family, shared and separate formats


@pytest.mark.parametrize("n_tokens", [1, 3, 17, 40])
def test_fused_product_is_each_parts_product(rng: np.random.Generator, n_tokens: int) -> None:
    """One call over matrices of several types (activations rounded inside, once per format, on the
    pool's threads for a prompt) gives, bit for bit, each part's own product side by side."""
    cols = 512
    parts = [(_weights(rng, t, rows, cols), t, rows, cols) for t, rows in zip(FUSED, (37, 8, 45, 16, 9, 3), strict=True)]
    x = _activations(rng, n_tokens, cols)
    for name in _implementations():
        cpu_kernels.set_implementation(name)
        want = np.concatenate([cpu_kernels.matmul(raw, t, rows, cols, x, threads=1) for raw, t, rows, _ in parts], axis=1)
        for threads in (1, 2, 3):
            got = cpu_kernels.FusedProduct(parts, threads)(x)
            assert got.shape == (n_tokens, 118) and np.array_equal(_bits(got), _bits(want)), f"{name}, {threads} threads"
        assert np.array_equal(_bits(cpu_kernels.FusedProduct(parts[2:3], 2)(x[None])[0]), _bits(want[:, 45:90]))


def test_fused_product_refusals(rng: np.random.Generator) -> None:
    raw = _weights(rng, T.Q8_0, 4, 64)
    with pytest.raises(ValueError, match="1 to 8"):
        cpu_kernels.FusedProduct([(raw, T.Q8_0, 4, 64)] * 9)
    with pytest.raises(ValueError, match="column count"):
        cpu_kernels.FusedProduct([(raw, T.Q8_0, 4, 64), (raw, T.Q8_0, 2, 128)])
    with pytest.raises(ValueError, match="bytes given"):
        cpu_kernels.FusedProduct([(raw[:-1], T.Q8_0, 4, 64)])
    fused = cpu_kernels.FusedProduct([(raw, T.Q8_0, 4, 64)])
    x = _activations(rng, 2, 64)
    with pytest.raises(ValueError, match="columns"):
        fused(x[:, :32])
    x[1, 3] = np.inf
    with pytest.raises(ValueError, match="NaN or infinity"):
        fused(x)


def test_half_to_float_is_numpys() -> None:
    """Every float16 bit pattern; signalling NaNs may come back quiet (F16C), still NaN."""
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).reshape(256, 256)
    want = h.astype(np.float32)
    for name in _implementations():
        cpu_kernels.set_implementation(name)
        got = cpu_kernels.half_to_float(h)
        assert got.shape == h.shape and got.dtype == np.float32
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan)
        assert np.array_equal(_bits(got)[~nan], _bits(want)[~nan]), name
    assert np.array_equal(cpu_kernels.half_to_float(h[:, ::3]), want[:, ::3], equal_nan=True)  # not contiguous


# ---------------------------------------------------------------- errors

def test_bad_inputs_are_refused(rng: np.random.Generator) -> None:
    raw = _weights(rng, T.Q4_K, 4, 256)
    x = _activations(rng, 2, 256)
    with pytest.raises(ValueError, match="do not support Q2_K"):
        cpu_kernels.matmul(raw, T.Q2_K, 4, 256, x)
    with pytest.raises(ValueError, match="not a positive multiple of the Q4_K block size 256"):
        cpu_kernels.matmul(raw, T.Q4_K, 8, 128, x[:, :128])
    with pytest.raises(ValueError, match="bytes given"):
        cpu_kernels.matmul(raw[:-1], T.Q4_K, 4, 256, x)
    with pytest.raises(ValueError, match="columns"):
        cpu_kernels.matmul(raw, T.Q4_K, 4, 256, x[:, :255])
    with pytest.raises(ValueError, match="2-D"):
        cpu_kernels.matmul(raw, T.Q4_K, 4, 256, x[0])
    with pytest.raises(ValueError, match="float32"):
        cpu_kernels.matmul(raw, T.Q4_K, 4, 256, x.astype(np.float64))
    bad = x.copy()
    bad[1, 7] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        cpu_kernels.matmul(raw, T.Q4_K, 4, 256, bad)
    with pytest.raises(ValueError, match="threads"):
        cpu_kernels.matmul(raw, T.Q4_K, 4, 256, x, threads=0)
    with pytest.raises(ValueError, match="quantized activations"):
        cpu_kernels.matmul_quantized(raw, T.Q4_K, 4, 256, cpu_kernels.quantize_activations(x, T.Q8_0))
    with pytest.raises(ValueError, match="implementation"):
        cpu_kernels.set_implementation("neon")


# ---------------------------------------------------------------- the AVX-512 VNNI path

needs_avx512 = pytest.mark.skipif(not cpu_kernels.available() or not cpu_kernels.cpu_has_avx512(),
                                  reason="this CPU lacks AVX-512 F/BW/VL/VNNI: the AVX-512 kernels cannot run")


@needs_avx512
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: T(t).name)
def test_avx512_and_portable_paths_agree_bit_for_bit(rng: np.random.Generator, ggml_type: int) -> None:
    """Every type (the float ones run AVX2 code under AVX-512), odd row counts (partial 8-row tiles),
    the smallest and a non-power-of-two column count, 1, 2, 7 and 64 tokens (one-token kernels,
    partial and full 8-token tiles), two threads against one."""
    block = GGML_QUANT_SIZES[T(ggml_type)][0]
    col_counts = [block, 3 * block] if block == 256 else [block, 5 * block] if block > 1 else [1, 45]
    for cols in col_counts:
        for rows in (1, 3, 17, 33):
            raw = _weights(rng, ggml_type, rows, cols)
            for n_tokens in (1, 2, 7, 64):
                x = _activations(rng, n_tokens, cols)
                cpu_kernels.set_implementation("avx512")
                got = cpu_kernels.matmul(raw, ggml_type, rows, cols, x, threads=2)
                cpu_kernels.set_implementation("portable")
                want = cpu_kernels.matmul(raw, ggml_type, rows, cols, x, threads=1)
                assert np.array_equal(_bits(got), _bits(want)), f"{rows} x {cols}, {n_tokens} tokens"


@pytest.mark.parametrize("impl", ["avx512", "avx2"])
@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: T(t).name)
def test_one_token_widths_agree_bit_for_bit(rng: np.random.Generator, ggml_type: int, impl: str) -> None:
    """One token at the widths where the vector kernels switch between reading a tile's 8 rows one
    after another and in lockstep (ROWS8 in native/cpu_qdot_common.h): block counts around 8, 16
    and 128, whole and partial tiles, one and two threads."""
    if impl not in _implementations():
        pytest.skip(f"this CPU cannot run the {impl} kernels")
    block = GGML_QUANT_SIZES[T(ggml_type)][0]
    blocks = (6, 16, 17, 35, 128, 129) if block == 256 else (18, 28, 128, 129, 150)
    for nb in blocks:
        cols = nb * block
        for rows in (8, 41):
            raw = _weights(rng, ggml_type, rows, cols)
            x = _activations(rng, 1, cols)
            cpu_kernels.set_implementation("portable")
            want = cpu_kernels.matmul(raw, ggml_type, rows, cols, x, threads=1)
            cpu_kernels.set_implementation(impl)
            for threads in (1, 2):
                got = cpu_kernels.matmul(raw, ggml_type, rows, cols, x, threads=threads)
                assert np.array_equal(_bits(got), _bits(want)), f"{rows} x {cols}, {threads} thread(s)"


@needs_avx512
@pytest.mark.parametrize("ggml_type", list(_VALUE_BYTES), ids=lambda t: T(t).name)
def test_avx512_extreme_values_agree_bit_for_bit(rng: np.random.Generator, ggml_type: int) -> None:
    """Weights at their extremes (nibbles all 15 or 0, Q8_0 at 127 or -128, K-quant scales at their
    largest, Q6_K's at +127 and -128) against +-127 activations: vpdpbusd's unsigned x signed bytes,
    Q8_0's +128 offset and the int16 pair sums of maddubs must all stay exact."""
    block, size = GGML_QUANT_SIZES[T(ggml_type)]
    rows, cols = 19, 3 * block if block == 256 else 9 * block
    raw = _weights(rng, ggml_type, rows, cols).reshape(rows, -1, size)
    values, *scales = _VALUE_BYTES[T(ggml_type)]
    fills = [0x7F, 0x80] if ggml_type == T.Q8_0 else [0xFF, 0x00]
    scale_fills = [0x7F, 0x80] if ggml_type == T.Q6_K else [0xFF]
    for i in range(rows - 3):  # the last rows keep random values
        raw[i, :, values[0] : values[1]] = fills[i % 2]
        for lo, hi in scales:
            raw[i, :, lo:hi] = scale_fills[(i // 2) % len(scale_fills)]
    raw = raw.reshape(-1)
    x = np.array([np.ones(cols), -np.ones(cols), np.resize([1.0, -1.0], cols), np.resize([1.0, 1.0, -1.0, -1.0], cols),
                  *np.where(rng.random((5, cols)) < 0.5, -1.0, 1.0)], dtype=np.float32)
    for n in (1, 3, len(x)):
        cpu_kernels.set_implementation("avx512")
        got = cpu_kernels.matmul(raw, ggml_type, rows, cols, x[:n], threads=1)
        cpu_kernels.set_implementation("portable")
        want = cpu_kernels.matmul(raw, ggml_type, rows, cols, x[:n], threads=1)
        assert np.array_equal(_bits(got), _bits(want)), f"{n} token(s)"


@needs_avx512
@pytest.mark.parametrize("n_tokens", [1, 17])
def test_avx512_fused_product_is_the_portable_one(rng: np.random.Generator, n_tokens: int) -> None:
    cols = 512
    parts = [(_weights(rng, t, rows, cols), t, rows, cols) for t, rows in zip(FUSED, (37, 8, 45, 16, 9, 3), strict=True)]
    x = _activations(rng, n_tokens, cols)
    results = {}
    for name in ("avx512", "portable"):
        cpu_kernels.set_implementation(name)
        results[name] = cpu_kernels.FusedProduct(parts, 2)(x)
    assert np.array_equal(_bits(results["avx512"]), _bits(results["portable"]))


@pytest.mark.parametrize("force", [None, "avx2", "portable"])
def test_environment_variable_chooses_the_native_path(force: str | None) -> None:
    """The first choice: the best path the CPU runs, NVMEDIRECT_CPU_KERNELS=avx2 caps it at AVX2,
    =portable forces portable C."""
    code = "from infer import cpu_kernels; print(cpu_kernels.implementation())"
    env = {k: v for k, v in os.environ.items() if k != "NVMEDIRECT_CPU_KERNELS"}
    if force:
        env["NVMEDIRECT_CPU_KERNELS"] = force
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    best = _implementations()[0]
    want = {None: best, "avx2": "avx2" if cpu_kernels.cpu_has_avx2() else "portable", "portable": "portable"}[force]
    assert out.stdout.strip() == want


def test_unknown_native_paths_are_refused() -> None:
    lib = cpu_kernels._lib()
    before = lib.qdot_implementation()
    assert lib.qdot_set_implementation(3) < 0 and lib.qdot_set_implementation(-1) < 0
    assert lib.qdot_implementation() == before
    if not cpu_kernels.cpu_has_avx512():
        with pytest.raises(ValueError, match="cannot run the avx512"):
            cpu_kernels.set_implementation("avx512")


# ---------------------------------------------------------------- llama.cpp's own order

def _ggml_cpu() -> object:
    """llama.cpp's CPU library, as the llama-cpp-python of the oracle tests ships it."""
    import ctypes
    from pathlib import Path

    llama_cpp = pytest.importorskip("llama_cpp")  # installed by scripts/bootstrap.sh, as for every oracle test
    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-cpu.so"))
    for name in ("ggml_vec_dot_q4_0_q8_0", "ggml_vec_dot_q5_0_q8_0", "ggml_vec_dot_q8_0_q8_0", "ggml_vec_dot_mxfp4_q8_0"):
        getattr(lib, name).argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                       ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.quantize_row_q8_0.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.ggml_cpu_init()  # its float16 -> float32 table, which the products read the scales through
    return lib


@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q5_0, T.Q8_0, T.MXFP4], ids=lambda t: T(t).name)
def test_q4_0_q5_0_q8_0_products_are_llama_cpps_bit_for_bit(rng: np.random.Generator, ggml_type: int) -> None:
    """These types sum in llama.cpp's order (native/cpu_qdot_ggml.c; MXFP4's two sets of lanes,
    native/cpu_qdot_mxfp4.c): every output, one token or a
    batch, on every code path, has the bits of llama.cpp's own ggml_vec_dot_*_q8_0 (its AVX2 kernel,
    which its batched llamafile tiles match) on the same weights and its own quantized activations."""
    if not cpu_kernels.cpu_has_avx2():
        pytest.skip("llama.cpp's AVX2 kernels are the order matched; this CPU runs its SSE or scalar ones")
    import ctypes

    lib = _ggml_cpu()
    rows, cols, n_tokens = 13, 32 * 37, 11
    raw = _weights(rng, ggml_type, rows, cols)
    x = _activations(rng, n_tokens, cols)
    xq = np.empty((n_tokens, cols // 32 * 34), np.uint8)
    for t in range(n_tokens):
        lib.quantize_row_q8_0(x[t].ctypes.data, xq[t].ctypes.data, cols)
    assert np.array_equal(xq, cpu_kernels.quantize_activations(x, ggml_type)), "q8_0 activations differ"
    wrow = raw.size // rows
    dot = getattr(lib, f"ggml_vec_dot_{T(ggml_type).name.lower()}_q8_0")
    want = np.empty((n_tokens, rows), np.float32)
    out = ctypes.c_float()
    for t in range(n_tokens):
        for r in range(rows):
            dot(cols, ctypes.addressof(out), 0, raw[r * wrow :].ctypes.data, 0, xq[t].ctypes.data, 0, 1)
            want[t, r] = out.value
    for name in _implementations():
        cpu_kernels.set_implementation(name)
        for tokens in (slice(0, 1), slice(0, n_tokens), slice(3, 4)):
            got = cpu_kernels.matmul(raw, ggml_type, rows, cols, x[tokens], threads=2)
            assert np.array_equal(got.view(np.uint32), want[tokens].view(np.uint32)), (name, tokens)


# ---------------------------------------------------------------- a token's routed experts

@pytest.mark.parametrize(("gate_type", "up_type", "down_type"),
                         [(T.Q4_K, T.Q4_K, T.Q6_K), (T.Q8_0, T.Q8_0, T.Q8_0), (T.Q5_0, T.Q5_1, T.Q4_0),
                          (T.Q4_K, T.Q8_0, T.F16), (T.F32, T.BF16, T.Q5_K)], ids=str)
@pytest.mark.parametrize("k", [1, 3, 8])
def test_routed_experts_are_each_experts_products(rng: np.random.Generator, gate_type: int, up_type: int,
                                                  down_type: int, k: int) -> None:
    """One call for a token's k experts gives, bit for bit, each expert's fused gate/up product, the
    native SwiGLU and its down product, on every code path and thread count (an expert chosen
    twice included); given the experts' weights, the same call gives infer.moe.weighted_sum's bits
    of those outputs."""
    from infer.cpu_layers import swiglu
    from infer.moe import weighted_sum

    n_experts, dim, width = 6, 512, 256 + 256 * (down_type in (T.Q5_K,))
    stack = {name: [(_weights(rng, t, rows, cols), t, rows, cols) for _ in range(n_experts)]
             for name, t, rows, cols in (("gate", gate_type, width, dim), ("up", up_type, width, dim),
                                         ("down", down_type, dim, width))}
    x = _activations(rng, 1, dim)[0]
    ids = rng.integers(0, n_experts, k)
    ids[-1] = ids[0]
    for name in _implementations():
        cpu_kernels.set_implementation(name)
        want = []
        for e in ids:
            gu = cpu_kernels.FusedProduct([stack["gate"][e], stack["up"][e]], 1)(x[None])
            want.append(cpu_kernels.FusedProduct([stack["down"][e]], 1)(swiglu(gu[:, :width], gu[:, width:]))[0])
        weights = rng.dirichlet(np.ones(k)).astype(np.float32)
        summed = weighted_sum(np.stack(want)[None], weights[None])[0]
        for threads in (1, 2, 3):
            experts = cpu_kernels.RoutedExperts(stack["gate"], stack["up"], stack["down"], threads)
            got = experts(x, ids)
            assert got.shape == (k, dim) and np.array_equal(_bits(got), _bits(np.stack(want))), f"{name}, {threads}"
            got = experts.weighted_sum(x, ids, weights)
            assert got.shape == (dim,) and np.array_equal(_bits(got), _bits(summed)), f"{name}, {threads}, summed"


def test_routed_experts_refusals(rng: np.random.Generator) -> None:
    stack = [(_weights(rng, T.Q8_0, 32, 64), T.Q8_0, 32, 64)] * 3
    down = [(_weights(rng, T.Q8_0, 64, 32), T.Q8_0, 64, 32)] * 3
    experts = cpu_kernels.RoutedExperts(stack, stack, down, 2)
    x = _activations(rng, 1, 64)[0]
    with pytest.raises(RuntimeError, match="bad row range"):
        experts(x, np.array([0, 3]))  # no expert 3
    with pytest.raises(ValueError, match="1 to 32"):
        experts(x, np.zeros(33, np.int32))
    with pytest.raises(ValueError, match="the experts 64"):
        experts(x[:32], np.array([0]))
    with pytest.raises(ValueError, match="1 weights for 2 experts"):
        experts.weighted_sum(x, np.array([0, 1]), np.ones(1, np.float32))
    bad = x.copy()
    bad[5] = np.nan
    from infer.errors import NonFiniteActivations

    with pytest.raises(NonFiniteActivations):
        experts(bad, np.array([1]))
    with pytest.raises(ValueError, match="gated experts"):
        cpu_kernels.RoutedExperts(stack, stack, stack)
    with pytest.raises(ValueError, match="same experts"):
        cpu_kernels.RoutedExperts(stack, stack[:2], down)


def test_an_expert_table_gives_the_routed_experts_bits(rng: np.random.Generator) -> None:
    """Experts held in separate buffers (the tiered cache's) through ExpertTable: the bits of
    RoutedExperts over the same bytes; a dropped expert cannot be called; bytes of another size are
    refused."""
    n_experts, dim, width = 5, 256, 256
    types = (T.Q4_K, T.Q4_K, T.Q6_K)
    stack = [[(_weights(rng, t, rows, cols), t, rows, cols) for _ in range(n_experts)]
             for t, rows, cols in ((types[0], width, dim), (types[1], width, dim), (types[2], dim, width))]
    table = cpu_kernels.ExpertTable(n_experts, types, width, dim, threads=2)
    for e in (4, 1, 2):
        table.hold(e, *(stack[m][e][0].copy() for m in range(3)))  # copies: buffers of their own
    x = _activations(rng, 1, dim)[0]
    ids = np.array([2, 4, 1, 2])
    want = cpu_kernels.RoutedExperts(*stack, threads=2)(x, ids)
    assert np.array_equal(_bits(table(x, ids)), _bits(want))
    table.drop(4)
    with pytest.raises(ValueError, match=r"experts \[4\] are not held"):
        table(x, ids)
    assert np.array_equal(_bits(table(x, np.array([1]))), _bits(want[2:3]))
    with pytest.raises(ValueError, match="are not its matrices"):
        table.hold(0, stack[0][0][0][:-1], stack[1][0][0], stack[2][0][0])
