"""A model split across GPUs in stages (infer.gpu.stages) on a real GPU: every row's logits are the
one-GPU engine's bits (prompt, decode steps, a batch beside a prompt chunk, a token tree and the
path it keeps) with the stages on one GPU joined by device copies (CopyLink, the stand-in for two
GPUs); and, where the machine has two GPUs, with each stage on its own GPU and NCCL between them."""

from __future__ import annotations

import gc
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from infer.gguf_file import GGUFModel
from infer.synth import Shape, write_model
from tests.tiers.test_stages_gpu_glue import steps_of

cupy = pytest.importorskip("cupy")
from infer.gpu import load_gpu_transformer  # noqa: E402
from infer.gpu.stages import CopyLink, NcclLink, PipelineTransformer, load_gpu_stages  # noqa: E402

pytestmark = pytest.mark.gpu
CTX = 256
SHAPE = Shape(n_layers=4, dim=512, ffn_dim=1536, n_heads=8, n_kv_heads=2, vocab_size=2000, context_length=1024)
MODELS = {"llama-q4_k_m": (SHAPE, "q4_k_m"), "qwen3-q8_0": (replace(SHAPE, arch="qwen3", head_dim=128), "q8_0"),
          "gemma3-q4_0": (replace(SHAPE, arch="gemma3", n_layers=6, head_dim=256, n_kv_heads=1, sliding_window=8),
                          "q4_0")}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    shape, kind = MODELS[request.param]
    path = tmp_path_factory.mktemp("stages") / f"{request.param}.gguf"
    write_model(path, shape, kind, seed=5)
    return path


def outputs(model, prompt: np.ndarray) -> list[np.ndarray]:
    out = steps_of(model, prompt, [12, 13, 15, 17])
    a, b, c = (model.new_cache(CTX) for _ in range(3))
    model.forward(prompt[:5], a)
    model.forward(prompt, c)
    out += model.forward_batch([(np.array([3, 4]), a), (prompt[:20], b)])
    out.append(model.verify_tree(np.array([9, 4, 5, 6, 7]), np.array([-1, 0, 0, 1, 1]), c).to_host())
    c.accept([0, 1, 4])
    out.append(model.forward(np.array([2]), c))
    return out


def same(expect: list[np.ndarray], got: list[np.ndarray]) -> None:
    assert len(expect) == len(got)
    for i, (e, g) in enumerate(zip(expect, got, strict=True)):
        assert np.array_equal(e, g), f"output {i}: max difference {np.abs(e - g).max()}"


