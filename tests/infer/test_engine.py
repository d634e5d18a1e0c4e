"""Engine mechanics on a small synthetic model (no downloads): batching, prefix reuse, context
limits, generation stop rules, and the weight cache budget."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from infer.engine import ContextFullError, Engine, greedy
from infer.gguf_file import GGUFModel
from infer.model import DequantizedWeights, load_transformer
from infer.synth import Shape, write_model

SMALL = Shape(n_layers=3, dim=128, ffn_dim=256, n_heads=4, n_kv_heads=2, vocab_size=300, context_length=256)


# Gemma 3 with a global layer after five local ones; a Llama file with a window on every layer (Mistral's)
SHAPES = {"llama": SMALL, "qwen2": SMALL, "gemma3": Shape(**{**SMALL.__dict__, "n_layers": 6, "sliding_window": 8}),
          "llama-window": Shape(**{**SMALL.__dict__, "sliding_window": 8})}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> GGUFModel:
    path = tmp_path_factory.mktemp("engine") / f"{request.param}.gguf"
    write_model(path, SHAPES[request.param], "f16", seed=7, arch=request.param.split("-")[0])
    return GGUFModel(path)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 300, n)]


# Identity claims (batching, prefix reuse) are checked in the exact numerics: float64 sums of exact
# terms, rounded to float32 once, do not depend on the order BLAS sums in, so one batch, pieces and
# token by token agree up to a float32 rounding tie (a float64 difference of ~1e-16 can move a result
# across one), i.e. to one ulp. The float32 numerics differ here by float16 rounding flips that
# depend on the CPU's summation order.
ONE_ULP = 2.0**-23  # relative: one float32 step


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=ONE_ULP, atol=0)


def test_a_llama_file_with_a_sliding_window_sees_only_the_window(tmp_path: Path) -> None:
    """llama.attention.sliding_window (Mistral 7B v0.1's 4096) bounds every layer's attention. llama.cpp
    ignores the key in llama files; we honour it, as the model was trained. Positions inside the
    window compute exactly what the file without the key does; later ones differ."""
    paths = {}
    for window in (0, 8):
        paths[window] = tmp_path / f"window{window}.gguf"
        write_model(paths[window], Shape(**{**SMALL.__dict__, "sliding_window": window}), "f16", seed=7)
    windowed, plain = (load_transformer(GGUFModel(paths[w]), exact=True) for w in (8, 0))
    assert windowed.args.local_layers == (True,) * 3 and windowed.args.rope_base_local == 0.0
    ids = np.array(prompt(20))
    got = windowed.forward(ids, windowed.new_cache(20), all_logits=True)
    want = plain.forward(ids, plain.new_cache(20), all_logits=True)
    assert_same(got[:8], want[:8])
    assert not np.allclose(got[8:], want[8:], atol=1e-3)


@pytest.mark.parametrize("name", ["gemma3", "llama-window"])
def test_local_layers_keep_a_ring_of_their_window_and_a_pass(name: str, tmp_path: Path) -> None:
    """A local layer keeps a ring of its window and the largest pass (infer/kv_cache.py): with a
    window of 8 and passes of 4 rows, 12 positions, widened to 18 by a pass of 10. Its logits are
    those of a cache that keeps every position: a prompt in passes of 4, a wider pass, a token tree
    whose accepted path is moved across the ring's wrap, decode steps after it."""
    from infer.kv_cache import KVCache

    path = tmp_path / f"{name}.gguf"
    write_model(path, SHAPES[name], "f16", seed=7, arch=name.split("-")[0])
    transformer = load_transformer(GGUFModel(path), exact=True)
    ringed, whole = KVCache(transformer.args, 200, pass_rows=4), KVCache(transformer.args, 200, pass_rows=200)
    assert ringed.ring == 12 and whole.ring == 200 and ringed.nbytes < whole.nbytes
    ids = prompt(80, seed=3)
    for at in range(0, 60, 4):
        assert_same(transformer.forward(np.array(ids[at : at + 4]), ringed, all_logits=True),
                    transformer.forward(np.array(ids[at : at + 4]), whole, all_logits=True))
    assert_same(transformer.forward(np.array(ids[60:70]), ringed, all_logits=True),
                transformer.forward(np.array(ids[60:70]), whole, all_logits=True))
    assert ringed.ring == 18
    tokens, parents = np.array(ids[70:75]), np.array([-1, 0, 0, 2, 2])  # chain 0 -> 2 -> 4, siblings 1, 3
    assert_same(transformer.forward_tree(tokens, parents, ringed), transformer.forward_tree(tokens, parents, whole))
    for cache in (ringed, whole):
        cache.accept([0, 2, 4])
    for t in ids[75:]:
        assert_same(transformer.forward(np.array([t]), ringed), transformer.forward(np.array([t]), whole))
    assert ringed.length == 78 and ringed.lost == 78 - 18
    # a pass at 71 reads 64..70, still in the ring; one at 60 would read 53..59, overwritten
    assert ringed.can_rewind(71) and not ringed.can_rewind(60) and ringed.can_rewind(0) and whole.can_rewind(60)


def test_a_prefix_the_ring_no_longer_holds_is_run_again(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Prefix reuse after the ring moved past the prefix's window: the engine runs the whole prompt
    again (the cached prefix's window was overwritten) and gets the fresh engine's logits."""
    from infer import kv_cache

    monkeypatch.setattr(kv_cache, "PASS_ROWS", 4)
    path = tmp_path / "gemma3.gguf"
    write_model(path, SHAPES["gemma3"], "f16", seed=7, arch="gemma3")
    transformer = load_transformer(GGUFModel(path), exact=True)
    engine = Engine(transformer, 128, prefill_batch=4)
    first = prompt(40, seed=4)
    engine.prefill(first)
    for t in prompt(30, seed=5):
        engine.decode_one(t)
    near = first + prompt(30, seed=5)[:27] + prompt(3, seed=6)  # diverges 3 tokens back: reused
    assert_same(engine.prefill(near), Engine(transformer, 128, prefill_batch=4).prefill(near))
    assert engine.stats.prompt_tokens == 3
    far = first[:20] + prompt(4, seed=6)  # the window before position 20 is gone from the ring
    assert_same(engine.prefill(far), Engine(transformer, 128, prefill_batch=4).prefill(far))
    assert engine.stats.prompt_tokens == len(far)


def test_batch_split_does_not_change_logits(model: GGUFModel) -> None:
    transformer = load_transformer(model, exact=True)
    ids = prompt(40)
    whole = Engine(transformer, 64).evaluate(ids, all_logits=True)
    pieces = Engine(transformer, 64, prefill_batch=7).evaluate(ids, all_logits=True)
    engine = Engine(transformer, 64)
    one_by_one = np.stack([engine.decode_one(t) for t in ids])
    assert_same(pieces, whole)
    assert_same(one_by_one, whole)


def test_prefill_reuses_the_cached_prefix(model: GGUFModel) -> None:
    transformer = load_transformer(model, exact=True)
    first, extended = prompt(20), prompt(20) + prompt(5, seed=1)
    engine = Engine(transformer, 64)
    engine.prefill(first)
    logits = engine.prefill(extended)
    assert engine.stats.prompt_tokens == 5  # only the new tokens ran
    fresh = Engine(transformer, 64).prefill(extended)
    assert_same(logits, fresh)
    diverging = first[:10] + prompt(4, seed=2)
    logits = engine.prefill(diverging)
    assert engine.stats.prompt_tokens == 4 and engine.tokens == diverging
    assert_same(logits, Engine(transformer, 64).prefill(diverging))


def test_generation_stops_at_end_token_and_length(model: GGUFModel) -> None:
    transformer = load_transformer(model)
    engine = Engine(transformer, 64)
    free = list(engine.generate(prompt(8), 6, greedy))
    assert len(free) == 6 and engine.stats.stop_reason == "length"
    stop_at = free[2]
    stopped = list(engine.generate(prompt(8), 6, greedy, is_end=lambda t: t == stop_at))
    assert stopped == free[: free.index(stop_at) + 1] and engine.stats.stop_reason == "eog"


def test_context_limit(model: GGUFModel) -> None:
    engine = Engine(load_transformer(model), 16)
    with pytest.raises(ContextFullError, match="context size 16"):
        engine.prefill(prompt(17))
    out = list(engine.generate(prompt(12), 10, greedy))
    assert len(out) == 5 and engine.stats.stop_reason == "context"  # 12 + 4 evaluated = 16


def test_weight_cache_respects_its_budget(model: GGUFModel) -> None:
    args = load_transformer(model).args
    unlimited = DequantizedWeights(model, args)
    layer_bytes = unlimited.layer(0).nbytes
    small = DequantizedWeights(model, args, budget_bytes=int(layer_bytes * 1.5))
    for i in range(args.n_layers):
        small.layer(i)
    assert small._cached_bytes <= small.budget_bytes
    assert small.layer(args.n_layers - 1) is small.layer(args.n_layers - 1)  # the latest stays cached
    np.testing.assert_array_equal(small.layer(0).attn_qkv.segments[0][0], unlimited.layer(0).attn_qkv.segments[0][0])
