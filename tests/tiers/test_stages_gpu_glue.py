"""A model split across GPUs in stages (infer.gpu.stages), run on the NumPy stand-in for CuPy
(tests/fake_cupy.py) with every stage on its one device and the hand-over a device copy: each
row's logits are the one-GPU engine's bits, for prompts, decode steps, a batch of sequences and a
token tree, on a Llama, a Qwen3 and a Gemma 3 (local layers, post-norms). tests/gpu/ runs the same
on a real GPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from infer.gguf_file import GGUFModel

CTX = 64


def pipeline(path: Path, cuts: list[int]):
    """The model in stages split before layers `cuts`, all on device 0, joined by copies."""
    from infer.gpu import load_gpu_transformer
    from infer.gpu.stages import CopyLink, PipelineTransformer

    model = GGUFModel(path)
    n = model.metadata[f"{model.metadata['general.architecture']}.block_count"]
    bounds = [0, *cuts, n]
    stages = [load_gpu_transformer(model, CTX, "10GB", layers=range(a, b)) for a, b in zip(bounds, bounds[1:], strict=False)]
    return PipelineTransformer(stages, CopyLink())


def steps_of(model, prompt: np.ndarray, steps: list[int]) -> list[np.ndarray]:
    cache = model.new_cache(CTX)
    return [model.forward(prompt, cache, all_logits=True)] + [model.forward(np.array([t]), cache) for t in steps]


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_qwen3", "tiny_gemma3"])
def test_stages_give_the_one_gpu_bits(request: pytest.FixtureRequest, fake_cupy: object, fixture: str) -> None:
    from infer.gpu import load_gpu_transformer

    path = request.getfixturevalue(fixture)
    whole = load_gpu_transformer(GGUFModel(path), CTX, "10GB")
    prompt = np.array([1, 5, 9, 14, 3, 7, 11, 2, 8, 4, 6, 10])
    expect = steps_of(whole, prompt, [12, 13, 15])
    for cuts in ([2], [1, 3]):
        staged = pipeline(path, cuts)
        got = steps_of(staged, prompt, [12, 13, 15])
        for e, g in zip(expect, got, strict=True):
            assert np.array_equal(e, g), cuts
        # a batch of two sequences, one of them mid-prompt, and a tree over a third
        caches = {m: [m.new_cache(CTX) for _ in range(3)] for m in (whole, staged)}
        outs = {}
        for m, (a, b, c) in caches.items():
            m.forward(prompt[:5], a)
            m.forward(prompt[:7], c)
            batch = m.forward_batch([(np.array([3, 4]), a), (prompt[:6], b)])
            tree = m.verify_tree(np.array([9, 4, 5, 6]), np.array([-1, 0, 0, 1]), c).to_host()
            c.accept([0, 1, 3])
            after = m.forward(np.array([2]), c)
            outs[m] = [*batch, tree, after]
        for e, g in zip(outs[whole], outs[staged], strict=True):
            assert np.array_equal(e, g), cuts


def test_a_stage_holds_only_its_layers(tiny_model: Path, fake_cupy: object) -> None:
    staged = pipeline(tiny_model, [2])
    first, last = staged.stages
    assert (first.embeds, first.heads, last.embeds, last.heads) == (True, False, False, True)
    assert sorted(first.weights.layers) == [0, 1] and sorted(last.weights.layers) == [2, 3]
    assert first.weights.output is None and last.weights.output is not None
    cache = staged.new_cache(CTX)
    assert [int(p.full.keys.shape[0]) for p in cache.parts] == [2, 2]  # each stage its layers' keys
    with pytest.raises(IndexError, match="another stage"):
        cache.parts[0].layer(3)
    whole = load_whole(tiny_model)
    assert staged.weight_bytes_per_token() == whole.weight_bytes_per_token()


def load_whole(path: Path):
    from infer.gpu import load_gpu_transformer

    return load_gpu_transformer(GGUFModel(path), CTX, "10GB")


def test_load_gpu_stages_plans_balanced_stages_and_refuses_what_is_not_there(tiny_model: Path,
                                                                             fake_cupy: object) -> None:
    from infer.gpu.stages import CopyLink, load_gpu_stages
    from infer.tiers.budget import VramBudgetError

    staged = load_gpu_stages(GGUFModel(tiny_model), [0, 0], ["10GB", "10GB"], CTX)  # the stand-in: one device twice
    assert [s.stage for s in staged.stages] == [(0, 1), (2, 3)]
    assert isinstance(staged.link, CopyLink)
    prompt = np.array([1, 5, 9, 14, 3])
    assert np.array_equal(steps_of(staged, prompt, [2])[1], steps_of(load_whole(tiny_model), prompt, [2])[1])
    with pytest.raises(ValueError, match="GPU 1 is not there"):
        load_gpu_stages(GGUFModel(tiny_model), [0, 1], [None, None], CTX)
    with pytest.raises(VramBudgetError, match="does not fit the budgets of GPU 0, GPU 0 split by layers"):
        load_gpu_stages(GGUFModel(tiny_model), [0, 0], ["1MB", "1MB"], CTX)


def test_the_scheduler_and_speculation_run_on_stages(tiny_model: Path, fake_cupy: object) -> None:
    """The generation loop (infer.scheduler) over a split model: four requests decoded together,
    and speculation with a draft model on the first GPU verifying every request's tree across
    the stages, give the one-GPU engine's tokens."""
    from infer.engine import greedy
    from infer.scheduler import Request, Scheduler, as_sampler
    from infer.spec_serve import DraftPool
    from infer.speculative import ModelDrafter

    prompts = [[1] + [40, 41, 42, 43] * 4, [1, 300, 2, 8], [1, *range(100, 118)], [1, 5, 9, 200, 31, 7, 7, 40]]
    whole, staged = load_whole(tiny_model), pipeline(tiny_model, [1])
    draft = load_whole(tiny_model)  # the target as its own draft: every tree is kept (the deepest walks)

    def served(model, drafting: bool) -> tuple[list[list[int]], int]:  # noqa: ANN001
        requests = [Request(list(p), 10, as_sampler(greedy)) for p in prompts]
        pool = DraftPool(model, lambda: ModelDrafter(draft, CTX, depth=3, width=2, cache=draft.new_cache(CTX)),
                         7, CTX) if drafting else None
        passes: list[int] = []
        Scheduler(model, CTX, 4, speculation=pool, on_pass=lambda _s, rows, _n: passes.append(rows)).run(requests)
        return [r.generated for r in requests], len(passes)

    expect, plain_passes = served(whole, False)
    assert served(staged, False) == (expect, plain_passes)
    tokens, spec_passes = served(staged, True)
    assert tokens == expect and spec_passes < plain_passes  # trees verified across the stages


