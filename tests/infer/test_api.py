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


def test_a_reasoning_models_chat_keeps_its_answer_and_hands_over_its_thinking(llm: LLM,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Chat.send on a model whose template and vocabulary write harmony messages: the pieces it
    yields are the answer, the analysis channel goes to on_reasoning, the history keeps the answer
    and the next turn restarts from the template's rendering (the model saw the raw reply). The
    model is SmolLM2 with its tokens' text scripted (tests/server/test_reasoning_replies.py)."""
    import infer.api
    from infer.api import Chat
    from infer.chat import ChatSession, ChatTemplate
    from infer.tokenizer import Tokenizer
    from tests.infer.test_tokenizer import _with_specials
    from tests.server.test_reasoning_replies import HARMONY_PIECES, HARMONY_TEMPLATE, ScriptedDecoder

    monkeypatch.setattr(infer.api, "StreamDecoder", ScriptedDecoder)
    ScriptedDecoder.script, ScriptedDecoder.specials = HARMONY_PIECES, []
    tokenizer = Tokenizer.from_gguf(_with_specials(["<|start|>", "<|channel|>", "<|message|>", "<|end|>",
                                                    "<|return|>", "<|call|>"]))
    chat = Chat(llm, ChatSession(ChatTemplate(HARMONY_TEMPLATE), tokenizer))
    banned = tuple((i, float("-inf")) for i in tokenizer.eot_ids)  # the scripted reply runs its whole length
    greedy = SamplerConfig(temperature=0.0, logit_bias=banned)
    thinking: list[str] = []
    answer = list(chat.send("What is 2+2?", max_tokens=len(HARMONY_PIECES), sampler=greedy,
                            on_reasoning=thinking.append))
    assert "".join(answer) == "It is 4." and "".join(thinking) == "Two plus two." and ScriptedDecoder.specials == [True]
    assert chat.messages[-1] == {"role": "assistant", "content": "It is 4."}
    assert chat.session.add_user("Thanks.").restart
