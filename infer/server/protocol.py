"""The OpenAI request bodies the server accepts, validated strictly (wrong types, unknown fields and
out-of-range numbers are 400s), and its error and response shapes.

Besides OpenAI's fields the bodies take llama-server's common extensions (top_k, min_p,
repeat_penalty, ignore_eos, a schema inside response_format). Unknown fields are refused, always:
a client then learns at once that a field it relies on does nothing here."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from infer.server.scheduler import TokenLogprob

MAX_TOKENS_LIMIT = 1 << 20  # past any context: a larger number is refused outright
MAX_STOPS = 4  # as OpenAI's API
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat (its legacy completions stop at 5)
MAX_LOGIT_BIAS = 1024  # entries in one logit_bias map


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`text`; `json_object` (any JSON object, or the object `schema` describes: llama-server's form);
    `json_schema` (OpenAI's: the schema under json_schema.schema)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")

    def schema_or_none(self) -> dict[str, Any] | None:
        """The schema the output must match; None for any JSON object. Only for the JSON types."""
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.schema_ is None:
                raise RequestError("response_format json_schema needs json_schema.schema", "response_format")
            return self.json_schema.schema_
        return self.schema_


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=1 << 20)  # llama-server's; 0 = off
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # llama-server's; 0 = off
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repeat_penalty: float = Field(1.0, gt=0.0, le=10.0)  # llama-server's; 1 = off
    repeat_last_n: int = Field(64, ge=-1, le=MAX_TOKENS_LIMIT)  # the penalties' window (llama-server's); -1: all
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> -100..100
    ignore_eos: bool = False  # llama-server's: generate to max_tokens through end-of-generation tokens
    response_format: ResponseFormat | None = None
    seed: int | None = Field(None, ge=-(1 << 63), le=(1 << 63) - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)
    user: str | None = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise RequestError(f"stop takes up to {MAX_STOPS} non-empty strings", "stop")
        return stops


    def bias(self, vocab_size: int) -> list[tuple[int, float]]:
        """logit_bias as (token id, bias) pairs, checked against the vocabulary."""
        pairs = []
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit() or int(key) >= vocab_size:
                raise RequestError(f"logit_bias keys are token ids in [0, {vocab_size}), not {key!r}", "logit_bias")
            if not -100.0 <= value <= 100.0:
                raise RequestError(f"logit_bias values lie in [-100, 100], not {value}", "logit_bias")
            pairs.append((int(key), value))
        if len(pairs) > MAX_LOGIT_BIAS:
            raise RequestError(f"logit_bias takes up to {MAX_LOGIT_BIAS} tokens", "logit_bias")
        return pairs

    def top_logprobs_asked(self) -> int | None:
        """How many alternatives each generated token's log-probability comes with; None: none asked."""
        return None


class CompletionRequest(_Common):
    prompt: str | list[int] = Field(..., min_length=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    # a part of another type carries its own fields (image_url, input_audio): checked_text names the type
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None

    def checked_text(self) -> str:
        if self.type != "text" or self.text is None:
            raise RequestError(f"a message part of type {self.type!r}: this model takes text parts only "
                               "({\"type\": \"text\", \"text\": ...})", "messages")
        return self.text


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str = "{}"


class ToolCallMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's earlier calls, replayed
    tool_call_id: str | None = None  # a tool result's call

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates know it: text parts joined, `developer` (OpenAI's newer
        name for the system role) as `system`."""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise RequestError(f"a {self.role} message needs content", "messages")
        content = self.content or ""
        text = content if isinstance(content, str) else "".join(p.checked_text() for p in content)
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        extra = {"name": self.name, "tool_call_id": self.tool_call_id}
        return out | {k: v for k, v in extra.items() if v is not None}


class Function(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: Function


class ChatRequest(_Common):
    messages: list[Message] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto"] | None = None  # "required" and a named function are refused
    parallel_tool_calls: bool | None = None
    # llama-server's: "auto" (its "deepseek" the same here) sends a reasoning model's thinking as
    # reasoning_content beside content; "none" leaves the reply whole (infer.reasoning). Default: the server's
    reasoning_format: Literal["auto", "deepseek", "none"] | None = None

    def offered_tools(self) -> list[dict[str, Any]]:
        """The tools to show the model (none when tool_choice is "none")."""
        if not self.tools or self.tool_choice == "none":
            return []
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def top_logprobs_asked(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    content: str
    add_special: bool = False  # a BOS where the model's tokenizer adds one
    parse_special: bool = True  # special tokens written in the text become those tokens
    with_pieces: bool = False  # each id with its text


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    tokens: list[int]


class RequestError(Exception):
    """A request the server refuses: status code, OpenAI error type and the offending field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code
        self.headers = headers or {}


def error_response(err: RequestError) -> JSONResponse:
    body = {"error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.code}}
    return JSONResponse(body, status_code=err.status, headers=err.headers)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, model: str, text: str | None, finish: str | None, chat: bool, chunk: bool,
                    use: dict[str, int] | None = None, first: bool = False,
                    logprobs: dict[str, Any] | None = None,
                    tool_calls: list[dict[str, Any]] | None = None, reasoning: str | None = None) -> dict[str, Any]:
    """A completion (or one streamed chunk of it), text or chat shaped; a chat reply's `reasoning`
    goes beside its content as reasoning_content (llama-server's field; a chunk of only reasoning
    has no content)."""
    if chat:
        content: dict[str, Any] = {"role": "assistant", "content": text} if not chunk or first else {"content": text}
        if reasoning:
            content["reasoning_content"] = reasoning
            if chunk and not text:
                content.pop("content")
        if tool_calls:  # a streamed delta numbers its calls
            content["tool_calls"] = [c | {"index": i} for i, c in enumerate(tool_calls)] if chunk else tool_calls
        choice = {"index": 0, ("delta" if chunk else "message"): content, "finish_reason": finish, "logprobs": logprobs}
        obj = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}
        obj = "text_completion"
    body: dict[str, Any] = {"id": rid, "object": obj, "created": int(time.time()), "model": model,
                            "choices": [choice]}
    if use is not None:
        body["usage"] = use
    return body


def _token_entry(text: bytes, logprob: float) -> dict[str, Any]:
    return {"token": text.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(text)}


def logprobs_body(entries: list[TokenLogprob], chat: bool, offset: int = 0) -> dict[str, Any]:
    """OpenAI's logprobs object for generated tokens: chat's `content` list, or the legacy
    completions' parallel lists (text_offset counted from `offset`, in characters)."""
    if chat:
        return {"content": [_token_entry(e.text, e.logprob) | {"top_logprobs": [_token_entry(t, lp) for t, lp in e.top]}
                            for e in entries], "refusal": None}
    texts = [e.text.decode("utf-8", errors="replace") for e in entries]
    offsets = [offset + sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    return {"tokens": texts, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.decode("utf-8", errors="replace"): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets}
