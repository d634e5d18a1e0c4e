"""Models for the streaming tests: a tiny synthetic Llama (always) and SmolLM2 (cached download)."""

from __future__ import annotations

from pathlib import Path

import pytest

from infer.synth import SHAPES, Shape, write_model
from tests.oracle.assets import smollm2_path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 layers so a plan can spread tiers over them; Q4_K_M mixes Q4_K and Q6_K like llama.cpp's."""
    path = tmp_path_factory.mktemp("synth") / "tiny4-q4_k_m.gguf"
    write_model(path, Shape(**{**SHAPES["tiny"].__dict__, "n_layers": 4}), "q4_k_m", seed=11)
    return path


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same as a Qwen3: per-head Q/K norms (vectors that stay in VRAM), its own head size."""
    path = tmp_path_factory.mktemp("synth") / "tiny4-qwen3-q4_k_m.gguf"
    shape = Shape(**{**SHAPES["tiny"].__dict__, "n_layers": 4, "arch": "qwen3", "head_dim": 128})
    write_model(path, shape, "q4_k_m", seed=11)
    return path


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """As a Gemma 3 of 6 layers: post-norms streamed with the layers, five local layers with an
    8-token window and their own rotary base, GeGLU and the embedding scale."""
    path = tmp_path_factory.mktemp("synth") / "tiny6-gemma3-q4_k_m.gguf"
    shape = Shape(**{**SHAPES["tiny"].__dict__, "n_layers": 6, "arch": "gemma3", "head_dim": 128, "sliding_window": 8})
    write_model(path, shape, "q4_k_m", seed=11)
    return path


@pytest.fixture(scope="session")
def smollm2() -> Path:
    path = smollm2_path()
    if not path.exists():
        pytest.skip(f"{path} missing: run scripts/fetch-models.sh smollm2")
    return path