def test_stages_on_one_gpu_give_its_bits(model_path: Path) -> None:
    model = GGUFModel(model_path)
    n = model.metadata[f"{model.metadata['general.architecture']}.block_count"]
    prompt = np.random.default_rng(3).integers(3, 2000, 40)
    expect = outputs(load_gpu_transformer(model, CTX, "4GB"), prompt)
    for cuts in ([n // 2], [1, n - 1]):
        bounds = [0, *cuts, n]
        stages = [load_gpu_transformer(model, CTX, "4GB", layers=range(a, b))
                  for a, b in zip(bounds, bounds[1:], strict=False)]
        same(expect, outputs(PipelineTransformer(stages, CopyLink()), prompt))


def test_load_gpu_stages_on_the_gpus_of_the_host(model_path: Path) -> None:
    """Two GPUs where there are two (NCCL between them), else both stages on GPU 0 (device copies)."""
    model = GGUFModel(model_path)
    prompt = np.random.default_rng(4).integers(3, 2000, 30)
    expect = outputs(load_gpu_transformer(model, CTX, "4GB"), prompt)
    two = cupy.cuda.runtime.getDeviceCount() >= 2
    staged = load_gpu_stages(model, [0, 1] if two else [0, 0], ["4GB", "4GB"], CTX)
    assert isinstance(staged.link, NcclLink if two else CopyLink)
    assert [s.device_id for s in staged.stages] == ([0, 1] if two else [0, 0])
    same(expect, outputs(staged, prompt))


def test_micro_batches_give_the_same_bits(model_path: Path) -> None:
    """A large pass as micro-batches through the stages (on one GPU here: the order and the bits,
    not the overlap two GPUs give): every logits row of a long prompt, then a decode step."""
    model = GGUFModel(model_path)
    n = model.metadata[f"{model.metadata['general.architecture']}.block_count"]
    prompt = np.random.default_rng(6).integers(3, 2000, 200)
    whole = load_gpu_transformer(model, CTX, "4GB")
    stages = [load_gpu_transformer(model, CTX, "4GB", layers=r) for r in (range(0, n // 2), range(n // 2, n))]
    outs = []
    for m in (whole, PipelineTransformer(stages, CopyLink(), micro_batches=3)):
        cache = m.new_cache(CTX)
        outs.append([m.forward(prompt, cache, all_logits=True), m.forward(np.array([11]), cache)])
    same(*outs)


@pytest.mark.parametrize("chunk", [None, 2], ids=["a-run-a-gpu", "runs-of-2-taking-turns"])
def test_streamed_stages_give_the_resident_bits(tmp_path: Path, chunk: int | None) -> None:
    """--streaming --gpus on the GPU: each stage (both on GPU 0 here) keeps a tenth of its layers
    resident and streams the rest through its own ring from pinned RAM and the file, as one run of
    layers a GPU or in runs of two taking turns; every row's logits are the resident engine's."""
    from infer.arch import ModelArgs
    from infer.gpu import gpu_pass_nbytes, memory
    from infer.tiers.config import StreamingConfig
    from infer.tiers.plan import Tier, minimum_vram, planner_tensors
    from infer.tiers.stage_plan import stage_tensors
    from infer.tiers.staged_session import build_streaming_stages

    path = tmp_path / "eight.gguf"  # layers of ~7 MB: a stage's four are well past its ring and scratch
    write_model(path, replace(SHAPE, n_layers=8, dim=1024, ffn_dim=3072), "q4_k_m", seed=7)
    model = GGUFModel(path)
    args = ModelArgs.from_gguf(model)
    tensors = planner_tensors(model, "gpu")
    raw = sum(t.nbytes for t in tensors if t.layer is not None and not t.is_vector)
    gc.collect()  # the earlier tests' models (their graphs hold device memory outside the pool) gone first
    cupy.get_default_memory_pool().free_all_blocks()
    reserve = sum(memory.new_account(None, "test").reserved.values())
    budgets = []
    for stage in (range(0, 4), range(4, 8)):
        mine = stage_tensors(tensors, model, stage, args.n_layers)
        layers = sum(t.device_nbytes for t in mine if t.layer is not None and not t.is_vector)
        overhead = args.kv_cache_nbytes(CTX, 512, layers=stage) + 4 * (CTX + 1) + reserve + \
            gpu_pass_nbytes(model, args, 512, CTX, None, stage)
        budgets.append(minimum_vram(mine, 4, True) + layers // 10 + overhead)
    config = StreamingConfig(enabled=True, vram_budget=",".join(map(str, budgets)), ram_budget=str(raw // 3 + 4 * raw))
    session = build_streaming_stages(model, config, CTX, [0, 0], chunk=chunk)
    try:
        for _, _, plan, _ in session.stage_plans:
            assert {plan.tier[t.name] for t in plan.tensors if t.layer is not None} - {Tier.VRAM}, "a stage streams"
        prompt = np.random.default_rng(8).integers(3, 2000, 40)
        same(outputs(load_gpu_transformer(model, CTX, "4GB"), prompt), outputs(session.engine.model, prompt))
    finally:
        session.close()


def test_interleaved_shares_give_its_bits(model_path: Path) -> None:
    """Two shares taking turns a layer at a time (even layers on one, odd on the other): the pass
    hands the hidden states back and forth at every layer; the bits stay the one-GPU engine's."""
    model = GGUFModel(model_path)
    n = model.metadata[f"{model.metadata['general.architecture']}.block_count"]
    prompt = np.random.default_rng(9).integers(3, 2000, 40)
    shares = [load_gpu_transformer(model, CTX, "4GB", layers=range(k, n, 2)) for k in (0, 1)]
    staged = PipelineTransformer(shares, CopyLink())
    assert len(staged.parts) == n
    same(outputs(load_gpu_transformer(model, CTX, "4GB"), prompt), outputs(staged, prompt))
