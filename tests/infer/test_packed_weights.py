"""The CPU engine on packed weights (infer.packed_weights: matrices left in the mapped file, native
products): each of a real model's products against the dequantized engine's, what it holds in
memory, and the switch. Agreement with llama.cpp is test_oracle.py's, run with
NVMEDIRECT_CPU_PRODUCTS=native (docs/INFERENCE.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from infer import cpu_kernels
from infer.gguf_file import GGUFModel
from infer.model import DequantizedWeights, Transformer, load_transformer
from infer.packed_weights import PackedLinear, PackedWeights
from tests.oracle.fixtures import model_path

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="native CPU kernels not built")


@pytest.fixture(scope="module")
def q4km() -> Path:
    """SmolLM2-135M Q4_K_M: Q5_0, Q4_K, Q6_K and Q8_0 matrices."""
    return model_path("smollm2-Q4_K_M")


def test_every_product_is_the_dequantized_engines(q4km: Path) -> None:
    """Same rounded inputs, same weights: only the float32 summation order differs (the oracle's
    per-product bar is 1e-5 relative)."""
    plain = load_transformer(GGUFModel(q4km), packed=False).weights
    packed = load_transformer(GGUFModel(q4km), packed=True).weights
    assert isinstance(packed, PackedWeights)
    rng = np.random.default_rng(7)
    pairs = [(getattr(plain.layer(i), k), getattr(packed.layer(i), k))
             for i in (0, 17) for k in ("attn_qkv", "attn_output", "ffn_gate_up", "ffn_down")] + [(plain.output(), packed.output())]
    seen = set()
    for want, got in pairs:
        assert isinstance(got, PackedLinear)
        seen |= {t for _, t, _, _ in got.parts}
        x = rng.standard_normal((3, want.segments[0][0].shape[1])).astype(np.float32)
        y, ref = got(x), want(x)
        assert y.shape == ref.shape and y.dtype == np.float32
        assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()
    assert len(seen) >= 3  # several weight types went through the kernels


def test_packed_weights_keep_no_float_copy(q4km: Path) -> None:
    plain = load_transformer(GGUFModel(q4km), packed=False)
    packed = load_transformer(GGUFModel(q4km), packed=True)
    for m in (plain, packed):
        m.weights.warm()
    assert packed.weights._cached_bytes < plain.weights._cached_bytes / 50


def test_the_switch(q4km: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NVMEDIRECT_CPU_PRODUCTS", "native")
    assert isinstance(load_transformer(GGUFModel(q4km)).weights, PackedWeights)
    assert not isinstance(load_transformer(GGUFModel(q4km), exact=True).weights, PackedWeights)  # never exact
    monkeypatch.setenv("NVMEDIRECT_CPU_PRODUCTS", "numpy")
    assert type(load_transformer(GGUFModel(q4km)).weights) is DequantizedWeights
    monkeypatch.delenv("NVMEDIRECT_CPU_PRODUCTS")  # the default: packed where the kernels are built
    assert isinstance(load_transformer(GGUFModel(q4km)).weights, PackedWeights)
    monkeypatch.setattr(cpu_kernels, "_cpu_kernels", None)  # not built: the NumPy engine, no error
    assert type(load_transformer(GGUFModel(q4km)).weights) is DequantizedWeights
    monkeypatch.setenv("NVMEDIRECT_CPU_PRODUCTS", "vector")
    with pytest.raises(ValueError, match="NVMEDIRECT_CPU_PRODUCTS='vector'"):
        load_transformer(GGUFModel(q4km))


def check_pass_invariance(model: Transformer, ids: np.ndarray, ctx: int, start: int, rows: int,
                          other_ids: np.ndarray) -> np.ndarray:
    """A sequence's logits, bit for bit, as one prompt, token by token, and its tokens start..start +
    rows beside another sequence (other_ids) after its first `start` in a pass of their own; returns
    the prompt's logits."""
    whole = model.forward(ids, model.new_cache(ctx), all_logits=True)
    cache = model.new_cache(ctx)
    steps = np.stack([model.forward(ids[i : i + 1], cache) for i in range(len(ids))])
    assert np.array_equal(whole.view(np.uint32), steps.view(np.uint32))
    cache, other = model.new_cache(ctx), model.new_cache(ctx)
    model.forward(ids[:start], cache)
    beside = model.forward_batch([(ids[start : start + rows], cache), (other_ids, other)], all_logits=True)[0]
    assert np.array_equal(beside.view(np.uint32), whole[start : start + rows].view(np.uint32))
    return whole


def test_a_sequences_logits_do_not_depend_on_its_pass(q4km: Path) -> None:
    """With norms, rope and attention in C as well (infer.cpu_layers), every output of the packed
    path has one fixed order of its own: a prompt in one pass, its tokens one at a time, and its
    tokens beside another sequence's give the same logits, bit for bit (the NumPy attention's
    OpenBLAS products sum a row differently in a one-row and a many-row pass)."""
    model = load_transformer(GGUFModel(q4km), packed=True)
    assert model._native is not None
    check_pass_invariance(model, np.arange(100, 120), 64, 5, 4, np.arange(300, 317))


def test_a_token_trees_logits_are_its_paths_decoded(q4km: Path) -> None:
    """Speculation's verify pass (a token tree, each node seeing the cache and its ancestors) gives
    each node the logits of decoding its path one token at a time, bit for bit: the attention sums
    over the slots a row sees in their order, wherever the slots it does not see lie."""
    model = load_transformer(GGUFModel(q4km), packed=True)
    prompt, tokens, parents = np.arange(100, 120), np.array([5, 6, 7, 8, 9, 10, 11]), np.array([-1, 0, 0, 1, 2, 3, 5])
    cache = model.new_cache(64)
    model.forward(prompt, cache)
    tree = model.forward_tree(tokens, parents, cache)
    for node in range(len(tokens)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(int(parents[path[-1]]))
        alone = model.new_cache(64)
        model.forward(prompt, alone)
        for i in reversed(path):
            logits = model.forward(tokens[i : i + 1], alone)
        assert np.array_equal(logits.view(np.uint32), tree[node].view(np.uint32)), f"node {node}"


def test_threads_come_from_the_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    """--threads reaches the native kernels' pool (NVMEDIRECT_CPU_THREADS), not only BLAS; a bad value
    is an error naming the variable."""
    from infer.cli import _set_threads

    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", cpu_kernels.THREADS_VARIABLE):
        monkeypatch.setenv(var, "")  # what _set_threads writes is undone after the test
    cpu_kernels.default_threads.cache_clear()
    try:
        _set_threads(1)
        assert cpu_kernels.default_threads() == 1
        cpu_kernels.default_threads.cache_clear()
        monkeypatch.setenv(cpu_kernels.THREADS_VARIABLE, "zero")
        with pytest.raises(ValueError, match="NVMEDIRECT_CPU_THREADS='zero'"):
            cpu_kernels.default_threads()
    finally:
        cpu_kernels.default_threads.cache_clear()
