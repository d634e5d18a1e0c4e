"""A mixed load against a running server for a while, then a check that it drained and did not grow.

Client threads send, at random, what clients send: streamed greedy chats read to the end, streams
dropped after their first event, sampled completions with a seed, completions with log-probabilities,
JSON-mode chats, stop strings, tokenize round trips and broken bodies. A good request must get 200
(or 503 when every slot and queue place is taken), a broken one a 4xx; anything else is a failure.
The server process's resident memory (from /proc, so the server runs on this machine) is sampled
through the run; after the load stops the server must drain (no active or queued request in
/metrics) and its memory must not have grown past the level it reached in the first fifth of the run
(the warm-up: allocator pools, compiled shapes) by more than --max-growth-mb.

    python -m bench.server_soak --url http://127.0.0.1:8080 --pid PID --seconds 600 --out soak.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
import threading
import time
import urllib.parse
from collections import Counter
from pathlib import Path
from typing import Any

QUESTIONS = ["Name a colour.", "What is 2+2?", "Say hello in French.", "Write a haiku about rain.",
             "List three fruits.", "Who wrote Hamlet?", "Give me a number between 1 and 9.", "What is a cat?"]


def rss_mb(pid: int) -> float:
    """Resident memory of process `pid` in MiB (VmRSS of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


class Client:
    """One HTTP connection per request (as many clients do), with the server's key when it has one."""

    def __init__(self, url: str, key: str | None) -> None:
        parsed = urllib.parse.urlparse(url)
        self.host, self.port = parsed.hostname or "127.0.0.1", parsed.port or 80
        self.headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})

    def open(self, method: str, path: str, body: bytes | None) -> tuple[http.client.HTTPConnection,
                                                                           http.client.HTTPResponse]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=300)
        conn.request(method, path, body=body, headers=self.headers)
        return conn, conn.getresponse()

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        raw = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        conn, response = self.open(method, path, raw)
        try:
            return response.status, response.read()
        finally:
            conn.close()

    def metric(self, name: str) -> float:
        text = self.call("GET", "/metrics")[1].decode()
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def _chat(rng: random.Random, tokens: int, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": rng.choice(QUESTIONS)}], "max_tokens": tokens, **extra}


def one_request(client: Client, rng: random.Random) -> tuple[str, str]:
    """Sends one request of a random kind: (kind, outcome), outcome 'ok', 'busy' or a failure text."""
    kind = rng.choice(["stream", "drop", "sampled", "logprobs", "json", "stop", "tokenize", "broken"])
    if kind in ("stream", "drop"):
        body = json.dumps(_chat(rng, rng.randint(8, 24), temperature=0, stream=True)).encode()
        conn, response = client.open("POST", "/v1/chat/completions", body)
        try:
            if response.status != 200:
                return kind, _status(response.status, response.read())
            if kind == "drop":
                response.fp.readline()  # the first event, then the client goes away mid-stream
                return kind, "ok"
            text = response.read().decode()
            return kind, "ok" if "data: [DONE]" in text else f"stream without [DONE]: {text[-200:]!r}"
        finally:
            conn.close()
    if kind == "sampled":
        status, raw = client.call("POST", "/v1/completions", {"prompt": rng.choice(QUESTIONS), "max_tokens": 12,
                                                               "temperature": 0.8, "seed": rng.randrange(1000)})
    elif kind == "logprobs":
        status, raw = client.call("POST", "/v1/chat/completions", _chat(rng, 6, logprobs=True, top_logprobs=2))
    elif kind == "json":
        status, raw = client.call("POST", "/v1/chat/completions",
                                  _chat(rng, 16, temperature=0, response_format={"type": "json_object"}))
    elif kind == "stop":
        status, raw = client.call("POST", "/v1/completions", {"prompt": rng.choice(QUESTIONS), "max_tokens": 16,
                                                               "temperature": 0, "stop": [".", "\n"]})
    elif kind == "tokenize":
        status, raw = client.call("POST", "/tokenize", {"content": rng.choice(QUESTIONS)})
        if status == 200:
            status, raw = client.call("POST", "/detokenize", {"tokens": json.loads(raw)["tokens"]})
    else:
        body = rng.choice([b"{", b"[]", json.dumps({"prompt": 3}).encode(), json.dumps({"max_tokens": -1}).encode(),
                           json.dumps({"messages": "hi"}).encode(), bytes(rng.randrange(256) for _ in range(16))])
        status, raw = client.call("POST", rng.choice(["/v1/completions", "/v1/chat/completions"]), body)
        return kind, "ok" if 400 <= status < 500 else f"broken body got {status}: {raw[:200]!r}"
    return kind, _status(status, raw)


def _status(status: int, raw: bytes) -> str:
    if status == 200:
        return "ok"
    if status == 503:
        return "busy"
    return f"{status}: {raw[:200]!r}"


def soak(url: str, pid: int, seconds: float, clients: int, key: str | None, seed: int = 0,
         drain_seconds: float = 120.0) -> dict[str, Any]:
    """Runs the mixed load; returns counts, failures, the memory samples and whether it drained."""
    client = Client(url, key)
    stop_at = time.monotonic() + seconds
    counts: Counter = Counter()
    failures: list[str] = []
    lock = threading.Lock()

    def worker(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        while time.monotonic() < stop_at:
            try:
                kind, outcome = one_request(client, rng)
            except (OSError, http.client.HTTPException) as err:
                kind, outcome = "connection", f"{type(err).__name__}: {err}"
            with lock:
                counts[f"{kind}:{'ok' if outcome in ('ok', 'busy') else 'failed'}"] += 1
                counts["busy"] += outcome == "busy"
                if outcome not in ("ok", "busy") and len(failures) < 20:
                    failures.append(f"{kind}: {outcome}")

    began = time.monotonic()
    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    memory: list[tuple[float, float]] = []
    while any(t.is_alive() for t in threads):
        memory.append((round(time.monotonic() - began, 1), round(rss_mb(pid), 1)))
        time.sleep(min(2.0, max(0.2, seconds / 100)))
    deadline = time.monotonic() + drain_seconds
    while time.monotonic() < deadline:
        active, queued = client.metric("ntransformer_active_requests"), client.metric("ntransformer_queued_requests")
        if active == 0 and queued == 0:
            break
        time.sleep(0.2)
    drained = active == 0 and queued == 0
    time.sleep(1.0)  # the last cancelled streams' bookkeeping
    warm = [mb for t, mb in memory if t <= seconds / 5] or [memory[0][1]]
    end = rss_mb(pid)
    return {"url": url, "seconds": seconds, "clients": clients, "requests": sum(v for k, v in counts.items()
                                                                                  if ":" in k),
            "counts": dict(sorted(counts.items())), "failures": failures, "drained": drained,
            "active_after": active, "queued_after": queued, "rss_warm_mb": max(warm), "rss_end_mb": round(end, 1),
            "rss_growth_mb": round(end - max(warm), 1), "memory": memory,
            "health_after": client.call("GET", "/health")[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.server_soak", description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8080")
    parser.add_argument("--pid", type=int, required=True, help="the server's process id (its memory is read)")
    parser.add_argument("--seconds", type=float, default=600.0, help="how long the load runs (default 600)")
    parser.add_argument("--clients", type=int, default=8, help="client threads (default 8)")
    parser.add_argument("--api-key", default=None, help="the server's API key, if it has one")
    parser.add_argument("--max-growth-mb", type=float, default=64.0,
                        help="memory growth allowed after the warm-up fifth of the run (default 64 MiB)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    args = parser.parse_args(argv)
    result = soak(args.url, args.pid, args.seconds, args.clients, args.api_key, args.seed)
    result["command"] = "python -m bench.server_soak " + " ".join(sys.argv[1:] if argv is None else argv)
    result["max_growth_mb"] = args.max_growth_mb
    ok = (not result["failures"] and result["drained"] and result["health_after"] == 200
          and result["rss_growth_mb"] <= args.max_growth_mb)
    result["passed"] = ok
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text)
    summary = {k: v for k, v in result.items() if k != "memory"}
    print(json.dumps(summary, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
