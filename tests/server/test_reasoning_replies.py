"""A reasoning model's chat replies through the live server (uvicorn in a thread, SmolLM2 Q8_0 on the
CPU): its thinking comes as reasoning_content beside content, plain and streamed; harmony's tool calls
as tool_calls; reasoning_format "none" (the request's or the server's) leaves the reply whole.

SmolLM2 writes neither form, so the model runs as it is and the text of its tokens is scripted: the
scheduler's stream decoder is replaced by one that returns the next piece of a gpt-oss (or Qwen3)
reply per token, and the server gets a vocabulary and a chat template with the markers. What runs
for real is everything after the decoder: the events, the split, the bodies."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import pytest

from infer.chat import ChatTemplate
from infer.server.app import Server
from infer.server.run import loader
from infer.tiers.config import StreamingConfig
from infer.tokenizer import Tokenizer
from tests.infer.test_tokenizer import _with_specials
from tests.oracle.assets import smollm2_path
from tests.server.test_server_edges import CTX, InProcess

HARMONY_TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}<|channel|>final<|message|>{{ m.content }}<|end|>"
                    "{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}<|start|>assistant")
THINK_TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}\n{{ m.content }}\n{% endfor %}<|start|>assistant\n"
                  "{% if not thinking %}<think>\n{% endif %}{# the reply closes it with </think> #}")
HARMONY_PIECES = ["<|channel|>", "analysis", "<|message|>", "Two plus", " two.", "<|end|>", "<|start|>", "assistant",
                  "<|channel|>", "final", "<|message|>", "It is", " 4."]
CALL_PIECES = ["<|channel|>", "analysis", "<|message|>", "Weather.", "<|end|>", "<|start|>", "assistant",
               "<|channel|>", "commentary to=functions.get_weather ", "<|constrain|>", "json", "<|message|>",
               '{"city":', ' "Paris"}']
THINK_PIECES = ["\n", "Two plus", " two.\n", "</think>", "\n\n", "It is", " 4."]
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


class ScriptedDecoder:
    """infer.tokenizer.StreamDecoder's interface: the next piece of `SCRIPT` for every token."""

    script: list[str] = []
    specials: list[bool] = []

    def __init__(self, tokenizer: Tokenizer, special: bool = False) -> None:
        self.pieces = iter(self.script)
        ScriptedDecoder.specials.append(special)

    def push(self, token_id: int) -> str:
        return next(self.pieces, "")

    def flush(self) -> str:
        return ""


def _served(form: str, reasoning: str = "auto") -> InProcess:
    loaded = loader(str(smollm2_path()), "cpu", CTX, 1, StreamingConfig())()
    markers = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"] \
        if form == "harmony" else ["<|start|>", "<think>", "</think>"]
    tokenizer = Tokenizer.from_gguf(_with_specials(markers))
    template = ChatTemplate(HARMONY_TEMPLATE if form == "harmony" else THINK_TEMPLATE)
    scripted = dataclasses.replace(loaded, tokenizer=tokenizer, template=template)
    return InProcess(Server(lambda: scripted, CTX, 1, 2, reasoning=reasoning))


@pytest.fixture(scope="module")
def harmony() -> Iterator[InProcess]:
    s = _served("harmony")
    yield s
    s.stop()


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch) -> type[ScriptedDecoder]:
    import infer.scheduler

    monkeypatch.setattr(infer.scheduler, "StreamDecoder", ScriptedDecoder)
    ScriptedDecoder.specials = []
    return ScriptedDecoder


def _ask(server: InProcess, pieces: list[str], stream: bool = False, **extra: object) -> dict | list[dict]:
    body = {"messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": len(pieces), "temperature": 0,
            "ignore_eos": True, "stream": stream, **extra}
    if not stream:
        status, reply = server.post("/v1/chat/completions", body)
        assert status == 200, reply
        return reply
    status, raw = server.request("POST", "/v1/chat/completions", json.dumps(body).encode())
    assert status == 200, raw
    return [json.loads(line[6:]) for line in raw.decode().splitlines()
            if line.startswith("data: {")]


def _deltas(chunks: list[dict], key: str) -> str:
    return "".join(c["choices"][0]["delta"].get(key) or "" for c in chunks if c["choices"])


def test_harmony_reasoning_comes_beside_the_answer(harmony: InProcess, script: type[ScriptedDecoder]) -> None:
    script.script = HARMONY_PIECES
    reply = _ask(harmony, HARMONY_PIECES)
    message = reply["choices"][0]["message"]  # type: ignore[index]
    assert message["reasoning_content"] == "Two plus two." and message["content"] == "It is 4."
    assert script.specials == [True]  # the markers are control tokens: decoded as text, then parsed
    chunks = _ask(harmony, HARMONY_PIECES, stream=True)
    assert _deltas(chunks, "reasoning_content") == "Two plus two." and _deltas(chunks, "content") == "It is 4."  # type: ignore[arg-type]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]


def test_reasoning_format_none_leaves_the_reply_whole(harmony: InProcess, script: type[ScriptedDecoder]) -> None:
    script.script = HARMONY_PIECES
    message = _ask(harmony, HARMONY_PIECES, reasoning_format="none")["choices"][0]["message"]  # type: ignore[index]
    assert message["content"] == "".join(HARMONY_PIECES) and "reasoning_content" not in message
    with pytest.raises(AssertionError, match="422|400"):
        _ask(harmony, HARMONY_PIECES, reasoning_format="sometimes")


def test_a_harmony_message_to_a_function_is_a_tool_call(harmony: InProcess, script: type[ScriptedDecoder]) -> None:
    script.script = CALL_PIECES
    for stream in (False, True):
        reply = _ask(harmony, CALL_PIECES, stream=stream, tools=WEATHER)
        choice = (reply if stream else [reply])[0]["choices"][0]  # type: ignore[index]
        message = choice["delta" if stream else "message"]
        assert choice["finish_reason"] == "tool_calls" and message["reasoning_content"] == "Weather."
        [call] = message["tool_calls"]
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_think_tags_opened_by_the_template(script: type[ScriptedDecoder]) -> None:
    """A template that opens <think> itself: the reply starts inside the reasoning; the server's
    --reasoning-format none sends it whole."""
    script.script = THINK_PIECES
    for reasoning, want in (("auto", {"reasoning_content": "Two plus two.\n", "content": "It is 4."}),
                            ("none", {"content": "".join(THINK_PIECES)})):
        served = _served("think", reasoning)
        try:
            message = _ask(served, THINK_PIECES)["choices"][0]["message"]  # type: ignore[index]
            assert {k: message[k] for k in ("reasoning_content", "content") if k in message} == want
            chunks = _ask(served, THINK_PIECES, stream=True)
            assert _deltas(chunks, "content") == want["content"]  # type: ignore[arg-type]
            assert _deltas(chunks, "reasoning_content") == want.get("reasoning_content", "")  # type: ignore[arg-type]
        finally:
            served.stop()
    assert script.specials == [False] * 4  # think tags are text of their own
