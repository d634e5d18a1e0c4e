"""Streaming computes what the resident engine computes: on the CPU, with device memory simulated
by small budgets so every tier (VRAM-resident, RAM, storage through the reader's O_DIRECT
FileBackend or the mmap baseline) carries part of the model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from infer.engine import greedy
from infer.gguf_file import GGUFModel
from infer.model import load_transformer
from infer.streaming import StreamingEngine
from infer.tiers.plan import Tier, minimum_vram
from infer.tiers.session import StreamingConfig, build_streaming_engine, planner_tensors

CTX = 96
ONE_ULP = 2.0**-23  # relative: one float32 step


def budgets_for(path: Path, resident_share: float, ram_share: float, slots: int = 4,
                batch: int = 1) -> tuple[int, int]:
    """Budgets (bytes) that keep about `resident_share` of the layer bytes in tier A and
    `ram_share` in tier B, on top of what the KV cache, activations and staging of the run take."""
    from infer.model import ModelArgs
    from infer.tiers.budget import compute_budgets

    model = GGUFModel(path)
    args = ModelArgs.from_gguf(model)
    tensors = planner_tensors(model, "cpu")
    layers = sum(t.nbytes for t in tensors if t.layer is not None and not t.is_vector)
    staging = 4 * max(t.nbytes for t in tensors if t.layer is not None)
    big = compute_budgets(args, CTX, batch, max(512, batch), staging, 10**15, 10**15, device=False)
    vram = minimum_vram(tensors, slots) + int(resident_share * layers) + big.vram_total - big.vram_for_weights
    return vram, int(ram_share * layers) + staging


def session(path: Path, resident: float, ram: float, tier_c: str = "file", slots: int = 4, batch: int = 1):
    vram_budget, ram_budget = budgets_for(path, resident, ram, slots, batch)
    config = StreamingConfig(enabled=True, vram_budget=str(vram_budget), ram_budget=str(ram_budget), tier_c=tier_c,
                             slots=slots, batch=batch)
    return build_streaming_engine(str(path), config, CTX, device="cpu", measure=False)


def resident_logits(path: Path, tokens: list[int]) -> np.ndarray:
    model = load_transformer(GGUFModel(path))
    return model.forward(np.asarray(tokens), model.new_cache(CTX), all_logits=True)


PROMPT = [1, 450, 4996, 17354, 1701, 432, 14, 9, 300, 77, 12, 5]


@pytest.mark.parametrize(("resident", "ram", "tier_c", "slots"), [
    (0.3, 0.3, "file", 4), (0.0, 0.0, "file", 2), (0.5, 0.0, "mmap", 3), (0.0, 1.0, "file", 7),
])
def test_tiny_streaming_logits_equal_resident(tiny_model: Path, resident: float, ram: float, tier_c: str,
                                              slots: int) -> None:
    s = session(tiny_model, resident, ram, tier_c, slots)
    try:
        tiers = {s.plan.tier[t.name] for t in s.plan.tensors if t.layer is not None and not t.is_vector}
        expect = {Tier.VRAM} if resident else set()
        expect |= {Tier.RAM} if ram else set()
        expect |= {Tier.STORAGE} if ram < 1.0 else set()
        assert tiers == expect
        tokens = [t % 1024 for t in PROMPT]
        cache = s.engine.model.new_cache(CTX)
        got = s.engine.model.forward(np.asarray(tokens), cache, all_logits=True)
        np.testing.assert_array_equal(got, resident_logits(tiny_model, tokens))
        moved = s.weights.bytes_moved()
        # one pass moved each streamed byte once (plus at most the ring's prefetch of the next pass)
        for tier in (Tier.RAM, Tier.STORAGE):
            once = s.plan.bytes_in(tier)
            assert once <= moved[tier] <= once + slots * s.plan.slot_nbytes
    finally:
        s.close()


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_gemma3"])
def test_later_architectures_stream_as_they_run_resident(fixture: str, request: pytest.FixtureRequest) -> None:
    """Qwen3's Q/K norms and Gemma 3's post-norms ride with the streamed layers' vectors, Gemma's window
    and local rotary base with the model: streamed logits are the resident ones."""
    path = request.getfixturevalue(fixture)
    s = session(path, 0.3, 0.3)
    try:
        assert s.engine.model.args.arch == fixture.removeprefix("tiny_")
        tokens = [t % 1024 for t in PROMPT]
        got = s.engine.model.forward(np.asarray(tokens), s.engine.model.new_cache(CTX), all_logits=True)
        np.testing.assert_array_equal(got, resident_logits(path, tokens))
    finally:
        s.close()


def test_tiny_generation_over_many_passes_equals_resident(tiny_model: Path) -> None:
    s = session(tiny_model, 0.25, 0.25)
    try:
        prompt = [t % 1024 for t in PROMPT]
        streamed = s.engine.generate([prompt], 12, greedy)[0]
        reference = StreamingEngine(load_transformer(GGUFModel(tiny_model)), CTX).generate([prompt], 12, greedy)[0]
        assert streamed == reference
        stats = s.engine.stats
        assert stats.prefill_passes == 1 and stats.decode_passes == 11
        passes = stats.prefill_passes + stats.decode_passes
        per_pass = s.plan.bytes_in(Tier.STORAGE)
        assert per_pass * passes <= stats.bytes_moved["C"] <= per_pass * passes + 4 * s.plan.slot_nbytes
        assert "tier C" in s.moved_report() and "tier B" in s.moved_report()
    finally:
        s.close()


def test_batch_of_sequences_equals_each_alone(tiny_model: Path) -> None:
    """Batching is checked as an identity in the exact numerics (float64 sums of exact terms do not
    depend on how many rows a product has; equal up to a float32 rounding tie, one ulp). In the
    float32 numerics rows batched together are summed in another order than alone, and on this
    q8_K-rounded model that moves logits by ~1e-3 (it differs between CPUs): there the tiered engine
    is held to computing exactly what the resident engine computes for the same batch."""
    prompts = [[t % 1024 for t in PROMPT], [1, 7, 99, 5], [1, 3] * 9]
    s = session(tiny_model, 0.3, 0.3, batch=3)
    try:
        together = s.engine.generate(prompts, 10, greedy)
        assert s.engine.stats.decode_passes == 9  # one pass per step serves all three
    finally:
        s.close()
    assert together == StreamingEngine(load_transformer(GGUFModel(tiny_model)), CTX).generate(prompts, 10, greedy)
    exact = load_transformer(GGUFModel(tiny_model), exact=True)
    engine = StreamingEngine(exact, CTX)
    assert engine.generate(prompts, 10, greedy) == [engine.generate([p], 10, greedy)[0] for p in prompts]
    caches = [exact.new_cache(CTX) for _ in prompts]
    batched = exact.forward_batch([(np.asarray(p), c) for p, c in zip(prompts, caches, strict=True)], all_logits=True)
    for p, logits in zip(prompts, batched, strict=True):
        single = exact.forward(np.asarray(p), exact.new_cache(CTX), all_logits=True)
        np.testing.assert_allclose(logits, single, rtol=ONE_ULP, atol=0)


def test_prompt_chunks_ride_beside_decode_tokens(tiny_model: Path) -> None:
    """infer.scheduler: a prompt is cut into chunks that share passes with the other requests'
    decode tokens, and a request's tokens do not depend on that (exact numerics: an identity)."""
    from infer.scheduler import Request, Scheduler, as_sampler

    model = load_transformer(GGUFModel(tiny_model), exact=True)
    passes: list[tuple[int, int]] = []
    scheduler = Scheduler(model, CTX, slots=2, prefill_chunk=5, on_pass=lambda _s, rows, seqs: passes.append((rows, seqs)))
    prompts = [[1] + list(range(2, 14)), [1, 2, 3]]
    seen: list[np.ndarray] = []  # the logits each choice of the long prompt's request was made from

    def recorded(logits: np.ndarray, history: list[int]) -> int:
        seen.append(logits.copy())
        return greedy(logits, history)

    requests = [Request(prompts[0], 3, as_sampler(recorded)), Request(prompts[1], 3, as_sampler(greedy))]
    scheduler.run(requests)
    whole = model.forward(np.asarray(prompts[0]), model.new_cache(CTX))
    np.testing.assert_allclose(seen[0], whole, rtol=ONE_ULP, atol=0)  # its prompt over four passes
    # 5 rows a pass: 2 + 2, then 2 + 1 (the short prompt ends and its first token comes), then its
    # decode token beside 4 prompt rows twice (it ends), then the long prompt's last row and its decode
    assert passes == [(4, 2), (3, 2), (5, 2), (5, 2), (1, 1), (1, 1), (1, 1)]
    assert scheduler.stats.prompt_passes == 5 and scheduler.idle and len(scheduler.free) == 2
    alone = StreamingEngine(model, CTX)
    assert [r.generated for r in requests] == [alone.generate([p], 3, greedy)[0] for p in prompts]
    assert [r.finish_reason for r in requests] == ["length", "length"]


