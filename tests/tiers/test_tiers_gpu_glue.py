"""The GPU engine (infer/gpu/model.py over the streaming provider, infer/tiers/pipeline.py) run on
the NumPy stand-in for CuPy (tests/fake_cupy.py): every tier and data path, decode (one row and
CUDA-graph segments around the streamed layers), a prompt and a batch of sequences, token trees.
Streamed equals resident exactly; a row's logits are the same bits in every pass it can ride in;
both follow the CPU engine. The real GPU runs the same checks in tests/gpu/test_streaming.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from infer.gguf_file import GGUFModel
from infer.model import ModelArgs, load_transformer
from infer.synth import Shape, write_model
from infer.tiers.budget import compute_budgets
from infer.tiers.plan import Tier, minimum_vram
from infer.tiers.session import StreamingConfig, build_streaming_engine, planner_tensors

SHAPE = Shape(n_layers=4, dim=256, ffn_dim=768, n_heads=4, n_kv_heads=2, vocab_size=600, context_length=512)
CTX = 64


@pytest.fixture(scope="module", params=["q4_k_m", "q8_0"])
def model_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("glue") / f"m-{request.param}.gguf"
    write_model(path, SHAPE, request.param, seed=9)
    return path


def device_reserve() -> int:
    """Device bytes outside the memory pool, as the session measures them."""
    from infer.gpu import memory

    return sum(memory.new_account(None, "test").reserved.values())


def gpu_session(path: Path, resident: float | None, ram: float = 0.3, tier_c: str = "file", tier_b: str = "pinned",
                cpu_tier: str | int = "off"):
    if resident is None:
        vram, ram_budget = "10GB", "1MB"
    else:
        model = GGUFModel(path)
        tensors = planner_tensors(model, "gpu")
        layers = sum(t.device_nbytes for t in tensors if t.layer is not None and not t.is_vector)
        raw = sum(t.nbytes for t in tensors if t.layer is not None and not t.is_vector)
        staging = 4 * max(t.nbytes for t in tensors if t.layer is not None)
        from infer.gpu import gpu_pass_nbytes

        args = ModelArgs.from_gguf(model)
        big = compute_budgets(args, CTX, 1, 512, staging, 10**15, 10**15, device_reserved=device_reserve(),
                              activations=gpu_pass_nbytes(model, args, 512, CTX))
        vram = str(minimum_vram(tensors, 4, True) + int(resident * layers) + big.vram_total - big.vram_for_weights)
        ram_budget = str(int(ram * raw) + staging)
    config = StreamingConfig(enabled=True, vram_budget=vram, ram_budget=ram_budget, tier_c=tier_c, tier_b=tier_b,
                             cpu_tier=cpu_tier)
    return build_streaming_engine(str(path), config, CTX, device="gpu", measure=False)


def logits_of(session, prompt: np.ndarray, steps: list[int]) -> list[np.ndarray]:
    m = session.engine.model
    cache = m.new_cache(CTX)
    return [m.forward(prompt, cache, all_logits=True)] + [m.forward(np.array([t]), cache) for t in steps]


@pytest.mark.parametrize(("tier_b", "tier_c"), [("pinned", "file"), ("registered", "mmap")])
def test_gpu_glue_streamed_equals_resident_and_follows_cpu(model_path: Path, fake_cupy: object,
                                                           tier_b: str, tier_c: str) -> None:
    prompt = np.random.default_rng(1).integers(3, SHAPE.vocab_size, 7)
    steps = [5, 77, 401]
    resident = gpu_session(model_path, None)
    try:
        assert resident.plan.streamed == []
        want = logits_of(resident, prompt, steps)
    finally:
        resident.close()
    streamed = gpu_session(model_path, 0.3, 0.3, tier_c, tier_b)
    try:
        assert {streamed.plan.tier[t.name] for t in streamed.plan.tensors if t.layer is not None} == set(Tier)
        assert streamed.plan.scratch_nbytes > 0
        got = logits_of(streamed, prompt, steps)
        moved = streamed.weights.bytes_moved()
        assert moved[Tier.STORAGE] >= 4 * streamed.plan.bytes_in(Tier.STORAGE)
        paths = set(streamed.paths.values())
        assert f"staged read ({tier_c})" in paths
        assert ("registered-mmap copy" if tier_b == "registered" else "pinned-RAM copy") in paths
    finally:
        streamed.close()
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    cpu = load_transformer(GGUFModel(model_path))
    cache = cpu.new_cache(CTX)
    reference = [cpu.forward(prompt, cache, all_logits=True)] + [cpu.forward(np.array([t]), cache) for t in steps]
    for g, r in zip(got, reference, strict=True):
        rel = float(np.linalg.norm(g - r) / np.linalg.norm(r))
        assert rel < 3e-2, rel  # float16 inputs to the products of many-row passes (the GPU tests' bound)



def test_gpu_glue_a_prompt_in_one_pass_equals_token_by_token(model_path: Path, fake_cupy: object) -> None:
    """A prompt's positions in one pass get the bits they get one pass a token (each row's numbers
    do not depend on the pass), and both follow the CPU engine."""
    tokens = [1, 17, 300, 42, 599]
    s = gpu_session(model_path, 0.25, 0.25)
    try:
        m = s.engine.model
        cache = m.new_cache(CTX)
        got = [m.forward(np.array([t]), cache) for t in tokens]
        whole = m.forward(np.array(tokens), m.new_cache(CTX), all_logits=True)
    finally:
        s.close()
    np.testing.assert_array_equal(np.stack(got), whole)
    cpu = load_transformer(GGUFModel(model_path))
    cache = cpu.new_cache(CTX)
    for t, g in zip(tokens, got, strict=True):
        r = cpu.forward(np.array([t]), cache)
        assert float(np.linalg.norm(g - r) / np.linalg.norm(r)) < 3e-2


def test_gpu_glue_batch_of_sequences(model_path: Path, fake_cupy: object) -> None:
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, SHAPE.vocab_size, n) for n in (5, 9, 1)]
    s = gpu_session(model_path, 0.3, 0.3)
    try:
        m = s.engine.model
        caches = [m.new_cache(CTX) for _ in prompts]
        together = m.forward_batch([(p, c) for p, c in zip(prompts, caches, strict=True)])
        step = m.forward_batch([(np.array([11]), c) for c in caches])
        for p, first, second in zip(prompts, together, step, strict=True):
            cache = m.new_cache(CTX)
            alone = m.forward(p, cache)
            alone_next = m.forward(np.array([11]), cache)
            for g, w in ((first, alone), (second, alone_next)):
                np.testing.assert_array_equal(g, w)  # a sequence's logits do not depend on the batch
        assert [c.length for c in caches] == [6, 10, 2]
    finally:
        s.close()


def test_gpu_glue_tree_pass_equals_each_path_alone(model_path: Path, fake_cupy: object) -> None:
    """The GPU engine's token-tree pass over streamed weights (on the stand-in): every node's logits
    are those of a plain pass over its path (its tokens in one pass), and accepting a path keeps
    those keys and values."""
    from infer.speculative import Tree

    s = gpu_session(model_path, 0.3, 0.3)
    try:
        m = s.engine.model
        rng = np.random.default_rng(6)
        prompt = rng.integers(3, SHAPE.vocab_size, 9)
        tree = Tree([int(t) for t in rng.integers(3, SHAPE.vocab_size, 6)], [-1, 0, 0, 1, 3, 2])
        cache = m.new_cache(CTX)
        m.forward(prompt, cache)
        got = m.forward_tree(np.array(tree.tokens), np.array(tree.parents), cache)
        assert cache.length == len(prompt) and got.shape == (6, SHAPE.vocab_size)
        for node, path in ((4, [0, 1, 3, 4]), (5, [0, 2, 5])):
            ref = m.new_cache(CTX)
            m.forward(prompt, ref)
            want = m.forward(np.array([tree.tokens[i] for i in path]), ref)
            np.testing.assert_array_equal(got[node], want)
        cache.accept([0, 1, 3, 4])
        nxt = m.forward(np.array([7]), cache)
        ref = m.new_cache(CTX)
        want = m.forward(np.concatenate([prompt, [tree.tokens[i] for i in (0, 1, 3, 4)], [7]]), ref)
        np.testing.assert_array_equal(nxt, want)
    finally:
        s.close()


def test_gpu_glue_verify_tree_is_each_path_decoded(model_path: Path, fake_cupy: object) -> None:
    """verify_tree over streamed weights on the stand-in: every node's logits equal, bit for bit,
    those of decode steps along its path, so greedy speculation emits the plain engine's tokens;
    accepting a path keeps its keys and values. The real GPU runs it in
    tests/gpu/test_speculative_gpu.py."""
    from infer.speculative import Tree

    s = gpu_session(model_path, 0.3, 0.3)
    try:
        m = s.engine.model
        rng = np.random.default_rng(7)
        prompt = rng.integers(3, SHAPE.vocab_size, 9)
        tree = Tree([int(t) for t in rng.integers(3, SHAPE.vocab_size, 7)], [-1, 0, 0, 1, 3, 2, 0])
        cache = m.new_cache(CTX)
        m.forward(prompt, cache)
        got = m.verify_tree(np.array(tree.tokens), np.array(tree.parents), cache).to_host()  # before other passes
        assert cache.length == len(prompt) and got.shape == (7, SHAPE.vocab_size)
        for node, path in ((4, [0, 1, 3, 4]), (5, [0, 2, 5]), (6, [0, 6]), (0, [0])):
            ref = m.new_cache(CTX)
            m.forward(prompt, ref)
            for i in path:  # one decode step per token
                want = m.forward(np.array([tree.tokens[i]]), ref)
            assert np.array_equal(got[node], want), node
        cache.accept([0, 1, 3, 4])
        nxt = m.forward(np.array([7]), cache)
        ref = m.new_cache(CTX)
        m.forward(prompt, ref)
        for t in [*(tree.tokens[i] for i in (0, 1, 3, 4)), 7]:
            want = m.forward(np.array([t]), ref)
        assert np.array_equal(nxt, want)
    finally:
        s.close()


@pytest.mark.parametrize(("width", "prompt_len"), [(1, 3), (3, 3), (1, 12)])
def test_gpu_glue_draft_chain_is_the_host_loop(model_path: Path, fake_cupy: object, width: int,
                                               prompt_len: int) -> None:
    """GpuTransformer.draft_chain (the greedy chain and each step's runners-up, on the device) gives
    the ids of the drafter's host loop, and leaves the cache where that loop leaves it."""
    from infer.speculative import ModelDrafter

    s = gpu_session(model_path, 0.3, 0.3)
    try:
        m = s.engine.model
        prompt = np.random.default_rng(8).integers(3, SHAPE.vocab_size, prompt_len)
        device_cache, host_cache = m.new_cache(CTX), m.new_cache(CTX)
        ids = m.draft_chain(prompt, device_cache, 4, width)
        host = ModelDrafter(m, CTX, 4, width, cache=host_cache)
        if prompt_len > 1:  # as draft_chain feeds a prompt: one pass
            m.forward(prompt[:-1], host_cache)
        want = host._chain(prompt[-1:], 4, width)
        assert np.array_equal(ids, want) and device_cache.length == host_cache.length == len(prompt) + 3
        assert np.array_equal(m.forward(np.array([5]), device_cache), m.forward(np.array([5]), host_cache))
    finally:
        s.close()


@pytest.mark.parametrize(("width", "spare_rows"), [(1, True), (3, True), (3, False)])
def test_gpu_glue_draft_chains_of_several_sequences(model_path: Path, fake_cupy: object, width: int,
                                                    spare_rows: bool) -> None:
    """GpuTransformer.draft_chains (a server's drafters on one draft model, their chains decoded
    together on the device) gives each sequence the tree its drafter proposes alone, and leaves each
    draft cache where proposing alone leaves it. Without spare logits rows for every step (a
    server's 8 drafters 8 deep on a 0.5B would need a copy of 64 rows of the vocabulary, outside the
    VRAM plan), each step's best ids are taken as it comes: the same trees."""
    from infer.speculative import ModelDrafter

    s = gpu_session(model_path, 0.3, 0.3)
    try:
        m = s.engine.model
        if not spare_rows:
            m.logits_rows = 3  # the three sequences' rows, no more
        rng = np.random.default_rng(9)
        contexts = [[int(t) for t in rng.integers(3, SHAPE.vocab_size, n)] for n in (5, 1, 9)]
        roots, sizes = [4, 6, 8], [1 + 3 * width, 1 + 3 * width, 1 + 2 * width]  # two shapes: two device runs
        alone = [ModelDrafter(m, CTX, 3, width) for _ in contexts]
        together = [ModelDrafter(m, CTX, 3, width) for _ in contexts]
        for _ in range(2):  # the second time each rewinds to what it shares with the longer context
            want = [d.propose(c, r, n) for d, c, r, n in zip(alone, contexts, roots, sizes, strict=True)]
            got = ModelDrafter.propose_many(together, contexts, roots, sizes)
            assert [(t.tokens, t.parents) for t in got] == [(t.tokens, t.parents) for t in want]
            assert [d.cache.length for d in together] == [d.cache.length for d in alone]
            contexts = [[*c, r] for c, r in zip(contexts, roots, strict=True)]
    finally:
        s.close()


def test_gpu_glue_best_first_drafter_on_the_device(model_path: Path, fake_cupy: object) -> None:
    """The best-first drafter on the streamed GPU engine (stand-in): the device's top children of a
    tree pass are the host's from the same rows, and speculation with it gives plain decoding's text."""
    from infer.draft_tree import BestFirstDrafter, top_children
    from infer.engine import greedy
    from infer.speculative import Speculator

    s = gpu_session(model_path, 0.4, 0.3)
    try:
        m = s.engine.model
        prompt = np.random.default_rng(10).integers(3, SHAPE.vocab_size, 6)
        cache = m.new_cache(CTX)
        m.forward(prompt[:-1], cache)
        logits = m.verify_tree(np.array([prompt[-1], 4, 9, 5]), np.array([-1, 0, 0, 1]), cache)
        ids, logp = logits.top_children([0, 3], 3)
        want_ids, want_logp = top_children(logits.to_host(), [0, 3], 3)
        assert np.array_equal(ids, want_ids) and np.allclose(logp, want_logp, atol=1e-4)
        want = m.generate(prompt, m.new_cache(CTX), 12)
        spec = Speculator(m, BestFirstDrafter(m, CTX, 3, 2), 7, CTX)
        assert list(spec.generate(list(prompt), 12, greedy)) == want
        assert spec.stats.tokens_per_pass > 2  # the draft is the target itself
    finally:
        s.close()


def test_gpu_glue_self_spec_reads_no_streamed_layer_while_drafting(model_path: Path, fake_cupy: object) -> None:
    """--self-spec on the streamed GPU engine (stand-in): the draft leaves the streamed layers out
    (no byte moves through the ring while it drafts), and the output is the plain engine's."""
    from infer.engine import greedy
    from infer.layerskip import skipping, streamed_layers
    from infer.speculative import ModelDrafter, Speculator

    s = gpu_session(model_path, 0.4, 0.3)
    try:
        m = s.engine.model
        skip = streamed_layers(m)
        assert 0 < len(skip) < SHAPE.n_layers
        view = skipping(m, skip)
        prompt = np.random.default_rng(9).integers(3, SHAPE.vocab_size, 7)
        want = m.generate(prompt, m.new_cache(CTX), 10)
        before = dict(m.weights.bytes_moved())
        draft_cache = view.new_cache(CTX)
        view.draft_chain(prompt, draft_cache, 3, 1)
        assert dict(m.weights.bytes_moved()) == before
        spec = Speculator(m, ModelDrafter(view, CTX, 3, 1, cache=draft_cache), 4, CTX)
        assert list(spec.generate(list(prompt), 10, greedy)) == want
    finally:
        s.close()


def test_an_account_lowers_the_thread_stack_first(fake_cupy) -> None:  # noqa: ANN001
    """The driver keeps local memory for every thread's stack outside any pool (1 KiB each by
    default): an engine's account lowers the limit to what its kernels need before it measures the
    memory outside the pool, and never raises a lower one."""
    from infer.gpu import memory

    fake_cupy.LIMITS[0] = 1024
    memory.new_account(None, "test")
    assert fake_cupy.LIMITS[0] == memory.THREAD_STACK_BYTES == 256
    fake_cupy.LIMITS[0] = 128
    memory.new_account(None, "test")
    assert fake_cupy.LIMITS[0] == 128


def test_the_pool_may_use_the_rounding_no_plan_takes(fake_cupy) -> None:  # noqa: ANN001
    """A plan filled to its last byte (as the planner fills tier A) still leaves the pool the 512 B a
    buffer its allocations round to: the account keeps POOL_ROUNDING out of every plan and the pool's
    cap includes it."""
    from infer.gpu import memory

    account = memory.new_account("4GB", "test")
    assert account.reserved[memory.POOL_ROUNDING_NAME] == memory.POOL_ROUNDING
    account.plan("weights", account.room)
    assert account.room == 0
    memory.enforce(account)
    try:
        assert fake_cupy.get_default_memory_pool().get_limit() == account.pool_limit + memory.POOL_ROUNDING
        assert account.pool_limit + memory.POOL_ROUNDING + sum(
            v for k, v in account.reserved.items() if k != memory.POOL_ROUNDING_NAME) == account.budget
    finally:
        fake_cupy.get_default_memory_pool().set_limit(size=0)


def test_gpu_glue_uploads_in_chunks_give_the_same_matrices(model_path: Path, fake_cupy: object,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A matrix uploaded in runs of 256 rows (infer.gpu.ops.UPLOAD_CHUNK_BYTES: the transient copy
    of its GGUF bytes bounded, as a tight budget needs) is repacked into the same planes."""
    from infer.gpu import ops

    prompt = np.random.default_rng(4).integers(3, SHAPE.vocab_size, 5)

    def run() -> list[np.ndarray]:
        session = gpu_session(model_path, 0.3)
        try:
            return logits_of(session, prompt, [9, 31])
        finally:
            session.close()

    want = run()
    monkeypatch.setattr(ops, "UPLOAD_CHUNK_BYTES", 1)  # every part split at each 256 rows
    assert len(ops._in_chunks([(np.zeros(600 * 144, np.uint8), 600)])) == 3
    for g, w in zip(run(), want, strict=True):
        np.testing.assert_array_equal(g, w)


def stream_graph_runs(open_session, prompt: np.ndarray, steps: list[int], ctx: int,  # noqa: ANN001
                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs `open_session()` (every streamed tensor in tier B) without and with
    NVMEDIRECT_STREAM_GRAPH=1 over a prompt, decode steps, a tree and a batch, and checks the
    captured passes (infer.gpu.stream_graph) give the per-layer path's bits, move the same bytes and
    leave the ring's count where it leaves it, with at least one graph replayed."""
    from infer.gpu import stream_graph

    runs = {}
    for on in (False, True):
        monkeypatch.setenv("NVMEDIRECT_STREAM_GRAPH", "1" if on else "0")
        s = open_session()
        try:
            assert Tier.STORAGE not in {s.plan.tier[t.name] for t in s.plan.tensors} and s.plan.streamed
            m = s.engine.model
            cache = m.new_cache(ctx)
            got = [m.forward(prompt, cache, all_logits=True)] + [m.forward(np.array([t]), cache) for t in steps]
            cache = m.new_cache(ctx)
            m.forward(prompt[:6], cache)
            got.append(m.verify_tree(np.array([9, 4, 5, 6, 2]), np.array([-1, 0, 0, 1, 1]), cache).to_host())
            caches = [m.new_cache(ctx) for _ in range(3)]
            got += m.forward_batch([(prompt[: 3 + k], c) for k, c in enumerate(caches)])
            got += m.forward_batch([(np.array([7 + k]), c) for k, c in enumerate(caches)])
            ring = s.weights.ring
            keys = [k for k in m.graphs._graphs if k[0] == stream_graph.KIND]
            runs[on] = (got, s.weights.bytes_moved(), (ring.issued, ring.consumed, ring.released), keys, m.passes)
        finally:
            s.close()
    (want, moved, count, none, _), (got, moved_on, count_on, keys, passes) = runs[False], runs[True]
    assert none == [] and 0 < len(keys) < passes  # captured, and replayed
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    assert moved_on == moved and count_on == count


def test_gpu_glue_a_streamed_pass_as_one_graph_gives_the_same_bits(model_path: Path, fake_cupy: object,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """NVMEDIRECT_STREAM_GRAPH=1 (infer.gpu.stream_graph): a streamed pass, its ring's copies and
    repacks with its layers, captured once a row bucket and ring phase and replayed, gives the
    per-layer path's bits (stream_graph_runs). A plan with tier C is not captured."""
    from infer.gpu import stream_graph

    prompt = np.random.default_rng(5).integers(3, SHAPE.vocab_size, 9)
    stream_graph_runs(lambda: gpu_session(model_path, 0.3, 1.5), prompt, [5, 77, 401, 9, 13, 21, 2, 300, 41], CTX,
                      monkeypatch)
    monkeypatch.setenv("NVMEDIRECT_STREAM_GRAPH", "1")
    s = gpu_session(model_path, 0.3, 0.3)  # tier C too: its reads wait on the host, no capture
    try:
        assert not stream_graph.can_capture(s.engine.model)
    finally:
        s.close()
