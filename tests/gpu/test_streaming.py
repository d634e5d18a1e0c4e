"""Streaming on the GPU computes what resident weights compute.

The same model runs through the streaming pipeline twice: once with budgets so small that every
tier carries layers (VRAM-resident, tier B pinned or registered, tier C from the file with O_DIRECT
or through the mmap baseline), once with everything resident. Both use the same kernels on the
same repacked bytes, so logits must be identical — for a prompt (batched products), for decode
(GEMVs) and for a batch of sequences. Against the GPU backend's own transformer and the CPU
engine they agree within float rounding.

Run on the H200:  .venv/bin/python -m pytest -v tests/gpu/test_streaming.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from infer.engine import greedy
from infer.gguf_file import GGUFModel
from infer.model import ModelArgs, load_transformer
from infer.synth import Shape, write_model
from infer.tiers.budget import compute_budgets
from infer.tiers.plan import Tier, minimum_vram
from infer.tiers.session import StreamingConfig, build_streaming_engine, planner_tensors

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu
SHAPE = Shape(n_layers=6, dim=512, ffn_dim=1536, n_heads=8, n_kv_heads=2, vocab_size=2000, context_length=1024)
CTX = 320


@pytest.fixture(scope="module", params=["q4_k_m", "q8_0", "f16", "qwen3-q4_k_m", "gemma3-q4_k_m"])
def model_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("stream") / f"m-{request.param}.gguf"
    arch, _, kind = request.param.rpartition("-")
    # Gemma 3: post-norms streamed with their layers, a 64-token window over the CTX positions
    extra = {"sliding_window": 64} if arch == "gemma3" else {}
    shape = Shape(**{**SHAPE.__dict__, "arch": arch, "head_dim": 128, **extra}) if arch else SHAPE
    write_model(path, shape, kind, seed=5)
    return path


def device_reserve() -> int:
    """Device bytes outside the memory pool, as the session measures them."""
    from infer.gpu import memory

    return sum(memory.new_account(None, "test").reserved.values())


def budgets(path: Path, resident: float, ram: float, batch: int = 1, slots: int = 4) -> tuple[int, int]:
    model = GGUFModel(path)
    args = ModelArgs.from_gguf(model)
    tensors = planner_tensors(model, "gpu")
    layers = sum(t.device_nbytes for t in tensors if t.layer is not None and not t.is_vector)
    raw_layers = sum(t.nbytes for t in tensors if t.layer is not None and not t.is_vector)
    staging = 4 * max(t.nbytes for t in tensors if t.layer is not None)
    from infer.gpu import gpu_pass_nbytes

    big = compute_budgets(args, CTX, batch, max(512, batch), staging, 10**15, 10**15, device=True,
                          device_reserved=device_reserve(),
                          activations=gpu_pass_nbytes(model, args, max(512, batch), CTX, batch))
    vram = minimum_vram(tensors, slots, True) + int(resident * layers) + big.vram_total - big.vram_for_weights
    return vram, int(ram * raw_layers) + staging


def open_session(path: Path, resident: float | None, ram: float = 0.3, tier_c: str = "file", tier_b: str = "auto",
                 batch: int = 1, cpu_tier: str | int = "off"):
    if resident is None:  # everything resident
        vram_budget, ram_budget = "10GB", "1GB"
    else:
        v, r = budgets(path, resident, ram, batch)
        vram_budget, ram_budget = str(v), str(r)
    config = StreamingConfig(enabled=True, vram_budget=vram_budget, ram_budget=ram_budget, tier_c=tier_c,
                             tier_b=tier_b, batch=batch, cpu_tier=cpu_tier)
    return build_streaming_engine(str(path), config, CTX, device="gpu", measure=False)


def run_logits(session, prompt: np.ndarray, steps: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
    model = session.engine.model
    cache = model.new_cache(CTX)
    prefill = model.forward(prompt, cache, all_logits=True)
    return prefill, [model.forward(np.array([t]), cache) for t in steps]


@pytest.mark.parametrize(("tier_b", "tier_c"), [("pinned", "file"), ("registered", "file"), ("pinned", "mmap")])
def test_streamed_equals_resident_bit_for_bit(model_path: Path, tier_b: str, tier_c: str) -> None:
    prompt = np.random.default_rng(1).integers(3, SHAPE.vocab_size, 40)
    steps = [5, 77, 1999, 42]
    resident = open_session(model_path, None)
    try:
        assert resident.plan.streamed == []
        want_prefill, want_steps = run_logits(resident, prompt, steps)
    finally:
        resident.close()
    streamed = open_session(model_path, 0.3, 0.3, tier_c, tier_b)
    try:
        tiers = {streamed.plan.tier[t.name] for t in streamed.plan.tensors if t.layer is not None}
        assert tiers == {Tier.VRAM, Tier.RAM, Tier.STORAGE}
        got_prefill, got_steps = run_logits(streamed, prompt, steps)
        moved = streamed.weights.bytes_moved()
        passes = 1 + len(steps)
        for tier in (Tier.RAM, Tier.STORAGE):
            once = streamed.plan.bytes_in(tier)
            assert passes * once <= moved[tier] <= passes * once + 4 * streamed.plan.slot_nbytes
    finally:
        streamed.close()
    np.testing.assert_array_equal(got_prefill, want_prefill)
    for got, want in zip(got_steps, want_steps, strict=True):
        np.testing.assert_array_equal(got, want)


def test_streamed_matches_cpu_engine(model_path: Path) -> None:
    prompt = np.random.default_rng(2).integers(3, SHAPE.vocab_size, 30)
    cpu = load_transformer(GGUFModel(model_path))
    want = cpu.forward(prompt, cpu.new_cache(CTX), all_logits=True)
    session = open_session(model_path, 0.2, 0.4)
    try:
        got = session.engine.model.forward(prompt, session.engine.model.new_cache(CTX), all_logits=True)
    finally:
        session.close()
    rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    assert rel < 3e-2, rel
    assert np.mean(got.argmax(1) == want.argmax(1)) >= 0.9


def test_batch_of_sequences_on_gpu_equals_each_alone(model_path: Path) -> None:
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, SHAPE.vocab_size, n) for n in (9, 17, 2)]
    session = open_session(model_path, 0.3, 0.3, batch=3)
    try:
        model = session.engine.model
        caches = [model.new_cache(CTX) for _ in prompts]
        together = model.forward_batch([(p, c) for p, c in zip(prompts, caches, strict=True)])
        step = model.forward_batch([(np.array([7]), c) for c in caches])  # one decode pass for all three
        for p, logits, next_logits in zip(prompts, together, step, strict=True):
            cache = model.new_cache(CTX)
            alone = model.forward(p, cache)
            alone_next = model.forward(np.array([7]), cache)  # one row
            for got, want in ((logits, alone), (next_logits, alone_next)):
                np.testing.assert_array_equal(got, want)  # a sequence's logits do not depend on the batch
        outputs = session.engine.generate([list(p) for p in prompts], 6, greedy)
        assert [len(o) for o in outputs] == [6, 6, 6] and session.engine.stats.decode_passes == 5
    finally:
        session.close()


@pytest.mark.parametrize("tier_b", ["pinned", "registered"])
def test_cpu_tier_follows_the_streamed_passes(model_path: Path, tier_b: str) -> None:
    """Layers held in RAM computed by the CPU in passes of <= 2 tokens (infer.tiers.cpu_tier): the
    logits of every pass follow the engine that streams them, prompts stream, decode copies none
    of those layers' bytes, and switching back and forth keeps the ring's order."""
    from infer import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("the native CPU kernels are not built")
    rng = np.random.default_rng(6)
    prompt, chunk, steps = rng.integers(3, SHAPE.vocab_size, 40), rng.integers(3, SHAPE.vocab_size, 9), [5, 77, 1999]

    def run(session) -> tuple[list[np.ndarray], list[int]]:
        model = session.engine.model
        cache = model.new_cache(CTX)
        out, moved = [], []
        for tokens in (prompt, *([t] for t in steps), chunk, *([t] for t in steps)):
            out.append(model.forward(np.asarray(tokens), cache, all_logits=len(tokens) > 1))
            moved.append(session.weights.bytes_moved()[Tier.RAM])
        return out, moved

    plain = open_session(model_path, 0.3, 1.2, tier_b=tier_b)
    try:
        want, _ = run(plain)
    finally:
        plain.close()
    session = open_session(model_path, 0.3, 1.2, tier_b=tier_b, cpu_tier=2)
    try:
        assert session.plan.bytes_in(Tier.STORAGE) == 0 and session.engine.model.cpu_tier is not None
        got, moved = run(session)
        slack = session.weights.ring.n_slots * session.plan.slot_nbytes
    finally:
        session.close()
    # the GPU engine against the CPU's products: within the bound of test_streamed_matches_cpu_engine
    # (the two engines' 8-bit roundings of the same values part by a unit here and there, and later
    # layers amplify it: 0.9-1.8% on the H100, 2026-12-06; F16, which rounds to float16 only, within 1e-3)
    for g, w in zip(got, want, strict=True):
        assert float(np.linalg.norm(g - w) / np.linalg.norm(w)) < 3e-2
    rows_got = np.concatenate([g.reshape(-1, SHAPE.vocab_size) for g in got])
    rows_want = np.concatenate([w.reshape(-1, SHAPE.vocab_size) for w in want])
    assert np.mean(rows_got.argmax(-1) == rows_want.argmax(-1)) >= 0.9
    assert moved[2] - moved[1] <= slack and moved[3] == moved[2]  # decode on the CPU: nothing crosses
    assert moved[4] - moved[3] > 0 and moved[7] == moved[6]  # the chunk streams; decode again does not


def test_plan_report_names_the_data_paths(model_path: Path) -> None:
    session = open_session(model_path, 0.3, 0.3)
    try:
        text = session.report()
    finally:
        session.close()
    assert "resident" in text and "staged read (file)" in text
    assert ("pinned-RAM copy" in text) or ("registered-mmap copy" in text)


@pytest.mark.parametrize("tier_b", ["pinned", "registered"])
def test_a_streamed_pass_as_one_graph_gives_the_per_layer_bits(model_path: Path, tier_b: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """NVMEDIRECT_STREAM_GRAPH=1 (infer.gpu.stream_graph): the ring's copies, repacks and layers of
    a pass captured once a row bucket and ring phase and replayed give the per-layer path's bits
    (prompt, decode steps, a tree, a batch), the same bytes moved and the ring's count
    (tests/tiers/test_tiers_gpu_glue.py stream_graph_runs); with tier C nothing is captured."""
    from infer.gpu import stream_graph
    from tests.tiers.test_tiers_gpu_glue import stream_graph_runs

    prompt = np.random.default_rng(6).integers(3, SHAPE.vocab_size, 40)
    stream_graph_runs(lambda: open_session(model_path, 0.3, 1.5, tier_b=tier_b), prompt,
                      [5, 77, 1999, 42, 8, 300, 13, 1000, 64, 7, 91], CTX, monkeypatch)
    monkeypatch.setenv("NVMEDIRECT_STREAM_GRAPH", "1")
    s = open_session(model_path, 0.3, 0.3)  # tier C too: no capture
    try:
        assert not stream_graph.can_capture(s.engine.model)
    finally:
        s.close()
