"""The request fields clients and benchmark tools send (issue 27), against a live server (uvicorn in
process, SmolLM2 Q8_0 on the CPU) through the real `openai` client: JSON output held to a schema
(llguidance), log-probabilities, ignore_eos, logit_bias, the penalties, llama-server's top_k and
min_p, message content as parts, the developer role, a message's name, /tokenize and /detokenize,
and a queued stream that gets its headers and keep-alive comments at once."""

from __future__ import annotations

import http.client
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from infer.server import app as app_module
from infer.server.app import Server
from infer.server.run import loader
from infer.tiers.config import StreamingConfig
from tests.oracle.assets import smollm2_path
from tests.server.test_server_edges import JSON, InProcess

openai = pytest.importorskip("openai")
CTX = 256
KEY = "sk-fields"


@pytest.fixture(scope="module")
def served() -> Iterator[InProcess]:
    path = smollm2_path("Q8_0")
    if not path.exists():
        pytest.skip(f"{path} missing: run scripts/fetch-models.sh")
    s = InProcess(Server(loader(str(path), "cpu", CTX, 1, StreamingConfig()), CTX, 1, 4, api_key=KEY))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(served: InProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key=KEY, max_retries=0)


def _post(served: InProcess, path: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=120)
    try:
        conn.request("POST", path, json.dumps(body), JSON | {"Authorization": f"Bearer {KEY}"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "colour": {"enum": ["red", "green", "blue"]}},
          "required": ["name", "age", "colour"], "additionalProperties": False}


def _matches_person(value: object) -> bool:
    return (isinstance(value, dict) and set(value) == {"name", "age", "colour"} and isinstance(value["name"], str)
            and len(value["name"]) <= 20 and isinstance(value["age"], int) and 0 <= value["age"] <= 150
            and value["colour"] in ("red", "green", "blue"))


def test_json_schema_output_parses_and_matches(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Describe a person called Ann, 31, who likes green."}]
    plain = client.chat.completions.create(model="m", messages=messages, max_tokens=40, temperature=0)
    with pytest.raises(json.JSONDecodeError):  # without the grammar this model answers in prose
        json.loads(plain.choices[0].message.content)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for temperature, seed in ((0, None), (1.0, 3), (1.0, 4)):
        reply = client.chat.completions.create(model="m", messages=messages, max_tokens=80, temperature=temperature,
                                               seed=seed, response_format=fmt)
        assert reply.choices[0].finish_reason == "stop", reply
        assert _matches_person(json.loads(reply.choices[0].message.content))
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="m", messages=messages, max_tokens=80, temperature=0, response_format=fmt, stream=True) if c.choices)
    assert _matches_person(json.loads(streamed))
    anything = client.completions.create(model="m", prompt="A person as a JSON object:", max_tokens=120,
                                         temperature=0, extra_body={"response_format": {"type": "json_object"}})
    assert anything.choices[0].finish_reason == "stop", anything  # the object closed within max_tokens
    assert isinstance(json.loads(anything.choices[0].text), dict)


def test_a_schema_llguidance_cannot_compile_is_a_400(served: InProcess) -> None:
    for fmt in ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}},
                {"type": "json_schema", "json_schema": {"name": "x"}}):
        status, body = _post(served, "/v1/completions", {"prompt": "x", "max_tokens": 2, "response_format": fmt})
        assert status == 400 and body["error"]["param"] == "response_format", body


