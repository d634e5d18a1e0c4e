"""`ntransformer --draft-model FILE` / `--lookup`: generation with speculative decoding (one target
pass verifies a tree of drafted tokens, infer/speculative.py), for one sequence on the resident or
the streaming engine. Output is the target's own, token for token.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from typing import Any

import click

DEFAULT_TREE_RESIDENT = 9  # --lookup: up to 8 tokens below the root
DEFAULT_TREE_STREAMING = 33  # --lookup with --streaming: a streamed pass costs about the same up to hundreds
# --draft-model without --draft-tree: the draft's chain with leaf siblings, its depth chosen by the
# run's own measurements (infer.spec_tuner.ShapeTuner), starting here, within TUNED_NODES (the
# verification pass planned for it). The width stays 4: on the H200 (2026-12-03, the real pair, target
# half streamed) the tuner free to choose widths 1-8 settled on 2-3 and gave 2.54x on code and 1.36x
# on prose, where fixed 16x4 gave 2.79x and 4x4 1.66x (docs/SPECULATIVE.md).
START_DEPTH_RESIDENT, START_DEPTH_STREAMING, MAX_DEPTH = 4, 12, 32
START_WIDTH, MAX_WIDTH, TUNED_NODES = 4, 4, 65


@dataclass(frozen=True)
class SpecOptions:
    draft_model: str | None = None
    tree: int | None = None
    lookup: bool = False
    self_spec: bool = False
    draft_k: int | None = None
    skip_threshold: float | None = None
    skip_text: str | None = None

    @property
    def self_draft(self) -> bool:
        """Drafting with the target's own layers (--self-spec and/or --skip-threshold)."""
        return self.self_spec or self.skip_threshold is not None

    @property
    def active(self) -> bool:
        return bool(self.draft_model or self.lookup or self.self_draft)

    def problem(self) -> str | None:
        """A combination of flags that cannot run, in one line, or None."""
        if self.draft_model and self.self_draft:
            return "--draft-model and --self-spec/--skip-threshold are two drafters: choose one"
        if self.lookup and self.self_draft:
            return "--lookup and --self-spec/--skip-threshold are two drafters: choose one"
        if self.draft_k is not None and not self.self_draft:
            return "--draft-k sets the self-draft's depth: use it with --self-spec or --skip-threshold"
        if self.skip_text and self.skip_threshold is None:
            return "--skip-text calibrates --skip-threshold: give the threshold too"
        if self.tree is not None and not (self.draft_model or self.lookup):
            return ("--draft-tree sizes the tree of --draft-model or --lookup"
                    + (" (the self-draft's depth is --draft-k)" if self.self_draft else ": add one of them"))
        return None


def spec_options(func: Any) -> Any:
    """--draft-model, --draft-tree and --lookup, given to the command as `spec: SpecOptions`."""
    import functools

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        kwargs["spec"] = SpecOptions(kwargs.pop("draft_model"), kwargs.pop("draft_tree"), kwargs.pop("lookup"),
                                     kwargs.pop("self_spec"), kwargs.pop("draft_k"), kwargs.pop("skip_threshold"),
                                     kwargs.pop("skip_text"))
        return func(*args, **kwargs)

    for option in reversed([
        click.option("--draft-model", type=click.Path(), help="Speculative decoding: a small model with the same "
                     "vocabulary drafts a tree of tokens that one target pass verifies (output unchanged)."),
        click.option("--draft-tree", type=click.IntRange(min=1), default=None,
                     help="Nodes of the draft tree, fixed (default with --draft-model: a chain with leaf "
                          "siblings whose depth and width are chosen from the run's measured pass times and "
                          f"acceptance, up to {TUNED_NODES} nodes; with "
                          f"--lookup {DEFAULT_TREE_RESIDENT}, {DEFAULT_TREE_STREAMING} with --streaming)."),
        click.option("--lookup", is_flag=True, help="Speculative decoding from n-gram matches in the prompt and "
                     "the output so far (no draft model)."),
        click.option("--self-spec", is_flag=True, help="Speculative decoding drafted by the target's resident layers "
                     "only (no streamed layer read while drafting; output unchanged). Usually a weak draft: "
                     "docs/SPECULATIVE.md."),
        click.option("--draft-k", type=click.IntRange(1, 64), default=None,
                     help="Tokens the self-draft proposes per pass (default 4)."),
        click.option("--skip-threshold", type=click.FloatRange(0.0, 1.0, min_open=True), default=None,
                     help="Self-draft leaving out the layers whose output is nearly their input (mean cosine "
                          "similarity >= T on a calibration text; streamed layers are always left out)."),
        click.option("--skip-text", type=click.Path(exists=True, dir_okay=False),
                     help="Calibration text for --skip-threshold (default: a built-in passage of prose and code)."),
    ]):
        wrapper = option(wrapper)
    return wrapper


