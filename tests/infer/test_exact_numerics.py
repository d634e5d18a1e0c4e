"""The CPU engine's exact numerics (load_transformer(exact=True)): float64 sums over exact terms, so
results do not depend on the order of summation. This is the reference the GPU decode kernels are
held to bit for bit (tests/gpu/test_model.py); here the order-independence is checked on the CPU,
where batching changes the order of every BLAS sum, on real models whose activation outliers make
the default float32 numerics disagree with themselves by percents (docs/GPU.md)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T

from infer import quants
from infer.gguf_file import GGUFModel
from infer.model import load_transformer
from infer.tokenizer import Tokenizer
from tests.oracle.fixtures import botchan_text, model_path


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b))


@pytest.mark.parametrize("name", ["smollm2-Q8_0", "smollm2-Q4_K_M", "smollm2-Q6_K"])
def test_exact_logits_do_not_depend_on_batching(name: str) -> None:
    model = load_transformer(GGUFModel(model_path(name)), exact=True)
    ids = np.array(Tokenizer.from_gguf(model.weights.model.metadata).encode(botchan_text()[5000:7000])[:48])
    batch = model.forward(ids, model.new_cache(64), all_logits=True)
    cache = model.new_cache(64)
    steps = np.stack([model.forward(ids[i : i + 1], cache) for i in range(len(ids))])
    identical = float(np.mean(np.all(batch == steps, axis=1)))
    print(f"\n{name}: one batch vs token by token: relative difference {_rel(steps, batch):.2e}, "
          f"bit-identical rows {identical:.3f}")
    # float32 numerics differ here by ~1e-2 (an 8-bit rounding flip); exact ones by rounding at most
    assert _rel(steps, batch) < 1e-6
    assert np.array_equal(steps.argmax(1), batch.argmax(1))


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K, T.F16, T.BF16])
def test_float64_dequantization_is_the_float32_one_unrounded(ggml_type: T) -> None:
    """Both dtypes decode the same bits; float32 only rounds (K-quants' d*sc*q - dmin*m can need
    more than 24 bits), so the float64 values round to within one float32 step of it."""
    block, size = quants.block_layout(ggml_type)
    raw = np.random.default_rng(int(ggml_type)).integers(0, 256, 64 * size, dtype=np.uint8)
    if ggml_type in (T.F16, T.BF16):  # random bits include NaN/inf patterns: keep finite values only
        raw = (np.random.default_rng(1).standard_normal(64 * block).astype(np.float16).view(np.uint8)
               if ggml_type == T.F16 else
               (np.random.default_rng(1).standard_normal(64 * block).astype(np.float32).view(np.uint32) >> 16)
               .astype(np.uint16).view(np.uint8))
    else:  # finite f16 scales: clear the exponent's top bit of every 2-byte field that could be one
        raw = raw.reshape(64, size)
        raw[:, 1::2] &= 0x3F
        raw = raw.reshape(-1)
    f32 = quants.dequantize(raw, ggml_type, (64 * block,))
    f64 = quants.dequantize(raw, ggml_type, (64 * block,), np.float64)
    assert f64.dtype == np.float64 and np.isfinite(f64).all()
    assert np.array_equal(f64.astype(np.float32), f32) or np.max(
        np.abs(f64 - f32) / np.maximum(np.abs(f64), 1e-30)) <= 2.0**-24


@pytest.mark.parametrize("fmt", ["q8_0", "q8_k", "f16", "bf16", "f32"])
def test_exact_activation_rounding(fmt: str) -> None:
    """exact=True gives the same rounded values unrounded: float32's values are their nearest
    float32, and q8_0's (8 bits times an f16 scale) are equal."""
    x = (np.random.default_rng(3).standard_normal((4, 512)) * 3).astype(np.float32)
    exact = quants.round_activations(x, fmt, exact=True)
    plain = quants.round_activations(x, fmt)
    assert exact.dtype == np.float64 and plain.dtype == np.float32
    assert np.array_equal(exact.astype(np.float32), plain)
    if fmt == "q8_k":
        assert not np.array_equal(exact, plain.astype(np.float64))  # 8 bits x a float32 scale: 32 bits