def test_logprobs_chat_and_completions(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name a fruit."}]
    reply = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert "".join(e.token for e in content) == reply.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        # greedy: the chosen token is the most likely one, with the same log-probability
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        assert sum(math.exp(t.logprob) for t in entry.top_logprobs) <= 1 + 1e-9
        assert bytes(entry.bytes) == entry.token.encode()
    streamed = [e for c in client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0,
                                                          logprobs=True, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.top_logprobs) for e in streamed] == [(e.token, []) for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    plain = client.completions.create(model="m", prompt="The capital of France is", max_tokens=6, temperature=0,
                                      logprobs=2)
    lp = plain.choices[0].logprobs
    assert "".join(lp.tokens) == plain.choices[0].text and len(lp.token_logprobs) == 6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    assert all(len(top) == 2 and max(top.values()) == pytest.approx(p)
               for top, p in zip(lp.top_logprobs, lp.token_logprobs, strict=True))
    assert client.completions.create(model="m", prompt="Hi", max_tokens=2).choices[0].logprobs is None


def test_ignore_eos_runs_to_max_tokens(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Hi!"}]
    plain = client.chat.completions.create(model="m", messages=messages, max_tokens=48, temperature=0)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens < 48
    forced = client.chat.completions.create(model="m", messages=messages, max_tokens=48, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert forced.choices[0].finish_reason == "length" and forced.usage.completion_tokens == 48
    assert forced.choices[0].message.content.startswith(plain.choices[0].message.content)


def test_logit_bias_bans_and_forces_tokens(served: InProcess, client: openai.OpenAI) -> None:
    ask = {"model": "m", "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0, "logprobs": 0}
    first = client.completions.create(**ask).choices[0].logprobs.tokens[0]
    first_id = _post(served, "/tokenize", {"content": first})[1]["tokens"]
    assert len(first_id) == 1
    banned = client.completions.create(**ask, logit_bias={str(first_id[0]): -100}).choices[0].logprobs.tokens[0]
    assert banned != first
    forced_id = _post(served, "/tokenize", {"content": " banana"})[1]["tokens"][0]
    forced = client.completions.create(**ask, logit_bias={str(forced_id): 100}).choices[0].text
    assert forced == _post(served, "/detokenize", {"tokens": [forced_id]})[1]["content"]
    for bias in ({"-1": 1}, {"49152": 1}, {"12": 101}, {"x": 1}):
        status, body = _post(served, "/v1/completions", {**ask, "logit_bias": bias})
        assert status == 400 and body["error"]["param"] == "logit_bias", body


def test_zero_valued_fields_change_nothing_and_penalties_do(client: openai.OpenAI) -> None:
    """What clients send by default (penalties at 0, top_k 0, min_p 0, a text format, parts, a name)
    is accepted and gives the plain reply; non-zero penalties change a repetitive reply."""
    messages = [{"role": "user", "content": "Count: one, two, three, four"}]
    plain = client.chat.completions.create(model="m", messages=messages, max_tokens=24, temperature=0)
    dressed = client.chat.completions.create(
        model="m", max_tokens=24, temperature=0, presence_penalty=0, frequency_penalty=0,
        response_format={"type": "text"}, messages=[{"role": "user", "name": "ann", "content": [
            {"type": "text", "text": "Count: one, "}, {"type": "text", "text": "two, three, four"}]}],
        extra_body={"top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0})
    assert dressed.choices[0].message.content == plain.choices[0].message.content
    penalized = client.chat.completions.create(model="m", messages=messages, max_tokens=24, temperature=0,
                                               frequency_penalty=2.0, presence_penalty=2.0)
    assert penalized.choices[0].message.content != plain.choices[0].message.content


def test_developer_role_is_the_system_role(client: openai.OpenAI) -> None:
    def ask(role: str) -> str:
        return client.chat.completions.create(model="m", max_tokens=16, temperature=0, messages=[
            {"role": role, "content": "You answer in French."}, {"role": "user", "content": "Hello!"}]
        ).choices[0].message.content

    assert ask("developer") == ask("system")


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 2.5}, "frequency_penalty"),
])
def test_fields_out_of_range_are_400s_naming_them(served: InProcess, body: dict, param: str) -> None:
    status, answer = _post(served, "/v1/chat/completions", {**body, "max_tokens": 2})
    assert status == 400 and answer["error"]["param"] == param, answer


def test_tokenize_and_detokenize(served: InProcess) -> None:
    text = "Hello, world! <|im_start|>"
    status, body = _post(served, "/tokenize", {"content": text})
    assert status == 200 and body["tokens"][-1] == 1  # <|im_start|> is token 1 in SmolLM2's vocabulary
    assert _post(served, "/detokenize", {"tokens": body["tokens"]})[1] == {"content": text}
    plain = _post(served, "/tokenize", {"content": text, "parse_special": False})[1]["tokens"]
    assert 1 not in plain and len(plain) > len(body["tokens"])
    pieces = _post(served, "/tokenize", {"content": "Hello world", "with_pieces": True})[1]["tokens"]
    assert "".join(p["piece"] for p in pieces) == "Hello world" and all(isinstance(p["id"], int) for p in pieces)
    assert _post(served, "/detokenize", {"tokens": [49152]})[0] == 400
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    conn.request("POST", "/tokenize", json.dumps({"content": "x"}), JSON)  # no key
    assert conn.getresponse().status == 401
    conn.close()


def test_a_queued_stream_gets_headers_and_keepalives_at_once(served: InProcess,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(app_module, "KEEPALIVE_SECONDS", 0.2)
    headers = JSON | {"Authorization": f"Bearer {KEY}"}
    holder = http.client.HTTPConnection("127.0.0.1", served.port, timeout=120)
    holder.request("POST", "/v1/completions", json.dumps({"prompt": "Once upon a time", "max_tokens": 60,
                                                          "temperature": 0, "stream": True}), headers)
    held = holder.getresponse()
    held.read(1)  # the first event came: the one slot is taken
    waiter = http.client.HTTPConnection("127.0.0.1", served.port, timeout=120)
    waiter.request("POST", "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2, "temperature": 0,
                                                          "stream": True}), headers)
    queued = waiter.getresponse()  # headers while it waits for the slot
    assert queued.status == 200 and queued.getheader("content-type").startswith("text/event-stream")
    assert queued.read(14) == b": keep-alive\n\n"
    assert served.metrics().get("ntransformer_queued_requests") == 1
    rest = queued.read().decode()
    assert rest.rstrip().endswith("data: [DONE]") and '"finish_reason"' in rest
    held.read()
    holder.close()
    waiter.close()


def test_tools_for_a_template_without_them_are_a_400(served: InProcess) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    status, body = _post(served, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                          "tools": tools, "max_tokens": 2})
    assert status == 400 and body["error"]["param"] == "tools" and "template" in body["error"]["message"]
    status, body = _post(served, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                          "tools": tools, "tool_choice": "required"})
    assert status == 400 and body["error"]["param"] == "tool_choice"


