"""What `ntransformer` does with a loaded model (infer.cli loads it): generate a prompt's continuation
to stdout as it comes, measure prompt and decode speed, or hold a conversation over stdin/stdout."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from infer.api import LLM


def generate(llm: LLM, prompt: str, n_predict: int, sampler: Any, as_json: bool) -> None:
    from infer import cli as c
    from infer.engine import ContextFullError
    from infer.tokenizer import StreamDecoder

    ids = llm.tokenize(prompt)
    if not ids:
        c._fail("the prompt is empty after tokenization", c.EXIT_BAD_INPUT)
    decoder = StreamDecoder(llm.tokenizer)
    out_ids: list[int] = []
    pieces: list[str] = []
    try:
        for token in llm.generate_ids(ids, n_predict, sampler):
            if llm.tokenizer.is_eog(token):
                break
            out_ids.append(token)
            pieces.append(decoder.push(token))
            if not as_json:
                click.echo(pieces[-1], nl=False)
                sys.stdout.flush()
    except ContextFullError as err:
        c._fail(str(err), c.EXIT_BAD_INPUT)
    pieces.append(decoder.flush())
    stats = llm.stats
    if as_json:
        click.echo(json.dumps({"prompt": prompt, "prompt_ids": ids, "text": "".join(pieces), "ids": out_ids,
                               **stats.as_dict()}))
    else:
        click.echo(pieces[-1])
        c._note(f"prompt {stats.prompt_tokens} tokens {stats.prompt_tokens_per_second:.1f} tok/s, "
              f"generated {stats.generated_tokens} tokens {stats.decode_tokens_per_second:.1f} tok/s")


def benchmark(llm: LLM, n_predict: int, as_json: bool, peak: Any = None) -> None:
    from infer.benchmark import measure, render

    result = {"model": str(llm.gguf.path), **measure(llm.transformer, n_predict)}
    if peak is not None:  # load and the measurement
        peak.sample()
        result["peak_vram_bytes"] = peak.peak
    click.echo(json.dumps(result) if as_json else render(result))


def chat(llm: LLM, sampler: Any, n_predict: int, system: str | None) -> None:
    from infer import cli as c
    from infer.chat import ChatTemplateError

    try:
        chat = llm.chat(system=system)
    except ChatTemplateError as err:
        c._fail(f"{llm.gguf.path}: {err}", c.EXIT_BAD_INPUT)
    interactive = sys.stdin.isatty()
    interrupted = False  # the last thing was a Ctrl-C: a second one in a row leaves
    while True:
        if interactive:
            click.echo("> ", nl=False, err=True)
        try:
            line = sys.stdin.readline()
        except KeyboardInterrupt:
            if interrupted:
                click.echo(err=True)
                break
            interrupted = True
            c._note("\n(Ctrl-C again, Ctrl-D or /exit leaves)")
            continue
        if not line:
            break
        message = line.rstrip("\r\n")
        if not message.strip():
            continue
        if message.strip() in ("/exit", "/quit"):
            break
        interrupted = False
        # a reasoning model's thinking goes to stderr, dimmed; stdout gets the answers only
        reply = chat.send(message, max_tokens=n_predict, sampler=sampler,
                          on_reasoning=lambda text: click.echo(click.style(text, dim=True), nl=False, err=True))
        try:
            for piece in reply:
                click.echo(piece, nl=False)
                sys.stdout.flush()
        except KeyboardInterrupt:  # stops this reply only; what it said so far stays in the conversation
            reply.close()
            interrupted = True
            click.echo()
            c._note("(reply stopped; Ctrl-C again, Ctrl-D or /exit leaves)")
            continue
        click.echo()
