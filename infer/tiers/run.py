"""`ntransformer --streaming`: text in, text out, through the streaming engine.

The prompts are `--prompts FILE` (one per line) or the -p prompt repeated `--batch` times; each is a
sequence of the batch, all served by the same passes. Each sequence has its own sampler (seed + its
index, so copies of one prompt draw differently). The plan goes to stderr; with --benchmark the
passes, tokens/s and bytes each tier moved per pass and per token follow.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from infer.gguf_file import GGUFModel
from infer.streaming import read_prompts_file
from infer.tiers.session import StreamingConfig, StreamingSession, build_streaming_engine

DEFAULT_CTX = 4096


def streaming_prompts(config: StreamingConfig, prompt: str | None) -> list[str]:
    if config.prompts_file:
        return read_prompts_file(config.prompts_file)
    if prompt is None:
        raise ValueError("nothing to do: give -p/--prompt TEXT or --prompts FILE")
    return [prompt] * config.batch


def run_streaming(model_path: str, config: StreamingConfig, ctx_size: int, device: str, prompt: str | None,
                  n_predict: int, sampler_config: Any, benchmark: bool = False, as_json: bool = False,
                  echo: Callable[[str], None] = print, note: Callable[[str], None] = print,
                  peak: Any = None, stream: Callable[[str], None] | None = None,
                  exact: bool = False, progress: Callable[[str, int, str], Any] | None = None,
                  gpus: list[int] | None = None) -> dict[str, Any]:
    """Generates for every prompt in one batch; prints each sequence's text (or one JSON object)
    with `echo` and the plan and statistics with `note`; returns the JSON-able result.
    ctx_size 0: the model's context, at most 4096 (per sequence: the KV cache is that times the
    number of sequences). benchmark with one sequence: the resident engine's measurement
    (infer.benchmark) on the streamed model, beside the plan's link roofline; `peak`: a
    PeakMonitor running around the call (GPU). stream (text output): the text of one sequence is
    given to it piece by piece as its tokens come; several sequences are echoed each as it ends.
    exact: the CPU engine's float64 sums (see build_streaming_engine). gpus: the layers split across
    these GPUs, each stage streaming its own share (infer.tiers.staged_session). progress(what, total, unit):
    a context manager yielding advance(done, total), for the CPU weights' load before the first pass."""
    from infer.sampler import Sampler
    from infer.tokenizer import StreamDecoder, Tokenizer

    texts = streaming_prompts(config, prompt)
    from infer.arch import ModelArgs, context_warning

    gguf = GGUFModel(model_path)
    args = ModelArgs.from_gguf(gguf)  # an architecture we cannot run is the error, not its tokenizer
    tokenizer = Tokenizer.from_gguf(gguf.metadata)
    if ctx_size <= 0:  # the model's context, at most DEFAULT_CTX (as the resident CLI)
        ctx_size = min(args.context_length, DEFAULT_CTX)
    warning = context_warning(args, ctx_size, gguf.path.name)
    if warning:
        note(warning)
    ids = [tokenizer.encode(t) for t in texts]
    if any(not x for x in ids):
        raise ValueError("a prompt is empty after tokenization")
    if gpus:  # the layers split across GPUs, each stage streaming its share (infer.tiers.staged_session)
        from infer.tiers.staged_session import build_streaming_stages

        session = build_streaming_stages(gguf, replace(config, batch=len(texts)), ctx_size, gpus, enforce_budget=True)
    else:
        session = build_streaming_engine(gguf, replace(config, batch=len(texts)), ctx_size, device,
                                         enforce_budget=True, exact=exact)
    try:
        note(session.report())
        with (progress or _silent)(f"loading {gguf.path.name}", 0, session.warm_unit) as advance:
            session.warm(advance)  # the CPU's tier A dequantized, or a MoE's most used experts read
        if benchmark and len(ids) == 1:
            return _benchmark_one(session, model_path, n_predict, as_json, echo, peak)
        seed = getattr(sampler_config, "seed", None)
        samplers = [Sampler(replace(sampler_config, seed=None if seed is None else seed + s)) for s in range(len(ids))]
        is_end = (lambda _: False) if benchmark else tokenizer.is_eog
        live = _LiveText(tokenizer, len(ids), stream, echo, n_predict) if stream and not as_json and not benchmark \
            else None
        outputs = session.engine.generate(ids, n_predict, [x.sample for x in samplers], is_end,
                                          on_token=live.push if live else None)
        stats = session.engine.stats
        sequences = []
        for text, out in zip(texts, outputs, strict=True):
            kept = out[:-1] if out and tokenizer.is_eog(out[-1]) and not benchmark else out
            decoder = StreamDecoder(tokenizer)
            sequences.append({"prompt": text, "ids": kept, "text": "".join(decoder.push(t) for t in kept) + decoder.flush()})
        result = {
            "model": model_path, "device": device, "sequences": sequences, "prefill_passes": stats.prefill_passes,
            "prompt_tokens": stats.prompt_tokens, "prompt_tokens_per_second": round(stats.prompt_tokens_per_second, 3),
            "decode_passes": stats.decode_passes, "generated_tokens": stats.generated_tokens,
            "decode_tokens_per_second": round(stats.decode_tokens_per_second, 3), "bytes_moved": stats.bytes_moved,
        }
        if peak is not None:
            peak.sample()
            result["peak_vram_bytes"] = peak.peak
        if session.account is not None:
            result["vram_budget_bytes"] = session.account.budget
        if as_json:
            echo(json.dumps(result))
        elif live is not None:
            live.finish()
        else:
            for s, seq in enumerate(sequences):
                echo(seq["text"] if len(sequences) == 1 else f"[{s}] {seq['text']}")
        if benchmark or not as_json:
            note(f"prompt {stats.prompt_tokens} tokens in {stats.prefill_passes} passes, "
                 f"{stats.prompt_tokens_per_second:.2f} tok/s; generated {stats.generated_tokens} tokens in "
                 f"{stats.decode_passes} passes, {stats.decode_tokens_per_second:.2f} tok/s")
            note(session.moved_report())
        return result
    finally:
        session.close()


