"""The OpenAI-compatible HTTP server (FastAPI on uvicorn) over the continuous-batching scheduler.

    / (a chat page), /v1/models, /v1/completions, /v1/chat/completions (stream: server-sent events),
    /tokenize, /detokenize (llama-server's), /health (loading / ready / failed), /metrics (Prometheus text)

The model loads in a thread after the server starts, so /health answers during a long load. With
an API key every /v1 request needs `Authorization: Bearer KEY` (else 401). Bad requests get 400 with
an OpenAI-style error body; a full server 503 with Retry-After; a client that disconnects frees its
slot at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from starlette.exceptions import HTTPException as StarletteHTTPException

from infer.chat import ChatTemplate
from infer.engine import Model
from infer.grammar import GrammarError, json_constraint
from infer.reasoning import reasoning_format
from infer.sampler import Sampler, SamplerConfig
from infer.server.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    RequestError,
    TokenizeRequest,
    _Common,
    completion_body,
    error_response,
    logprobs_body,
    new_id,
    usage,
)
from infer.server.replies import ChatReply
from infer.server.scheduler import Event, Job, QueueFull, Scheduler
from infer.server.tools import template_message
from infer.tokenizer import Tokenizer, TokenizerError

COMPLETION_DEFAULT_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
MAX_BODY_BYTES = 8 << 20
# /metrics labels requests by these paths; any other path is "other", so a client cannot grow the
# number of series (the server's memory) by asking for paths that do not exist
CHAT_PAGE = Path(__file__).with_name("static") / "chat.html"
ENDPOINTS = frozenset({"/", "/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize",
                       "/detokenize"})
KEYED = ("/v1/", "/tokenize", "/detokenize")  # paths that need the API key when one is set
KEEPALIVE_SECONDS = 10.0  # a stream that has nothing to send (queued for a slot) sends a comment this often
DISCONNECTED = "disconnected"  # the status label of a request whose client went away before its answer
log = logging.getLogger("uvicorn.error")  # uvicorn's own log: one line where it prints its own


@dataclass
class Loaded:
    """What the loader returns: the model, its tokenizer and chat template, and the cleanup."""

    model: Model
    tokenizer: Tokenizer
    template: ChatTemplate | None
    name: str  # the model's id: the file's stem, as llama-server reports it
    close: Callable[[], None] = lambda: None
    title: str | None = None  # the metadata's general.name, reported beside the id
    # why the weights can no longer be read (a tier C device taken away), or None while they can
    problem: Callable[[], str | None] = lambda: None
    # serve --draft-model/--lookup: each KV cache's speculator (infer.spec_serve.DraftPool), or None
    speculation: Callable[[Any], Any] | None = None


class Metrics:
    def __init__(self) -> None:
        disable_created_metrics()  # no *_created series: counts and times only
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ntransformer_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.tokens = Counter("ntransformer_tokens", "Tokens processed", ["kind"], registry=r)
        self.active = Gauge("ntransformer_active_requests", "Requests holding a KV cache slot", registry=r)
        self.queued = Gauge("ntransformer_queued_requests", "Requests waiting for a slot", registry=r)
        self.pass_seconds = Histogram("ntransformer_pass_seconds", "Time of one forward pass", registry=r,
                                      buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.batch_rows = Histogram("ntransformer_batch_rows", "Rows (tokens) in one pass", registry=r,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))
        self.batch_sequences = Gauge("ntransformer_batch_sequences", "Sequences in the last pass", registry=r)
        self.prefix_requests = Counter("ntransformer_prefix_cache_requests", "Admitted requests by whether they "
                                       "reused a cached prefix", ["result"], registry=r)
        self.prefix_tokens = Counter("ntransformer_prefix_cache_tokens", "Prompt tokens reused from a cached "
                                     "prefix or run", ["kind"], registry=r)
        self.draft_tokens = Gauge("ntransformer_draft_tokens", "Speculation: tree nodes drafted and the ones the "
                                  "target kept, since the start", ["kind"], registry=r)

    def on_admit(self, reused: int, computed: int) -> None:
        self.prefix_requests.labels("hit" if reused else "miss").inc()
        self.prefix_tokens.labels("reused").inc(reused)
        self.prefix_tokens.labels("computed").inc(computed)

    def on_pass(self, seconds: float, rows: int, sequences: int) -> None:
        self.pass_seconds.observe(seconds)
        self.batch_rows.observe(rows)
        self.batch_sequences.set(sequences)


class Server:
    """The state behind the endpoints: loading status, the scheduler once loaded, the key."""

    def __init__(self, load: Callable[[], Loaded], ctx_size: int, max_batch: int, queue_size: int,
                 api_key: str | None = None, drain_seconds: float = 30.0, prefix_cache: bool | None = None,
                 reasoning: str = "auto") -> None:
        self.load, self.ctx_size, self.max_batch, self.queue_size = load, ctx_size, max_batch, queue_size
        self.prefix_cache = prefix_cache
        self.reasoning = reasoning  # --reasoning-format: chat replies' thinking split off ("auto") or not ("none")
        self.reply_form: str | None = None  # the loaded model's reply form (infer.reasoning), None: plain text
        self.api_key, self.drain_seconds = api_key, drain_seconds
        self.status, self.failure = "loading", ""
        self.loaded: Loaded | None = None
        self.scheduler: Scheduler | None = None
        self.metrics = Metrics()
        self._loader: threading.Thread | None = None

    def start(self) -> None:
        self._loader = threading.Thread(target=self._load, name="model-load", daemon=True)
        self._loader.start()

    def _load(self) -> None:
        try:
            self.loaded = self.load()
            template = self.loaded.template
            self.reply_form = reasoning_format(template.source, self.loaded.tokenizer) if template else None
            self.scheduler = Scheduler(self.loaded.model, self.loaded.tokenizer, self.ctx_size, self.max_batch,
                                       self.queue_size, on_pass=self.metrics.on_pass, on_error=self._engine_failed,
                                       prefix_cache=self.prefix_cache, on_admit=self.metrics.on_admit,
                                       speculation=self.loaded.speculation)
            self.status = "ready"
        except Exception as err:  # reported by /health and every request; the server stays up
            self.status, self.failure = "failed", f"{type(err).__name__}: {err}"

    def _engine_failed(self, err: BaseException) -> None:
        """The scheduler stopped on an error (a tier C read failed): /health says why from now on,
        and the weights' resources (a tier C device) are released; the requests in flight already
        got the error."""
        self.status, self.failure = "failed", f"the engine failed: {type(err).__name__}: {str(err).splitlines()[0]}"
        if self.loaded is not None:
            self.loaded.close()
        # then the traceback to the server's log (where the failing allocation or read is), not to
        # clients: formatting it takes a while, and the release comes first
        log.error("engine failed, the server stays up unhealthy: %s", self.failure,
                  exc_info=(type(err), err, err.__traceback__))

    def health(self) -> tuple[str, str]:
        """(status, why): loading, ready or failed; a tier C device taken away fails a ready server."""
        if self.status == "ready" and self.loaded is not None:
            problem = self.loaded.problem()
            if problem:
                return "failed", problem
        return self.status, self.failure

    def stop(self) -> None:
        if self._loader is not None:
            self._loader.join()
        if self.scheduler is not None:
            self.scheduler.close(self.drain_seconds)
        if self.loaded is not None:
            self.loaded.close()

    def ready(self) -> tuple[Loaded, Scheduler]:
        if self.scheduler is not None and self.scheduler.error is not None:
            raise RequestError(self.failure or f"the engine failed: {self.scheduler.error}", status=500,
                               kind="server_error")
        if self.status != "ready" or self.loaded is None or self.scheduler is None:
            message = "the model is still loading" if self.status == "loading" else f"the model failed to load: {self.failure}"
            raise RequestError(message, status=503, kind="server_error", headers={"Retry-After": "5"})
        return self.loaded, self.scheduler

    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise RequestError("missing or wrong API key (Authorization: Bearer KEY)", status=401,
                               code="invalid_api_key")

    def job(self, body: _Common, prompt: list[int], default_tokens: int) -> Job:
        loaded, _ = self.ready()
        vocab = loaded.model.args.vocab_size
        if not prompt:
            raise RequestError("the prompt has no tokens", "prompt")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise RequestError(f"token ids must lie in [0, {vocab})", "prompt")
        room = self.ctx_size - len(prompt)
        asked = getattr(body, "max_completion_tokens", None) or body.max_tokens
        if room < 1 or (asked is not None and asked > room):
            raise RequestError(f"this server's context is {self.ctx_size} tokens; the prompt has {len(prompt)} and "
                               f"{asked or 1} more were asked for", "max_tokens", code="context_length_exceeded")
        seed = None if body.seed is None else body.seed & ((1 << 64) - 1)
        stop_ids = loaded.tokenizer.vocab.eog_ids
        bias = body.bias(vocab)
        if body.ignore_eos:  # llama-server's rule: end-of-generation tokens are banned, not just ignored
            bias += [(token, float("-inf")) for token in sorted(stop_ids)]
            stop_ids = frozenset()
        # the penalties count over the last repeat_last_n tokens of prompt and reply, as llama-server's
        config = SamplerConfig(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, min_p=body.min_p,
                               repeat_penalty=body.repeat_penalty, repeat_last_n=body.repeat_last_n,
                               frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty,
                               logit_bias=tuple(bias), seed=seed)
        constraint = None
        if body.response_format is not None and body.response_format.type != "text":
            try:
                constraint = json_constraint(loaded.tokenizer, body.response_format.schema_or_none())
            except GrammarError as err:
                raise RequestError(str(err), "response_format") from None
        return Job(prompt=prompt, max_tokens=asked or min(default_tokens, room), sampler=Sampler(config, constraint),
                   stop_ids=stop_ids, stop=body.stops(), loop=asyncio.get_running_loop(),
                   top_logprobs=body.top_logprobs_asked())


def create_app(server: Server) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        server.start()
        yield
        await asyncio.to_thread(server.stop)  # Ctrl-C: uvicorn drained the requests, then this

    app = FastAPI(title="ntransformer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    m = server.metrics

    @app.middleware("http")
    async def gate(request: Request, call_next: Callable) -> Response:
        """The API key and the body size are checked before the body is read or validated."""
        try:
            if request.url.path.startswith(KEYED):
                server.check_key(request)
            if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
                raise RequestError(f"request body over {MAX_BODY_BYTES} bytes", status=413)
        except ValueError:
            return error_response(RequestError("bad Content-Length"))
        except RequestError as err:
            m.requests.labels(_endpoint(request), str(err.status)).inc()
            return error_response(err)
        return await call_next(request)

    @app.exception_handler(RequestError)
    async def refused(request: Request, err: RequestError) -> JSONResponse:
        m.requests.labels(_endpoint(request), str(err.status)).inc()
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {"msg": "invalid request", "loc": ()}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
        m.requests.labels(_endpoint(request), "400").inc()
        return error_response(RequestError(f"{where or 'body'}: {first.get('msg')}", where))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        m.requests.labels(_endpoint(request), str(err.status_code)).inc()
        return error_response(RequestError(str(err.detail), status=err.status_code))

    @app.exception_handler(Exception)
    async def failed(request: Request, err: Exception) -> JSONResponse:
        m.requests.labels(_endpoint(request), "500").inc()
        return error_response(RequestError(f"internal error: {type(err).__name__}: {err}", status=500,
                                           kind="server_error"))

    @app.get("/")
    async def chat_page() -> HTMLResponse:
        """The chat page: static HTML and script that talk to /v1/chat/completions from the browser."""
        return HTMLResponse(CHAT_PAGE.read_text(encoding="utf-8"))

    @app.get("/health")
    async def health() -> JSONResponse:
        status, why = server.health()
        body = {"status": status} | ({"error": why} if why else {})
        return JSONResponse(body, status_code=200 if status == "ready" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        if server.scheduler is not None:
            m.active.set(server.scheduler.busy_slots)
            m.queued.set(server.scheduler.queued)
            m.draft_tokens.labels("drafted").set(server.scheduler.stats.draft_tokens)
            m.draft_tokens.labels("accepted").set(server.scheduler.stats.accepted_tokens)
        return PlainTextResponse(generate_latest(m.registry).decode(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        loaded, _ = server.ready()
        entry = {"id": loaded.name, "object": "model", "created": 0, "owned_by": "nvmedirect"}
        return JSONResponse({"object": "list", "data": [entry | ({"name": loaded.title} if loaded.title else {})]})

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        loaded, _ = server.ready()
        prompt = body.prompt if isinstance(body.prompt, list) else _encode(loaded, body.prompt, "prompt")
        return await _run(request, body, server.job(body, prompt, COMPLETION_DEFAULT_TOKENS), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatRequest) -> Response:
        loaded, _ = server.ready()
        if loaded.template is None:
            raise RequestError("this model has no chat template", "messages")
        tools = body.offered_tools()
        if tools and "tools" not in loaded.template.source:
            raise RequestError("this model's chat template does not take tools, so it cannot be shown them", "tools")
        messages = [template_message(x.for_template()) for x in body.messages]
        try:
            text = loaded.template.render(messages, add_generation_prompt=True, **({"tools": tools} if tools else {}))
        except ValueError as err:
            raise RequestError(str(err), "messages") from None
        bos = loaded.tokenizer.vocab.add_bos and not (loaded.template.bos_token and
                                                        text.startswith(loaded.template.bos_token))
        prompt = _encode(loaded, text, "messages", add_bos=bos)
        names = {t["function"]["name"] for t in tools}
        job = server.job(body, prompt, server.ctx_size)
        form = server.reply_form
        job.special_text = form == "harmony"  # its markers are control tokens: written out, then parsed (or sent raw)
        if (body.reasoning_format or server.reasoning) == "none":
            form = None
        opened = form == "think" and text.rstrip().endswith("<think>")
        return await _run(request, body, job, chat=True, reply=ChatReply(form, names, opened))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        loaded, _ = server.ready()
        tokenizer = loaded.tokenizer
        try:
            ids = tokenizer.encode(body.content, add_bos=body.add_special and tokenizer.vocab.add_bos,
                                   special=body.parse_special)
        except TokenizerError as err:
            raise RequestError(f"content: {err}", "content") from None
        if not body.with_pieces:
            return JSONResponse({"tokens": ids})
        pieces = [{"id": i, "piece": tokenizer.token_bytes(i, special=True).decode("utf-8", errors="replace")}
                  for i in ids]
        return JSONResponse({"tokens": pieces})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        loaded, _ = server.ready()
        vocab = loaded.tokenizer.vocab_size
        if any(not 0 <= i < vocab for i in body.tokens):
            raise RequestError(f"token ids must lie in [0, {vocab})", "tokens")
        return JSONResponse({"content": loaded.tokenizer.decode(body.tokens, special=True)})

    async def _run(request: Request, body: _Common, job: Job, chat: bool, reply: ChatReply | None = None) -> Response:
        loaded, scheduler = server.ready()
        try:
            scheduler.submit(job)
        except QueueFull as err:
            raise RequestError(f"the server is busy: {err}", status=503, kind="server_error",
                               headers={"Retry-After": "1"}) from None
        rid, endpoint = new_id("chatcmpl" if chat else "cmpl"), _endpoint(request)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            m.requests.labels(endpoint, "200").inc()
            events = _events(scheduler, job, rid, loaded.name, chat, include_usage, reply)
            return StreamingResponse(events,
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        collected = await _collect(request, scheduler, job)
        if collected is None:  # nobody is left to answer: counted apart, no traceback, no 500
            m.requests.labels(endpoint, DISCONNECTED).inc()
            log.info("%s %s: the client went away before the answer; its request was cancelled", endpoint, rid)
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        text, finish = collected
        m.requests.labels(endpoint, "200").inc()
        _count(job)
        logprobs = None if job.top_logprobs is None else logprobs_body(job.logprobs, chat)
        reasoning, content, calls = reply.whole(text) if reply else ("", text, [])
        return JSONResponse(completion_body(rid, loaded.name, content, "tool_calls" if calls else finish, chat, False,
                                            usage(len(job.prompt), len(job.generated)), logprobs=logprobs,
                                            tool_calls=[c.body() for c in calls], reasoning=reasoning))

    def _count(job: Job) -> None:
        m.tokens.labels("prompt").inc(len(job.prompt))
        m.tokens.labels("generated").inc(len(job.generated))

    async def _collect(request: Request, scheduler: Scheduler, job: Job) -> tuple[str, str] | None:
        """The whole completion; a client that disconnects meanwhile (waiting for a slot or while
        its tokens come) cancels its job, and the answer is None."""
        gone = asyncio.ensure_future(_disconnected(request))
        pieces: list[str] = []
        try:
            while True:
                get = asyncio.ensure_future(job.events.get())
                done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    return None
                event: Event = get.result()
                if event.error and event.status < 500:
                    raise RequestError(event.error, status=event.status)
                if event.error:
                    raise RequestError(f"the engine failed: {event.error}", status=500, kind="server_error")
                pieces.append(event.text)
                if event.finish_reason:
                    return "".join(pieces), event.finish_reason
        finally:
            gone.cancel()
            if job.finish_reason is None:
                scheduler.cancel(job)

    async def _events(scheduler: Scheduler, job: Job, rid: str, name: str, chat: bool,
                      include_usage: bool, reply: ChatReply | None = None) -> AsyncIterator[str]:
        """The stream's events: a chat reply's pieces as reasoning and content deltas (`reply`).
        With tools the reply is held back until it ends (a call is only known to be one when it is
        complete), then sent as its reasoning, content and calls."""
        try:
            first, sent_chars, held = True, 0, []
            get = asyncio.ensure_future(job.events.get())
            while True:
                done, _ = await asyncio.wait({get}, timeout=KEEPALIVE_SECONDS)
                if not done:  # queued for a slot, or a long prompt: keep the connection (and proxies) alive
                    yield ": keep-alive\n\n"
                    continue
                event: Event = get.result()
                get = asyncio.ensure_future(job.events.get())
                if event.error:
                    kind = "server_error" if event.status >= 500 else "invalid_request_error"
                    message = event.error if event.status < 500 else f"the engine failed: {event.error}"
                    yield _sse({"error": {"message": message, "type": kind}})
                    return
                if reply and reply.held and not event.finish_reason:
                    held.append(event)
                    continue
                if reply and reply.held:
                    reasoning, content, calls = reply.whole("".join(e.text for e in held) + event.text)
                    lps = [lp for e in [*held, event] for lp in e.logprobs]
                    logprobs = logprobs_body(lps, chat) if job.top_logprobs is not None else None
                    yield _sse(completion_body(rid, name, content, "tool_calls" if calls else event.finish_reason, chat,
                                               True, first=True, logprobs=logprobs,
                                               tool_calls=[c.body() for c in calls], reasoning=reasoning))
                    break
                reasoning, text = reply.push(event.text) if reply else ("", event.text)
                if event.finish_reason and reply:
                    more = reply.finish()
                    reasoning, text = reasoning + more[0], text + more[1]
                if text or reasoning or event.finish_reason or (chat and first) or event.logprobs:
                    logprobs = None
                    if job.top_logprobs is not None:
                        logprobs = logprobs_body(event.logprobs, chat, sent_chars)
                    yield _sse(completion_body(rid, name, text, event.finish_reason, chat, True, first=first,
                                               logprobs=logprobs, reasoning=reasoning))
                    first, sent_chars = False, sent_chars + len(event.text)
                if event.finish_reason:
                    break
            _count(job)
            if include_usage:
                body = completion_body(rid, name, "", None, chat, True, usage(len(job.prompt), len(job.generated)))
                body["choices"] = []
                yield _sse(body)
            yield "data: [DONE]\n\n"
        finally:  # the client disconnected (the stream was cancelled) or it ended
            get.cancel()
            if job.finish_reason is None:
                scheduler.cancel(job)

    return app


def _endpoint(request: Request) -> str:
    """The /metrics label of a request's path: the path itself for the server's endpoints, "other"
    for anything else."""
    return request.url.path if request.url.path in ENDPOINTS else "other"


def _encode(loaded: Loaded, text: str, param: str, add_bos: bool | None = None) -> list[int]:
    """Token ids of a request's text; text the tokenizer refuses (a lone surrogate such as "\\ud800"
    in the JSON) is the client's error: 400 naming the field."""
    try:
        return loaded.tokenizer.encode(text, add_bos=add_bos, special=True)
    except TokenizerError as err:
        raise RequestError(f"{param}: {err}", param) from None


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"
