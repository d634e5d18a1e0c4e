"""Our dequantizers against the gguf package's reference implementation, on random blocks."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import quants as gguf_quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from infer import quants
from infer.errors import UnsupportedTensorTypeError

T = GGMLQuantizationType
# Byte offsets of the float16 scale fields in each block: random bytes there could be NaN or inf,
# which the two implementations may propagate differently, so they get finite random values instead.
F16_FIELDS = {
    T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2],
    T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}


def random_tensor(qtype: GGMLQuantizationType, n_rows: int, n_cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = n_rows * n_cols // block_size
    if qtype in (T.F32, T.F16):
        dtype = np.float32 if qtype == T.F32 else np.float16
        return rng.standard_normal(n_rows * n_cols).astype(dtype).view(np.uint8).reshape(n_rows, -1)
    if qtype == T.BF16:
        bits = rng.standard_normal(n_rows * n_cols).astype(np.float32).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8).reshape(n_rows, -1)
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    if qtype == T.MXFP4:  # E8M0 exponents: the subnormal scales (e < 2) and finite values up to 2^11
        blocks[:, 0] = rng.integers(0, 140, size=n_blocks)
        blocks[:2, 0] = [0, 1]
    for offset in F16_FIELDS.get(qtype, []):
        scale = rng.uniform(-2, 2, size=n_blocks).astype(np.float16)
        blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(n_rows, -1)


@pytest.mark.parametrize("qtype", sorted(quants.SUPPORTED_TYPES, key=lambda t: t.name), ids=lambda t: t.name)
def test_dequantize_matches_gguf_reference(qtype: GGMLQuantizationType) -> None:
    n_rows, n_cols = 7, 512
    raw = random_tensor(qtype, n_rows, n_cols, seed=int(qtype))
    ours = quants.dequantize(raw, qtype, (n_rows, n_cols))
    reference = gguf_quants.dequantize(raw, qtype).astype(np.float32)
    assert ours.shape == reference.shape == (n_rows, n_cols)
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_dequantize_rows_picks_the_right_rows(qtype: GGMLQuantizationType) -> None:
    raw = random_tensor(qtype, 9, 256, seed=3)
    full = quants.dequantize(raw, qtype, (9, 256))
    picked = quants.dequantize_rows(raw, qtype, 256, np.array([8, 0, 3, 3]))
    np.testing.assert_array_equal(picked, full[[8, 0, 3, 3]])


def test_chunked_dequantization_equals_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = random_tensor(T.Q5_0, 40, 64, seed=5)
    whole = quants.dequantize(raw, T.Q5_0, (40, 64))
    monkeypatch.setattr(quants, "_CHUNK_ELEMENTS", 3 * 64)  # 3 rows per chunk, last chunk partial
    np.testing.assert_array_equal(quants.dequantize(raw, T.Q5_0, (40, 64)), whole)


def test_unknown_and_unsupported_types_are_refused() -> None:
    with pytest.raises(UnsupportedTensorTypeError, match="unknown tensor type id 99"):
        quants.dequantize(np.zeros(34, np.uint8), 99, (1, 32))
    with pytest.raises(UnsupportedTensorTypeError, match="IQ2_XXS is not supported"):
        quants.dequantize(np.zeros(66, np.uint8), T.IQ2_XXS, (1, 256))


def test_row_length_must_hold_whole_blocks() -> None:
    with pytest.raises(UnsupportedTensorTypeError, match="not a multiple"):
        quants.row_nbytes(T.Q4_K, 576)
