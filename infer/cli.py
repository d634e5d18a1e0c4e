"""`ntransformer`: run GGUF models from the command line.

    ntransformer -m MODEL -p TEXT [-n N]         generate (tokens stream to stdout)
    ntransformer -m MODEL --chat                 conversation over stdin/stdout
    ntransformer -m MODEL --benchmark [-n N]     prompt and decode tokens/s
    ntransformer perplexity -m MODEL -f TEXT     llama.cpp-style perplexity

Exit codes: 0 ok, 1 failed (a tier C read failed while generating), 2 bad input (bad model file,
bad flag, budget too small), 4 not available (--device gpu without a GPU; a tier C device that cannot
be opened).
Informational lines go to stderr so stdout carries only the generated text (or JSON).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from infer import cli_run
from infer.cli_options import streaming_options
from infer.cli_spec import SpecOptions, spec_options
from infer.tiers.config import StreamingConfig

if TYPE_CHECKING:
    from infer.api import LLM

EXIT_FAILED, EXIT_BAD_INPUT, EXIT_NOT_AVAILABLE = 1, 2, 4
BENCHMARK_PROMPT = "The three most useful things to know about NVMe are"


class CliError(click.ClickException):
    """A one-line error with a chosen exit code."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class _Main(click.Group):
    """The `ntransformer` group: a model that turns out broken while generating (NaN logits) ends
    in one line naming it, not a traceback; the driver's notices are one line each."""

    def invoke(self, ctx: click.Context) -> Any:
        from nvmedirect.errors import notices_as_lines

        try:
            with notices_as_lines():  # e.g. fewer queue pairs than asked for: one `note:` line
                return super().invoke(ctx)
        except ValueError as err:
            from infer.errors import NonFiniteValues

            if not isinstance(err, NonFiniteValues):  # NaN logits, or NaN activations on the packed engine
                raise
            raise CliError(f"{ctx.params.get('model') or 'the model'}: {err}", EXIT_BAD_INPUT) from None


def _fail(message: str, code: int) -> NoReturn:
    raise CliError(message, code)


def _note(message: str) -> None:
    click.echo(message, err=True)


def _stream(piece: str) -> None:
    """Generated text as it comes (a streamed pass can take seconds per token)."""
    click.echo(piece, nl=False)
    sys.stdout.flush()


THREADS_HELP = ("CPU threads: the native kernels' (default: the physical cores; NVMEDIRECT_CPU_THREADS) and "
                "BLAS's (default: all cores).")


def _set_threads(threads: int | None) -> None:
    # BLAS reads its thread count when NumPy is first imported, so this only works before that; the
    # native kernels' pool reads NVMEDIRECT_CPU_THREADS when it first runs (infer.cpu_kernels)
    if threads:
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NVMEDIRECT_CPU_THREADS"):
            os.environ[var] = str(threads)


def _resolve_device(device: str) -> str:
    from infer.gpu import resolve_device

    try:
        return resolve_device(device)
    except ValueError as err:
        _fail(str(err), EXIT_NOT_AVAILABLE)


