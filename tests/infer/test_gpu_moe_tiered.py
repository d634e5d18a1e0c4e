"""A mixture of experts streamed on the GPU (issue 26; infer.tiers.expert_session on device "gpu"), on
the NumPy stand-in for CuPy: the experts of the blocks the VRAM budget holds are computed there, the
CPU computes the other blocks' feed-forward with their experts from a cache of --ram-budget over tier
C. The bytes a product reads are the same wherever they came from, so the logits are the resident GPU
engine's (experts of those blocks in the file's pages), bit for bit; the cache serves only the CPU's
blocks. tests/gpu/test_moe_gpu.py runs the same on a real GPU."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from infer import cpu_kernels
from infer.gguf_file import GGUFModel
from infer.tiers.config import StreamingConfig
from infer.tiers.experts import ExpertSlices
from tests.infer.test_gpu_moe import CTX, write_moe

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the native CPU kernels are not built")


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Router statistics go to a directory of each test's own, not the user's cache."""
    monkeypatch.setenv("NVMEDIRECT_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gpumoe-tiered")


def _largest_expert(model: GGUFModel, layers: list[int]) -> int:
    return max(ExpertSlices.of_layer(model, i).expert_nbytes for i in layers)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


def _run(gpu: object, prompt: np.ndarray, steps: list[int]) -> list[np.ndarray]:
    cache = gpu.new_cache(CTX)  # type: ignore[attr-defined]
    return [gpu.forward(prompt, cache, all_logits=True)] + \
        [gpu.forward(np.array([t]), cache) for t in steps]  # type: ignore[attr-defined]


PLACES = pytest.mark.parametrize("place", ["cpu", 2], ids=["all-on-cpu", "first-2-on-cpu"])
HELD = pytest.mark.parametrize("held", ["k", "all"])


@PLACES
@HELD
def test_the_cpu_blocks_take_their_experts_from_the_tiered_cache(moe_dir: Path, place: str | int, held: str,
                                                                 fake_cupy: object) -> None:
    check_tiered_against_resident(moe_dir, place, held)


def check_tiered_against_resident(moe_dir: Path, place: str | int, held: str) -> None:
    """The session's GPU engine gives the resident engine's logits, bit for bit, for a prompt and
    decode steps; its cache (room for one token's experts, or all of the CPU's) serves only the CPU's
    blocks and read them from tier C."""
    from infer.gpu import load_gpu_transformer
    from infer.tiers.session import build_streaming_engine

    path = write_moe(moe_dir, "qwen3moe", "q4_k_m")
    resident = load_gpu_transformer(GGUFModel(path), CTX, experts=place, expert_stream="off")
    on_cpu = list(resident.cpu_experts.layers)
    assert on_cpu == ([0, 1, 2] if place == "cpu" else [0, 1])
    prompt, steps = np.random.default_rng(1).integers(3, 600, 9), [5, 77, 401, 12, 9, 300]
    want = _run(resident, prompt, steps)

    model = GGUFModel(path)
    k, n_experts = 3, 8
    count = k if held == "k" else len(on_cpu) * n_experts
    budget = count * _largest_expert(model, on_cpu)
    session = build_streaming_engine(model, StreamingConfig(enabled=True, ram_budget=str(budget), experts=place),
                                     CTX, "gpu")
    try:
        gpu = session.engine.model
        assert gpu.cpu_experts.blocks is session.weights and gpu.cpu_experts.layers == on_cpu
        assert sorted(gpu.gpu_experts.blocks if gpu.gpu_experts else []) == [i for i in range(3) if i not in on_cpu]
        assert gpu.gpu_experts is None or gpu.gpu_experts.stream is None  # nothing pins the file's pages
        got = _run(gpu, prompt, steps)
        cache = session.cache
        report = session.report()
    finally:
        session.close()
    assert all(np.array_equal(_bits(g), _bits(w)) for g, w in zip(got, want, strict=True))
    assert cache.total_experts == len(on_cpu) * n_experts and cache.capacity == count
    kept = cache.residency.keys()  # an ExpertResidency, not a dict
    assert {layer for layer, _ in kept} <= set(on_cpu)  # the VRAM blocks' experts never pass by
    assert cache.stats.misses > 0 and cache.stats.bytes_read > 0
    assert (cache.stats.evictions > 0) == (held == "k")
    assert f"of the {len(on_cpu)} of 3 blocks the CPU computes" in report or len(on_cpu) == 3, report
    if place == 2:
        assert "with the experts of 1 of 3 blocks (2) computed there" in report, report
    else:
        assert "the CPU computes every block's experts" in report, report


