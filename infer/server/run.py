"""Loading the model for the server and running uvicorn (what `ntransformer serve` calls)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from infer.server.app import Loaded, Server, create_app
from infer.tiers.config import StreamingConfig


def loader(model_path: str, device: str, ctx_size: int, max_batch: int, streaming: StreamingConfig,
           exact: bool = False):  # noqa: ANN201 - a Callable[[], Loaded]
    """The function the server calls (in a thread) to load the model: resident on the GPU or the
    CPU, or through the streaming engine, planned for `max_batch` caches of `ctx_size` positions."""

    def load() -> Loaded:
        from infer.chat import ChatTemplate, ChatTemplateError
        from infer.gguf_file import GGUFModel
        from infer.tokenizer import Tokenizer

        gguf = GGUFModel(model_path)
        tokenizer = Tokenizer.from_gguf(gguf.metadata)
        try:
            template: ChatTemplate | None = ChatTemplate.from_gguf(gguf.metadata, tokenizer)
        except ChatTemplateError:
            template = None
        title = gguf.metadata.get("general.name")
        close = lambda: None  # noqa: E731
        problem = lambda: None  # noqa: E731
        if streaming.enabled:
            from infer.tiers.session import build_streaming_engine

            session = build_streaming_engine(gguf, replace(streaming, batch=max_batch), ctx_size, device,
                                             enforce_budget=device == "gpu", exact=exact)
            model, close, problem = session.engine.model, session.close, session.problem
        elif device == "gpu":
            from infer.gpu import load_gpu_transformer

            model = load_gpu_transformer(gguf, ctx_size, streaming.vram_budget, batch=max_batch, enforce_budget=True)
        else:
            from infer.model import load_transformer

            model = load_transformer(gguf, exact=exact)
            model.weights.warm()  # type: ignore[attr-defined]
        return Loaded(model, tokenizer, template, Path(model_path).stem, close, str(title) if title else None,
                      problem)

    return load


def serve(server: Server, host: str, port: int) -> None:
    """Runs until Ctrl-C (SIGINT/SIGTERM): uvicorn stops accepting, waits for the requests in flight
    (up to the server's drain time), then the scheduler stops."""
    import uvicorn

    uvicorn.run(create_app(server), host=host, port=port, log_level="warning",
                timeout_graceful_shutdown=int(server.drain_seconds))
