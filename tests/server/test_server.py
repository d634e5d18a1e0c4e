"""`ntransformer serve` against the real `openai` client and raw HTTP, on SmolLM2 Q8_0 on the CPU.

Identity claims (server = CLI, concurrent = solo) use the CPU engine's exact numerics (--exact:
float64 sums, so a batch of any shape gives each sequence the bits it gets alone); the default
float32 numerics depend on how rows are batched (docs/INFERENCE.md)."""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.oracle.assets import smollm2_path
from tests.oracle.fixtures import model_path

openai = pytest.importorskip("openai")
REPO = Path(__file__).resolve().parents[2]
CTX = 384
KEY = "sk-test-key"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The three laws of robotics",
           "import numpy as np\n", "Water boils at", "My favourite colour is", "In 1969, astronauts",
           "A haiku about the sea:", "The quick brown fox", "SELECT * FROM", "Photosynthesis is",
           "The best way to learn", "Dear Sir or Madam,", "To be or not to be", "Rust and C++ differ in"]


@pytest.fixture(scope="module")
def model() -> Path:
    path = smollm2_path("Q8_0")
    if not path.exists():
        pytest.skip(f"{path} missing: run scripts/fetch-models.sh")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    def __init__(self, model: Path, *args: str, exact: bool = True) -> None:
        """exact=False: the CPU's default engine (the packed native one where the kernels are built)."""
        self.port = _free_port()
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
        cmd = [sys.executable, "-c", "from infer.cli import main; main()", "serve", "-m", str(model), "--device",
               "cpu", *(["--exact"] if exact else []), "-c", str(CTX), "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.proc.stdout.read()}")  # type: ignore[union-attr]
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError("the server did not become ready")

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            response = conn.getresponse()
            return response.status, dict(response.getheaders()), response.read()
        finally:
            conn.close()

    def get(self, path: str) -> tuple[int, bytes]:
        status, _, body = self.request("GET", path)
        return status, body

    def metric(self, name: str) -> float:
        text = self.get("/metrics")[1].decode()
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=key, max_retries=0)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[Served]:
    s = Served(model, "--max-batch", "16", "--queue-size", "16", "--api-key", KEY)
    yield s
    s.stop()


def cli_text(model: Path, prompt: str, n: int) -> str:
    cmd = [sys.executable, "-c", "from infer.cli import main; main()", "-m", str(model), "-p", prompt, "-n", str(n),
           "-t", "0", "--exact", "--device", "cpu", "-c", str(CTX)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    return done.stdout.removesuffix("\n")


def _completions_and_chat_equal_the_cli(server: Served, model: Path) -> None:
    client = server.client()
    prompt, n = PROMPTS[0], 24
    want = cli_text(model, prompt, n)
    plain = client.completions.create(model="m", prompt=prompt, max_tokens=n, temperature=0)
    assert plain.choices[0].text == want
    assert plain.usage.completion_tokens <= n and plain.choices[0].finish_reason in ("length", "stop")
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="m", prompt=prompt, max_tokens=n, temperature=0, stream=True) if c.choices)
    assert streamed == want
    from infer.chat import ChatTemplate
    from infer.gguf_file import GGUFModel
    from infer.tokenizer import Tokenizer

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    gguf = GGUFModel(model)
    rendered = ChatTemplate.from_gguf(gguf.metadata, Tokenizer.from_gguf(gguf.metadata)).render(messages)
    want_chat = cli_text(model, rendered, n)
    chat = client.chat.completions.create(model="m", messages=messages, max_tokens=n, temperature=0)
    assert chat.choices[0].message.content == want_chat and chat.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=n, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_chat
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    assert [m.id for m in client.models.list().data] and server.get("/health")[0] == 200


def test_completions_and_chat_equal_the_cli(server: Served, model: Path) -> None:
    _completions_and_chat_equal_the_cli(server, model)