def test_the_server_bench_measures_a_running_server_by_url(served: InProcess, tmp_path: Path) -> None:
    """bench.server_bench --url: the load generator against any OpenAI-compatible address; with
    ignore_eos every client gets exactly --tokens tokens."""
    from bench import server_bench

    out = tmp_path / "bench.json"
    assert server_bench.main(["--url", f"http://127.0.0.1:{served.port}", "--vocab-size", "49152", "--clients", "3",
                              "--tokens", "5", "--prompt-tokens", "8", "--api-key", KEY, "--out", str(out)]) == 0
    result = json.loads(out.read_text())["server"]
    assert result["clients"] == 3 and result["generated_tokens"] == 15 and result["aggregate_tok_s"] > 0
    assert 0 < result["ttft_p50_s"] <= result["ttft_p95_s"] <= result["wall_seconds"]


def test_the_server_bench_sends_a_prompt_set_as_raw_completions(served: InProcess, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """bench.server_bench --url --prompt-set humaneval: the set's prompts as raw text to
    /v1/completions, the measured clients on the first ones and the warm-up on the next; the
    replies are kept (for the speculative server's comparison); with --prompt-file or --chat, refused."""
    from bench import server_bench, spec_bench

    asked: list[int] = []

    def prompts(n: int) -> list[str]:
        asked.append(n)
        return [f"def f{i}(x):\n    return" for i in range(n)]

    monkeypatch.setattr(spec_bench, "humaneval_prompts", prompts)
    out = tmp_path / "code.json"
    assert server_bench.main(["--url", f"http://127.0.0.1:{served.port}", "--prompt-set", "humaneval", "--clients", "2",
                              "--tokens", "3", "--api-key", KEY, "--out", str(out)]) == 0
    result = json.loads(out.read_text())["server"]
    assert asked == [4, 4] and result["clients"] == 2 and result["generated_tokens"] == 6
    assert len(result["replies"]) == 2 and all(isinstance(r, str) for r in result["replies"])
    # --rounds: waves one after another on the next prompts (the warm-up on those after them)
    asked.clear()
    assert server_bench.main(["--url", f"http://127.0.0.1:{served.port}", "--prompt-set", "humaneval", "--clients", "2",
                              "--tokens", "3", "--rounds", "3", "--api-key", KEY, "--out", str(out)]) == 0
    result = json.loads(out.read_text())["server"]
    assert asked == [8] * 4 and result["rounds"] == 3 and result["generated_tokens"] == 18
    assert len(result["per_round_tok_s"]) == 3 and len(result["replies"]) == 6
    assert result["aggregate_tok_s"] == round(18 / result["wall_seconds"], 2)
    for extra in (["--chat"], ["--prompt-file", str(out)], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            server_bench.main(["--url", "http://127.0.0.1:1", "--prompt-set", "humaneval", *extra])


def test_the_server_bench_can_let_replies_end_where_the_model_ends_them(served: InProcess, tmp_path: Path) -> None:
    """--stop-at-eos: no ignore_eos, so a reply ends at the model's end of generation (SmolLM2's
    greedy answer to "What is 2+2?" is 11 tokens); without it every reply runs to --tokens."""
    from bench import server_bench

    prompts, out = tmp_path / "q.txt", tmp_path / "eos.json"
    prompts.write_text("What is 2+2?\nAnd 3+3?\n")
    counts = []
    for extra in ([], ["--stop-at-eos"]):
        assert server_bench.main(["--url", f"http://127.0.0.1:{served.port}", "--prompt-file", str(prompts), "--chat",
                                  "--clients", "1", "--tokens", "40", "--api-key", KEY, "--out", str(out),
                                  *extra]) == 0
        counts.append(json.loads(out.read_text())["server"]["generated_tokens"])
    assert counts == [40, 11]
    with pytest.raises(SystemExit):
        server_bench.main(["--model", "x.gguf", "--stop-at-eos"])


def test_a_chat_replay_that_outgrows_the_context_ends_early_and_says_where(served: InProcess, tmp_path: Path) -> None:
    """bench.server_bench --url --chat-turns: when the resent history no longer fits the server's
    context (a 400 that says so), the replay stops there and reports the turn, keeping the others."""
    from bench import server_bench

    out = tmp_path / "chat.json"
    assert server_bench.main(["--url", f"http://127.0.0.1:{served.port}", "--chat-turns", "16", "--tokens", "40",
                              "--api-key", KEY, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert 1 < result["context_full_at_turn"] <= 16
    assert result["turns_done"] == result["context_full_at_turn"] - 1 == len(result["answers"]) == len(result["ttft_s"])
    assert result["ttft_median_turns_2_on_s"] is None or result["ttft_median_turns_2_on_s"] > 0