def check_vocabulary(target: Any, draft: Any, draft_path: str) -> None:
    """The draft must map ids to the same tokens as the target, else its proposals mean nothing."""
    a, b = target.vocab.tokens, draft.vocab.tokens
    if a != b:
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        raise ValueError(f"{draft_path}: the draft's vocabulary differs from the target's ({len(b)} vs {len(a)} "
                         f"tokens, first difference at id {first}): it cannot draft for this model")


def check_draft(model: str, draft_model: str) -> None:
    """Bad input exits 2 with one line before anything loads: an architecture we cannot run (the
    target's, then the draft's), then a draft whose vocabulary is not the target's."""
    from infer import cli as c
    from infer.arch import ModelArgs
    from infer.errors import ModelError
    from infer.gguf_file import GGUFModel
    from infer.tokenizer import Tokenizer

    try:
        for path in (model, draft_model):
            ModelArgs.from_gguf(GGUFModel(path))
        check_vocabulary(Tokenizer.from_gguf(GGUFModel(model).metadata),
                         Tokenizer.from_gguf(GGUFModel(draft_model).metadata), draft_model)
    except (ValueError, ModelError) as err:
        c._fail(str(err), c.EXIT_BAD_INPUT)


def drafter(spec: SpecOptions, draft: Any, ctx: int, tree: int) -> Any:
    """The drafter for a tree of `tree` nodes; `draft` an LLM whose KV cache (counted in the budget)
    the drafter uses."""
    from infer.speculative import LookupDrafter, ModelDrafter

    if spec.draft_model:
        depth, width = chain_shape(tree)
        return ModelDrafter(draft.transformer, ctx, depth=depth, width=width, cache=draft.engine.cache)
    return LookupDrafter(max_ngram=3, depth=max(1, tree - 1))


