"""Mixture-of-experts blocks on the CPU engine (infer.moe): the routing rules (softmax, top k with
ties to the lower id, weights divided by their sum), the grouped computation against a plain
per-token one, exact numerics and packed experts that do not depend on batching, the engines that refuse these files
with one line, and the skewed router synth offers for cache studies. Agreement with llama.cpp is
tests/infer/test_oracle_moe.py's."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from infer import cpu_kernels
from infer.arch import ModelArgs
from infer.gguf_file import GGUFModel
from infer.model import load_transformer
from infer.moe import expert_weights, router_softmax, top_k, weighted_sum
from infer.packed_weights import PackedLinear, PackedWeights, batch_invariant
from infer.synth import Shape, write_model
from tests.infer.test_packed_weights import check_pass_invariance

# small and quick: rows of 64 (q8_0 blocks of 32); 8 experts, 3 per token
QWEN3MOE = Shape(n_layers=2, dim=64, ffn_dim=192, n_heads=4, n_kv_heads=2, vocab_size=300, context_length=256,
                 arch="qwen3moe", head_dim=32, n_experts=8, n_experts_used=3, expert_ffn_dim=64)
MIXTRAL = Shape(n_layers=2, dim=64, ffn_dim=128, n_heads=4, n_kv_heads=2, vocab_size=300, context_length=256,
                n_experts=4, n_experts_used=2)


@pytest.fixture(scope="module")
def qwen3moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("moe") / "qwen3moe-q8_0.gguf"
    write_model(path, QWEN3MOE, "q8_0", seed=2)
    return path


def test_routing_is_softmax_top_k_with_normalised_weights() -> None:
    logits = np.array([[0.5, 2.0, 2.0, -1.0, 2.0], [3.0, 0.0, 0.0, 0.0, 1.0]], np.float32)
    probs = router_softmax(logits)
    want = np.exp(logits.astype(np.float64) - 2.0)
    want = want / want.sum(1, keepdims=True)
    assert probs.dtype == np.float32 and np.allclose(probs, want, rtol=1e-6)
    chosen = top_k(probs, 3)
    assert chosen.tolist() == [[1, 2, 4], [0, 4, 1]]  # equal probabilities: the lower expert first
    weights = expert_weights(probs, chosen)
    assert np.allclose(weights.sum(1), 1.0, rtol=1e-6)
    assert np.allclose(weights, np.take_along_axis(want, chosen, 1) / np.take_along_axis(want, chosen, 1).sum(
        1, keepdims=True), rtol=1e-6)
    assert np.array_equal(expert_weights(probs, chosen, normalize=False), np.take_along_axis(probs, chosen, 1))
    outs = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    summed = weighted_sum(outs, weights)  # float32 products added in the top-k order, as ggml adds them
    in_order = (outs[:, 0] * weights[:, :1] + outs[:, 1] * weights[:, 1:2]) + outs[:, 2] * weights[:, 2:3]
    assert np.array_equal(summed, in_order)


def test_the_files_load_as_mixtures_of_experts(qwen3moe: Path, tmp_path: Path) -> None:
    args = ModelArgs.from_gguf(GGUFModel(qwen3moe))
    assert (args.arch, args.n_experts, args.n_experts_used, args.expert_ffn_dim) == ("qwen3moe", 8, 3, 64)
    assert "blk.0.ffn_gate.weight" not in args.layer_shapes(0)
    assert args.layer_shapes(1)["blk.1.ffn_down_exps.weight"] == (8, 64, 64)
    mixtral = tmp_path / "mixtral.gguf"
    write_model(mixtral, MIXTRAL, "q8_0", seed=1)
    args = ModelArgs.from_gguf(GGUFModel(mixtral))  # a llama file with experts: each is feed_forward_length wide
    assert (args.arch, args.n_experts, args.n_experts_used, args.expert_ffn_dim) == ("llama", 4, 2, 128)
    dense = tmp_path / "dense.gguf"
    write_model(dense, replace(MIXTRAL, n_experts=0, n_experts_used=0), "q8_0")
    assert ModelArgs.from_gguf(GGUFModel(dense)).n_experts == 0
    for path in (qwen3moe, mixtral):
        model = load_transformer(GGUFModel(path))
        layer = model.weights.layer(1)
        assert layer.ffn_gate_up is None and layer.experts is not None and layer.experts.n_experts == model.args.n_experts
        logits = model.forward(np.array([1, 17, 250, 4, 9]), model.new_cache(16), all_logits=True)
        assert logits.shape == (5, 300) and np.isfinite(logits).all() and logits.std() > 0.1


def test_grouped_experts_equal_a_plain_per_token_sum(qwen3moe: Path) -> None:
    """Each expert run once for all its tokens gives what every token's own k experts give."""
    model = load_transformer(GGUFModel(qwen3moe))
    moe = model.weights.layer(0).experts
    assert moe is not None
    h = np.random.default_rng(3).standard_normal((40, 64)).astype(np.float32)
    got = moe(h, model._glu)
    chosen, weights = moe.route(h)
    assert len(np.unique(chosen)) == 8  # every expert has tokens
    want = np.zeros((40, 64))
    for t in range(40):
        for j, e in enumerate(chosen[t]):
            gate_up = moe.gate_up[e](h[t : t + 1])
            want[t] += weights[t, j] * moe.down[e](model._glu(gate_up[:, :64], gate_up[:, 64:]))[0]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_exact_numerics_do_not_depend_on_batching(qwen3moe: Path) -> None:
    model = load_transformer(GGUFModel(qwen3moe), exact=True)
    ids = np.random.default_rng(4).integers(3, 300, 32)
    batch = model.forward(ids, model.new_cache(40), all_logits=True)
    cache = model.new_cache(40)
    steps = np.stack([model.forward(ids[i : i + 1], cache) for i in range(len(ids))])
    rel = float(np.linalg.norm(steps.astype(np.float64) - batch) / np.linalg.norm(batch))
    print(f"\nexact qwen3moe: one batch vs token by token {rel:.2e}, bit-identical rows "
          f"{np.mean(np.all(batch == steps, axis=1)):.3f}")
    assert rel < 1e-6


