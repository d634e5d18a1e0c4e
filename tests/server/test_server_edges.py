"""The server's edges, in process (uvicorn in a thread, SmolLM2 Q8_0 on the CPU): text the tokenizer
refuses, a temperature too small to divide by, paths that do not exist, a client that gives up while
it waits for a slot, the model's id, and an engine that fails (issue 29)."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from infer.server.app import Loaded, Server, create_app
from infer.server.run import loader
from infer.tiers.config import StreamingConfig
from tests.oracle.assets import smollm2_path

CTX = 256
JSON = {"Content-Type": "application/json"}


class InProcess:
    """uvicorn serving `server` on a free port in a daemon thread; uvicorn leaves logging alone
    (log_config=None), so its records reach pytest's caplog."""

    def __init__(self, server: Server) -> None:
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = server
        self.web = uvicorn.Server(uvicorn.Config(create_app(server), host="127.0.0.1", port=self.port,
                                                 log_config=None, log_level="info"))
        self.thread = threading.Thread(target=self.web.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120
        while server.status == "loading" or not self.web.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            conn.request(method, path, body=body, headers=JSON if body is not None else {})
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def post(self, path: str, body: dict | bytes) -> tuple[int, dict]:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        status, data = self.request("POST", path, raw)
        return status, json.loads(data)

    def metrics(self) -> dict[str, float]:
        text = self.request("GET", "/metrics")[1].decode()
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line and not line.startswith("#")}

    def stop(self) -> None:
        self.web.should_exit = True
        self.thread.join(timeout=60)


@pytest.fixture(scope="module")
def model() -> Path:
    path = smollm2_path("Q8_0")
    if not path.exists():
        pytest.skip(f"{path} missing: run scripts/fetch-models.sh")
    return path


@pytest.fixture(scope="module")
def served(model: Path) -> Iterator[InProcess]:
    """One slot and a queue, so a second request waits for the first."""
    s = InProcess(Server(loader(str(model), "cpu", CTX, 1, StreamingConfig()), CTX, 1, 4))
    yield s
    s.stop()


def errors_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 1}', "prompt"),
    ("/v1/completions", b'{"prompt": "ok \\udfff\\ud800", "max_tokens": 1}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 1}', "messages"),
])
def test_text_that_is_not_unicode_is_a_400(served: InProcess, caplog: pytest.LogCaptureFixture, path: str,
                                           body: bytes, param: str) -> None:
    """A lone surrogate is valid JSON but not valid Unicode: the client's error, not a 500."""
    status, answer = served.post(path, body)
    assert status == 400, answer
    assert answer["error"]["param"] == param and "not valid Unicode" in answer["error"]["message"]
    assert errors_logged(caplog) == []
    assert served.metrics().get(f'ntransformer_requests_total{{endpoint="{path}",status="500"}}') is None


def test_a_temperature_too_small_to_divide_by_is_greedy(served: InProcess) -> None:
    import warnings

    ask = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 12, "seed": 5}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the divide-by-zero warnings came from infer/sampler.py
        greedy = served.post("/v1/chat/completions", {**ask, "temperature": 0})
        tiny = served.post("/v1/chat/completions", {**ask, "temperature": 1e-320})
    assert greedy[0] == tiny[0] == 200
    assert tiny[1]["choices"][0]["message"] == greedy[1]["choices"][0]["message"]


def test_unknown_paths_share_one_metrics_label(served: InProcess) -> None:
    for i in range(5):
        assert served.request("GET", f"/random-{12345 + i}")[0] == 404
    series = [k for k in served.metrics() if k.startswith("ntransformer_requests_total") and "random" in k]
    assert series == []
    assert served.metrics()['ntransformer_requests_total{endpoint="other",status="404"}'] >= 5