def test_the_command_line_streams_a_mixture_of_experts_on_the_gpu(moe_dir: Path, fake_cupy: object) -> None:
    """`--device gpu --streaming` gives the resident GPU run's text with the CPU's experts tiered
    (--n-cpu-moe places them as without --streaming); --benchmark sets decode against tier C; a
    budget below a token's experts is one line; the float file (its experts stay with the CPU) runs
    too."""
    from infer.cli import main

    path = write_moe(moe_dir, "qwen3moe", "q8_0")
    common = ["-m", str(path), "-p", "hello there", "-n", "6", "-t", "0", "--json", "--device", "gpu",
              "--n-cpu-moe", "2"]
    resident = CliRunner().invoke(main, [*common, "--expert-stream", "off"])
    assert resident.exit_code == 0, resident.output
    one = _largest_expert(GGUFModel(path), [0, 1])
    streamed = CliRunner().invoke(main, [*common, "--streaming", "--ram-budget", str(4 * one)])
    assert streamed.exit_code == 0, streamed.output
    assert json.loads(streamed.stdout)["sequences"][0]["ids"] == json.loads(resident.stdout)["ids"]
    err = streamed.stderr
    assert "(--ram-budget)" in err and "the experts of the 2 of 3 blocks the CPU computes" in err, err
    assert "experts of 1 of 3 blocks (2) computed there" in err and json.loads(streamed.stdout)["bytes_moved"]["C"] > 0
    assert "ignores them" not in err, err
    bench = CliRunner().invoke(main, ["-m", str(path), "-n", "8", "--device", "gpu", "--cpu-moe", "--streaming",
                                      "--ram-budget", str(4 * one), "--benchmark", "--json"])
    assert bench.exit_code == 0, bench.output
    result = json.loads(bench.stdout)
    assert result["device"] == "gpu" and result["tg_tokens"] == 8 and result["tier_c_bytes_per_token"] > 0
    assert result["storage_roofline_tok_s"] > 0
    small = CliRunner().invoke(main, [*common, "--streaming", "--ram-budget", "10KB"])
    lines = [line for line in small.output.splitlines() if line.strip()]
    assert small.exit_code == 2 and len(lines) == 1 and "a token needs 3 at once" in lines[0], small.output
    floats = write_moe(moe_dir, "qwen3moe", "f16")
    args = ["-m", str(floats), "-p", "hello there", "-n", "6", "-t", "0", "--json", "--device", "gpu"]
    gpu = CliRunner().invoke(main, args)
    streamed = CliRunner().invoke(main, [*args, "--streaming"])
    assert gpu.exit_code == 0 and streamed.exit_code == 0, streamed.output
    assert json.loads(streamed.stdout)["sequences"][0]["ids"] == json.loads(gpu.stdout)["ids"]
    assert "demo: a quarter of" in streamed.stderr, streamed.stderr


def test_sequences_served_together_get_their_text_alone(moe_dir: Path, fake_cupy: object) -> None:
    """Two prompts in the session's passes (as `serve` and --batch run it) each get the greedy tokens
    of the same prompt alone, and those of the resident GPU engine."""
    from infer.engine import greedy
    from infer.gpu import load_gpu_transformer
    from infer.streaming import StreamingEngine
    from infer.tiers.session import build_streaming_engine

    path = write_moe(moe_dir, "qwen3moe", "q4_k_m")
    prompts = [list(np.random.default_rng(s).integers(3, 600, n)) for s, n in ((3, 7), (4, 12))]
    resident = StreamingEngine(load_gpu_transformer(GGUFModel(path), CTX, batch=2, experts=1, expert_stream="off"), CTX)
    want = [resident.generate([p], 8, greedy)[0] for p in prompts]
    one = _largest_expert(GGUFModel(path), [0])
    session = build_streaming_engine(GGUFModel(path), StreamingConfig(enabled=True, ram_budget=str(4 * one), batch=2,
                                                                      experts=1), CTX, "gpu")
    try:
        together = session.engine.generate(prompts, 8, greedy)
        alone = [session.engine.generate([p], 8, greedy)[0] for p in prompts]
        misses = session.cache.stats.misses
    finally:
        session.close()
    assert together == alone == want and misses > 0


DRAFTERS = pytest.mark.parametrize("drafter", ["lookup", "model"])


@DRAFTERS
def test_speculation_gives_the_plain_text(moe_dir: Path, drafter: str, fake_cupy: object) -> None:
    check_speculation(moe_dir, drafter)


def check_speculation(moe_dir: Path, drafter: str) -> None:
    """Greedy speculation on the streamed MoE (the CPU's blocks from the tiered cache) gives plain
    decoding's tokens, with a lookup draft or a draft model (the file itself: every token accepted)."""
    from infer.cli import main

    path = write_moe(moe_dir, "qwen3moe", "q8_0")
    one = _largest_expert(GGUFModel(path), [0, 1])
    common = ["-m", str(path), "-p", "hello there how are you", "-n", "16", "-t", "0", "--device", "gpu",
              "--n-cpu-moe", "2", "--streaming", "--ram-budget", str(4 * one)]
    plain = CliRunner().invoke(main, common)
    assert plain.exit_code == 0, plain.output
    how = ["--lookup"] if drafter == "lookup" else ["--draft-model", str(path)]
    spec = CliRunner().invoke(main, [*common, *how])
    assert spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout and "target passes" in spec.stderr
    assert "the experts of the 2 of 3 blocks the CPU computes" in spec.stderr and "read from tier C" in spec.stderr
    if drafter == "model":  # the target drafting for itself: its trees' first branch always accepted
        per_pass = float(re.search(r"= ([0-9.]+) tokens per pass", spec.stderr).group(1))  # type: ignore[union-attr]
        assert per_pass >= 2, spec.stderr


def test_every_block_in_vram_opens_no_tier_c(moe_dir: Path, fake_cupy: object) -> None:
    """With every block's experts in VRAM nothing is the CPU's to read: tier C's device is not
    opened (a device that is not there is no error), and the report says no RAM budget is needed."""
    from infer.engine import greedy
    from infer.tiers.session import build_streaming_engine

    path = write_moe(moe_dir, "qwen3moe", "q4_k_m")
    config = StreamingConfig(enabled=True, tier_c="nvme", nvme_device="0000:ff:1f.7", experts="gpu")
    session = build_streaming_engine(GGUFModel(path), config, CTX, "gpu")
    try:
        assert session.source is None and session.engine.model.cpu_experts is None
        report = session.report()
        tokens = session.engine.generate([[5, 77, 401]], 4, greedy)
    finally:
        session.close()
    assert "none needed (every block's experts are in VRAM)" in report and "tier C not read" in report
    assert len(tokens[0]) == 4
