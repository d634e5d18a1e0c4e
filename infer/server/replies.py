"""A chat request's generated text as the message the client gets: a reasoning model's thinking
split off as `reasoning_content` (infer.reasoning), and the tool calls read from what is left
(infer.server.tools), or, in gpt-oss's harmony form, from the messages it addresses to a function.
"""

from __future__ import annotations

import json

from infer.reasoning import ReplySplitter
from infer.server.tools import ToolCall, parse_tool_calls


class ChatReply:
    """One chat request's reply. `form`: "harmony", "think" or None (the text is the content);
    `tools`: the offered functions' names (a streamed reply is then held to its end, as a call is
    only known to be one when complete); `opened`: the prompt ends inside the thinking."""

    def __init__(self, form: str | None, tools: set[str] | None = None, opened: bool = False) -> None:
        self.splitter = ReplySplitter(form, opened) if form else None
        self.tools = tools or set()

    @property
    def held(self) -> bool:
        return bool(self.tools)

    def push(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that this piece of the reply made certain."""
        return self.splitter.push(text) if self.splitter else ("", text)

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) left at the end of the reply."""
        return self.splitter.flush() if self.splitter else ("", "")

    def whole(self, text: str) -> tuple[str, str | None, list[ToolCall]]:
        """The whole reply: (reasoning, content or None when only calls are left, calls)."""
        reasoning, content = self.splitter.split(text) if self.splitter else ("", text)
        if not self.tools:
            return reasoning, content, []
        if self.splitter is not None and self.splitter.form == "harmony":
            calls = [ToolCall(c.name, _arguments(c.arguments)) for c in self.splitter.calls if c.name in self.tools]
            return reasoning, (content or None) if calls else content, calls
        kept, calls = parse_tool_calls(content, self.tools)
        return reasoning, kept, calls


def _arguments(text: str) -> str:
    """A harmony call's body as OpenAI's arguments string: compact JSON where it parses, else as written."""
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return text.strip()