def test_a_client_that_gives_up_waiting_for_a_slot_is_a_disconnect(served: InProcess,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    before = served.metrics()
    holder = http.client.HTTPConnection("127.0.0.1", served.port, timeout=120)
    holder.request("POST", "/v1/completions", json.dumps({"prompt": "Once upon a time", "max_tokens": 200,
                                                          "temperature": 0, "stream": True}), JSON)
    response = holder.getresponse()
    response.fp.readline()  # the first event: the one slot is taken
    waiter = socket.create_connection(("127.0.0.1", served.port))
    body = json.dumps({"prompt": "Hello", "max_tokens": 4}).encode()
    waiter.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    deadline = time.monotonic() + 30
    while served.metrics().get("ntransformer_queued_requests", 0) < 1:
        assert time.monotonic() < deadline, "the second request never queued"
        time.sleep(0.05)
    waiter.close()  # gives up while it waits
    key = 'ntransformer_requests_total{endpoint="/v1/completions",status="disconnected"}'
    while served.metrics().get(key, 0) <= before.get(key, 0):
        assert time.monotonic() < deadline, "the disconnect was not counted"
        time.sleep(0.05)
    holder.close()
    after = served.metrics()
    failed = 'ntransformer_requests_total{endpoint="/v1/completions",status="500"}'
    assert after.get(failed, 0) == before.get(failed, 0)
    assert errors_logged(caplog) == []
    said = [r.getMessage() for r in caplog.records if "went away" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0]


def test_the_model_id_is_the_file_stem(served: InProcess, model: Path) -> None:
    status, body = served.request("GET", "/v1/models")
    entry = json.loads(body)["data"][0]
    assert status == 200 and entry["id"] == model.stem and " " not in entry["id"]
    assert entry["name"] == "Smollm2 135M 8k Lc100K Mix1 Ep2"  # the metadata's general.name, beside it


def test_an_engine_that_fails_fails_the_request_and_the_health(model: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A pass that raises (as a tier C read error does) answers the request in flight with a JSON
    error, says why on /health, and releases the weights (closes the session); the server's log has
    the traceback (where it failed), the clients only the one line."""
    from nvmedirect.reader.base import ReadError

    closed = []
    base = loader(str(model), "cpu", CTX, 1, StreamingConfig())

    def load() -> Loaded:
        loaded = base()

        def broken(batch, all_logits=False, prompt_rows=None):  # noqa: ANN001, ANN202
            raise ReadError("0000:01:00.0 nsid 1: NVMe read of LBAs 8..15 (bytes 4096..8192) failed: "
                            "ERROR status: 02/81 Unrecovered Read Error (read, cid 3)")

        loaded.model.forward_batch = broken  # type: ignore[method-assign]
        loaded.close = lambda: closed.append(True)
        return loaded

    s = InProcess(Server(load, CTX, 1, 4))
    try:
        status, answer = s.post("/v1/completions", {"prompt": "Hi", "max_tokens": 3})
        assert status == 500 and "Unrecovered Read Error" in answer["error"]["message"]
        status, body = s.request("GET", "/health")
        health = json.loads(body)
        assert status == 503 and health["status"] == "failed"
        assert health["error"].startswith("the engine failed: ReadError: 0000:01:00.0 nsid 1: NVMe read of LBAs")
        assert closed == [True]
        status, answer = s.post("/v1/completions", {"prompt": "Hi", "max_tokens": 3})
        assert status == 500 and answer["error"]["message"] == health["error"]
        [record] = [r for r in caplog.records if "engine failed" in r.getMessage()]
        assert record.exc_info is not None and record.exc_info[0] is ReadError
        assert "in broken" in caplog.text and "Traceback" not in answer["error"]["message"]
    finally:
        s.stop()


def test_a_device_taken_away_makes_the_server_unhealthy(model: Path) -> None:
    """The weights' own report (a tier C reader that released its device on a hot-unplug request)
    turns /health to failed even when no request is running."""
    gone: list[str] = []
    base = loader(str(model), "cpu", CTX, 1, StreamingConfig())

    def load() -> Loaded:
        loaded = base()
        loaded.problem = lambda: gone[0] if gone else None
        return loaded

    s = InProcess(Server(load, CTX, 1, 4))
    try:
        assert s.request("GET", "/health")[0] == 200
        gone.append("0000:01:00.0 nsid 1: the kernel asked for the device back (hot-unplug): released")
        status, body = s.request("GET", "/health")
        assert status == 503 and json.loads(body) == {"status": "failed", "error": gone[0]}
    finally:
        s.stop()