def chain_shape(tree: int) -> tuple[int, int]:
    """(depth, width) of a draft model's chain with leaf siblings for a tree of `tree` nodes."""
    depth = max(1, min(16, (tree - 1) // 2 if tree <= 9 else (tree - 1) // 4))
    return depth, max(1, (tree - 1) // depth)


def tuned(spec: SpecOptions, streaming: bool) -> Any:
    """The tree-shape tuner for --draft-model without --draft-tree, else None."""
    from infer.spec_tuner import ShapeTuner

    if not spec.draft_model or spec.tree is not None:
        return None
    return ShapeTuner(START_DEPTH_STREAMING if streaming else START_DEPTH_RESIDENT, MAX_DEPTH, START_WIDTH,
                      MAX_WIDTH, TUNED_NODES, min_width=START_WIDTH)


def generate(target: Any, cache: Any, tokenizer: Any, spec: SpecOptions, draft: Any, ctx: int, tree: int,
             prompt: str, n_predict: int, sampler_config: Any, benchmark: bool, as_json: bool,
             note: Any, tuner: Any = None, drafting: Any = None) -> dict[str, Any]:
    """Generates with a Speculator on the target's KV cache `cache` (the one its budget planned) and
    prints the text (or JSON), then its statistics."""
    from infer.sampler import Sampler
    from infer.speculative import Speculator
    from infer.tokenizer import StreamDecoder

    ids = tokenizer.encode(prompt)
    if not ids:
        raise ValueError("the prompt is empty after tokenization")
    if tuner is not None:
        tree = tuner.max_nodes  # the tuner picks the tree's depth and width within it
    if drafting is None:
        drafting = drafter(spec, draft, ctx, tree)
    if tuner is not None:
        drafting.depth, drafting.width = tuner.depth, tuner.width
    spec_run = Speculator(target, drafting, tree, ctx, tuner=tuner)
    decoder = StreamDecoder(tokenizer)
    is_end = (lambda _: False) if benchmark else tokenizer.is_eog
    out: list[int] = []
    pieces: list[str] = []
    began = time.perf_counter()
    for token in spec_run.generate(ids, n_predict, Sampler(sampler_config), is_end, cache):
        if is_end(token):
            break
        out.append(token)
        pieces.append(decoder.push(token))
        if not as_json and not benchmark:
            click.echo(pieces[-1], nl=False)
            sys.stdout.flush()
    seconds = time.perf_counter() - began
    pieces.append(decoder.flush())
    s = spec_run.stats
    result = {"prompt": prompt, "ids": out, "text": "".join(pieces), "tree_nodes": tree,
              "drafter": "model" if spec.draft_model else "self" if spec.self_draft else "lookup", "tok_s": round(len(out) / seconds, 3),
              "speculation": s.as_dict()}
    if as_json:
        click.echo(json.dumps(result))
    elif not benchmark:
        click.echo(pieces[-1])
    depths = ", ".join(f"{d}: {v:.2f}" for d, v in s.as_dict()["acceptance_by_depth"].items())  # type: ignore[union-attr]
    if tuner is not None:
        result["tuned_depth"], result["tuned_width"] = tuner.depth, tuner.width
        note(f"draft tree chosen from this run's measurements: depth x width {tuner.describe()}")
    shape = f"trees tuned up to {tree} nodes" if tuner is not None else f"trees of {tree} nodes"
    note(f"speculation ({result['drafter']}, {shape}): {len(out)} tokens in {s.passes} target passes = "
         f"{s.tokens_per_pass:.2f} tokens per pass; accepted per pass by depth {{{depths}}}; draft "
         f"{s.draft_seconds:.2f} s, verify {s.verify_seconds:.2f} s; {result['tok_s']} tok/s")
    return result


def run(model: str | None, spec: SpecOptions, streaming: Any, ctx_size: int, device: str, prompt: str,
        n_predict: int, sampler: Any, chat: bool, benchmark: bool, exact: bool, as_json: bool,
        gpus: list[int] | None = None) -> None:
    """--draft-model / --lookup: one sequence, each target pass verifying a tree of drafted tokens.
    Bad input is one line and exit 2 (infer.cli's conventions). gpus: the target split across these
    GPUs (infer.gpu.stages), the draft on the first."""
    from infer import cli as c
    from infer.errors import ModelError
    from infer.tokenizer import TokenizerError

    if spec.problem():
        c._fail(spec.problem(), c.EXIT_BAD_INPUT)  # type: ignore[arg-type]
    if chat:
        c._fail("--chat with speculative decoding is not supported yet: drop --draft-model/--lookup", c.EXIT_BAD_INPUT)
    if streaming.batch > 1 or streaming.prompts_file:
        c._fail("speculative decoding runs one sequence: drop --batch/--prompts (or --draft-model/--lookup)",
                c.EXIT_BAD_INPUT)
    if not model:
        c._fail("no model given: use -m/--model FILE.gguf", c.EXIT_BAD_INPUT)

    where = c._resolve_device(device)
    c._warn_experts_on_cpu(where, streaming.experts)
    if where == "cpu" and not cpu_speculation_allowed(model, exact, streaming.enabled):
        c._fail(CPU_NEEDS_EXACT, c.EXIT_BAD_INPUT)
    if spec.draft_model:  # before anything loads: a draft with another vocabulary is bad input
        check_draft(model, spec.draft_model)
    with c._storage_errors(), c._device_errors(where):
        draft = None
        if spec.draft_model:  # resident, inside the budget
            from infer.tiers.stage_plan import parse_budgets

            budget = parse_budgets(streaming.vram_budget, len(gpus))[0] if gpus else streaming.vram_budget
            draft = c._load(spec.draft_model, ctx_size, where, budget)  # on the first GPU (infer.cli._gpus)
        planned = {"draft model": draft.transformer.account.planned_total} if draft is not None and where == "gpu" \
            else None  # type: ignore[attr-defined]
        tree = spec.tree or (DEFAULT_TREE_STREAMING if streaming.enabled else DEFAULT_TREE_RESIDENT)
        if spec.self_draft:
            tree = 1 + (spec.draft_k or SELF_DRAFT_K)
        # the verification pass holds the whole tree (tuned trees: up to TUNED_NODES)
        nodes = max(tree, TUNED_NODES) if tuned(spec, streaming.enabled) is not None else tree
        if spec.self_draft and where == "gpu":  # the self-draft's own KV cache, in the same budget
            planned = {"self-draft KV cache": _self_draft_kv_bytes(model, ctx_size, max(512, nodes))}
        try:
            if streaming.enabled:
                streaming = _speculation_cpu_tier(streaming, where)
                from infer.arch import ModelArgs
                from infer.gguf_file import GGUFModel
                from infer.tiers.session import build_streaming_engine
                from infer.tokenizer import Tokenizer

                gguf = GGUFModel(model)
                tokenizer = Tokenizer.from_gguf(gguf.metadata)
                context = ctx_size or min(_context(gguf), 4096)
                c._context_note(ModelArgs.from_gguf(gguf), context, model)
                if gpus:  # the target's stages each streaming their share (infer.tiers.staged_session)
                    from infer.tiers.staged_session import build_streaming_stages

                    session = build_streaming_stages(gguf, streaming, context, gpus, prefill_chunk=max(512, nodes),
                                                     enforce_budget=True, planned=planned, tree_nodes=nodes)
                else:
                    session = build_streaming_engine(gguf, streaming, context, where, prefill_chunk=max(512, nodes),
                                                     enforce_budget=where == "gpu", planned=planned, tree_nodes=nodes,
                                                     exact=exact)
                c._note(session.report())
                with c._progress(f"loading {gguf.path.name}", 0, session.warm_unit) as advance:
                    session.warm(advance)
                target, cache, closer = session.engine.model, None, session.close
            else:
                llm = c._load(model, ctx_size, where, streaming.vram_budget, exact, planned=planned, tree_nodes=nodes,
                              gpus=gpus, experts=streaming.experts)
                target, tokenizer, context, closer = llm.transformer, llm.tokenizer, llm.engine.ctx_size, None
                cache = llm.engine.cache  # the one cache its budget planned
            try:
                drafting = self_drafter(spec, model, target, tokenizer, context, c._note) if spec.self_draft else None
                generate(target, cache, tokenizer, spec, draft, context, tree, prompt, n_predict, sampler, benchmark,
                         as_json, c._note, tuner=tuned(spec, streaming.enabled), drafting=drafting)
            finally:
                if closer is not None:
                    closer()
        except TokenizerError as err:
            c._fail(f"{model}: tokenizer: {err}", c.EXIT_BAD_INPUT)
        except (ValueError, ModelError) as err:
            c._fail(str(err), c.EXIT_BAD_INPUT)


SELF_DRAFT_K = 4  # --draft-k's default
# The NumPy float32 engine sums a pass's rows in an order that depends on how many the pass holds
# (a tree pass and a plain pass give a position logits up to ~0.9 apart on SmolLM2 Q4_0), so the
# text of a speculative run would drift from plain decoding. The packed engine (native kernels, the
# CPU's default where they are built) and the float64 one (--exact) do not depend on the batch, and
# there the output is plain decoding's, token for token: speculation on the CPU runs on those.
CPU_NEEDS_EXACT = ("speculative decoding on the CPU needs an engine whose logits do not depend on how many tokens a "
                   "pass holds, or the text would differ from plain decoding: the packed native engine (the default "
                   "where the native kernels are built; not --streaming, files with a matrix type the kernels do not "
                   "take, or NVMEDIRECT_CPU_PRODUCTS=numpy) or --exact")


def cpu_speculation_allowed(model: str, exact: bool, streamed: bool) -> bool:
    """Whether speculation on the CPU keeps plain decoding's text (CPU_NEEDS_EXACT says when)."""
    from infer.errors import ModelError
    from infer.gguf_file import GGUFModel
    from infer.packed_weights import batch_invariant, native_products_requested

    if exact:
        return True
    if streamed or not native_products_requested():
        return False
    try:
        return batch_invariant(GGUFModel(model))
    except (OSError, ModelError):
        return True  # a file that does not load: the load says why, in its own words


def _args_and_ctx(model: str, ctx_size: int) -> tuple[Any, int]:
    """The model's ModelArgs and the context its run plans for (-c, else min(its own, 4096))."""
    from infer.arch import ModelArgs
    from infer.gguf_file import GGUFModel

    args = ModelArgs.from_gguf(GGUFModel(model))
    return args, ctx_size or min(args.context_length, 4096)


def _self_draft_kv_bytes(model: str, ctx_size: int, pass_rows: int) -> int:
    """The self-draft's cache: one sequence's keys, values and token history, for passes of at most
    pass_rows rows (the target's)."""
    args, ctx = _args_and_ctx(model, ctx_size)
    return args.kv_cache_nbytes(ctx, pass_rows) + 4 * (ctx + 1)


def self_drafter(spec: SpecOptions, model_path: str, target: Any, tokenizer: Any, ctx: int, note: Any) -> Any:
    """The --self-spec / --skip-threshold drafter: the target's own weights with layers left out
    (infer.layerskip), drafting a chain of --draft-k tokens with its own KV cache."""
    from infer.layerskip import CALIBRATION_TEXT, layer_similarity, self_draft_layers, skipping
    from infer.speculative import ModelDrafter

    similarity = None
    if spec.skip_threshold is not None:
        text = CALIBRATION_TEXT
        if spec.skip_text:
            with open(spec.skip_text, encoding="utf-8") as f:
                text = f.read()
        ids = tokenizer.encode(text)[:512]
        cpu = target
        if getattr(target, "device", "cpu") != "cpu" or getattr(target, "skip", None) is None:
            from infer.gguf_file import GGUFModel
            from infer.model import load_transformer

            cpu = load_transformer(GGUFModel(model_path))  # the calibration runs on the CPU engine
        similarity = layer_similarity(cpu, ids)
    skip = self_draft_layers(target, similarity, spec.skip_threshold, spec.self_spec)
    kept = target.args.n_layers - len(skip)
    how = f"similarity >= {spec.skip_threshold} on {len(ids)} calibration tokens" if similarity is not None else ""
    note(f"self-draft: {kept} of {target.args.n_layers} layers (left out: {sorted(skip) or 'none'}"
         f"{'; ' + how if how else ''}{'; the streamed ones' if spec.self_spec or similarity is not None else ''})")
    view = skipping(target, skip)
    return ModelDrafter(view, ctx, depth=spec.draft_k or SELF_DRAFT_K, width=1, cache=view.new_cache(ctx))


def _context(gguf: Any) -> int:
    from infer.arch import ModelArgs

    return ModelArgs.from_gguf(gguf).context_length


def _speculation_cpu_tier(streaming: Any, where: str) -> Any:
    """The CPU tier for a speculative run: off unless --cpu-tier was given. Its trees stream anyway
    (they are larger than the passes the CPU takes), and a pass the CPU computes has logits about 1%
    off the GPU's, so a small tree taken by the CPU could make the text differ from plain decoding's.
    Given explicitly, it is kept and the note says so."""
    import dataclasses

    if where != "gpu" or streaming.cpu_tier == "off":
        return streaming
    source = click.get_current_context().get_parameter_source("cpu_tier")
    if source in (None, click.core.ParameterSource.DEFAULT):
        from infer import cli as c

        c._note("speculation: --cpu-tier off (its trees stream; a pass on the CPU could change the text; "
                "--cpu-tier auto keeps the CPU for passes of few tokens)")
        return dataclasses.replace(streaming, cpu_tier="off")
    return streaming


def parse_draft_shape(text: str | None) -> tuple[int, int] | None:
    """serve --draft-shape DEPTHxWIDTH (e.g. 12x1: a chain of 12, no leaves) as (depth, width);
    ValueError naming what is wrong."""
    if text is None:
        return None
    depth, sep, width = text.lower().partition("x")
    if not sep or not depth.isdigit() or not width.isdigit() or int(depth) < 1 or int(width) < 1:
        raise ValueError(f"--draft-shape takes DEPTHxWIDTH with both at least 1 (e.g. 12x1 or 4x4), not {text!r}")
    return int(depth), int(width)


def serve_speculation(model: str, draft_model: str | None, lookup: bool, tree: int | None, where: str, exact: bool,
                      streamed: bool, shape: str | None = None) -> Any:
    """serve's --draft-model/--lookup/--draft-tree/--draft-shape checked (bad input exits 2 before the
    server listens), as an infer.server.run.ServeSpeculation or None."""
    from infer.cli import EXIT_BAD_INPUT, _fail
    from infer.server.run import ServeSpeculation

    if draft_model and lookup:
        _fail("--draft-model and --lookup are two drafters: choose one", EXIT_BAD_INPUT)
    if not (draft_model or lookup):
        if tree is not None or shape is not None:
            _fail(f"{'--draft-tree' if tree is not None else '--draft-shape'} sizes the tree of --draft-model or "
                  "--lookup: add one of them", EXIT_BAD_INPUT)
        return None
    try:
        depth_width = parse_draft_shape(shape)
    except ValueError as err:
        _fail(str(err), EXIT_BAD_INPUT)
    if depth_width is not None and (lookup or tree is not None):
        _fail("--draft-shape gives a draft model's tree its depth and width: not with --lookup or --draft-tree",
              EXIT_BAD_INPUT)
    if where == "cpu" and not cpu_speculation_allowed(model, exact, streamed):
        _fail(CPU_NEEDS_EXACT, EXIT_BAD_INPUT)
    if draft_model:
        check_draft(model, draft_model)
    if depth_width is not None:
        return ServeSpeculation(draft_model, 1 + depth_width[0] * depth_width[1], depth_width)
    default = DEFAULT_TREE_STREAMING if streamed else DEFAULT_TREE_RESIDENT
    return ServeSpeculation(draft_model, tree or default)

