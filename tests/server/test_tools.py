"""Tool calls: the two written forms read back as OpenAI tool_calls (pure), and a live server on the
real Qwen2.5-Coder-0.5B, whose chat template offers tools, answering a weather question with a call
(plain and streamed) and then taking the tool's result."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from infer.server.app import Server
from infer.server.run import loader
from infer.server.tools import parse_tool_calls, template_message
from infer.tiers.config import StreamingConfig
from tests.oracle.fixtures import model_path
from tests.server.test_server_edges import InProcess

NAMES = {"get_weather", "add"}


def test_tagged_calls_are_read_and_the_rest_is_content() -> None:
    reply = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>')
    content, calls = parse_tool_calls(reply, NAMES)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("add", {"a": 1, "b": 2})]
    body = calls[0].body()
    assert body["type"] == "function" and body["id"].startswith("call_") and body["function"]["name"] == "get_weather"


def test_a_whole_json_reply_is_a_llama3_call() -> None:
    content, calls = parse_tool_calls(' {"name": "add", "parameters": {"a": 2, "b": 3}} ', NAMES)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 2, "b": 3})]


@pytest.mark.parametrize("reply", [
    "The weather is fine.",
    '<tool_call>{"name": "unknown_tool", "arguments": {}}</tool_call>',  # not offered: stays text
    '<tool_call>{"name": "add", "arguments": {broken</tool_call>',
    '{"name": "add", "arguments": [1, 2]}',  # arguments must be an object
    '{"city": "Paris"}',
])
def test_what_is_no_call_stays_content(reply: str) -> None:
    assert parse_tool_calls(reply, NAMES) == (reply, [])


def test_replayed_calls_reach_templates_with_object_arguments() -> None:
    message = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]}
    assert template_message(message)["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert template_message({"role": "user", "content": "x"}) == {"role": "user", "content": "x"}


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def qwen() -> Iterator[InProcess]:
    path = model_path("qwen05b")
    s = InProcess(Server(loader(str(path), "cpu", 1024, 1, StreamingConfig()), 1024, 1, 2))
    yield s
    s.stop()


@pytest.mark.oracle
@pytest.mark.slow
def test_qwen_calls_a_tool_and_reads_its_result(qwen: InProcess) -> None:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{qwen.port}/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(model="m", messages=QUESTION, tools=WEATHER, max_tokens=60, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    chunks = [c for c in client.chat.completions.create(model="m", messages=QUESTION, tools=WEATHER, max_tokens=60,
                                                        temperature=0, stream=True) if c.choices]
    streamed = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert [(t.index, t.function.name, t.function.arguments) for t in streamed] == [
        (0, "get_weather", call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # without the tools the same question is answered in text
    plain = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=30, temperature=0)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
    none = client.chat.completions.create(model="m", messages=QUESTION, tools=WEATHER, tool_choice="none",
                                          max_tokens=30, temperature=0)
    assert none.choices[0].message.content == plain.choices[0].message.content
    result = {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18, "sky": "cloudy"})}
    after = client.chat.completions.create(model="m", tools=WEATHER, max_tokens=40, temperature=0,
                                           messages=[*QUESTION, choice.message.model_dump(exclude_none=True), result])
    assert after.choices[0].finish_reason in ("stop", "length") and after.choices[0].message.content