@pytest.mark.skipif(not cpu_kernels.available(), reason="native CPU kernels not built")
@pytest.mark.parametrize("kind", ["q8_0", "q4_k_m"])
def test_packed_experts_do_not_depend_on_batching(kind: str, tmp_path: Path) -> None:
    """The packed engine keeps each expert as a slice of its stack in the mapped file (no float copy)
    and multiplies it natively: a row's logits are the same bits token by token (a row's experts in
    one native call), as one prompt (grouped by expert), and beside another sequence, so speculation
    needs no --exact on these files either."""
    path = tmp_path / f"qwen3moe-{kind}.gguf"
    write_model(path, QWEN3MOE, kind, seed=2)
    model = load_transformer(GGUFModel(path), packed=True)
    moe = model.weights.layer(0).experts
    assert isinstance(model.weights, PackedWeights) and model.weights.batch_invariant and batch_invariant(GGUFModel(path))
    assert all(isinstance(p, PackedLinear) for p in (*moe.gate_up, *moe.down))
    # token by token runs each row's experts and their weighted sum in one native call
    # (RoutedExperts.weighted_sum), the prompt groups its rows by expert through the products and
    # sums in NumPy: the comparisons below hold the two to the same bits
    assert moe.row_experts is not None and moe.row_sum is not None
    ids = np.random.default_rng(4).integers(3, 300, 24)
    whole = check_pass_invariance(model, ids, 40, 10, 4, ids[:7])
    if kind == "q8_0":  # the exact engine's function (float64 sums), up to float32 rounding; the float32
        # NumPy engine is no reference here: its BLAS order flips an 8-bit activation rounding on this
        # file (one token off by 2e-3 relative, where the packed engine is 1.2e-7 from the exact one)
        exact = load_transformer(GGUFModel(path), exact=True)
        want = exact.forward(ids, exact.new_cache(40), all_logits=True)
        assert np.abs(whole - want).max() <= 1e-4 * np.abs(want).max()


def test_a_skewed_router_concentrates_the_routing(tmp_path: Path) -> None:
    """Routing shares of isotropic inputs (unit RMS) through layer 0's router, 2 of 32 experts per
    token: random routers spread tokens nearly evenly; --router-skew 8 (expert e's row scaled by
    8^(-e/31)) sends most of them to a quarter of the experts."""
    shape = replace(QWEN3MOE, n_experts=32, n_experts_used=2)
    top_quarter = {}
    for skew in (1.0, 8.0):
        path = tmp_path / f"skew{skew:g}.gguf"
        write_model(path, shape, "q8_0", seed=2, router_skew=skew)
        moe = load_transformer(GGUFModel(path)).weights.layer(0).experts
        assert moe is not None
        chosen, _ = moe.route(np.random.default_rng(5).standard_normal((4000, 64)).astype(np.float32))
        shares = np.sort(np.bincount(chosen.ravel(), minlength=32) / chosen.size)[::-1]
        top_quarter[skew] = float(shares[:8].sum())
        print(f"\nrouter skew {skew:g}: the 8 most used experts of 32 take {top_quarter[skew]:.1%} of the routings, "
              f"the most used {shares[0]:.1%}, the least {shares[-1]:.2%}")
    assert top_quarter[1.0] < 0.4 and top_quarter[8.0] > 0.55
