"""The OpenAI request bodies the server accepts, validated strictly (wrong types, unknown fields and
out-of-range numbers are 400s), and its error and response shapes."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

MAX_TOKENS_LIMIT = 1 << 20  # past any context: a larger number is refused outright
MAX_STOPS = 4  # as OpenAI's API


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
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


class CompletionRequest(_Common):
    prompt: str | list[int] = Field(..., min_length=1)


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(_Common):
    messages: list[Message] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)


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


def completion_body(rid: str, model: str, text: str, finish: str | None, chat: bool, chunk: bool,
                    use: dict[str, int] | None = None, first: bool = False) -> dict[str, Any]:
    """A completion (or one streamed chunk of it), text or chat shaped."""
    if chat:
        content: dict[str, Any] = {"role": "assistant", "content": text} if not chunk or first else {"content": text}
        choice = {"index": 0, ("delta" if chunk else "message"): content, "finish_reason": finish, "logprobs": None}
        obj = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    body: dict[str, Any] = {"id": rid, "object": obj, "created": int(time.time()), "model": model,
                            "choices": [choice]}
    if use is not None:
        body["usage"] = use
    return body
