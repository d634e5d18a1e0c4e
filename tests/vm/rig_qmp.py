"""QEMU's monitor (QMP) for fault tests: a small client, and a service that runs guest requests.

A guest test cannot reach the host's monitor socket, so it writes a request file into the results
share (`qmp-requests/<name>.json`, `{"execute": ..., "arguments": {...}}`) and waits for
`<name>.reply.json`; `GuestRequestService` polls for those files on the host and runs them.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

REQUESTS_DIR = "qmp-requests"


class QmpError(Exception):
    """QEMU refused a command, or the monitor socket broke."""


class Qmp:
    """One connection to QEMU's QMP socket. Events that arrive between replies are kept in `events`."""

    def __init__(self, path: Path, connect_timeout: float = 10.0):
        deadline = time.monotonic() + connect_timeout
        while True:
            try:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._sock.connect(str(path))
                break
            except (FileNotFoundError, ConnectionRefusedError):
                self._sock.close()
                if time.monotonic() > deadline:
                    raise QmpError(f"QMP socket {path} did not come up within {connect_timeout} s") from None
                time.sleep(0.05)
        self._buffer = b""  # bytes received but not yet split into lines
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        greeting = self._read()
        if "QMP" not in greeting:
            raise QmpError(f"unexpected QMP greeting {greeting}")
        self.execute("qmp_capabilities")

    def _read(self, timeout: float | None = None) -> dict[str, Any]:
        """The next JSON line from QEMU; TimeoutError after `timeout` s with nothing complete."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                self._sock.settimeout(remaining)
            try:
                chunk = self._sock.recv(65536)
            finally:
                self._sock.settimeout(None)
            if not chunk:
                raise QmpError("QMP connection closed (QEMU exited?)")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def execute(self, command: str, **arguments: Any) -> Any:
        """Run one command and return its `return` value; raise QmpError with QEMU's reason."""
        message: dict[str, Any] = {"execute": command}
        if arguments:
            message["arguments"] = arguments
        with self._lock:
            self._sock.sendall(json.dumps(message).encode() + b"\n")
            while True:
                reply = self._read()
                if "event" in reply:
                    self.events.append(reply)
                    continue
                if "error" in reply:
                    raise QmpError(f"{command}: {reply['error'].get('desc', reply['error'])}")
                return reply.get("return")

    def wait_event(self, name: str, timeout: float = 30.0, **data: Any) -> dict[str, Any]:
        """Block until event `name` whose data has the given items arrives (or was already seen),
        e.g. `wait_event("DEVICE_DELETED", device="nvme1")`; raise QmpError on timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                for event in self.events:
                    details = event.get("data", {})
                    if event["event"] == name and all(details.get(k) == v for k, v in data.items()):
                        self.events.remove(event)
                        return event
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise QmpError(f"no {name} event within {timeout} s")
                try:
                    reply = self._read(timeout=remaining)
                except TimeoutError:
                    continue
                if "event" in reply:
                    self.events.append(reply)

    def close(self) -> None:
        self._sock.close()


class GuestRequestService:
    """Polls the results share for guest QMP requests and answers each with a reply file.

    A request may carry `"resume_after": seconds`: the service then sends `cont` that long after the
    command (how a guest asks to be paused with `stop` and woken again). Replies are
    `{"return": ...}` or `{"error": "..."}`.
    """

    def __init__(self, share: Path, connect, poll_interval: float = 0.1):
        self.requests = share / REQUESTS_DIR
        self.requests.mkdir(exist_ok=True)
        self._connect = connect  # called once, on the first request: returns the Vm's Qmp
        self._interval = poll_interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vm-qmp-requests", daemon=True)
        self.handled: list[dict[str, Any]] = []

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            for request in sorted(self.requests.glob("*.json")):
                if request.name.endswith(".reply.json"):
                    continue
                reply_path = request.with_name(request.stem + ".reply.json")
                if reply_path.exists():
                    continue
                self._answer(request, reply_path)

    def _answer(self, request: Path, reply_path: Path) -> None:
        try:
            message = json.loads(request.read_text())
        except ValueError:
            return  # the guest is still writing it; the next poll sees it whole
        reply: dict[str, Any]
        try:
            qmp = self._connect()
            reply = {"return": qmp.execute(message["execute"], **message.get("arguments", {}))}
            if message.get("resume_after") is not None:
                time.sleep(float(message["resume_after"]))
                qmp.execute("cont")
        except (QmpError, KeyError, OSError) as exc:
            reply = {"error": str(exc)}
        self.handled.append({"request": message, "reply": reply})
        tmp = reply_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(reply))
        tmp.rename(reply_path)  # the guest never sees a half-written reply