@pytest.mark.slow
def test_smollm2_streaming_equals_resident(smollm2: Path) -> None:
    """A real model: tied output embedding, Q4_1/Q8_0 tensors, 30 layers over three tiers."""
    s = session(smollm2, 0.3, 0.3, "file", 4)
    try:
        assert s.plan.bytes_in(Tier.STORAGE) > 0 and s.plan.bytes_in(Tier.RAM) > 0
        tokens = [1, 504, 3458, 282, 260, 2066, 30, 378, 905, 314]
        got = s.engine.model.forward(np.asarray(tokens), s.engine.model.new_cache(CTX), all_logits=True)
        np.testing.assert_array_equal(got, resident_logits(smollm2, tokens))
        report = s.report()
        assert "staged read (file)" in report and "tier A (VRAM)" in report
    finally:
        s.close()


def test_budget_below_the_minimum_is_refused_with_it(tiny_model: Path) -> None:
    from infer.tiers.budget import BudgetError

    vram, _ = budgets_for(tiny_model, 0.0, 0.0)  # exactly the minimum
    config = StreamingConfig(enabled=True, vram_budget=str(vram - 1), ram_budget="1MB")
    with pytest.raises(BudgetError, match="must be at least") as info:
        build_streaming_engine(str(tiny_model), config, CTX, device="cpu", measure=False)
    assert "\n" not in str(info.value)
    config = StreamingConfig(enabled=True, vram_budget=str(vram), ram_budget="1MB")
    build_streaming_engine(str(tiny_model), config, CTX, device="cpu", measure=False).close()
    config = StreamingConfig(enabled=True, vram_budget="100KB", ram_budget="1MB")
    with pytest.raises(BudgetError, match="cannot hold the KV cache"):
        build_streaming_engine(str(tiny_model), config, CTX, device="cpu", measure=False)