def test_micro_batches_of_a_large_pass_give_the_same_bits(tiny_model: Path, fake_cupy: object) -> None:
    """A pass of many rows split into micro-batches (so that one stage works on the next while the
    next stage works on the one before): a long prompt's every logits row, and a batch of prompt
    chunks of several sequences, as the one-GPU engine gives them."""
    from infer.gpu import load_gpu_transformer
    from infer.gpu.stages import MICRO_ROWS, CopyLink, PipelineTransformer

    ctx = 512
    model = GGUFModel(tiny_model)
    whole = load_gpu_transformer(model, ctx, "10GB")
    stages = [load_gpu_transformer(model, ctx, "10GB", layers=r) for r in (range(0, 2), range(2, 4))]
    rng = np.random.default_rng(2)
    prompt = rng.integers(3, 500, 3 * MICRO_ROWS + 5)
    others = [rng.integers(3, 500, n) for n in (40, 90)]
    for micro in (2, 3):
        staged = PipelineTransformer(stages, CopyLink(), micro_batches=micro)
        assert staged.micro_batches(len(prompt), True) == \
            [(len(prompt) * i // micro, len(prompt) * (i + 1) // micro) for i in range(micro)]
        assert staged.micro_batches(len(prompt), False) == [(0, len(prompt))]  # logits kept on the device
        outs = {}
        for m in (whole, staged):
            a, b, c = (m.new_cache(ctx) for _ in range(3))
            before = stages[0].passes
            rows = [m.forward(prompt, a, all_logits=True)]
            if m is staged:  # the pass went as `micro` passes of each stage
                assert stages[0].passes - before == micro
            rows += m.forward_batch([(prompt[:100], b), (others[0], c)], all_logits=True)
            rows.append(m.forward(others[1], c))  # then a decode-sized pass on what the micro-batches wrote
            rows.append(m.forward(np.array([7]), a))
            outs[m] = rows
        for e, g in zip(outs[whole], outs[staged], strict=True):
            assert np.array_equal(e, g), micro


def test_streamed_stages_give_the_resident_bits(tmp_path: Path, fake_cupy: object) -> None:
    """--streaming --gpus: each stage's own plan streams part of its layers through its own ring
    (tier B pinned RAM and tier C the file here); every row's logits are the resident one-GPU
    engine's, and both stages moved bytes. Eight layers: a stage of four is more than its ring
    and scratch."""
    from infer.arch import ModelArgs
    from infer.gpu import gpu_pass_nbytes
    from infer.synth import SHAPES, Shape, write_model
    from infer.tiers.config import StreamingConfig
    from infer.tiers.plan import minimum_vram, planner_tensors
    from infer.tiers.stage_plan import stage_tensors
    from tests.tiers.test_tiers_gpu_glue import device_reserve

    tiny_model = tmp_path / "tiny8.gguf"
    write_model(tiny_model, Shape(**{**SHAPES["tiny"].__dict__, "n_layers": 8}), "q4_k_m", seed=11)
    model = GGUFModel(tiny_model)
    args = ModelArgs.from_gguf(model)
    tensors = planner_tensors(model, "gpu")
    raw = sum(t.nbytes for t in tensors if t.layer is not None and not t.is_vector)
    budgets = []
    for stage in (range(0, 4), range(4, 8)):  # each GPU: its stage's minimum and a tenth of its layers
        mine = stage_tensors(tensors, model, stage, args.n_layers)
        layers = sum(t.device_nbytes for t in mine if t.layer is not None and not t.is_vector)
        overhead = args.kv_cache_nbytes(CTX, 512, layers=stage) + 4 * (CTX + 1) + device_reserve() + \
            gpu_pass_nbytes(model, args, 512, CTX, None, stage)
        budgets.append(minimum_vram(mine, 4, True) + layers // 10 + overhead)
    config = StreamingConfig(enabled=True, vram_budget=",".join(map(str, budgets)),
                             ram_budget=str(int(0.3 * raw) + 4 * raw))
    for chunk in (None, 2):  # one run a GPU, then runs of two layers taking turns
        check_streamed_stages(model, config, chunk)


def check_streamed_stages(model: GGUFModel, config, chunk: int | None) -> None:  # noqa: ANN001
    from infer.gpu import load_gpu_transformer
    from infer.tiers.plan import Tier
    from infer.tiers.staged_session import build_streaming_stages

    session = build_streaming_stages(model, config, CTX, [0, 0], chunk=chunk)
    try:
        tiers = [{plan.tier[t.name] for t in plan.tensors if t.layer is not None} for _, _, plan, _ in session.stage_plans]
        assert all(Tier.RAM in found or Tier.STORAGE in found for found in tiers), tiers  # each stage streams
        shares = [list(r) for _, r, _, _ in session.stage_plans]
        if chunk:
            assert shares == [[0, 1, 4, 5], [2, 3, 6, 7]] and len(session.engine.model.parts) == 4
            assert "2 stages: GPU 0 layers 0, 1, 4, 5, GPU 0 layers 2, 3, 6, 7" in session.report()
        else:  # cut where the time per pass balances (the rooms' estimates)
            cut = shares[1][0]
            assert shares == [list(range(cut)), list(range(cut, 8))] and 0 < cut < 8
            assert f"2 stages: GPU 0 layers 0-{cut - 1}, GPU 0 layers {cut}-7" in session.report()
        staged = session.engine.model
        whole = load_gpu_transformer(model, CTX, "10GB")
        prompt = np.array([1, 5, 9, 14, 3, 7, 11, 2, 8, 4, 6, 10])
        for e, g in zip(steps_of(whole, prompt, [12, 13]), steps_of(staged, prompt, [12, 13]), strict=True):
            assert np.array_equal(e, g)
        assert all(sum(s.weights.bytes_moved().values()) > 0 for s in staged.stages)  # each GPU's link moved bytes
    finally:
        session.close()


def test_interleaved_runs_give_the_one_gpu_bits(tmp_path: Path, fake_cupy: object) -> None:
    """Two GPU shares that take turns (layers 0-1 and 4-5 on one, 2-3 and 6-7 on the other): the
    pass runs the four runs in order, handing the hidden states back and forth; the bits are the
    one-GPU engine's, and a share's graphs never span its gap."""
    from infer.gpu import load_gpu_transformer
    from infer.gpu.stages import CopyLink, PipelineTransformer
    from infer.synth import SHAPES, Shape, write_model

    path = tmp_path / "tiny8.gguf"
    write_model(path, Shape(**{**SHAPES["tiny"].__dict__, "n_layers": 8}), "q4_k_m", seed=11)
    model = GGUFModel(path)
    shares = [load_gpu_transformer(model, CTX, "10GB", layers=[0, 1, 4, 5]),
              load_gpu_transformer(model, CTX, "10GB", layers=[2, 3, 6, 7])]
    staged = PipelineTransformer(shares, CopyLink())
    assert [(k, r) for k, r in staged.parts] == [(0, range(0, 2)), (1, range(2, 4)), (0, range(4, 6)), (1, range(6, 8))]
    assert staged.head is shares[1] and staged.micro == 1
    assert all(items[-1] - items[0] == len(items) - 1 for _, items in shares[0]._segments if items[0] >= 0)
    whole = load_gpu_transformer(model, CTX, "10GB")
    prompt = np.array([1, 5, 9, 14, 3, 7, 11, 2, 8, 4, 6, 10])
    for e, g in zip(steps_of(whole, prompt, [12, 13]), steps_of(staged, prompt, [12, 13]), strict=True):
        assert np.array_equal(e, g)
    with pytest.raises(ValueError, match="every layer once"):
        PipelineTransformer(shares[:1], CopyLink())


def test_links_micro_batches_and_a_share_without_the_head(tiny_model: Path, fake_cupy: object) -> None:
    """The hand-over chosen (a copy on one GPU; NCCL asked for where CuPy has none: one line); two
    micro-batches by default only where the stages have GPUs of their own and one run each; a
    share without the last layer refuses to run a head."""
    from infer.gpu.stages import CopyLink, PipelineTransformer, choose_link

    assert isinstance(choose_link([0, 0]), CopyLink) and isinstance(choose_link([0, 1], "copy"), CopyLink)
    with pytest.raises(ValueError, match="one of auto, nccl, copy"):
        choose_link([0, 1], "pcie")
    with pytest.raises(ValueError, match="NCCL"):
        choose_link([0, 1], "nccl")  # the stand-in has no NCCL
    assert isinstance(choose_link([0, 1]), CopyLink)  # auto: copies where NCCL cannot start
    staged = pipeline(tiny_model, [2])
    assert staged.micro == 1  # one GPU
    staged.stages[1].device_id = 1  # as if on a GPU of its own
    assert PipelineTransformer(staged.stages, CopyLink()).micro == 2
    with pytest.raises(ValueError, match="no head"):
        staged.stages[0].forward(np.array([1, 2]), staged.stages[0].new_cache(CTX))


class _FakeNccl:
    """NCCL as far as NcclLink uses it, logging each call (a unit test of the link's orchestration:
    the real NCCL runs only where two GPUs are, tests/gpu/test_stages_gpu.py)."""

    NCCL_FLOAT32 = 7
    available = True

    def __init__(self) -> None:
        self.log: list[tuple] = []
        log = self.log

        class Comm:
            def __init__(self, rank: int) -> None:
                self.rank = rank

            def send(self, ptr: int, count: int, dtype: int, peer: int, stream: int) -> None:
                log.append(("send", self.rank, peer, count))

            def recv(self, ptr: int, count: int, dtype: int, peer: int, stream: int) -> None:
                log.append(("recv", self.rank, peer, count))

            def destroy(self) -> None:
                log.append(("destroy", self.rank))

        class NcclCommunicator:
            @staticmethod
            def initAll(devices: list[int]) -> list[Comm]:  # noqa: N802 (CuPy's name)
                log.append(("init", tuple(devices)))
                return [Comm(r) for r in range(len(devices))]

        self.NcclCommunicator = NcclCommunicator

    def get_version(self) -> int:
        return 22304

    def groupStart(self) -> None:  # noqa: N802
        self.log.append(("group",))

    def groupEnd(self) -> None:  # noqa: N802
        self.log.append(("end",))


def test_the_nccl_link_connects_every_pair_before_the_stages_are_planned(tiny_model: Path, fake_cupy: object,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL allocates a pair's buffers at its first send: the link sends one float each way between
    every pair as it is made, before any GPU's VRAM account is opened (which then counts that
    memory as in use), and a split that does not fit closes it (its communicators destroyed)."""
    import sys

    from infer.gpu import memory as gpu_memory
    from infer.gpu import stages
    from infer.tiers.budget import VramBudgetError

    nccl = _FakeNccl()
    monkeypatch.setattr(fake_cupy.cuda, "nccl", nccl, raising=False)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy.cuda", fake_cupy.cuda)  # type: ignore[attr-defined]
    link = stages.choose_link([0, 1, 2])
    assert isinstance(link, stages.NcclLink)
    pairs = [(s, d) for s in range(3) for d in range(3) if s != d]
    assert nccl.log == [("init", (0, 1, 2)), *[e for s, d in pairs for e in
                                                (("group",), ("send", s, d, 1), ("recv", d, s, 1), ("end",))]]
    link.close()
    assert nccl.log[-3:] == [("destroy", 0), ("destroy", 1), ("destroy", 2)] and link.comms == []
    link.close()  # twice: nothing more

    nccl.log.clear()
    opened = gpu_memory.new_account
    monkeypatch.setattr(gpu_memory, "new_account", lambda *a, **k: (nccl.log.append(("account",)), opened(*a, **k))[1])
    monkeypatch.setattr(stages, "missing_gpu", lambda gpus: None)  # the stand-in has one device
    with pytest.raises(VramBudgetError):
        stages.load_gpu_stages(GGUFModel(tiny_model), [0, 1], ["1MB", "1MB"], max_context=CTX)
    kinds = [e[0] for e in nccl.log]
    assert kinds[0] == "init" and kinds.index("account") > kinds.index("end") and kinds[-2:] == ["destroy", "destroy"]

    from infer.tiers.budget import BudgetError
    from infer.tiers.config import StreamingConfig
    from infer.tiers.staged_session import build_streaming_stages

    nccl.log.clear()  # the streamed stages too: the link first, closed when a stage's plan fails
    config = StreamingConfig(enabled=True, vram_budget="1MB,1MB", ram_budget="1GB")
    with pytest.raises(BudgetError):
        build_streaming_stages(GGUFModel(tiny_model), config, CTX, [0, 1])
    kinds = [e[0] for e in nccl.log]
    assert kinds[0] == "init" and kinds.index("account") > kinds.index("end") and kinds[-2:] == ["destroy", "destroy"]
