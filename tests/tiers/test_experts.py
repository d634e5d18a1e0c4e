"""Experts tiered on the CPU engine (infer.tiers.experts, issue 26): a mixture-of-experts model whose
experts do not all fit the RAM budget reads the routed ones from tier C (the O_DIRECT file reader,
or the NVMe reader on raw LBAs) and computes what the all-RAM packed engine computes, bit for bit;
the cache's accounting, its refusals and the command line. The userspace-driver path is the same
reader over NvmeBackend (tests/vm: test_ntransformer_tiers_experts_from_the_device)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from infer import cpu_kernels, host_memory
from infer.arch import check_model
from infer.gguf_file import GGUFModel
from infer.model import Transformer, load_transformer
from infer.synth import SHAPES, write_model
from infer.tiers.budget import BudgetError
from infer.tiers.config import StreamingConfig
from infer.tiers.experts import ExpertCache, ExpertSlices, tiered_weights
from infer.tiers.session import build_streaming_engine
from infer.tiers.tier_c import FileSource
from nvmedirect.cli import main as nvmedirect_main

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="native CPU kernels not built")
CTX = 64


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Router statistics go to a directory of each test's own, not the user's cache."""
    monkeypatch.setenv("NVMEDIRECT_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-moe (qwen3moe, 2 blocks, 4 of 16 experts), Q4_K_M: Q4_K gate/up stacks, Q6_K down."""
    path = tmp_path_factory.mktemp("moe") / "tiny-moe-q4_k_m.gguf"
    write_model(path, SHAPES["tiny-moe"], "q4_k_m", seed=12)
    return path


def _ids(n: int = 20) -> np.ndarray:
    return np.random.default_rng(5).integers(3, SHAPES["tiny-moe"].vocab_size, n)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


def _largest_expert(gguf: GGUFModel) -> int:
    """Bytes of the largest expert (Q4_K_M keeps some layers' down stacks at Q6_K): the cache's unit."""
    return max(ExpertSlices.of_layer(gguf, i).expert_nbytes for i in range(check_model(gguf).n_layers))


@pytest.mark.parametrize("held", ["k", "half", "all"])
def test_tiered_experts_compute_the_all_ram_logits(moe: Path, held: str) -> None:
    gguf = GGUFModel(moe)
    args = check_model(gguf)
    full = load_transformer(gguf, packed=True)
    ids = _ids()
    want = full.forward(ids, full.new_cache(CTX), all_logits=True)
    expert = _largest_expert(gguf)
    count = {"k": args.n_experts_used, "half": args.n_experts, "all": 2 * args.n_experts}[held]
    source = FileSource(moe)
    try:
        weights = tiered_weights(gguf, args, source, count * expert)
        model = Transformer(args, weights, full.rope.freq_factors)
        got = model.forward(ids, model.new_cache(CTX), all_logits=True)  # one prompt
        cache = model.new_cache(CTX)
        model.forward(ids[:5], cache)
        steps = [model.forward(ids[j : j + 1], cache) for j in range(5, len(ids))]  # then token by token
    finally:
        source.close()
    assert np.array_equal(_bits(got), _bits(want))
    assert all(np.array_equal(_bits(s), _bits(want[5 + j])) for j, s in enumerate(steps))
    stats, cache_ = weights.expert_cache.stats, weights.expert_cache
    assert cache_.held <= max(cache_.capacity, args.n_experts_used)
    assert 0 < stats.bytes_read <= stats.misses * expert
    if held == "all":  # every expert read once at most, then held
        assert stats.misses <= cache_.total_experts and stats.evictions == 0
    else:
        assert stats.evictions > 0


@pytest.mark.parametrize("held", ["k", "all"])
def test_tiered_gpt_oss_experts_compute_the_all_ram_logits(tmp_path: Path, held: str) -> None:
    """gpt-oss's MXFP4 experts tiered (its routers' and experts' biases stay in the file's mapping with
    the rest): the all-RAM packed engine's logits, bit for bit, as a prompt and token by token."""
    path = tmp_path / "gpt-oss.gguf"
    write_model(path, SHAPES["tiny-gpt-oss"], "q8_0", seed=3)
    gguf = GGUFModel(path)
    args = check_model(gguf)
    full = load_transformer(gguf, packed=True)
    ids = _ids(24)
    want = full.forward(ids, full.new_cache(CTX), all_logits=True)
    count = {"k": args.n_experts_used, "all": 2 * args.n_experts}[held]
    source = FileSource(path)
    try:
        weights = tiered_weights(gguf, args, source, count * _largest_expert(gguf))
        model = Transformer(args, weights, full.rope.freq_factors)
        got = model.forward(ids, model.new_cache(CTX), all_logits=True)
        cache = model.new_cache(CTX)
        model.forward(ids[:5], cache)
        steps = [model.forward(ids[j : j + 1], cache) for j in range(5, len(ids))]
    finally:
        source.close()
    assert weights.layer(0).experts.gating == "softmax_weight" and weights.layer(0).experts.down_bias is not None
    assert np.array_equal(_bits(got), _bits(want))
    assert all(np.array_equal(_bits(s), _bits(want[5 + j])) for j, s in enumerate(steps))
    assert (weights.expert_cache.stats.evictions > 0) == (held == "k")


def test_the_huge_page_copy_leaves_the_experts_to_their_tier(moe: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The packed engine copies its matrices to huge pages (infer.host_memory), experts included; with
    experts tiered under a RAM budget it copies the rest only, or the budget would mean nothing."""
    monkeypatch.setattr(host_memory, "transparent_huge_pages", lambda: True)
    gguf = GGUFModel(moe)
    args = check_model(gguf)
    experts = [info for info in gguf.tensors.values() if info.name.endswith("_exps.weight")]
    full = load_transformer(gguf, packed=True).weights
    assert full.huge_pages is not None
    assert all(full.huge_pages.view(info.offset, info.nbytes).size == info.nbytes for info in experts)
    source = FileSource(moe)
    try:
        tiered = tiered_weights(gguf, args, source, 4 * _largest_expert(gguf))
    finally:
        source.close()
    assert tiered.huge_pages is not None
    assert tiered.huge_pages.nbytes == full.huge_pages.nbytes - sum(info.nbytes for info in experts)
    for info in experts:
        with pytest.raises(ValueError, match="not inside one copied range"):
            tiered.huge_pages.view(info.offset, info.nbytes)


class _CountingSource:
    """A tier C source that records every range it is asked for, then reads the file."""

    def __init__(self, path: Path) -> None:
        self.inner = FileSource(path)
        self.description = "counting"
        self.ranges: list[tuple[int, int]] = []

    def read_async(self, ranges, buffers):  # noqa: ANN001, ANN201
        self.ranges += list(ranges)
        return self.inner.read_async(ranges, buffers)

    def close(self) -> None:
        self.inner.close()


def test_the_cache_reads_only_what_it_lacks_and_drops_what_its_policy_says(moe: Path) -> None:
    gguf = GGUFModel(moe)
    args = check_model(gguf)
    slices = ExpertSlices.of_layer(gguf, 1)
    source = _CountingSource(moe)
    try:
        cache = ExpertCache(gguf, args, source, 5 * _largest_expert(gguf), policy="lru")
        assert cache.capacity == 5
        cache.ensure(1, [3, 7, 9, 11])
        assert source.ranges == [r for e in (3, 7, 9, 11) for r in slices.ranges(e)]  # one batch, gate/up/down each
        cache.ensure(1, [7, 3])  # hits: 7 and 3 are now the most recent
        cache.ensure(1, [0, 1])  # two misses: 9 then 11 (least recent) go
        assert (cache.stats.hits, cache.stats.misses, cache.stats.evictions) == (2, 6, 1)
        assert cache.residency.keys() == [(1, 11), (1, 7), (1, 3), (1, 0), (1, 1)]
        assert set(cache._held) == set(cache.residency.keys())  # bytes held for exactly those
        before = len(source.ranges)
        cache.ensure(1, [0, 1, 3, 7, 11])
        assert len(source.ranges) == before  # all held: nothing read
        raw = np.fromfile(moe, dtype=np.uint8)
        gate_up, down = cache.products(1, 7)
        (offset, n), *_ = slices.ranges(7)
        assert np.array_equal(gate_up.parts[0][0], raw[offset : offset + n])  # the expert's own bytes
        # the held bytes live in the arena's slots, one each, the dropped ones' taken back
        assert cache._slots.count == 5 and cache._slots.free == 0 and sorted(cache._slot_of.values()) == list(range(5))
        base, end = cache._slots._bytes.ctypes.data, cache._slots._bytes.ctypes.data + cache._slots._bytes.nbytes
        assert base <= gate_up.parts[0][0].ctypes.data < end
        x = np.random.default_rng(1).standard_normal(args.dim).astype(np.float32)
        row = cache.row(1, x, np.array([7, 0]))  # the decode row's one call, over the same bytes
        from infer.cpu_layers import swiglu

        for got, e in zip(row, (7, 0), strict=True):
            gu, d = cache.products(1, e)
            y = gu(x[None])
            width = y.shape[1] // 2
            assert np.array_equal(got.view(np.uint32), d(swiglu(y[:, :width], y[:, width:]))[0].view(np.uint32))
    finally:
        source.close()


def test_a_prompt_routing_to_more_experts_than_the_budget_holds_stays_within_it(moe: Path) -> None:
    """A 40-token prompt routes to most of a layer's 16 experts; a cache of 5 takes them in groups
    of at most 5 and never holds more, and the logits are still the all-RAM ones."""
    gguf = GGUFModel(moe)
    args = check_model(gguf)
    full = load_transformer(gguf, packed=True)
    ids = _ids(40)
    want = full.forward(ids, full.new_cache(CTX), all_logits=True)
    source = FileSource(moe)
    try:
        weights = tiered_weights(gguf, args, source, 5 * _largest_expert(gguf))
        cache = weights.expert_cache
        most = []
        ensure = cache.ensure

        def watched(layer: int, experts: object, uses: object = None) -> None:
            ensure(layer, experts, uses)  # type: ignore[arg-type]
            most.append(cache.held)

        cache.ensure = watched  # type: ignore[method-assign]
        model = Transformer(args, weights, full.rope.freq_factors)
        got = model.forward(ids, model.new_cache(CTX), all_logits=True)
    finally:
        source.close()
    assert np.array_equal(_bits(got), _bits(want))
    assert max(most) <= 5 and len(most) > 2 * args.n_layers  # several groups a layer


def test_a_budget_below_one_tokens_experts_is_refused_in_one_line(moe: Path) -> None:
    gguf = GGUFModel(moe)
    args = check_model(gguf)
    source = FileSource(moe)
    try:
        with pytest.raises(ValueError, match=r"holds 3 experts of .* a token needs 4 at once"):
            ExpertCache(gguf, args, source, 3 * _largest_expert(gguf))
    finally:
        source.close()
    with pytest.raises(BudgetError, match="a token needs 4 at once"):
        build_streaming_engine(gguf, StreamingConfig(enabled=True, ram_budget="10KB"), CTX, "cpu")
    with pytest.raises(BudgetError, match="page cache"):
        build_streaming_engine(gguf, StreamingConfig(enabled=True, tier_c="mmap"), CTX, "cpu")
    with pytest.raises(BudgetError, match="packed native engine"):
        build_streaming_engine(gguf, StreamingConfig(enabled=True), CTX, "cpu", exact=True)


def test_tier_c_from_a_model_on_raw_lbas(moe: Path, tmp_path: Path) -> None:
    image = tmp_path / "nvme.img"
    with open(image, "wb") as f:
        f.truncate(16 << 20)
    result = CliRunner().invoke(nvmedirect_main, ["write-gguf", str(moe), "-d", str(image), "--lba", "300", "--yes",
                                                  "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    config = StreamingConfig(enabled=True, tier_c="nvme", nvme_device=str(image), nvme_lba=300, ram_budget="600KB")
    session = build_streaming_engine(GGUFModel(moe), config, CTX, "cpu")
    try:
        assert "nvme" in session.report() and session.problem() is None
        model = session.engine.model
        got = model.forward(_ids(), model.new_cache(CTX), all_logits=True)
        assert session.cache.stats.misses > 0
    finally:
        session.close()
    full = load_transformer(GGUFModel(moe), packed=True)
    assert np.array_equal(_bits(got), _bits(full.forward(_ids(), full.new_cache(CTX), all_logits=True)))


def _cli(*args: str) -> tuple[int, str, str]:
    from infer.cli import main

    result = CliRunner().invoke(main, ["--device", "cpu", "-c", "128", *args])
    return result.exit_code, result.stdout, result.stderr


def test_the_command_line_streams_experts(moe: Path) -> None:
    common = ["-m", str(moe), "-p", "one two three four", "-n", "12", "-t", "0"]
    code, resident, err = _cli(*common)
    assert code == 0, err
    code, tiered, err = _cli(*common, "--streaming", "--ram-budget", "600KB")
    assert code == 0, err
    assert tiered == resident
    assert "RAM budget for experts: 585.94 KiB (--ram-budget)" in err, err
    assert "experts:" in err and "misses" in err and "tier C read" in err, err
    code, out, err = _cli("-m", str(moe), "-n", "16", "--streaming", "--ram-budget", "600KB", "--benchmark", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["tg_tokens"] == 16 and 0 <= result["decode_expert_hit_rate"] <= 1
    assert result["tier_c_bytes_per_token"] > 0 and result["storage_roofline_tok_s"] > 0
    assert result["decode_fraction_of_storage_roofline"] > 0
    code, out, err = _cli("-m", str(moe), "-p", "hi", "-n", "2", "--streaming", "--ram-budget", "10KB")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and out == "" and len(lines) == 1 and "a token needs 4 at once" in lines[0], err


def test_router_statistics_carry_over_between_runs(moe: Path, tmp_path: Path) -> None:
    """The first run gathers the routings and writes them; the next preloads the most used experts,
    states the hit rate they predict and generates the same text; 'off' keeps none."""
    stats = tmp_path / "stats.npz"
    common = ["-m", str(moe), "-p", "one two three four", "-n", "12", "-t", "0", "--streaming", "--ram-budget", "600KB"]
    code, first, err = _cli(*common, "--expert-stats", str(stats))
    assert code == 0, err
    assert "router statistics: none yet for these routers" in err and str(stats) in err, err
    gguf = GGUFModel(moe)
    args = check_model(gguf)
    from infer.tiers.expert_policy import ExpertUse

    use = ExpertUse.load(stats, args.n_layers, args.n_experts)
    assert use is not None and use.routings == use.tokens * args.n_layers * args.n_experts_used > 0
    code, second, err = _cli(*common, "--expert-stats", str(stats))
    assert code == 0, err
    assert second == first
    assert f"router statistics: {use.tokens} tokens routed in earlier runs" in err and "preloaded, expected hit rate" in err, err
    again = ExpertUse.load(stats, args.n_layers, args.n_experts)
    assert again is not None and again.tokens == 2 * use.tokens  # this run's routings added
    code, third, err = _cli(*common, "--expert-stats", "off")
    assert code == 0 and third == first, err
    assert "router statistics: off" in err, err
    code, _, err = _cli(*common)  # the default file, named after the routers, under NVMEDIRECT_CACHE
    assert code == 0, err
    assert len(list((tmp_path / "cache" / "expert-use").glob("*.npz"))) == 1
    code, out, err = _cli("-m", str(moe), "-p", "hi", "-n", "2", "--expert-stats", "off")
    assert code == 2 and "--expert-stats sets the streaming engine's tiers: add --streaming" in err, err
