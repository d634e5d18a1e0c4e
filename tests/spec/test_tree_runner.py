"""infer.gpu.tree.TreeRunner on the NumPy stand-in for CuPy (tests/fake_cupy.py): the verify pass's
resident layers captured once per tree size and replayed at other cache lengths (the attention
kernels take the cache length from the tree's index, not from a launch argument), every node's
logits those of plain decode steps along its path, and the runner's buffers inside the bound the
VRAM budget plans for them. Orchestration, not CUDA: tests/gpu run the kernels."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from infer.synth import Shape, write_model

SHAPE = Shape(n_layers=3, dim=256, ffn_dim=512, n_heads=4, n_kv_heads=2, vocab_size=300, context_length=256)


def _decoded(model, ref, path: list[int]) -> np.ndarray:  # noqa: ANN001
    """Logits after each token of `path` fed one decode step at a time to a copy of cache `ref`."""
    cache = model.new_cache(ref.max_tokens)
    cache.keys[...] = ref.keys
    cache.values[...] = ref.values
    cache.length = ref.length
    return np.stack([model.forward(np.asarray([t]), cache) for t in path])


def test_graphs_replay_at_any_cache_length_with_decode_numbers(tmp_path: Path, fake_cupy: object) -> None:
    from infer.gguf_file import GGUFModel
    from infer.gpu import load_gpu_transformer
    from infer.tiers.budget import tree_buffers_nbytes

    path = tmp_path / "m.gguf"
    write_model(path, SHAPE, "q4_k_m", seed=7)
    model = load_gpu_transformer(GGUFModel(path), 128)
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(3, SHAPE.vocab_size, 9)]
    cache, ref = model.new_cache(128), model.new_cache(128)  # ref: the same tokens by decode steps
    model.forward(np.asarray(prompt), cache)
    model.forward(np.asarray(prompt), ref)
    parents = np.array([-1, 0, 1, 1, 2])  # a chain with a sibling: node 3 beside node 2
    for _ in range(3):  # three passes at three cache lengths, one tree size: captured once
        tokens = rng.integers(3, SHAPE.vocab_size, len(parents))
        logits = model.verify_tree(tokens, parents, cache)
        for node, path in ((4, [0, 1, 2, 4]), (3, [0, 1, 3])):
            want = _decoded(model, ref, [int(tokens[i]) for i in path])[-1]
            np.testing.assert_array_equal(logits[node], want)
        cache.accept([0, 1])
        for t in tokens[:2]:
            model.forward(np.asarray([t]), ref)
    tree_graphs = [k for k in cache.graphs if k[0] == "tree"]
    assert len(tree_graphs) == sum(c for c, _ in model.tree_runner(5, 128).segments), tree_graphs
    runner = model.tree_runner(5, 128)
    assert runner.nbytes <= tree_buffers_nbytes(model.args, runner.capacity, 128)

    big = np.array([-1, *range(19)])  # 20 nodes: past the first runner's 16, made anew
    tokens = rng.integers(3, SHAPE.vocab_size, len(big))
    logits = model.verify_tree(tokens, big, cache)
    assert model.tree_runner(20, 128).capacity == 32 and model.tree_runner(20, 128) is not runner
    want = _decoded(model, ref, [int(t) for t in tokens])
    np.testing.assert_array_equal(logits.to_host(), want)
    ids, maxima, bad = logits.row_argmax()  # on the device: the host arg-max of each row
    np.testing.assert_array_equal(ids, np.argmax(want, axis=1))
    np.testing.assert_array_equal(maxima, want.max(axis=1))
    assert not bad.any()
