"""The Python API on the real SmolLM2 file: tokenize/detokenize, generate, logits, chat history."""

from __future__ import annotations

import numpy as np
import pytest

from infer.api import LLM
from infer.sampler import SamplerConfig
from tests.oracle.fixtures import model_path

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM.load(model_path("smollm2-Q8_0"), ctx_size=512)


def test_tokenize_round_trip_and_logits(llm: LLM) -> None:
    ids = llm.tokenize("The capital of France is")
    assert llm.detokenize(ids) == "The capital of France is"
    logits = llm.logits(ids)
    assert logits.shape == (len(ids), llm.args.vocab_size) and logits.dtype == np.float32
    assert llm.detokenize([int(logits[-1].argmax())]) == " Paris"


def test_generate_streams_text_and_is_reproducible(llm: LLM) -> None:
    greedy = [t for t in llm.generate("The capital of France is", max_tokens=8, temperature=0)]
    assert "Paris" in "".join(t.text for t in greedy)
    assert llm.stats.generated_tokens == len(greedy) and llm.stats.decode_tokens_per_second > 0
    sampled = [llm.complete("Once upon a time", max_tokens=12, temperature=0.9, seed=s) for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] != sampled[2]


def test_chat_keeps_history_and_only_prefills_the_new_turn(llm: LLM) -> None:
    chat = llm.chat()
    greedy = SamplerConfig(temperature=0.0)
    first = chat.ask("What is the capital of France? Answer in one word.", max_tokens=24, sampler=greedy)
    assert "Paris" in first
    second = chat.ask("And of Italy?", max_tokens=24, sampler=greedy)
    assert second.strip()
    assert [m["role"] for m in chat.messages] == ["user", "assistant", "user", "assistant"]
    turn = llm.tokenize(chat.session.template.render(chat.messages[:3]), special=True)
    assert llm.stats.prompt_tokens < len(turn) // 2  # the first turn came from the cache
    conversation = llm.tokenizer.decode(chat._history, special=True)
    assert "What is the capital of France? Answer in one word." in conversation and first.strip() in conversation
    assert "And of Italy?" in conversation
