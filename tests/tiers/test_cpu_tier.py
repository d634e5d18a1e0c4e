"""The CPU tier of the streamed GPU engine (infer.tiers.cpu_tier), run on the NumPy stand-in for
CuPy (tests/fake_cupy.py) with the native CPU kernels: small passes compute the layers held in RAM
on the CPU and copy none of their bytes, large passes stream them; switching between the two in
any order keeps the ring's schedule and the logits; the choice and its refusals are reported.
tests/gpu/test_streaming.py runs the same engine on a real GPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from infer import cpu_kernels
from infer.engine import greedy
from infer.gguf_file import GGUFModel
from infer.model import ModelArgs
from infer.synth import write_model
from infer.tiers.config import parse_cpu_tier
from infer.tiers.cpu_tier import CpuLayers, choose, cpu_share, crossover_rows, spread
from infer.tiers.plan import Tier
from tests.tiers.test_tiers_gpu_glue import CTX, SHAPE, gpu_session

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the native CPU kernels are not built")


@pytest.fixture(scope="module", params=["q4_k_m", "q8_0"])
def model_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cputier") / f"m-{request.param}.gguf"
    write_model(path, SHAPE, request.param, seed=4)
    return path


def session_for(path: Path, cpu_tier: str | int, resident: float = 0.3, ram: float = 1.2):
    """A streamed session (the glue tests' budgets) whose non-resident layers are all in RAM when
    ram >= 1 (tier C stays empty), with tier B pinned."""
    return gpu_session(path, resident, ram, tier_b="pinned", cpu_tier=cpu_tier)


def layer_bytes(session, layers: frozenset[int]) -> int:
    plan = session.plan
    return sum(t.nbytes for t in plan.streamed if t.layer in layers)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_crossover_rows() -> None:
    assert crossover_rows(0.010, 0.017, 0.008, 512) == 0  # slower than the link even for one token
    assert crossover_rows(0.004, 0.011, 0.008, 512) == 5  # 4 ms + 1 ms a row: rows 1..5 fit 8 ms
    assert crossover_rows(0.004, 0.004, 0.008, 64) == 64  # no cost per extra row: every pass
    assert crossover_rows(0.001, 1.0, 0.5, 512) == 4


def test_cpu_share_balances_the_cpu_against_the_link() -> None:
    assert cpu_share(46, 0.007, 0.0087) == 26  # 26 x 7 = 182 ms against 20 x 8.7 = 174 (25: 175 against 183)
    assert cpu_share(40, 0.010, 0.010) == 20
    assert cpu_share(10, 0.030, 0.010) == 2  # a slow CPU still takes a share: 60 ms against 80
    assert cpu_share(10, 1.0, 1e-6) == 0  # a link this fast: streaming all is best
    assert cpu_share(10, 1e-6, 1.0) == 10 and cpu_share(3, 0.0, 0.01) == 3
    for n, c, link in ((46, 0.007, 0.0087), (7, 0.002, 0.013), (80, 0.02, 0.004)):
        k = cpu_share(n, c, link)
        assert all(max(k * c, (n - k) * link) <= max(j * c, (n - j) * link) for j in range(n + 1))


def test_spread_takes_evenly_spaced_layers() -> None:
    assert spread([10, 11, 12, 13], 2) == [10, 12] or spread([10, 11, 12, 13], 2) == [11, 13]
    assert spread(list(range(10)), 10) == list(range(10))
    assert spread(list(range(9)), 3) == [1, 4, 7]
    picked = spread(list(range(46)), 26)
    assert len(set(picked)) == 26 and max(np.diff(picked)) <= 2


def test_parse_cpu_tier() -> None:
    assert parse_cpu_tier("AUTO") == "auto" and parse_cpu_tier("off") == "off" and parse_cpu_tier("3") == 3
    for bad in ("0", "-1", "sometimes", ""):
        with pytest.raises(ValueError, match="--cpu-tier takes auto, off or a number of rows"):
            parse_cpu_tier(bad)


def test_small_passes_compute_ram_layers_on_the_cpu(model_path: Path, fake_cupy: object) -> None:
    """Prompt (streamed), decode steps (the CPU), another prompt chunk (streamed), decode again: each
    pass's logits follow the engine without the CPU tier, and the CPU's passes copy none of its
    layers' bytes."""
    prompt = np.random.default_rng(1).integers(3, SHAPE.vocab_size, 7)
    chunk = np.random.default_rng(2).integers(3, SHAPE.vocab_size, 5)
    steps = [5, 77, 401]

    def run(session) -> tuple[list[np.ndarray], list[int]]:
        m = session.engine.model
        cache = m.new_cache(CTX)
        out, moved = [], []

        def note(logits: np.ndarray) -> None:
            out.append(logits)
            moved.append(session.weights.bytes_moved()[Tier.RAM])

        note(m.forward(prompt, cache, all_logits=True))
        for t in steps:
            note(m.forward(np.array([t]), cache))
        note(m.forward(chunk, cache, all_logits=True))
        for t in steps:
            note(m.forward(np.array([t]), cache))
        generated.append(session.engine.generate([list(prompt), list(chunk)], 6, greedy))  # the engine's decode loop
        return out, moved

    generated: list[list[list[int]]] = []
    plain = session_for(model_path, "off")
    try:
        assert plain.engine.model.cpu_tier is None and plain.plan.bytes_in(Tier.STORAGE) == 0
        assert any("CPU tier: off" in n for n in plain.plan.notes)
        want, _ = run(plain)
    finally:
        plain.close()
    session = session_for(model_path, 2)
    try:
        tier = session.engine.model.cpu_tier
        assert tier is not None and tier.max_rows == 2
        cpu_layers = tier.layers.layers
        assert cpu_layers and cpu_layers == {t.layer for t in session.plan.tensors_in(Tier.RAM)}
        assert any("passes of <= 2 tokens" in n for n in session.plan.notes)
        got, moved = run(session)
        ring = session.weights.ring
        slack = ring.n_slots * session.plan.slot_nbytes  # copied ahead before a switch, then dropped
        once = layer_bytes(session, cpu_layers)
    finally:
        session.close()
    assert generated[0] == generated[1] and [len(o) for o in generated[1]] == [6, 6]
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert rel(g, w) < 1e-4, rel(g, w)  # the same roundings, summed in another order
        assert np.array_equal(g.reshape(-1, g.shape[-1]).argmax(-1), w.reshape(-1, w.shape[-1]).argmax(-1))
    # moved[k]: bytes copied from RAM after pass k (the ring copies ahead: up to n_slots pieces early)
    prompt_pass = moved[0]
    assert once <= prompt_pass <= once + slack
    decode = np.diff(moved[:4])
    assert decode[0] <= slack and decode[1] == decode[2] == 0  # after the switch: nothing crosses
    assert once <= moved[4] - moved[3] <= once + slack  # the chunk streams again
    assert moved[7] - moved[5] == 0


def test_speculation_with_the_cpu_tier(model_path: Path, fake_cupy: object) -> None:
    """A streamed target with a CPU tier: speculation (its tree passes stream, single rows take the
    CPU) gives plain decoding's text, and a self-draft that skips the streamed layers moves no byte
    and leaves the ring's order alone."""
    from infer.layerskip import skipping, streamed_layers
    from infer.speculative import ModelDrafter, Speculator

    session = session_for(model_path, 1)
    try:
        m = session.engine.model
        prompt = np.random.default_rng(3).integers(3, SHAPE.vocab_size, 6)
        want = m.generate(prompt, m.new_cache(CTX), 10)
        skip = streamed_layers(m)
        view = skipping(m, skip)
        spec = Speculator(m, ModelDrafter(view, CTX, 3, 1), 4, CTX)
        ring = session.weights.ring
        left_out, before = ring.left_out, dict(session.weights.bytes_moved())
        view.draft_chain(prompt, view.new_cache(CTX), 3, 1)
        assert ring.left_out == left_out and dict(session.weights.bytes_moved()) == before
        assert list(spec.generate(list(prompt), 10, greedy)) == want
        assert spec.stats.passes > 0
    finally:
        session.close()


def test_auto_chooses_from_the_measured_speeds(model_path: Path, fake_cupy: object,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    session = session_for(model_path, "off")
    try:
        m = session.engine.model
        args = ModelArgs.from_gguf(GGUFModel(model_path))
        host = session.weights.ring.host
        ram_layers = {t.layer for t in session.plan.tensors_in(Tier.RAM)}
        tier, line = choose(GGUFModel(model_path), args, session.plan, host, "auto", 1e15, m.capacity)
        assert tier is None and "the link is so much faster than the CPU" in line
        tier, line = choose(GGUFModel(model_path), args, session.plan, host, "auto", 1e3, m.capacity)
        assert tier is not None and tier.max_rows == m.capacity and "passes of <=" in line and "ms for 1 token" in line
        assert tier.layers.layers == ram_layers and "streams the other 0" in line  # a slow link: all to the CPU
        # a link as fast as the CPU on one layer (1 ms, 1 ms more a row): the CPU takes half of them
        monkeypatch.setattr(CpuLayers, "products_seconds", lambda self, i, rows: 1e-3 * rows)
        nbytes = sum(t.nbytes for t in session.plan.streamed if t.layer == min(ram_layers))
        tier, line = choose(GGUFModel(model_path), args, session.plan, host, "auto", nbytes / 1e-3, m.capacity)
        n, k = len(ram_layers), cpu_share(len(ram_layers), 1e-3, 1e-3)
        assert tier is not None and len(tier.layers.layers) == k == n // 2, line
        assert tier.max_rows == n // k  # k x rows ms within the n ms of streaming all
        assert tier.layers.layers < ram_layers and f"streams the other {len(ram_layers) - len(tier.layers.layers)}" in line
        tier, line = choose(GGUFModel(model_path), args, session.plan, host, "auto", 0.0, m.capacity)
        assert tier is None and "not measured" in line
    finally:
        session.close()


def test_split_decode_streams_the_layers_the_cpu_does_not_take(model_path: Path, fake_cupy: object,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """auto with a link as fast as the CPU: the CPU computes half of the RAM layers in decode while
    the other half keep streaming; every pass follows the engine without the tier, and a decode pass
    copies exactly the bytes of the RAM layers the CPU left (the prompt streams them all)."""
    prompt = np.random.default_rng(6).integers(3, SHAPE.vocab_size, 6)
    steps = [11, 12, 13, 14]
    session = session_for(model_path, "off")
    try:
        cache = session.engine.model.new_cache(CTX)
        want = [session.engine.model.forward(prompt, cache, all_logits=True)]
        want += [session.engine.model.forward(np.array([t]), cache) for t in steps]
    finally:
        session.close()
    session = session_for(model_path, "off")
    try:
        m, plan = session.engine.model, session.plan
        ram_layers = {t.layer for t in plan.tensors_in(Tier.RAM)}
        monkeypatch.setattr(CpuLayers, "products_seconds", lambda self, i, rows: 1e-3 * rows)
        nbytes = sum(t.nbytes for t in plan.streamed if t.layer == min(ram_layers))
        m.cpu_tier, line = choose(GGUFModel(model_path), ModelArgs.from_gguf(GGUFModel(model_path)), plan,
                                  session.weights.ring.host, "auto", nbytes / 1e-3, m.capacity)
        on_cpu = m.cpu_tier.layers.layers
        assert 0 < len(on_cpu) < len(ram_layers), line
        cache = m.new_cache(CTX)
        got, moved = [m.forward(prompt, cache, all_logits=True)], [session.weights.bytes_moved()[Tier.RAM]]
        for t in steps:
            got.append(m.forward(np.array([t]), cache))
            moved.append(session.weights.bytes_moved()[Tier.RAM])
        streamed_in_decode = sum(t.nbytes for t in plan.tensors_in(Tier.RAM) if t.layer not in on_cpu)
        slack = session.weights.ring.n_slots * plan.slot_nbytes
    finally:
        session.close()
    for g, w in zip(got, want, strict=True):
        assert rel(g, w) < 1e-4, rel(g, w)
    assert streamed_in_decode > 0
    decode = np.diff(moved)
    assert decode[0] <= streamed_in_decode + slack  # the switch drops what was copied ahead
    assert list(decode[1:]) == [streamed_in_decode] * (len(steps) - 1)


def test_with_tier_c_the_cpu_takes_the_ram_layers(model_path: Path, fake_cupy: object) -> None:
    """A plan with tier C: the layers wholly in RAM go to the CPU in small passes, the tier C layers
    keep streaming through the staging reader, whose cycle restarts with each change of the order;
    every pass follows the engine without the tier."""
    prompt = np.random.default_rng(5).integers(3, SHAPE.vocab_size, 6)
    passes = [prompt, [7], [8], prompt[:3], [9], [10]]

    def run(session) -> tuple[list[np.ndarray], list[dict]]:
        m = session.engine.model
        cache = m.new_cache(CTX)
        out, moved = [], []
        for tokens in passes:
            out.append(m.forward(np.asarray(tokens), cache, all_logits=len(tokens) > 1))
            moved.append(dict(session.weights.bytes_moved()))
        return out, moved

    plain = session_for(model_path, "off", ram=0.5)
    try:
        assert plain.plan.bytes_in(Tier.STORAGE) > 0 and plain.plan.bytes_in(Tier.RAM) > 0
        want, _ = run(plain)
    finally:
        plain.close()
    session = session_for(model_path, 1, ram=0.5)
    try:
        tier = session.engine.model.cpu_tier
        assert tier is not None
        plan = session.plan
        c_layers = {t.layer for t in plan.tensors_in(Tier.STORAGE)}
        assert tier.layers.layers and not tier.layers.layers & c_layers
        got, moved = run(session)
        slack = session.weights.ring.n_slots * plan.slot_nbytes
        cpu_bytes = layer_bytes(session, tier.layers.layers)
        c_bytes = plan.bytes_in(Tier.STORAGE)
        b_other = plan.bytes_in(Tier.RAM) - cpu_bytes  # RAM tensors of a layer split with tier C: streamed
    finally:
        session.close()
    for g, w in zip(got, want, strict=True):
        assert rel(g, w) < 1e-4, rel(g, w)
    ram = [m[Tier.RAM] for m in moved]
    storage = [m[Tier.STORAGE] for m in moved]
    for k in (2, 5):  # decode after decode (steady state: a pass's worth issued per pass): only the RAM
        assert ram[k] - ram[k - 1] == b_other  # tensors of layers the CPU does not take cross
    assert ram[3] - ram[2] >= cpu_bytes - slack  # the prompt streams them again
    for k in (2, 5):  # tier C still crosses every pass, decode included
        assert storage[k] - storage[k - 1] == c_bytes


def test_no_layer_wholly_in_ram_means_no_cpu_tier(model_path: Path, fake_cupy: object) -> None:
    session = session_for(model_path, 4, ram=0.05)
    try:
        assert session.plan.bytes_in(Tier.STORAGE) > 0
        assert session.engine.model.cpu_tier is None
        assert "CPU tier: not used: no layer has its streamed matrices all in RAM" in session.report()
        m = session.engine.model
        cache = m.new_cache(CTX)
        m.forward(np.array([3, 4, 5]), cache)
        m.forward(np.array([6]), cache)  # decode still streams
    finally:
        session.close()


def test_the_cpu_computes_a_pass_s_live_rows_only(model_path: Path, fake_cupy: object,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Three sequences' decode rows (a pass padded to a bucket of 4): the CPU's products see 3 rows,
    and each sequence gets the logits it gets decoded alone (1-row passes, on the CPU too)."""
    from infer.gpu.passes import bucket_of
    from infer.packed_weights import PackedLinear

    seen: list[int] = []
    call = PackedLinear.__call__

    def spy(self: PackedLinear, x: np.ndarray) -> np.ndarray:
        seen.append(len(x))
        return call(self, x)

    session = session_for(model_path, 4)
    try:
        m = session.engine.model
        assert bucket_of(3, m.capacity) == 4 and m.cpu_tier is not None
        prompts = [np.array([3 + k, 9, 4]) for k in range(3)]
        alone = []
        for k, p in enumerate(prompts):
            cache = m.new_cache(CTX)
            m.forward(p, cache)
            alone.append(m.forward(np.array([20 + k]), cache))
        caches = [m.new_cache(CTX) for _ in prompts]
        for p, c in zip(prompts, caches, strict=True):
            m.forward(p, c)
        monkeypatch.setattr(PackedLinear, "__call__", spy)
        together = m.forward_batch([(np.array([20 + k]), c) for k, c in enumerate(caches)])
        n_cpu = len(m.cpu_tier.layers.layers)
    finally:
        session.close()
    assert len(seen) == 4 * n_cpu and set(seen) == {3}, seen  # qkv, wo, gate/up, down: 3 rows each
    for g, w in zip(together, alone, strict=True):
        np.testing.assert_array_equal(g, w)
