"""Loading the model for the server and running uvicorn (what `ntransformer serve` calls)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from infer.server.app import Loaded, Server, create_app
from infer.tiers.config import StreamingConfig


def loader(model_path: str, device: str, ctx_size: int, max_batch: int, streaming: StreamingConfig,
           exact: bool = False, speculation: ServeSpeculation | None = None,
           gpus: list[int] | None = None):  # noqa: ANN201 - a Callable[[], Loaded]
    """The function the server calls (in a thread) to load the model: resident on the GPU or the
    CPU, or through the streaming engine, planned for `max_batch` caches of `ctx_size` positions.
    speculation: the draft model (loaded first, in the same budget) or prompt lookup. gpus: the
    layers split across these GPUs (infer.gpu.stages; a draft on the first, in its budget)."""

    def load() -> Loaded:
        from infer.chat import ChatTemplate, ChatTemplateError
        from infer.gguf_file import GGUFModel
        from infer.tokenizer import Tokenizer

        gguf = GGUFModel(model_path)
        tokenizer = Tokenizer.from_gguf(gguf.metadata)
        draft, planned, tree_nodes = None, None, 0
        if speculation is not None:
            from infer.tiers.stage_plan import parse_budgets

            budget = parse_budgets(streaming.vram_budget, len(gpus))[0] if gpus else streaming.vram_budget
            draft = speculation.load_draft(device, ctx_size, max_batch, budget, exact)
            account = getattr(draft, "account", None)
            planned = {"draft model": account.planned_total} if account is not None else None
            # every slot's tree in one pass: their logits stay on the device (within a pass's rows)
            tree_nodes = min(speculation.tree * max_batch, 512)
        try:
            template: ChatTemplate | None = ChatTemplate.from_gguf(gguf.metadata, tokenizer)
        except ChatTemplateError:
            template = None
        title = gguf.metadata.get("general.name")
        close = lambda: None  # noqa: E731
        problem = lambda: None  # noqa: E731
        if streaming.enabled and gpus:  # each stage streams its share over its own GPU's link
            from infer.tiers.staged_session import build_streaming_stages

            session = build_streaming_stages(gguf, replace(streaming, batch=max_batch), ctx_size, gpus,
                                             enforce_budget=True, planned=planned, tree_nodes=tree_nodes)
            model, close, problem = session.engine.model, session.close, session.problem
        elif streaming.enabled:
            from infer.tiers.session import build_streaming_engine

            session = build_streaming_engine(gguf, replace(streaming, batch=max_batch), ctx_size, device,
                                             enforce_budget=device == "gpu", exact=exact, planned=planned,
                                             tree_nodes=tree_nodes)
            session.warm()  # before the first request: the CPU's tier A, or a MoE's most used experts
            model, close, problem = session.engine.model, session.close, session.problem
        elif device == "gpu" and gpus:
            from infer.gpu.stages import load_gpu_stages
            from infer.tiers.stage_plan import parse_budgets

            model = load_gpu_stages(gguf, gpus, parse_budgets(streaming.vram_budget, len(gpus)), ctx_size,
                                    batch=max_batch, tree_nodes=tree_nodes, enforce_budget=True, planned=planned)
        elif device == "gpu":
            from infer.gpu import load_gpu_transformer

            model = load_gpu_transformer(gguf, ctx_size, streaming.vram_budget, batch=max_batch, enforce_budget=True,
                                         planned=planned, tree_nodes=tree_nodes)
        else:
            from infer.model import load_transformer

            model = load_transformer(gguf, exact=exact)
            model.weights.warm()  # type: ignore[attr-defined]
        pool = speculation.pool(model, draft, ctx_size) if speculation is not None else None
        return Loaded(model, tokenizer, template, Path(model_path).stem, close, str(title) if title else None,
                      problem, pool)

    return load


@dataclass(frozen=True)
class ServeSpeculation:
    """serve --draft-model FILE / --lookup: every request that can (infer.spec_serve.can_speculate)
    gets trees of up to `tree` nodes from a drafter of its slot's own, and one pass verifies the
    trees of all running requests."""

    draft_model: str | None
    tree: int
    shape: tuple[int, int] | None = None  # --draft-shape: the draft model's (depth, width); else chain_shape(tree)

    def load_draft(self, device: str, ctx_size: int, slots: int, vram_budget: str | None, exact: bool) -> Any:
        """The draft model (None for prompt lookup): resident, with room for a KV cache per slot
        (the CLI checked its vocabulary before the server listened: infer.cli_spec.check_draft)."""
        if self.draft_model is None:
            return None
        from infer.gguf_file import GGUFModel

        gguf = GGUFModel(self.draft_model)
        if device == "gpu":
            from infer.gpu import load_gpu_transformer

            return load_gpu_transformer(gguf, ctx_size, vram_budget, batch=slots, enforce_budget=True)
        from infer.model import load_transformer

        draft = load_transformer(gguf, exact=exact)
        draft.weights.warm()  # type: ignore[attr-defined]
        return draft

    def pool(self, target: Any, draft: Any, ctx_size: int) -> Any:
        """The speculators of the target's caches: a model drafter (its own draft cache) or prompt
        lookup for each."""
        from infer.cli_spec import chain_shape
        from infer.spec_serve import DraftPool
        from infer.speculative import LookupDrafter, ModelDrafter

        if draft is None:
            lookup = LookupDrafter(max_ngram=3, depth=max(1, self.tree - 1))  # no state: one for all
            return DraftPool(target, lambda: lookup, self.tree, ctx_size)
        depth, width = self.shape or chain_shape(self.tree)
        return DraftPool(target, lambda: ModelDrafter(draft, ctx_size, depth=depth, width=width), self.tree, ctx_size)


def serve(server: Server, host: str, port: int) -> None:
    """Runs until Ctrl-C (SIGINT/SIGTERM): uvicorn stops accepting, waits for the requests in flight
    (up to the server's drain time), then the scheduler stops."""
    import uvicorn

    uvicorn.run(create_app(server), host=host, port=port, log_level="warning",
                timeout_graceful_shutdown=int(server.drain_seconds))
