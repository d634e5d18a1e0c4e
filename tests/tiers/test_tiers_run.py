"""`run_streaming`, what `ntransformer --streaming` calls: SmolLM2's text through every tier, a
batch from a prompts file, and the same greedy text as the resident engine on the same batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infer.api import LLM
from infer.engine import greedy
from infer.sampler import SamplerConfig
from infer.streaming import StreamingEngine
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
    # The resident engine on the same batch: the same float32 arithmetic, so the same text on any
    # CPU (each prompt alone sums in another order, and a near tie may go the other way).
    llm = LLM.load(smollm2, ctx_size=128)
    ids = [llm.tokenizer.encode(text) for text in prompts]
    resident = StreamingEngine(llm.transformer, 128).generate(ids, 8, greedy, llm.tokenizer.is_eog)
    for seq, out in zip(result["sequences"], resident, strict=True):
        assert seq["ids"] == [t for t in out if not llm.tokenizer.is_eog(t)]
        assert seq["text"] == llm.detokenize(seq["ids"])
