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


def test_trees_of_several_sequences_share_one_pass(tmp_path: Path, fake_cupy: object) -> None:
    """forward_batch with trees: two sequences' trees, a decode token and a prompt chunk in ONE pass;
    each tree's logits are verify_tree's alone, the decode token's plain decoding's; the trees'
    caches keep their length, the others grow."""
    from infer.gguf_file import GGUFModel
    from infer.gpu import load_gpu_transformer

    file = tmp_path / "m.gguf"
    write_model(file, SHAPE, "q4_k_m", seed=7)
    model = load_gpu_transformer(GGUFModel(file), 128, batch=4, tree_nodes=32)
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(3, SHAPE.vocab_size, n)] for n in (9, 5, 7, 3)]
    caches, refs = [model.new_cache(128) for _ in prompts], [model.new_cache(128) for _ in prompts]
    for prompt, cache, ref in zip(prompts, caches, refs, strict=True):
        model.forward(np.asarray(prompt), cache)
        model.forward(np.asarray(prompt), ref)
    trees = [np.array([-1, 0, 1, 1, 2]), np.array([-1, 0, 0])]
    tokens = [rng.integers(3, SHAPE.vocab_size, len(t)) for t in trees]
    chunk = rng.integers(3, SHAPE.vocab_size, 6)
    batch = [(tokens[0], caches[0]), (np.array([11]), caches[2]), (tokens[1], caches[1]), (chunk, caches[3])]
    passes = model.passes
    out = model.forward_batch(batch, prompt_rows=[0, 0, 0, 5], trees=[trees[0], None, trees[1], None])
    assert model.passes == passes + 1
    got = [out[0].to_host(), out[2].to_host()]
    want_decode = model.forward(np.array([11]), refs[2])
    want_chunk = model.forward(chunk, refs[3], prompt=True)
    want_trees = [model.verify_tree(tokens[i], trees[i], refs[i]).to_host() for i in (0, 1)]
    for g, w in zip(got, want_trees, strict=True):
        np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(out[1], want_decode)
    np.testing.assert_array_equal(out[3], want_chunk)
    assert [c.length for c in caches] == [9, 5, 8, 9]
    with pytest.raises(ValueError, match="parents"):
        model.forward_batch([(tokens[1], caches[1])], trees=[np.array([-1, 0])])


def test_the_server_loop_speculates_on_the_gpu_engine(tmp_path: Path, fake_cupy: object) -> None:
    """The generation loop with speculation on the GPU engine (stand-in): drafters on a GPU draft
    model chain together on the device (draft_chains), every request's tree is verified in one
    pass and walked through its device arg-maxes; the replies are the plain loop's (a wrong draft,
    the target drafting itself, prompt lookup)."""
    from infer.engine import greedy
    from infer.gguf_file import GGUFModel
    from infer.gpu import load_gpu_transformer
    from infer.request import Request, as_sampler
    from infer.scheduler import Scheduler
    from infer.spec_serve import DraftPool
    from infer.speculative import LookupDrafter, ModelDrafter

    target_file, draft_file = tmp_path / "m.gguf", tmp_path / "d.gguf"
    write_model(target_file, SHAPE, "q4_k_m", seed=8)
    write_model(draft_file, Shape(**{**SHAPE.__dict__, "n_layers": 1}), "q4_k_m", seed=8)
    model = load_gpu_transformer(GGUFModel(target_file), 128, batch=4, tree_nodes=28)
    draft = load_gpu_transformer(GGUFModel(draft_file), 128, batch=4)
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, SHAPE.vocab_size, n)] for n in (40, 7, 60, 3)]
    prompts[1] = [11, 12, 13, 14] * 6  # something for prompt lookup to find
    plain = [Request(p, 12, as_sampler(greedy)) for p in prompts]
    baseline = Scheduler(model, 128, 4, device_runs=False)
    baseline.run(plain)
    passes = {}
    for name, drafter in (("draft", lambda: ModelDrafter(draft, 128, depth=3, width=2)),
                          ("self", lambda: ModelDrafter(model, 128, depth=3, width=2)),
                          ("lookup", lambda: LookupDrafter(depth=6))):
        spec = [Request(p, 12, as_sampler(greedy)) for p in prompts]
        scheduler = Scheduler(model, 128, 4, device_runs=False, speculation=DraftPool(model, drafter, 7, 128))
        scheduler.run(spec)
        assert [r.generated for r in spec] == [r.generated for r in plain], name
        assert scheduler.stats.draft_tokens > 0
        passes[name] = scheduler.stats.passes
    assert passes["self"] < baseline.stats.passes / 2  # the target drafting itself: its chains kept
