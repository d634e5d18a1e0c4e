"""`ntransformer --device gpu` end to end on a tiny synthetic model: greedy generation (through the
CUDA-graph loop the scheduler hands a lone greedy request to) and --benchmark. The GPU path of the CLI had no test,
and crashed at load until run 11 found it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from infer.cli import main
from infer.synth import SHAPES, write_model

pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "tiny-f16.gguf"
    write_model(path, SHAPES["tiny"], "f16", seed=5)
    return path


def _run(*args: str) -> dict:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output
    return json.loads(result.output.strip().splitlines()[-1])


def test_gpu_generation_is_the_greedy_loop(tiny: Path) -> None:
    """The CLI's ids (sampled on the GPU by the graph loop) are those of the host-side greedy loop
    on the same GPU model, and stay close to the CPU's."""
    from infer.api import LLM
    from infer.engine import greedy

    gpu = _run("-m", str(tiny), "-p", "hello world", "-n", "12", "--temp", "0", "--json", "--device", "gpu")
    cpu = _run("-m", str(tiny), "-p", "hello world", "-n", "12", "--temp", "0", "--json", "--device", "cpu")
    llm = LLM.load(tiny, device="gpu")
    want = list(llm.engine.generate(gpu["prompt_ids"], 12, greedy))
    assert gpu["ids"] == want and len(want) == 12
    assert gpu["prompt_ids"] == cpu["prompt_ids"]
    assert sum(a == b for a, b in zip(gpu["ids"], cpu["ids"], strict=True)) >= 6, (gpu["ids"], cpu["ids"])


def test_gpu_benchmark_reports_decode_and_the_roofline(tiny: Path) -> None:
    result = _run("-m", str(tiny), "--device", "gpu", "--benchmark", "-n", "16", "--json")
    assert result["tg_tokens"] == 16 and result["pp_tokens"] == 512
    assert result["tg_tok_s"] > 0 and result["pp_tok_s"] > 0 and result["copy_GBps"] > 0
    assert 0 < result["peak_vram_bytes"] <= result["vram_budget_bytes"]


def test_gpu_benchmark_at_a_depth_past_a_sliding_window(tmp_path: Path) -> None:
    """bench.gpu_bench --depth (llama-bench's -d): the prompt and the decode are timed after 600
    cached positions of a Gemma 3 file whose local layers keep a ring of their 100-token window and
    a pass (each timed run rewinds to the depth, which the ring still holds)."""
    from dataclasses import replace

    from bench.gpu_bench import bench_model

    path = tmp_path / "gemma3.gguf"
    write_model(path, replace(SHAPES["tiny"], sliding_window=100), "q8_0", seed=5, arch="gemma3")
    result = bench_model(path, pp=64, tg=16, with_kernels=False, depth=600)
    assert result["depth"] == 600 and result["context"] == 600 + 64 + 16 + 16
    assert result["pp_tok_s"] > 0 and result["tg_tok_s"] > 0
