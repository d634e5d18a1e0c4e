"""The VRAM budget holds on every path: the resident engine, the streaming engine and a batch of
sequences each run in a fresh process (`ntransformer ... --vram-budget B --json`) with a budget just
above what the run plans, and the peak device memory the driver reports (total - free, sampled
through the run: the pool, the CUDA context, kernels and graphs) stays within B. One MiB below the
plan the resident engine refuses with exit 2 and one line.

Run on the H200:  .venv/bin/python -m pytest -v tests/gpu/test_budget.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from infer.synth import Shape, write_model

pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]
# ~370 MB of Q4_K_M
SHAPE = Shape(n_layers=8, dim=2048, ffn_dim=8192, n_heads=16, n_kv_heads=4, vocab_size=32000, context_length=2048)
CTX = "1024"
SLACK = 16 << 20  # the budget above the plan


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("budget") / "m-q4_k_m.gguf"
    write_model(path, SHAPE, "q4_k_m", seed=3)
    return path


def run(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", "from infer.cli import main; main()", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


def record(*args: str) -> dict:
    done = run(*args)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def planned(result: dict) -> int:
    """Everything the run planned: weights, KV cache, pass buffers, the reserve."""
    return sum(result["vram_plan"].values())


@pytest.fixture(scope="module")
def free(model: Path) -> dict:
    """The resident run without a budget: its plan (weights, KV cache, pass buffers, reserve)."""
    return record("-m", str(model), "--device", "gpu", "-c", CTX, "--benchmark", "-n", "16", "--json")


def streaming_budget(free: dict) -> int:
    """Half of the weights off the device, plus room for the ring and the layer scratch."""
    return planned(free) - free["vram_plan"]["weights"] // 2 + (128 << 20)


def test_resident_engine_holds_its_budget(model: Path, free: dict) -> None:
    need = planned(free)
    budget = need + SLACK
    tight = record("-m", str(model), "--device", "gpu", "-c", CTX, "--benchmark", "-n", "16", "--json",
                   "--vram-budget", str(budget))
    print(f"resident: plan {need / 2**30:.3f} GiB, budget {budget / 2**30:.3f} GiB, peak "
          f"{tight['peak_vram_bytes'] / 2**30:.3f} GiB (no budget: peak {free['peak_vram_bytes'] / 2**30:.3f} GiB)")
    assert tight["vram_budget_bytes"] == budget
    assert 0 < tight["peak_vram_bytes"] <= budget
    assert tight["tg_tok_s"] > 0 and tight["pp_tok_s"] > 0
    refused = run("-m", str(model), "--device", "gpu", "-c", CTX, "-p", "hi", "-n", "4",
                  "--vram-budget", str(need - (1 << 20)))
    assert refused.returncode == 2, refused.stderr
    error = refused.stderr.strip().splitlines()[-1]
    assert "run with --streaming" in error and "Traceback" not in refused.stderr


def test_streaming_engine_holds_its_budget(model: Path, free: dict) -> None:
    budget = streaming_budget(free)
    result = record("-m", str(model), "--device", "gpu", "-c", CTX, "--streaming", "--vram-budget", str(budget),
                    "--benchmark", "-n", "8", "--json")
    print(f"streaming: budget {budget / 2**30:.3f} GiB, peak {result['peak_vram_bytes'] / 2**30:.3f} GiB, "
          f"streamed {result['streamed_bytes_per_pass'] / 1e6:.0f} MB a pass")
    assert result["streamed_bytes_per_pass"] > 0
    assert 0 < result["peak_vram_bytes"] <= budget


def test_batch_of_sequences_holds_its_budget(model: Path, free: dict) -> None:
    budget = streaming_budget(free)
    result = record("-m", str(model), "--device", "gpu", "-c", "256", "--streaming", "--vram-budget", str(budget),
                    "--batch", "8", "-p", "hello there", "-n", "8", "--json", "-t", "0")
    print(f"batch of 8: budget {budget / 2**30:.3f} GiB, peak {result['peak_vram_bytes'] / 2**30:.3f} GiB")
    assert len(result["sequences"]) == 8 and all(len(s["ids"]) > 0 for s in result["sequences"])
    assert 0 < result["peak_vram_bytes"] <= budget


def test_loading_takes_no_device_memory_outside_the_pool(model: Path) -> None:
    """The resident weights come from one pool allocation (memory.arena): loading adds to the device
    memory the driver counts what the pool counts, within a few pages (kernel modules), not the up to
    2 MiB page the driver rounds each of the model's 60-odd buffers to."""
    import cupy

    from infer.gguf_file import GGUFModel
    from infer.gpu import load_gpu_transformer
    from infer.gpu.memory import device_memory

    pool = cupy.get_default_memory_pool()

    def outside() -> int:
        cupy.cuda.Device().synchronize()
        free, total = device_memory()
        return total - free - pool.total_bytes()

    gpu = load_gpu_transformer(GGUFModel(model), 256)  # compiles the kernels a load takes
    del gpu
    pool.free_all_blocks()
    before = outside()
    gpu = load_gpu_transformer(GGUFModel(model), 256)
    grown = outside() - before
    assert pool.total_bytes() > 300 << 20
    assert grown < 8 << 20, f"loading added {grown / 2**20:.1f} MiB outside the pool"
    del gpu
    pool.free_all_blocks()