@pytest.mark.oracle
def test_gemma3_completions_and_chat_equal_the_cli() -> None:
    """Gemma 3 (no chat template in its file: Gemma's turns) served as the CLI runs it."""
    path = model_path("gemma3")
    served = Served(path, "--max-batch", "2", "--api-key", KEY)
    try:
        _completions_and_chat_equal_the_cli(served, path)
    finally:
        assert served.stop() == 0


def test_gpt_oss_completions_and_chat_equal_the_cli(tmp_path: Path) -> None:
    """A synthetic gpt-oss file (MXFP4 experts, attention sinks; infer.synth's tiny-gpt-oss) served on
    the CPU as the CLI runs it."""
    from infer.synth import SHAPES, write_model

    path = tmp_path / "gpt-oss.gguf"
    write_model(path, SHAPES["tiny-gpt-oss"], "q8_0", seed=1)
    served = Served(path, "--max-batch", "2", "--api-key", KEY)
    try:
        _completions_and_chat_equal_the_cli(served, path)
    finally:
        assert served.stop() == 0


def test_sixteen_concurrent_clients_get_their_solo_outputs(server: Served) -> None:
    client = server.client()
    n = 12
    solo = [client.completions.create(model="m", prompt=p, max_tokens=n, temperature=0).choices[0].text
            for p in PROMPTS]
    together: list[str | None] = [None] * len(PROMPTS)

    def ask(i: int) -> None:
        stream = i % 2 == 0  # half of them streamed
        if stream:
            together[i] = "".join(c.choices[0].text for c in client.completions.create(
                model="m", prompt=PROMPTS[i], max_tokens=n, temperature=0, stream=True) if c.choices)
        else:
            together[i] = client.completions.create(model="m", prompt=PROMPTS[i], max_tokens=n,
                                                    temperature=0).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == solo
    assert server.metric("ntransformer_active_requests") == 0


def test_bad_requests_get_4xx_and_leave_the_server_up(server: Served) -> None:
    """1000 fuzzed requests: broken JSON, wrong types, huge and negative numbers, unknown fields,
    missing or wrong keys, over-long prompts. Each gets a 4xx with an OpenAI-style error body."""
    rng = random.Random(7)
    good = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
    mutations = [
        lambda b: b"{" + json.dumps(b).encode()[: rng.randrange(1, 20)],  # broken JSON
        lambda b: json.dumps({**b, "max_tokens": rng.choice(["4", 4.5, -3, 0, 10**30, [], True])}).encode(),
        lambda b: json.dumps({**b, "temperature": rng.choice(["hot", -1, 1e308, 3, [0.1], {}])}).encode(),
        lambda b: json.dumps({**b, "prompt": rng.choice([3, None, [], ["a", "b"], {"x": 1}, [10**12], [-1]])}).encode(),
        lambda b: json.dumps({**b, rng.choice(["bogus", "logit_bias_x", "n_probs"]): 1}).encode(),
        lambda b: json.dumps({**b, "seed": rng.choice([2**80, "x", 1.5])}).encode(),
        lambda b: json.dumps({**b, "stop": rng.choice([["a"] * 9, [""], 5, [1, 2]])}).encode(),
        lambda b: json.dumps({**b, "max_tokens": CTX + 1}).encode(),
        lambda b: json.dumps({**b, "prompt": "word " * (CTX * 2)}).encode(),
        lambda b: json.dumps({"messages": rng.choice([[], [{"role": "robot", "content": "x"}], "hi", [{"role": "user"}]]),
                              "max_tokens": 2}).encode(),
        lambda b: bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))),  # noise
    ]
    statuses = []
    for i in range(1000):
        body = mutations[i % len(mutations)](dict(good))
        key = {0: None, 1: "sk-wrong"}.get(i % 7, KEY)  # every 7th without a key, the next with a wrong one
        headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
        path = "/v1/chat/completions" if i % len(mutations) == 9 else "/v1/completions"
        status, _, raw = server.request("POST", path, body, headers)
        statuses.append(status)
        assert 400 <= status < 500, (i, body[:200], status, raw[:300])
        error = json.loads(raw).get("error") or pytest.fail(f"{i}: {status} {raw[:300]!r} for {body[:120]!r}")
        assert error["message"] and error["type"]
        if key != KEY:
            assert status == 401
    assert {400, 401} <= set(statuses)
    assert server.get("/health")[0] == 200
    assert server.metric("ntransformer_active_requests") == 0 and server.metric("ntransformer_queued_requests") == 0
    ok = server.client().completions.create(model="m", prompt="Hello", max_tokens=3, temperature=0)
    assert ok.choices[0].text