def _load(model: str | None, ctx_size: int, device: str, vram_budget: str | None = None, exact: bool = False,
          planned: dict[str, int] | None = None, tree_nodes: int = 0, experts: str | int = "auto",
          expert_stream: str | int = "auto", gpus: list[int] | None = None) -> LLM:
    if not model:
        _fail("no model given: use -m/--model FILE.gguf", EXIT_BAD_INPUT)
    from infer.api import LLM
    from infer.errors import ModelError
    from infer.tokenizer import TokenizerError

    where = _resolve_device(device)
    started = time.perf_counter()
    try:  # a model too large for the VRAM budget stops here with a hint to use --streaming
        uploads = _progress(f"loading {Path(model).name}", 0, "layer") if where == "gpu" else contextlib.nullcontext()
        with uploads as advance:  # the GPU's uploads, layer by layer (the CPU's come with warm below)
            llm = LLM.load(model, ctx_size=ctx_size or None, device=where, exact=exact, vram_budget=vram_budget,
                           enforce_budget=where == "gpu", planned=planned, tree_nodes=tree_nodes, progress=advance,
                           experts=experts, expert_stream=expert_stream, gpus=gpus)
    except TokenizerError as err:  # before ValueError, which it is
        _fail(f"{model}: tokenizer: {err}", EXIT_BAD_INPUT)
    except (ValueError, ModelError) as err:  # bad file, bad size, budget too small (BudgetError)
        _fail(str(err), EXIT_BAD_INPUT)
    warm = getattr(getattr(llm.transformer, "weights", None), "warm", None)  # CPU weights only
    if warm is not None:  # dequantize now, so that the speeds reported later measure inference only
        with _progress(f"loading {Path(model).name}", llm.args.n_layers + 1, "layer") as advance:
            warm(advance)
    a = llm.args
    _note(f"loaded {Path(model).name} on the {where.upper()}: {a.arch}, {a.n_layers} layers, width {a.dim}, "
          f"{a.n_heads}/{a.n_kv_heads} heads, vocab {a.vocab_size}, context {llm.engine.ctx_size} "
          f"({time.perf_counter() - started:.1f} s)")
    _context_note(a, llm.engine.ctx_size, model)
    for account in getattr(llm.transformer, "accounts", None) or [getattr(llm.transformer, "account", None)]:
        if account is not None:  # a pipeline across GPUs: each stage's plan
            _note(account.render())
    for part in getattr(llm.transformer, "stages", None) or [llm.transformer]:  # a pipeline: each stage's experts
        for placed in (getattr(part, "gpu_experts", None), getattr(part, "cpu_experts", None)):
            if placed is not None:
                _note(placed.describe())
    return llm


GPUS_HELP = ("Split the layers across these GPUs of the host (e.g. 0,1): each GPU a stage of contiguous layers, "
             "balanced by their bytes, the hidden states handed over by NCCL (a draft model, if any, on the first). "
             "--vram-budget is then one size for each GPU or one per GPU (24GB,20GB); with --streaming each GPU "
             "streams its stage's share over its own link; a mixture of experts places each stage's experts "
             "in its GPU (not with --streaming). Not with --exact or --self-spec (yet).")


PROGRESS_DELAY_S = 2.0  # a bar appears only for work that has already taken this long


@contextlib.contextmanager
def _progress(what: str, total: int, unit: str) -> Iterator[Any]:
    """A progress bar on stderr for a long load (shown after PROGRESS_DELAY_S, erased when done);
    yields `advance(done, total)`."""
    from tqdm import tqdm

    bar = tqdm(total=total or None, desc=what, unit=unit, delay=PROGRESS_DELAY_S, leave=False, file=sys.stderr,
               dynamic_ncols=True)

    def advance(done: int, steps: int) -> None:
        bar.total = steps  # a caller may know the count only once it starts
        bar.update(done - bar.n)

    try:
        yield advance
    finally:
        bar.close()


def _context_note(args: Any, ctx_size: int, model: str) -> None:
    from infer.arch import context_warning

    warning = context_warning(args, ctx_size, Path(model).name)
    if warning:
        _note(warning)


@contextlib.contextmanager
def _device_errors(device: str, measure_peak: bool = False) -> Iterator[Any]:
    """Device memory that runs out under the budget becomes a one-line error (exit 2); with
    measure_peak the peak device memory of the block is sampled (the monitor is yielded, else None)."""
    if device != "gpu":
        yield None
        return
    from infer.gpu import memory

    try:
        with memory.PeakMonitor() if measure_peak else contextlib.nullcontext() as monitor:
            yield monitor
    except Exception as err:
        if memory.is_out_of_memory(err):
            _fail(str(memory.over_budget(err, memory.current_account())), EXIT_BAD_INPUT)
        raise


