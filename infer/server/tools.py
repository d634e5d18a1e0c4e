"""Tool calls: the tools a chat request offers reach the model through its chat template, and the
calls it writes come back as OpenAI `tool_calls`.

Two written forms are read, the ones the templates of the common open models teach:
- Hermes / Qwen 2.5 / Qwen 3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or more;
- Llama 3.x: the whole reply one JSON object `{"name": ..., "parameters": {...}}` (or "arguments").
A reply in neither form is plain content. A template that never mentions `tools` cannot show them to
the model: such a request is refused rather than answered as if no tools were offered.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it

    def body(self) -> dict[str, Any]:
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def _call(text: str, names: set[str]) -> ToolCall | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string already
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def parse_tool_calls(reply: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(the content outside the calls, or None when nothing is left; the calls) of a reply, for tools
    named `names`. A tagged call that does not parse, or names an unknown tool, stays in the content."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = 0
    for match in _TAGGED.finditer(reply):
        call = _call(match.group(1), names)
        if call is None:
            continue
        calls.append(call)
        kept.append(reply[last : match.start()])
        last = match.end()
    if calls:
        kept.append(reply[last:])
        content = "".join(kept).strip()
        return content or None, calls
    whole = _call(reply.strip(), names)
    if whole is not None:
        return None, [whole]
    return reply, []


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's tool calls as templates read them: arguments as an object (OpenAI
    sends a JSON string; the templates write `arguments | tojson`)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    shaped = []
    for call in calls:
        function = dict(call.get("function", {}))
        with contextlib.suppress(ValueError):  # else left as the client sent it
            function["arguments"] = json.loads(function.get("arguments") or "{}")
        shaped.append({**call, "function": function})
    return {**message, "tool_calls": shaped}
