"""A chat reply split into its reasoning and its answer, as it streams.

Two written forms are read, the ones the chat templates of the common reasoning models teach:

- **harmony** (gpt-oss): the reply is a run of messages, each a header and a body,
  `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...`. The
  `analysis` channel is the reasoning, `final` the answer; a `commentary` message addressed
  `to=functions.NAME` is a tool call whose body is its arguments, other commentary is answer text.
  The markers are control tokens, so the reply must be decoded with them written out
  (`needs_special_text`).
- **think tags** (Qwen3, DeepSeek-R1 and their kin): `<think>...</think>` at the start of the reply
  (or the prompt already opened it) is the reasoning, the rest the answer, its leading blank lines
  dropped.

`reasoning_format(template_source, tokenizer)` says which form a model writes, from its template and
vocabulary; `ReplySplitter.push(text)` takes the reply's text piece by piece and returns the
reasoning and the answer text that became certain with it, holding back what may be the start of a
marker; `flush()` returns what is left at the end. llama-server splits replies the same way and
sends the reasoning as `reasoning_content` beside `content`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from infer.tokenizer import Tokenizer

FORMATS = ("auto", "none")  # the server's --reasoning-format and a request's reasoning_format

HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>")
_HARMONY_ALL = (*HARMONY_MARKERS, "<|constrain|>")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_RECIPIENT = re.compile(r"\bto=functions\.([A-Za-z0-9_.\-]+)")


def reasoning_format(template_source: str, tokenizer: Tokenizer) -> str | None:
    """"harmony", "think" or None: the form of this model's replies, when its template writes one
    and its vocabulary has the markers as tokens of their own."""
    def has(*texts: str) -> bool:
        return all(len(tokenizer.encode(t, add_bos=False, special=True)) == 1 for t in texts)

    if "<|channel|>" in template_source and has(*HARMONY_MARKERS):
        return "harmony"
    if THINK_OPEN in template_source and THINK_CLOSE in template_source and has(THINK_OPEN, THINK_CLOSE):
        return "think"
    return None


def _held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could start one of `markers` (kept for the next piece)."""
    longest = max(len(m) for m in markers)
    for n in range(min(longest - 1, len(text)), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) for m in markers):
            return n
    return 0


@dataclass
class ToolCallText:
    name: str
    arguments: str


@dataclass
class ReplySplitter:
    """A reply's text in, its reasoning and answer out (module docstring). `opened`: the prompt ends
    inside the reasoning (a template that writes `<think>` itself)."""

    form: str
    opened: bool = False
    calls: list[ToolCallText] = field(default_factory=list)
    _buffer: str = ""
    _state: str = "start"  # harmony: start, header, body; think: start, reasoning(_start), answer(_start)
    _channel: str = "final"
    _call: ToolCallText | None = None

    def __post_init__(self) -> None:
        if self.form not in ("harmony", "think"):
            raise ValueError(f"unknown reply form {self.form!r}")
        if self.form == "think" and self.opened:
            self._state = "reasoning_start"

    def push(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) text made certain by this piece."""
        self._buffer += text
        return self._drain(final=False)

    def flush(self) -> tuple[str, str]:
        """What is left at the end of the reply (an unfinished header is dropped)."""
        return self._drain(final=True)

    def split(self, text: str) -> tuple[str, str]:
        """A whole reply: (reasoning, answer)."""
        r1, a1 = self.push(text)
        r2, a2 = self.flush()
        return r1 + r2, a1 + a2

    # ---------------------------------------------------------------- harmony
    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning, answer = [], []
        if self.form == "harmony":
            self._harmony(reasoning, answer, final)
        else:
            self._think(reasoning, answer, final)
        return "".join(reasoning), "".join(answer)

    def _harmony(self, reasoning: list[str], answer: list[str], final: bool) -> None:
        while self._buffer:
            if self._state == "start":  # a reply that opens with text, not a header, is answer text
                if not final and any(m.startswith(self._buffer) for m in _HARMONY_ALL):
                    return
                self._state = "header" if any(self._buffer.startswith(m) for m in _HARMONY_ALL) else "body"
                continue
            if self._state == "header":
                end = self._buffer.find("<|message|>")
                if end < 0:
                    if final:
                        self._buffer = ""
                    return
                self._open(self._buffer[:end])
                self._buffer, self._state = self._buffer[end + len("<|message|>"):], "body"
                continue
            end = self._buffer.find("<|end|>")  # body
            if end < 0:
                keep = 0 if final else _held_back(self._buffer, ("<|end|>",))
                self._emit(self._buffer[: len(self._buffer) - keep], reasoning, answer)
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return
            self._emit(self._buffer[:end], reasoning, answer)
            self._buffer, self._state, self._call = self._buffer[end + len("<|end|>"):], "header", None

    def _open(self, header: str) -> None:
        """A message's header (`<|start|>assistant<|channel|>final`, `... to=functions.f <|constrain|>json`)."""
        channel = header.split("<|channel|>", 1)[1] if "<|channel|>" in header else ""
        self._channel = channel.split("<|", 1)[0].split()[0] if channel.split() else "final"
        recipient = _RECIPIENT.search(header)
        self._call = None
        if recipient:
            self._call = ToolCallText(recipient.group(1), "")
            self.calls.append(self._call)

    def _emit(self, text: str, reasoning: list[str], answer: list[str]) -> None:
        if not text:
            return
        if self._call is not None:
            self._call.arguments += text
        elif self._channel == "analysis":
            reasoning.append(text)
        else:
            answer.append(text)

    # ---------------------------------------------------------------- think tags
    def _think(self, reasoning: list[str], answer: list[str], final: bool) -> None:
        while self._buffer:
            if self._state == "start":
                stripped = self._buffer.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self._buffer, self._state = stripped[len(THINK_OPEN):], "reasoning_start"
                elif not final and (not stripped or THINK_OPEN.startswith(stripped)):
                    return
                else:
                    self._state = "answer"
                continue
            if self._state == "reasoning":
                end = self._buffer.find(THINK_CLOSE)
                if end < 0:
                    keep = 0 if final else _held_back(self._buffer, (THINK_CLOSE,))
                    reasoning.append(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return
                reasoning.append(self._buffer[:end])
                self._buffer, self._state = self._buffer[end + len(THINK_CLOSE):], "answer_start"
                continue
            if self._state in ("reasoning_start", "answer_start"):  # blank lines after a tag are layout
                stripped = self._buffer.lstrip("\r\n")
                if not stripped and not final:
                    self._buffer = ""
                    return
                self._buffer, self._state = stripped, self._state.removesuffix("_start")
                continue
            answer.append(self._buffer)
            self._buffer = ""