def test_exact_streaming_equals_exact_resident_and_does_not_depend_on_the_pass(tiny_model: Path) -> None:
    """--streaming --exact (which speculation on the CPU needs, issue 29): the streamed engine in
    float64 sums gives the exact resident engine's logits bit for bit, and a prompt fed in two
    passes the logits of one pass."""
    vram_budget, ram_budget = budgets_for(tiny_model, 0.3, 0.3)
    config = StreamingConfig(enabled=True, vram_budget=str(vram_budget), ram_budget=str(ram_budget))
    s = build_streaming_engine(str(tiny_model), config, CTX, device="cpu", measure=False, exact=True)
    try:
        assert {Tier.VRAM, Tier.RAM, Tier.STORAGE} <= set(s.plan.tier.values())
        model = s.engine.model
        tokens = np.asarray([t % 1024 for t in PROMPT])
        whole = model.forward(tokens, model.new_cache(CTX), all_logits=True)
        cache = model.new_cache(CTX)
        split = np.concatenate([model.forward(tokens[:5], cache, all_logits=True),
                                model.forward(tokens[5:], cache, all_logits=True)])
    finally:
        s.close()
    exact = load_transformer(GGUFModel(tiny_model), exact=True)
    np.testing.assert_array_equal(whole, exact.forward(tokens, exact.new_cache(CTX), all_logits=True))
    np.testing.assert_array_equal(split, whole)