def test_a_disconnected_stream_frees_its_slot_and_a_full_server_says_503(model: Path) -> None:
    s = Served(model, "--max-batch", "1", "--queue-size", "0")
    try:
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 300, "temperature": 0, "stream": True})
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        response.fp.readline()  # the first event: the slot is held now
        busy = s.request("POST", "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2}).encode(),
                         {"Content-Type": "application/json"})
        assert busy[0] == 503 and busy[1].get("retry-after") == "1" and "busy" in json.loads(busy[2])["error"]["message"]
        conn.close()  # the client goes away mid-stream
        deadline = time.monotonic() + 30
        while s.metric("ntransformer_active_requests") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert s.metric("ntransformer_active_requests") == 0
        after = s.client().completions.create(model="m", prompt="Hi", max_tokens=2, temperature=0)
        assert after.choices[0].text is not None  # admitted at once
    finally:
        assert s.stop() == 0


def test_ctrl_c_drains_the_requests_in_flight(model: Path) -> None:
    s = Served(model, "--max-batch", "2")
    result: dict[str, object] = {}

    def ask() -> None:
        result["r"] = s.client().completions.create(model="m", prompt="Once upon a time", max_tokens=40, temperature=0)

    t = threading.Thread(target=ask)
    t.start()
    deadline = time.monotonic() + 30
    while not s.metric("ntransformer_active_requests") and time.monotonic() < deadline:
        time.sleep(0.05)
    code = s.stop()  # SIGINT while the request runs
    t.join(timeout=60)
    assert code == 0
    assert result["r"].choices[0].finish_reason == "length" and result["r"].usage.completion_tokens == 40


def test_serve_refuses_bad_input_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 10)
    done = subprocess.run([sys.executable, "-c", "from infer.cli import main; main()", "serve", "-m", str(bad),
                           "--device", "cpu"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr and done.stderr.strip().count("\n") == 0


def test_health_says_loading_until_the_model_is_ready(model: Path) -> None:
    """The server answers while the model loads: /health 503 "loading", requests 503 with Retry-After."""
    import uvicorn

    from infer.server.app import Server, create_app
    from infer.server.run import loader
    from infer.tiers.config import StreamingConfig

    release = threading.Event()
    load = loader(str(model), "cpu", CTX, 1, StreamingConfig(), exact=True)
    server = Server(lambda: (release.wait(60), load())[1], CTX, 1, 0)
    port = _free_port()
    web = uvicorn.Server(uvicorn.Config(create_app(server), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    try:
        while not web.started:
            time.sleep(0.02)
        probe = Served.__new__(Served)
        probe.port = port
        assert probe.get("/health") == (503, b'{"status":"loading"}')
        status, headers, body = probe.request("POST", "/v1/completions", json.dumps({"prompt": "Hi"}).encode(),
                                              {"Content-Type": "application/json"})
        assert status == 503 and headers.get("retry-after") and "loading" in json.loads(body)["error"]["message"]
        release.set()
        deadline = time.monotonic() + 60
        while probe.get("/health")[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert json.loads(probe.get("/health")[1]) == {"status": "ready"}
    finally:
        release.set()
        web.should_exit = True
        thread.join(timeout=60)