@contextlib.contextmanager
def _storage_errors() -> Iterator[None]:
    """Tier C that cannot be opened is one line and exit 4 (not ready); a read that fails while
    generating (a media error, a device taken away) one line naming the device and exit 1. The
    session has closed the device by the time the line is printed."""
    from infer.errors import StorageUnavailable
    from nvmedirect.errors import NvmeDirectError

    try:
        yield
    except StorageUnavailable as err:
        _fail(str(err), EXIT_NOT_AVAILABLE)
    except NvmeDirectError as err:  # raised by the tier C reader in the middle of a pass
        _fail(f"tier C read failed: {str(err).splitlines()[0]}", EXIT_FAILED)


def _sampler(temp: float, top_k: int, top_p: float, min_p: float, repeat_penalty: float, seed: int | None) -> Any:
    from infer.sampler import SamplerConfig

    try:
        return SamplerConfig(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                             repeat_penalty=repeat_penalty, seed=seed)
    except ValueError as err:
        _fail(str(err), EXIT_BAD_INPUT)


@click.group(cls=_Main, invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-m", "--model", type=click.Path(), help="GGUF model file.")
@click.option("-p", "--prompt", help="Text to continue.")
@click.option("-n", "--n-predict", type=click.IntRange(min=1), default=128, show_default=True,
              help="Tokens to generate (per reply with --chat).")
@click.option("--chat", is_flag=True, help="Conversation: one user message per stdin line (template from the file); "
              "Ctrl-C stops a reply, Ctrl-C twice, Ctrl-D or /exit leaves.")
@click.option("--system", help="System message for --chat.")
@click.option("--benchmark", is_flag=True,
              help="Measure prompt and decode speed (pp512 on the GPU, pp128 on the CPU, then -n greedy tokens; "
                   "warmed up first), with peak memory; the same measurement as bench/gpu_bench.py.")
@click.option("-t", "--temp", type=float, default=0.8, show_default=True, help="Temperature; 0 (or anything below 1e-6) = greedy.")
@click.option("--top-k", type=int, default=40, show_default=True, help="Keep the k most likely tokens; 0 = off.")
@click.option("--top-p", type=float, default=0.95, show_default=True, help="Nucleus sampling; 1 = off.")
@click.option("--min-p", type=float, default=0.05, show_default=True, help="Min-p filter; 0 = off.")
@click.option("--repeat-penalty", type=float, default=1.0, show_default=True, help="Repetition penalty; 1 = off.")
@click.option("-c", "--ctx-size", type=click.IntRange(min=0), default=0,
              help="Context size in tokens; 0 = the model's, at most 4096.")
@click.option("--seed", type=int, default=None, help="Random seed (default: a fresh one each run).")
@click.option("--device", type=click.Choice(["auto", "cpu", "gpu"]), default="auto", show_default=True,
              help="Where to run; auto = the GPU when CuPy sees one, else the CPU.")
@streaming_options
@spec_options
@click.option("--threads", type=click.IntRange(min=1), default=None, help=THREADS_HELP)
@click.option("--exact", is_flag=True,
              help="CPU: take every sum in float64 and round once (results independent of batching, the same "
                   "logits as the GPU's decode kernels; about 2x slower, 2x the memory). Default: float32 as llama.cpp.")
@click.option("--cpu-moe", is_flag=True,
              help="GPU, a mixture of experts: keep the experts in RAM and compute them on the CPU (llama.cpp's "
                   "--cpu-moe). Default: in VRAM when they fit the budget beside the rest, else the experts of as "
                   "many of the last blocks as fit, the others' on the CPU (with --streaming, from a cache of "
                   "--ram-budget over --tier-c).")
@click.option("--n-cpu-moe", type=click.IntRange(min=0), default=None, metavar="N",
              help="GPU, a mixture of experts: the experts of the first N blocks on the CPU, the rest in VRAM "
                   "(llama.cpp's --n-cpu-moe).")
@click.option("--expert-stream", default="auto", metavar="auto|off|N",
              help="GPU, a mixture of experts with blocks on the CPU: stream those blocks' experts to the GPU for "
                   "prompts of at least N tokens (auto: 2 x experts / used, at least 16) and, in decode, fetch "
                   "a share of each token's experts to the GPU while the CPU computes the rest; off: the CPU "
                   "computes those blocks alone.")
@click.option("--gpus", metavar="LIST", default=None, help=GPUS_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.pass_context
def main(ctx: click.Context, model: str | None, prompt: str | None, n_predict: int, chat: bool, system: str | None,
         benchmark: bool, temp: float, top_k: int, top_p: float, min_p: float, repeat_penalty: float,
         ctx_size: int, seed: int | None, device: str, streaming: StreamingConfig, spec: SpecOptions,
         threads: int | None, exact: bool, cpu_moe: bool, n_cpu_moe: int | None, expert_stream: str,
         gpus: str | None, as_json: bool) -> None:
    """Run a GGUF language model (Llama, Qwen2, Qwen3, Gemma 3, their mixtures of experts, gpt-oss) on the GPU or the CPU.

    With --streaming, weights that do not fit the VRAM budget are streamed each pass from pinned RAM
    (tier B) and from the file or an NVMe drive (tier C); --batch/--prompts decode several
    sequences per pass."""
    if ctx.invoked_subcommand is not None:
        return
    _set_threads(threads)
    if chat and benchmark:
        _fail("--chat and --benchmark cannot be combined", EXIT_BAD_INPUT)
    if not chat and not benchmark and prompt is None:
        _fail("nothing to do: give -p/--prompt TEXT, --chat or --benchmark", EXIT_BAD_INPUT)
    sampler = _sampler(temp, top_k, top_p, min_p, repeat_penalty, seed)
    if spec.problem():
        _fail(spec.problem(), EXIT_BAD_INPUT)  # type: ignore[arg-type]
    if cpu_moe and n_cpu_moe is not None:
        _fail("--cpu-moe and --n-cpu-moe cannot be combined (--cpu-moe is every block's experts on the CPU)",
              EXIT_BAD_INPUT)
    experts: str | int = "cpu" if cpu_moe else ("auto" if n_cpu_moe is None else n_cpu_moe)
    devices = _gpus(gpus, device, streaming, exact, spec.self_draft, benchmark)
    streaming = replace(streaming, experts=experts)  # a MoE's placement on the GPU, resident or streamed
    if spec.active:
        from infer.cli_spec import run as run_speculative

        run_speculative(model, spec, streaming, ctx_size, device, prompt or BENCHMARK_PROMPT, n_predict, sampler,
                        chat, benchmark, exact, as_json, gpus=devices)
        return
    if streaming.enabled or streaming.batch > 1 or streaming.prompts_file:
        _run_streaming(model, streaming, ctx_size, device, prompt, n_predict, sampler, chat,
                       benchmark, as_json, exact, gpus=devices)
        return
    where = _resolve_device(device)
    _warn_unused(where, streaming, exact)
    _warn_experts_on_cpu(where, experts)
    with _device_errors(where, measure_peak=benchmark or as_json) as peak:
        llm = _load(model, ctx_size, where, streaming.vram_budget, exact, experts=experts,
                    expert_stream=int(expert_stream) if expert_stream.isdigit() else expert_stream, gpus=devices)
        if benchmark:
            cli_run.benchmark(llm, n_predict, as_json, peak)
        elif chat:
            cli_run.chat(llm, sampler, n_predict, system)
        else:
            cli_run.generate(llm, prompt or "", n_predict, sampler, as_json)


def _gpus(text: str | None, device: str, streaming: StreamingConfig, exact: bool = False,
          self_draft: bool = False, benchmark: bool = False) -> list[int] | None:
    """--gpus as device numbers, or the reason it cannot be (exit 2); a budget per GPU needs it.
    The first GPU becomes this thread's current one: a draft model loads and runs there."""
    if text is None:
        if streaming.vram_budget and "," in streaming.vram_budget:
            _fail("--vram-budget: one size per GPU (a list) needs --gpus", EXIT_BAD_INPUT)
        return None
    from infer.gpu import gpu_available
    from infer.tiers.stage_plan import parse_budgets, parse_gpus

    try:
        devices = parse_gpus(text)
        parse_budgets(streaming.vram_budget, len(devices))
    except ValueError as err:
        _fail(str(err), EXIT_BAD_INPUT)
    clash = [flag for flag, on in (("--device cpu", device == "cpu"), ("--exact", exact),
                                   ("--tier-c nvme", streaming.enabled and streaming.tier_c == "nvme"),
                                   ("--cpu-tier", streaming.enabled and streaming.cpu_tier not in (None, "off", "auto")),
                                   ("--self-spec/--skip-threshold (a draft of the target's own layers)", self_draft),
                                   ("--benchmark (it measures the device's own decode loop)", benchmark),
                                   ("--batch/--prompts without --streaming",
                                    not streaming.enabled and (streaming.batch > 1 or bool(streaming.prompts_file))),
                                   ("--tier-b registered (a pinned copy a stage)",
                                    streaming.enabled and streaming.tier_b == "registered"))
             if on]
    if clash:
        _fail(f"--gpus splits a resident GPU run: it cannot be combined with {clash[0]} (yet)", EXIT_BAD_INPUT)
    if not gpu_available():
        _fail(f"--gpus {text}: no CUDA GPU is visible to CuPy (install cupy-cuda13x, check the driver)",
              EXIT_NOT_AVAILABLE)
    import cupy

    from infer.gpu.stages import missing_gpu

    missing = missing_gpu(devices)
    if missing:
        _fail(missing, EXIT_NOT_AVAILABLE)
    cupy.cuda.Device(devices[0]).use()
    return devices


def _warn_unused(where: str, streaming: StreamingConfig, exact: bool) -> None:
    """Flags that mean something on another path than this one: said once, then the run goes on."""
    if where == "cpu" and streaming.vram_budget and not streaming.enabled:
        _note("warning: --vram-budget sizes GPU memory (or tier A with --streaming): the CPU's resident engine "
              "ignores it")
    if where == "gpu" and exact:
        _note("warning: --exact selects the CPU engine's float64 sums: the GPU engine ignores it")


def _warn_experts_on_cpu(where: str, experts: str | int) -> None:
    if where == "cpu" and experts != "auto":
        _note("warning: --cpu-moe and --n-cpu-moe place the experts of a GPU run: on the CPU every expert is the "
              "CPU's anyway")


def _run_streaming(model: str | None, streaming: StreamingConfig, ctx_size: int, device: str, prompt: str | None,
                   n_predict: int, sampler: Any, chat: bool, benchmark: bool, as_json: bool,
                   exact: bool = False, gpus: list[int] | None = None) -> None:
    if chat:
        _fail("--chat runs one sequence on the resident engine: drop --streaming/--batch/--prompts", EXIT_BAD_INPUT)
    if not model:
        _fail("no model given: use -m/--model FILE.gguf", EXIT_BAD_INPUT)
    from infer.errors import ModelError
    from infer.tiers.run import run_streaming
    from infer.tokenizer import TokenizerError

    where = _resolve_device(device)
    _warn_unused(where, streaming, exact)
    _warn_experts_on_cpu(where, streaming.experts)
    try:
        with _storage_errors(), _device_errors(where, measure_peak=benchmark or as_json) as peak:
            run_streaming(model, streaming, ctx_size, where, prompt or (BENCHMARK_PROMPT if benchmark else None),
                          n_predict, sampler, benchmark=benchmark, as_json=as_json, echo=click.echo, note=_note,
                          peak=peak, stream=_stream, exact=exact, progress=_progress, gpus=gpus)
    except TokenizerError as err:  # before ValueError, which it is
        _fail(f"{model}: tokenizer: {err}", EXIT_BAD_INPUT)
    except (ValueError, ModelError) as err:  # bad file, budgets too small (BudgetError)
        _fail(str(err), EXIT_BAD_INPUT)


@main.command("perplexity")
@click.option("-m", "--model", type=click.Path(), help="GGUF model file.")
@click.option("-f", "--file", "text_file", type=click.Path(), required=True, help="UTF-8 text to score.")
@click.option("-c", "--ctx-size", type=click.IntRange(min=4), default=256, show_default=True,
              help="Tokens per chunk (the second half of each is scored).")
@click.option("--chunks", type=click.IntRange(min=1), default=None, help="Score at most this many chunks.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help=THREADS_HELP)
@click.option("--exact", is_flag=True, help="Float64 sums on the CPU (see ntransformer --help).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_context
def perplexity_command(ctx: click.Context, model: str | None, text_file: str, ctx_size: int, chunks: int | None,
                       threads: int | None, exact: bool, as_json: bool) -> None:
    """Perplexity of a text, computed as llama.cpp's llama-perplexity does."""
    _set_threads(threads)
    if model is None and ctx.parent is not None:  # `ntransformer -m MODEL perplexity ...` works too
        model = ctx.parent.params.get("model")
    path = Path(text_file)
    if not path.is_file():
        _fail(f"{text_file}: no such file", EXIT_BAD_INPUT)
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        _fail(f"{text_file}: not UTF-8 text ({err.reason} at byte {err.start})", EXIT_BAD_INPUT)
    if ctx_size % 2:
        _fail(f"-c/--ctx-size must be even, not {ctx_size}", EXIT_BAD_INPUT)
    llm = _load(model, ctx_size, "cpu", exact=exact)
    from infer.perplexity import perplexity

    tokens = llm.tokenize(text)
    bos = llm.tokenizer.bos_id if llm.tokenizer.vocab.add_bos else None

    def progress(done: int, total: int, running: float) -> None:
        if not as_json:
            _note(f"chunk {done}/{total}: perplexity so far {running:.4f}")

    try:
        result = perplexity(tokens, ctx_size, llm.logits, bos_id=bos, max_chunks=chunks, progress=progress)
    except ValueError as err:
        _fail(f"{text_file}: {err}", EXIT_BAD_INPUT)
    if as_json:
        click.echo(json.dumps({"model": str(model), "file": text_file, "tokens": len(tokens), **result.as_dict()}))
    else:
        click.echo(f"perplexity: {result.perplexity:.4f} over {result.chunks} chunks of {ctx_size} tokens "
                   f"({result.scored_tokens} scored)")


@main.command("serve")
@click.option("-m", "--model", type=click.Path(), help="GGUF model file.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (127.0.0.1: this machine only; 0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option("--api-key", envvar="NTRANSFORMER_API_KEY",
              help="Require `Authorization: Bearer KEY` on /v1 requests (or set NTRANSFORMER_API_KEY).")
@click.option("--max-batch", type=click.IntRange(1, 4096), default=8, show_default=True,
              help="Requests decoded together; each holds a KV cache of --ctx-size positions.")
@click.option("--queue-size", type=click.IntRange(0, 1 << 20), default=64, show_default=True,
              help="Requests that may wait for a slot; past that, 503 with Retry-After.")
@click.option("-c", "--ctx-size", type=click.IntRange(min=0), default=0,
              help="Context of each request in tokens; 0 = the model's, at most 4096.")
@click.option("--device", type=click.Choice(["auto", "cpu", "gpu"]), default="auto", show_default=True)
@streaming_options(batch=False)
@click.option("--exact", is_flag=True, help="CPU: float64 sums (batching-independent results, see ntransformer --help).")
@click.option("--threads", type=click.IntRange(min=1), default=None, help=THREADS_HELP)
@click.option("--prefix-cache/--no-prefix-cache", default=None,
              help="Reuse the KV cache of an earlier request whose prompt a new prompt starts with (a chat "
                   "resending its history runs only the new turn). Default: on where it changes no answer (the "
                   "GPU, the CPU's packed native engine, --exact); off on the NumPy engine "
                   "(NVMEDIRECT_CPU_PRODUCTS=numpy), whose results depend on how a prompt is split into passes.")
@click.option("--draft-model", type=click.Path(), help="Speculation: a small model with the target's vocabulary "
              "drafts a tree for every running request (a draft KV cache per slot) and one pass verifies all "
              "of them; replies unchanged (greedy: token for token; on the CPU on the packed native engine, "
              "the default, or with --exact).")
@click.option("--lookup", is_flag=True, help="Speculation from n-gram matches in each request's prompt and output "
              "(no draft model).")
@click.option("--draft-tree", type=click.IntRange(min=1), default=None,
              help="Nodes of each request's draft tree (default 9, 33 with --streaming).")
@click.option("--draft-shape", metavar="DxW", default=None,
              help="--draft-model's tree as depth x width instead of --draft-tree: a chain of D draft tokens "
                   "with W - 1 leaf siblings at each depth (e.g. 12x1, a plain chain, for code; 4x4 for prose).")
@click.option("--reasoning-format", type=click.Choice(["auto", "none"]), default="auto", show_default=True,
              help="A reasoning model's chat replies (gpt-oss's harmony channels, Qwen3's <think> tags): auto sends "
                   "the thinking as reasoning_content beside the answer's content, as llama-server does; none sends "
                   "the reply whole (harmony's markers written out). A request's reasoning_format overrides it.")
@click.option("--gpus", metavar="LIST", default=None, help=GPUS_HELP)
@click.pass_context
def serve_command(ctx: click.Context, model: str | None, host: str, port: int, api_key: str | None, max_batch: int,
                  queue_size: int, ctx_size: int, device: str, streaming: StreamingConfig, exact: bool,
                  threads: int | None, prefix_cache: bool | None, draft_model: str | None, lookup: bool,
                  draft_tree: int | None, draft_shape: str | None, reasoning_format: str, gpus: str | None) -> None:
    """An OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (stream: true for
    server-sent events; JSON schemas, tools, logprobs), /v1/models, /tokenize, /detokenize, /health,
    /metrics, and a chat page at /. Continuous batching: every pass over the weights serves every
    active request (with --streaming, the streamed weights too).

        ntransformer serve -m model.gguf --port 8080
        curl http://127.0.0.1:8080/v1/completions -H 'Content-Type: application/json' \\
             -d '{"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}'
    """
    _set_threads(threads)
    if model is None and ctx.parent is not None:
        model = ctx.parent.params.get("model")
    if not model:
        _fail("no model given: use -m/--model FILE.gguf", EXIT_BAD_INPUT)
    from infer.arch import check_model
    from infer.cli_spec import serve_speculation
    from infer.errors import ModelError
    from infer.gguf_file import GGUFModel
    from infer.server.app import Server
    from infer.server.run import loader, serve

    devices = _gpus(gpus, device, streaming, exact=exact)
    if devices and devices[0] != 0 and draft_model:  # the server's threads keep GPU 0 current
        _fail("serve --gpus with --draft-model: list GPU 0 first (the draft runs on it), e.g. --gpus 0,1",
              EXIT_BAD_INPUT)
    where = _resolve_device(device)
    speculation = serve_speculation(model, draft_model, lookup, draft_tree, where, exact, streaming.enabled,
                                    draft_shape)
    try:  # a bad file stops here, before the server listens
        args = check_model(GGUFModel(model))
    except (ValueError, ModelError) as err:
        _fail(str(err), EXIT_BAD_INPUT)
    context = ctx_size or min(args.context_length, 4096)
    _context_note(args, context, model)
    server = Server(loader(model, where, context, max_batch, streaming, exact, speculation, gpus=devices), context,
                    max_batch, queue_size, api_key, prefix_cache=prefix_cache, reasoning=reasoning_format)
    _note(f"serving {Path(model).name} on http://{host}:{port} ({where}, {max_batch} slots of {context} tokens"
          f"{', API key required' if api_key else ''}); Ctrl-C stops after the requests in flight")
    serve(server, host, port)
    if server.status == "failed":
        _fail(server.failure, EXIT_FAILED)
