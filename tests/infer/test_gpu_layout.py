"""The planar GPU formats in NumPy (no GPU needed): repacking any GGUF block type and reading it
back gives exactly the weights infer.quants (the CPU engine's dequantizer) gives."""

from __future__ import annotations

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from infer import quants
from infer.gpu import layout
from infer.synth import random_blocks

T = GGMLQuantizationType
EXACT = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.F16, T.BF16, T.F32]
K_QUANTS = [T.Q4_K, T.Q5_K, T.Q6_K]


def _random_tensor(ggml_type: int, rows: int, cols: int, seed: int) -> np.ndarray:
    block, _ = GGML_QUANT_SIZES[T(ggml_type)]
    rng = np.random.default_rng(seed)
    if ggml_type == T.BF16:
        values = rng.standard_normal(rows * cols).astype(np.float32)
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    return random_blocks(ggml_type, rows * cols // block, rng, 0.05).reshape(-1)


@pytest.mark.parametrize("ggml_type", EXACT + K_QUANTS, ids=lambda t: T(t).name)
def test_repack_reconstructs_the_cpu_dequantization(ggml_type: int) -> None:
    rows, cols = 6, 512
    raw = _random_tensor(ggml_type, rows, cols, seed=int(ggml_type))
    fmt = layout.format_of(ggml_type)
    planar = layout.repack(raw, ggml_type, rows, cols)
    assert len(planar) == layout.plane_layout(fmt, rows, cols).nbytes
    got = layout.reconstruct(planar, fmt, rows, cols)
    want = quants.dequantize(raw, ggml_type, (rows, cols))
    assert np.isfinite(want).all() and np.abs(want).max() > 0
    # every format keeps GGUF's numbers: the same float32 weights as the CPU engine
    np.testing.assert_array_equal(got, want)


def test_plane_offsets_are_aligned_and_disjoint() -> None:
    for fmt in ("q8", "g4", "g5", "k4", "k5", "k6"):
        lay = layout.plane_layout(fmt, 14336, 4096)
        spans = [(o, o + s) for o, s in zip(lay.offsets, lay.sizes, strict=True) if s]
        assert all(o % layout.PLANE_ALIGN == 0 for o, _ in spans)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))
        assert lay.nbytes == spans[-1][1]


def test_unknown_type_is_refused_with_its_name() -> None:
    with pytest.raises(ValueError, match="IQ2_XXS"):
        layout.format_of(T.IQ2_XXS)


@pytest.mark.parametrize("ggml_type", [t for t in EXACT + K_QUANTS if t not in (T.F16, T.BF16, T.F32)],
                         ids=lambda t: T(t).name)
def test_prompt_weights_are_the_weights_in_float16(ggml_type: int) -> None:
    """The float16 weights of the prompt products (infer.gpu.reference.prompt_weights, what pmm.cu
    computes) are the CPU engine's weights within float16 rounding: one rounding of the formula,
    after the K-quants' scale and min are rounded to float16 themselves."""
    from infer.gpu.reference import prompt_weights

    rows, cols = 6, 512
    raw = _random_tensor(ggml_type, rows, cols, seed=1 + int(ggml_type))
    fmt = layout.format_of(ggml_type)
    got = prompt_weights(layout.repack(raw, ggml_type, rows, cols), fmt, rows, cols)
    want = quants.dequantize(raw, ggml_type, (rows, cols)).astype(np.float64)
    assert got.dtype == np.float16 and got.shape == (rows, cols)
    ulp = np.spacing(np.abs(want).astype(np.float16)).astype(np.float64)  # float16 spacing at each weight
    err = np.abs(got.astype(np.float64) - want)
    if ggml_type in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):  # one rounding of an exact product or fma
        assert (err <= ulp / 2).all()
    else:  # the K-quant scale and min rounded to float16 first: a few ulps of the row's largest weight
        assert (err <= 4 * ulp.max(axis=1, keepdims=True)).all(), float((err / ulp.max(axis=1, keepdims=True)).max())
