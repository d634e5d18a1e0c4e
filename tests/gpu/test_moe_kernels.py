"""The mixture-of-experts kernels (infer/kernels/moe.cu, qmm.cu's qgemv_id and qmm_id) against
their NumPy references on fresh random inputs: each routed (row, slot) pair's product is, bit for
bit, the canonical sum of that expert's rows (infer/gpu/reference.py) and the ordinary product of
the same rows uploaded alone, and the grouped product (pairs sorted by expert) gives each pair
those bits too; the routing picks infer/moe.py's experts in its order with its weights; the
combination is infer/moe.py's weighted sum. The seed of each test's inputs is printed.

Run on the GPU machine:  python -m pytest -v tests/gpu/test_moe_kernels.py
(On the NumPy stand-in: PYTHONPATH=tests/gpu/numpy_cupy:. python -m pytest tests/gpu/test_moe_kernels.py)
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from infer.gpu import layout
from infer.moe import SharedExpert, expert_weights, router_softmax, top_k, weighted_sum
from infer.quants import activation_format
from infer.synth import random_blocks

cupy = pytest.importorskip("cupy")
from infer.gpu import experts, ops, products  # noqa: E402

pytestmark = pytest.mark.gpu
T = GGMLQuantizationType


@pytest.fixture
def rng() -> np.random.Generator:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    return np.random.default_rng(seed)


def _stack(rng: np.random.Generator, ggml_type: int, n_experts: int, rows: int, cols: int) -> np.ndarray:
    block, _ = GGML_QUANT_SIZES[T(ggml_type)]
    return random_blocks(ggml_type, n_experts * rows * cols // block, rng, 1.0 / np.sqrt(cols)).reshape(n_experts, -1)


def _int8(rng: np.random.Generator, n: int, cols: int, act: str) -> tuple[ops.Int8Act, tuple[np.ndarray, ...]]:
    """n random rows as the device's 8-bit form (rounded there), and that form on the host."""
    x = cupy.asarray((rng.standard_normal((n, cols)) * rng.choice([0.01, 1.0, 50.0], (n, 1))).astype(np.float32))
    x8 = ops.Int8Act.zeros(n, cols, act)
    ops.round_act(x, cupy.zeros((n, cols), cupy.float32), n, cols, act, int8=x8)
    group = 32 if act == "q8_0" else 256
    host = (cupy.asnumpy(x8.xq).reshape(n, cols), cupy.asnumpy(x8.xs).reshape(n, cols // group),
            cupy.asnumpy(x8.xsum).reshape(n, cols // 32))
    return x8, host


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q4_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: T(t).name)
@pytest.mark.parametrize("xdiv", [1, 3])  # down: a row per pair; gate/up: one input row for k slots
@pytest.mark.parametrize("per_warp", [1, 4])  # weight rows a qgemv warp
def test_expert_products_are_each_experts_canonical_sum(rng: np.random.Generator, ggml_type: int, xdiv: int,
                                                        per_warp: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from infer.gpu.reference import canonical_product

    monkeypatch.setenv("NVMEDIRECT_QGEMV_ROWS", str(per_warp))

    n_experts, rows, cols = 6, 72, 512
    act = activation_format(ggml_type)
    gate, up = _stack(rng, ggml_type, n_experts, rows, cols), _stack(rng, ggml_type, n_experts, rows, cols)
    parts = [ops.upload_stacked([(s.reshape(-1), n_experts * rows)], ggml_type, cols) for s in (gate, up)]
    pairs = 7 * xdiv
    x8, (q, scale, qsum) = _int8(rng, -(-pairs // xdiv), cols, act)
    ids = rng.integers(0, n_experts, pairs).astype(np.int32)
    ids[2] = -1  # a null row's pair: left as it is
    y = cupy.full((pairs, 2 * rows), np.nan, np.float32)
    products.expert_product(parts, n_experts, x8, cupy.asarray(ids), pairs, xdiv, y, 2 * rows)
    got = cupy.asnumpy(y)
    assert np.isnan(got[2]).all()
    for j, e in enumerate(ids):
        if e < 0:
            continue
        r = j // xdiv
        want = []
        for stack in (gate, up):
            planar = layout.repack(stack[e], ggml_type, rows, cols)
            want.append(canonical_product(planar, layout.format_of(ggml_type), rows, cols, q[r : r + 1],
                                          scale[r : r + 1], qsum[r : r + 1])[0])
            alone = ops.upload_matrix(stack[e], ggml_type, rows, cols)  # the same rows as a matrix of their own
            y1 = cupy.full((1, rows), np.nan, np.float32)
            products.product([alone], x8.rows(r, r + 1), y1, 1)
            np.testing.assert_array_equal(cupy.asnumpy(y1)[0], want[-1], err_msg=f"pair {j}, expert {e}, alone")
        np.testing.assert_array_equal(got[j], np.concatenate(want), err_msg=f"pair {j}, expert {e}")


def _grouped(ids: np.ndarray, n_experts: int, nt: int) -> tuple[cupy.ndarray, ...]:
    """moe_group on the device for `ids`: (starts, tiles, order, slot)."""
    pairs = ids.size
    starts, tiles = cupy.full(n_experts + 1, -7, cupy.int32), cupy.full(n_experts + 1, -7, cupy.int32)
    order, slot = cupy.full(pairs, -7, cupy.int32), cupy.full(pairs, -7, cupy.int32)
    experts.group(cupy.asarray(ids), pairs, n_experts, 8 * nt, starts, tiles, order, slot)
    return starts, tiles, order, slot


@pytest.mark.parametrize(("n_experts", "pairs"), [(8, 5), (128, 4096), (60, 3001), (300, 2048)])
def test_grouping_sorts_the_pairs_by_expert(rng: np.random.Generator, n_experts: int, pairs: int) -> None:
    ids = rng.integers(0, n_experts, pairs).astype(np.int32)
    ids[rng.random(pairs) < 0.1] = -1  # null rows' pairs: no position
    ids[ids == 3] = 4  # an expert nobody routes to: no tiles
    bn = 16
    starts, tiles, order, slot = (cupy.asnumpy(a) for a in _grouped(ids, n_experts, bn // 8))
    counts = np.bincount(ids[ids >= 0], minlength=n_experts)
    np.testing.assert_array_equal(starts, np.concatenate([[0], np.cumsum(counts)]))
    np.testing.assert_array_equal(tiles, np.concatenate([[0], np.cumsum(-(-counts // bn))]))
    total = int(starts[-1])
    assert sorted(order[:total]) == sorted(np.flatnonzero(ids >= 0))  # every pair once
    np.testing.assert_array_equal(ids[order[:total]], np.repeat(np.arange(n_experts), counts))
    np.testing.assert_array_equal(slot[order[:total]], np.arange(total))
    assert (slot[ids < 0] == -1).all()


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q4_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: T(t).name)
@pytest.mark.parametrize("nt", [1, 2, 4, 8])
def test_grouped_expert_products_are_the_per_pair_ones(rng: np.random.Generator, ggml_type: int, nt: int) -> None:
    """Pairs grouped by expert (moe_group, moe_gather8, qmm_id): each sorted row has, bit for bit,
    the per-pair product's row of its pair (qgemv_id), for gate and up as one launch (xdiv: a token's
    k slots share its input row) and for down (xdiv 1)."""
    n_experts, rows, cols, k, tokens = 12, 128, 512, 3, 61
    act = activation_format(ggml_type)
    gate, up = _stack(rng, ggml_type, n_experts, rows, cols), _stack(rng, ggml_type, n_experts, rows, cols)
    parts = [ops.upload_stacked([(s.reshape(-1), n_experts * rows)], ggml_type, cols) for s in (gate, up)]
    pairs = tokens * k
    ids = rng.choice(np.arange(n_experts), pairs, p=np.arange(1, n_experts + 1) / sum(range(1, n_experts + 1)))
    ids = ids.astype(np.int32)
    ids[3 * k : 4 * k] = -1  # a null row
    ids[ids == 5] = 6  # an expert without pairs
    x8, _ = _int8(rng, tokens, cols, act)
    want = cupy.full((pairs, 2 * rows), np.nan, np.float32)
    products.expert_product(parts, n_experts, x8, cupy.asarray(ids), pairs, k, want, 2 * rows)
    starts, tiles, order, slot = _grouped(ids, n_experts, nt)
    xg = ops.Int8Act.zeros(pairs, cols, act)
    experts.gather8(x8, order, starts[n_experts:], k, pairs, xg)
    got = cupy.full((pairs, 2 * rows), np.nan, np.float32)
    products.grouped_expert_product(parts, n_experts, xg, starts, tiles, pairs, nt, got, 2 * rows)
    total, order_h = int(starts[-1]), cupy.asnumpy(order)
    np.testing.assert_array_equal(cupy.asnumpy(got)[:total], cupy.asnumpy(want)[order_h[:total]])
    assert np.isnan(cupy.asnumpy(got)[total:]).all()  # positions past the pairs: untouched
    # down: one input row a pair, already in sorted order
    down = _stack(rng, ggml_type, n_experts, cols, rows * 2)
    dpart = ops.upload_stacked([(down.reshape(-1), n_experts * cols)], ggml_type, 2 * rows)
    h8, _ = _int8(rng, pairs, 2 * rows, act)
    want_d = cupy.full((pairs, cols), np.nan, np.float32)
    products.expert_product([dpart], n_experts, h8, cupy.asarray(ids), pairs, 1, want_d, cols)
    hg = ops.Int8Act.zeros(pairs, 2 * rows, act)
    experts.gather8(h8, order, starts[n_experts:], 1, pairs, hg)
    got_d = cupy.full((pairs, cols), np.nan, np.float32)
    products.grouped_expert_product([dpart], n_experts, hg, starts, tiles, pairs, nt, got_d, cols)
    np.testing.assert_array_equal(cupy.asnumpy(got_d)[:total], cupy.asnumpy(want_d)[order_h[:total]])


@pytest.mark.parametrize(("n_experts", "k"), [(8, 2), (64, 8), (128, 8)])
@pytest.mark.parametrize("normalize", [True, False])
def test_routing_is_the_cpus(rng: np.random.Generator, n_experts: int, k: int, normalize: bool) -> None:
    rows = 9
    # distinct logits a few hundredths apart: no two probabilities tie within an exp's last bits
    logits = np.stack([rng.permutation(n_experts) * 0.03 + rng.standard_normal() for _ in range(rows)])
    logits[6] = np.where(np.arange(n_experts) % 3 == 0, 0.5, -0.25)  # exact ties: the lower id first
    logits = logits.astype(np.float32)
    live = np.ones(rows, np.int32)
    live[4] = 0
    ids, weights = cupy.full(rows * k, 7, cupy.int32), cupy.full(rows * k, np.nan, cupy.float32)
    experts.route(cupy.asarray(logits), rows, n_experts, k, normalize, cupy.asarray(live), ids, weights)
    got_ids, got_w = cupy.asnumpy(ids).reshape(rows, k), cupy.asnumpy(weights).reshape(rows, k)
    probs = router_softmax(logits)
    want_ids = top_k(probs, k)
    want_w = expert_weights(probs, want_ids, normalize)
    alive = live == 1
    np.testing.assert_array_equal(got_ids[alive], want_ids[alive])
    np.testing.assert_allclose(got_w[alive], want_w[alive], rtol=2e-6, atol=0)
    assert (got_ids[4] == -1).all() and (got_w[4] == 0).all()


@pytest.mark.parametrize("shared", [False, True])
def test_combination_is_the_cpus_weighted_sum(rng: np.random.Generator, shared: bool) -> None:
    rows, k, dim = 5, 8, 1000
    outs = rng.standard_normal((rows, k, dim)).astype(np.float32)
    w = rng.random((rows, k)).astype(np.float32)
    ids = rng.integers(0, 64, (rows, k)).astype(np.int32)
    ids[3] = -1  # a null row: x left as it is
    x = rng.standard_normal((rows, dim)).astype(np.float32)
    s_out = rng.standard_normal((rows, dim)).astype(np.float32) if shared else None
    gate = rng.standard_normal(rows).astype(np.float32) if shared else None
    y = cupy.asarray(x)
    experts.combine(cupy.asarray(outs.reshape(-1, dim)), cupy.asarray(ids.reshape(-1)), cupy.asarray(w.reshape(-1)),
                    k, dim, rows, None if s_out is None else cupy.asarray(s_out),
                    None if gate is None else cupy.asarray(gate), y)
    got = cupy.asnumpy(y)
    # the same outputs in another order (moe_group's positions): the same sums
    perm = rng.permutation(rows * k).astype(np.int32)
    moved = np.empty_like(outs.reshape(-1, dim))
    moved[perm] = outs.reshape(-1, dim)
    y2 = cupy.asarray(x)
    experts.combine(cupy.asarray(moved), cupy.asarray(ids.reshape(-1)), cupy.asarray(w.reshape(-1)), k, dim, rows,
                    None if s_out is None else cupy.asarray(s_out), None if gate is None else cupy.asarray(gate), y2,
                    slot=cupy.asarray(perm))
    np.testing.assert_array_equal(cupy.asnumpy(y2), got)
    t = weighted_sum(outs, w)
    if shared:
        t = t + s_out * SharedExpert.scale(gate)[:, None]
    want = x + t
    want[3] = x[3]
    if shared:  # the gate's exp: the device's expf against a correctly rounded one
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    else:
        np.testing.assert_array_equal(got, want)


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
    """moe_combine_norm (the next layer's input norm in the combination's launch): bit for bit
    moe_combine then rmsnorm, its outputs included (what lets a row get the same logits in any pass)."""
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

