"""Token-tree passes of the GPU engine on the NumPy stand-in for CuPy (tests/fake_cupy.py): a pass's
graphs captured once per row bucket and replayed at other cache lengths and for other sequences
(every kernel reads the rows from the pass index, not from launch arguments), every node's logits
those of plain decode steps along its path, and the pass buffers inside the bound the VRAM budget
plans for them. Orchestration, not CUDA: tests/gpu run the kernels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from infer.synth import Shape, write_model

SHAPE = Shape(n_layers=3, dim=256, ffn_dim=512, n_heads=4, n_kv_heads=2, vocab_size=300, context_length=256)


def _decoded(model, ref, path: list[int]) -> np.ndarray:  # noqa: ANN001
    """Logits after each token of `path` fed one decode step at a time to a copy of cache `ref`."""
    cache = model.new_cache(ref.max_tokens)
    cache.copy_from(ref)
    return np.stack([model.forward(np.asarray([t]), cache) for t in path])


def test_graphs_replay_at_any_cache_length_with_decode_numbers(tmp_path: Path, fake_cupy: object) -> None:
    from infer.gguf_file import GGUFModel
    from infer.gpu import gpu_pass_nbytes, load_gpu_transformer

    file = tmp_path / "m.gguf"
    write_model(file, SHAPE, "q4_k_m", seed=7)
    model = load_gpu_transformer(GGUFModel(file), 128, tree_nodes=32)
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(3, SHAPE.vocab_size, 9)]
    cache, ref = model.new_cache(128), model.new_cache(128)  # ref: the same tokens by decode steps
    model.forward(np.asarray(prompt), cache)
    model.forward(np.asarray(prompt), ref)
    parents = np.array([-1, 0, 1, 1, 2])  # a chain with a sibling: node 3 beside node 2
    for _ in range(3):  # three passes at three cache lengths, one tree size: captured once
        tokens = rng.integers(3, SHAPE.vocab_size, len(parents))
        logits = model.verify_tree(tokens, parents, cache).to_host()
        for node, path in ((4, [0, 1, 2, 4]), (3, [0, 1, 3])):
            want = _decoded(model, ref, [int(tokens[i]) for i in path])[-1]
            np.testing.assert_array_equal(logits[node], want)
        cache.accept([0, 1])
        for t in tokens[:2]:
            model.forward(np.asarray([t]), ref)
    captured = len(model.graphs)
    from infer.gpu.passes import PassShape

    assert {k[:3] for k in model.graphs._graphs if k[0] == "run"} >= {("run", 0, PassShape(8))}  # the 5 nodes' bucket
    model.verify_tree(rng.integers(3, SHAPE.vocab_size, len(parents)), parents, cache)
    assert len(model.graphs) == captured  # replayed, not captured again
    planned = gpu_pass_nbytes(GGUFModel(file), model.args, model.capacity, 128, 32)
    buffers = [model.x, model.qkv, model.att, model.gu, model.work, model.logits, model.index.device,
               *model.rope_tables]
    held = (sum(int(b.nbytes) for b in buffers) + model.inputs.nbytes + model.head_inputs.nbytes
            + model.null_cache.nbytes)
    assert held <= planned, (held, planned)

    big = np.array([-1, *range(19)])  # 20 nodes: another bucket (32)
    tokens = rng.integers(3, SHAPE.vocab_size, len(big))
    logits = model.verify_tree(tokens, big, cache)
    ids, maxima, bad = logits.row_argmax()  # on the device: the host arg-max of each row
    got = logits.to_host()
    want = _decoded(model, ref, [int(t) for t in tokens])
    with pytest.raises(RuntimeError, match="after another pass"):
        logits.to_host()  # the device block was overwritten by those passes
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(ids, np.argmax(want, axis=1))
    np.testing.assert_array_equal(maxima, want.max(axis=1))
    assert not bad.any()


def test_a_temperature_too_small_to_divide_by_is_greedy(tmp_path: Path, fake_cupy: object) -> None:
    """The device sampler takes the host sampler's rule (infer.sampler.GREEDY_BELOW): a temperature
    that small would turn the logits into infinities, so the row is decoded by arg-max."""
    from infer.gguf_file import GGUFModel
    from infer.gpu import load_gpu_transformer

    file = tmp_path / "m.gguf"
    write_model(file, SHAPE, "q8_0", seed=3)
    model = load_gpu_transformer(GGUFModel(file), 64)
    prompt = np.array([5, 17, 42, 8])
    greedy = model.generate(prompt, model.new_cache(64), 12, temperature=0.0)
    tiny = model.generate(prompt, model.new_cache(64), 12, temperature=1e-39, seed=5)
    assert list(tiny) == list(greedy)