@contextlib.contextmanager
def _silent(_what: str, _total: int, _unit: str) -> Iterator[Callable[[int, int], None]]:
    yield lambda _done, _total: None


class _LiveText:
    """Text printed as it is generated: one sequence piece by piece through `stream`; with several,
    each sequence's line through `echo` as soon as it ends (their tokens interleave)."""

    def __init__(self, tokenizer: Any, n: int, stream: Callable[[str], None], echo: Callable[[str], None],
                 limit: int) -> None:
        from infer.tokenizer import StreamDecoder

        self.tokenizer, self.n, self.stream, self.echo, self.limit = tokenizer, n, stream, echo, limit
        self.decoders = [StreamDecoder(tokenizer) for _ in range(n)]
        self.texts = [""] * n
        self.counts = [0] * n
        self.done = [False] * n

    def push(self, s: int, token: int) -> None:
        self.counts[s] += 1
        end = self.tokenizer.is_eog(token)
        if not end:
            piece = self.decoders[s].push(token)
            if self.n == 1:
                self.stream(piece)
            else:
                self.texts[s] += piece
        if end or self.counts[s] >= self.limit:
            self._end(s)

    def _end(self, s: int) -> None:
        if self.done[s]:
            return
        self.done[s] = True
        tail = self.decoders[s].flush()
        if self.n == 1:
            self.stream(tail + "\n")
        else:
            self.echo(f"[{s}] {self.texts[s] + tail}")

    def finish(self) -> None:
        """Ends the sequences a full context stopped (no end token, fewer tokens than asked)."""
        for s in range(self.n):
            self._end(s)


def _benchmark_one(session: StreamingSession, model_path: str, n_predict: int, as_json: bool,
                   echo: Callable[[str], None], peak: Any) -> dict[str, Any]:
    """One sequence: pp and tg as `ntransformer --benchmark` measures them, beside the roofline of
    the link (bytes streamed per pass / host-to-device bandwidth measured at start-up)."""
    from infer.benchmark import measure, render

    experts = getattr(session, "benchmark", None)  # a mixture of experts, tiered (infer.tiers.experts)
    if experts is not None:
        result = {"model": model_path, **experts(n_predict)}
        echo(json.dumps(result) if as_json else session.render_benchmark(result))  # type: ignore[attr-defined]
        return result
    result: dict[str, Any] = {"model": model_path, **measure(session.engine.model, n_predict)}
    streamed = session.plan.streamed_nbytes
    link = session.bandwidths.host_to_device if session.bandwidths else 0.0
    result["streamed_bytes_per_pass"] = streamed
    if streamed and link:
        result["roofline_tok_s"] = round(link / streamed, 3)
        result["decode_fraction_of_roofline"] = round(result["tg_tok_s"] / (link / streamed), 3)
    if peak is not None:
        peak.sample()
        result["peak_vram_bytes"] = peak.peak
    text = render(result)
    if "roofline_tok_s" in result:
        text += (f"\n  streamed {streamed / 1e9:.2f} GB a pass at {link / 1e9:.1f} GB/s: roofline "
                 f"{result['roofline_tok_s']} tok/s, decode at {result['decode_fraction_of_roofline']:.0%} of it")
    echo(json.dumps(result) if as_json else text)
    return result
