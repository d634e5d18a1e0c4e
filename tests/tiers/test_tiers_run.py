"""`run_streaming`, what `ntransformer --streaming` calls: SmolLM2's text through every tier, a
batch from a prompts file, and the same greedy text as the resident engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infer.api import LLM
from infer.sampler import SamplerConfig
from infer.tiers.run import run_streaming
from infer.tiers.session import StreamingConfig


@pytest.mark.slow
def test_streaming_text_equals_resident_text_for_each_prompt(smollm2: Path, tmp_path: Path) -> None:
    prompts = ["The capital of France is", "def fibonacci(n):"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    printed: list[str] = []
    notes: list[str] = []
    config = StreamingConfig(enabled=True, prompts_file=str(tmp_path / "prompts.txt"))
    result = run_streaming(str(smollm2), config, 128, "cpu", None, 8, SamplerConfig(temperature=0.0),
                           as_json=True, echo=printed.append, note=notes.append)
    assert json.loads(printed[0])["sequences"] == result["sequences"]
    assert result["decode_passes"] <= 7 and result["prefill_passes"] == 1
    assert set(result["bytes_moved"]) == {"B", "C"} and all(v > 0 for v in result["bytes_moved"].values())
    assert "layer tiers" in notes[0]
    llm = LLM.load(smollm2, ctx_size=128)
    for text, seq in zip(prompts, result["sequences"], strict=True):
        assert seq["text"] == llm.complete(text, max_tokens=8, temperature=0.0)
