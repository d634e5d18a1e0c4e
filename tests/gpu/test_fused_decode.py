"""The launch a block of experts on the device saves (infer/gpu/experts.py, fused_steps) gives the
separate launches' bits, on fresh random inputs (the seed is printed): moe_combine_norm (the
combination normalising the next layer's input) = moe_combine then rmsnorm. Bit-identity is what
lets a row get the same logits alone, batched, or as a prompt position.

Run on the GPU machine:  python -m pytest -v tests/gpu/test_fused_decode.py
(On the NumPy stand-in: PYTHONPATH=tests/gpu/numpy_cupy:. python -m pytest tests/gpu/test_fused_decode.py)
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType

cupy = pytest.importorskip("cupy")
from infer.gpu import experts, ops  # noqa: E402

pytestmark = pytest.mark.gpu
T = GGMLQuantizationType


@pytest.fixture
def rng() -> np.random.Generator:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    return np.random.default_rng(seed)


def _outputs(n: int, dim: int, act: str, unrounded: bool) -> ops.NormOutputs:
    """Fresh NaN-filled buffers for a normalised row's outputs (so a missing write shows)."""
    return ops.NormOutputs(act, y=cupy.full((n, dim), np.nan, np.float32),
                           int8=ops.Int8Act.zeros(n, dim, act) if act in ops.EIGHT_BIT else None,
                           y_unrounded=cupy.full((n, dim), np.nan, np.float32) if unrounded else None)


def _same_outputs(got: ops.NormOutputs, want: ops.NormOutputs) -> None:
    np.testing.assert_array_equal(cupy.asnumpy(got.y), cupy.asnumpy(want.y), err_msg="rounded values")
    if want.y_unrounded is not None:
        np.testing.assert_array_equal(cupy.asnumpy(got.y_unrounded), cupy.asnumpy(want.y_unrounded),
                                      err_msg="values before rounding")
    if want.int8 is not None:
        for name in ("xq", "xs", "xsum"):
            np.testing.assert_array_equal(cupy.asnumpy(getattr(got.int8, name)), cupy.asnumpy(getattr(want.int8, name)),
                                          err_msg=f"8-bit form: {name}")


@pytest.mark.parametrize(("dim", "act"), [(2048, "q8_k"), (896, "q8_0")])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("slotted", [False, True])
def test_the_combination_with_the_next_norm_is_combine_then_rmsnorm(rng: np.random.Generator, dim: int, act: str,
                                                                    shared: bool, slotted: bool) -> None:
    rows, k = 5, 8
    outs = cupy.asarray(rng.standard_normal((rows * k, dim)).astype(np.float32))
    w = cupy.asarray(rng.random(rows * k).astype(np.float32))
    ids = rng.integers(0, 64, (rows, k)).astype(np.int32)
    ids[3] = -1  # a null row: x left as it is, and normalised all the same
    ids = cupy.asarray(ids.reshape(-1))
    slot = cupy.asarray(rng.permutation(rows * k).astype(np.int32)) if slotted else None
    s_out = cupy.asarray(rng.standard_normal((rows, dim)).astype(np.float32)) if shared else None
    gate = cupy.asarray(rng.standard_normal(rows).astype(np.float32)) if shared else None
    x0 = rng.standard_normal((rows, dim)).astype(np.float32)
    weight = cupy.asarray((1 + 0.1 * rng.standard_normal(dim)).astype(np.float32))
    want_x, want_out = cupy.asarray(x0), _outputs(rows, dim, act, unrounded=True)
    experts.combine(outs, ids, w, k, dim, rows, s_out, gate, want_x, slot)
    ops.rmsnorm(want_x, weight, 1e-5, rows, dim, y=want_out.y, act=act, int8=want_out.int8,
                y_unrounded=want_out.y_unrounded)
    got_x, got_out = cupy.asarray(x0), _outputs(rows, dim, act, unrounded=True)
    experts.combine(outs, ids, w, k, dim, rows, s_out, gate, got_x, slot,
                    norm=experts.NextNorm(weight, 1e-5, got_out))
    np.testing.assert_array_equal(cupy.asnumpy(got_x), cupy.asnumpy(want_x))
    np.testing.assert_array_equal(cupy.asnumpy(got_x)[3], x0[3])
    _same_outputs(got_out, want_out)

