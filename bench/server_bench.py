"""Serving benchmark: N concurrent streaming clients against `ntransformer serve`'s app, and the
offline batch of the same N sequences on the same loaded model in the same run.

    python -m bench.server_bench --synth 70b:q4_k_m --streaming --vram-budget 24GB --clients 32 --tokens 64
    python -m bench.server_bench --synth 8b:q4_k_m --clients 64 --tokens 64
    python -m bench.server_bench --url http://127.0.0.1:8080 --vocab-size 128256 --clients 32 --tokens 64

With --url, the same load generator measures any OpenAI-compatible server already running (ours,
llama-server, vLLM), so they are measured alike; nothing is loaded here and there is no offline row.
It first sends the same load (8 tokens each) with other prompts, so that what is measured is neither
a first pass of a shape nor a cached prefix.

--chat-turns T replays one T-turn chat through /v1/chat/completions instead, each turn resending the
whole history (as chat clients and agents do), and reports each turn's time to first token and the
median over turns 2..T. In process (--model/--synth) it runs the replay on a server with the prefix
cache and on one without, and reports the ratio and whether the answers are identical; with --url,
run it once against each server.
Every request sends `ignore_eos` (llama-server's field, which ours takes too), so each client gets
exactly --tokens tokens; with --url, `--stop-at-eos` leaves it out (a reply ends where a user's
would, as bench.spec_bench e2e ends its replies; the aggregate counts the tokens generated).

The model is loaded once. Offline: `StreamingEngine.generate` of the N prompts (what
`ntransformer --batch N` runs), greedy. Online: the server app (infer/server) on uvicorn in this
process, and an asyncio load generator (aiohttp) opening N streaming /v1/completions requests at
once: time to first token per request (p50/p95), aggregate generated tokens per second of wall
time from the first request to the last token. Prompts are random token ids (the same for both).
Results: JSON to --out and stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np


def load(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(model, tokenizer, close) planned for `clients` sequences of `ctx` positions."""
    from infer.gguf_file import GGUFModel
    from infer.tokenizer import Tokenizer

    path = args.model or _synth(args.synth, args.synth_dir)
    gguf = GGUFModel(path)
    tokenizer = Tokenizer.from_gguf(gguf.metadata)
    if args.streaming:
        from infer.tiers.session import StreamingConfig, build_streaming_engine

        config = StreamingConfig(enabled=True, vram_budget=args.vram_budget, ram_budget=args.ram_budget,
                                 batch=args.clients, slots=8)
        session = build_streaming_engine(gguf, config, args.ctx, args.device, enforce_budget=args.device == "gpu")
        print(session.report(), file=sys.stderr)
        return session.engine.model, tokenizer, session.close
    if args.device == "gpu":
        from infer.gpu import load_gpu_transformer

        gpu = load_gpu_transformer(gguf, args.ctx, args.vram_budget, batch=args.clients, enforce_budget=True)
        print(gpu.account.render(), file=sys.stderr)  # type: ignore[union-attr]
        return gpu, tokenizer, lambda: None
    from infer.model import load_transformer

    return load_transformer(gguf, exact=args.exact), tokenizer, lambda: None


def _synth(spec: str, directory: Path) -> Path:
    from bench.gpu_bench import synth_path

    return synth_path(spec, directory)


def offline(model: Any, prompts: list[list[int]], tokens: int, ctx: int) -> dict[str, Any]:
    from infer.engine import greedy
    from infer.streaming import StreamingEngine

    engine = StreamingEngine(model, ctx)
    engine.generate(prompts[:1], 2, greedy)  # warm-up: kernels, graphs, float16 scratch
    began = time.perf_counter()
    outputs = engine.generate(prompts, tokens, greedy)
    wall = time.perf_counter() - began
    s = engine.stats
    generated = sum(len(o) for o in outputs)
    return {"sequences": len(prompts), "generated_tokens": generated, "wall_seconds": round(wall, 3),
            "aggregate_tok_s": round(generated / wall, 2), "decode_tok_s": round(s.decode_tokens_per_second, 2),
            "prefill_passes": s.prefill_passes, "decode_passes": s.decode_passes}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _clients(base: str, prompts: list[list[int]] | list[str], tokens: int, key: str | None = None,
                   chat: bool = False, ignore_eos: bool = True) -> dict[str, Any]:
    """Each prompt (ids, or text) streamed by a client of its own, greedy, `tokens` each
    (ignore_eos); with `chat`, text prompts are user messages to /v1/chat/completions. Text prompts'
    replies are kept (speculation's runs compare them with the plain server's)."""
    import aiohttp

    url = f"{base.rstrip('/')}/v1/{'chat/completions' if chat else 'completions'}"
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    began = time.perf_counter()

    async def one(session: aiohttp.ClientSession, prompt: list[int] | str) -> tuple[float, int, float, str]:
        sent = time.perf_counter()
        first, count, text = None, 0, []
        body = {"max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": ignore_eos,
                "stream_options": {"include_usage": True}}
        body |= {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
        async with session.post(url, json=body, headers=headers) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    count = event["usage"]["completion_tokens"]
                if event.get("choices"):
                    first = first or time.perf_counter()
                    choice = event["choices"][0]
                    text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
        return (first or time.perf_counter()) - sent, count, time.perf_counter(), "".join(text)

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        results = await asyncio.gather(*(one(session, p) for p in prompts))
    wall = max(r[2] for r in results) - began
    ttft = sorted(r[0] for r in results)
    generated = sum(r[1] for r in results)
    out = {"clients": len(prompts), "generated_tokens": generated, "wall_seconds": round(wall, 3),
           "aggregate_tok_s": round(generated / wall, 2),
           "ttft_p50_s": round(statistics.median(ttft), 3), "ttft_p95_s": round(ttft[int(0.95 * (len(ttft) - 1))], 3)}
    if prompts and isinstance(prompts[0], str):
        out["replies"] = [r[3] for r in results]
    return out


def _combined(waves: list[dict[str, Any]]) -> dict[str, Any]:
    """Waves of clients run one after another, as one measurement: tokens over the waves' summed wall
    time, the median of the waves' TTFT medians and the worst wave's p95, each wave's tok/s, the
    replies in order."""
    generated, wall = sum(w["generated_tokens"] for w in waves), round(sum(w["wall_seconds"] for w in waves), 3)
    out = {"clients": waves[0]["clients"], "rounds": len(waves), "generated_tokens": generated,
           "wall_seconds": wall, "aggregate_tok_s": round(generated / wall, 2),
           "ttft_p50_s": round(statistics.median(w["ttft_p50_s"] for w in waves), 3),
           "ttft_p95_s": max(w["ttft_p95_s"] for w in waves),
           "per_round_tok_s": [w["aggregate_tok_s"] for w in waves]}
    if "replies" in waves[0]:
        out["replies"] = [r for w in waves for r in w["replies"]]
    return out


CHAT_TURNS = ["Tell me about the history of the bicycle.", "How did the gears change over time?",
              "Which materials do modern frames use?", "Why is carbon fibre so stiff?", "And titanium?",
              "What about tyres: tubes or tubeless?", "How often should a chain be replaced?",
              "Which tools should a rider carry?", "How do disc brakes work?", "Are they better in the rain?",
              "What is a good cadence for long rides?", "How should one train for a century ride?",
              "What should one eat on the way?", "How is a wheel trued?", "What makes a saddle comfortable?",
              "Thank you, summarise what we discussed."]


async def _chat_replay(base: str, turns: int, tokens: int, key: str | None = None) -> dict[str, Any]:
    """One chat of `turns` user turns (CHAT_TURNS, repeated), each request resending the history; it
    ends early, saying at which turn, when the history outgrows the server's context."""
    import aiohttp

    url = f"{base.rstrip('/')}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    history: list[dict[str, str]] = [{"role": "system", "content": "You are a patient cycling mechanic."}]
    ttft, answers = [], []
    full = None  # the turn whose history no longer fit the server's context, if one did not
    # a connection per turn: llama-server closes a stream's connection, which a pooled one would reuse
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600), connector=connector) as session:
        for turn in range(turns):
            history.append({"role": "user", "content": CHAT_TURNS[turn % len(CHAT_TURNS)]})
            body = {"messages": history, "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True}
            sent, first, pieces = time.perf_counter(), None, []
            async with session.post(url, json=body, headers=headers) as response:
                if response.status != 200:
                    text = await response.text()
                    if response.status == 400 and "context" in text and turn > 0:
                        full = turn + 1  # the history outgrew the server's context (ours and llama-server say so)
                        break
                    raise RuntimeError(f"HTTP {response.status}: {text}")
                async for raw in response.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if event["choices"] and event["choices"][0]["delta"].get("content"):
                        first = first or time.perf_counter()
                        pieces.append(event["choices"][0]["delta"]["content"])
            ttft.append((first or time.perf_counter()) - sent)
            answers.append("".join(pieces))
            history.append({"role": "assistant", "content": answers[-1]})
    return {"turns": turns, "turns_done": len(ttft), "context_full_at_turn": full,
            "ttft_s": [round(t, 4) for t in ttft],
            "ttft_median_turns_2_on_s": round(statistics.median(ttft[1:]), 4) if len(ttft) > 1 else None,
            "answers": answers}


def _start(model: Any, tokenizer: Any, template: Any, ctx: int, slots: int,
           prefix_cache: bool = True) -> tuple[Any, Any, threading.Thread, str]:
    """The server app over the loaded model on uvicorn in a thread: (server, web, thread, base URL)."""
    import uvicorn

    from infer.server.app import Loaded, Server, create_app

    server = Server(lambda: Loaded(model, tokenizer, template, "bench"), ctx, slots, slots, prefix_cache=prefix_cache)
    port = _free_port()
    web = uvicorn.Server(uvicorn.Config(create_app(server), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=web.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 600
    while server.status == "loading" and time.monotonic() < deadline:
        time.sleep(0.05)
    while not web.started and time.monotonic() < deadline:
        time.sleep(0.05)
    if server.status != "ready":
        raise RuntimeError(f"the server did not become ready: {server.status} {server.failure}")
    return server, web, thread, f"http://127.0.0.1:{port}"


def online(model: Any, tokenizer: Any, prompts: list[list[int]], tokens: int, ctx: int) -> dict[str, Any]:
    server, web, thread, base = _start(model, tokenizer, None, ctx, len(prompts))
    try:
        asyncio.run(_clients(base, prompts[:1], 2))  # warm-up through the server
        result = asyncio.run(_clients(base, prompts, tokens))
        result["passes"] = server.scheduler.stats.passes  # type: ignore[union-attr]
        return result
    finally:
        web.should_exit = True
        thread.join(timeout=120)


def chat_replay(model: Any, tokenizer: Any, template: Any, turns: int, tokens: int, ctx: int) -> dict[str, Any]:
    """The replay on a server with the prefix cache, then on one without; TTFT medians and their ratio."""
    result: dict[str, Any] = {}
    for name, on in (("prefix_cache", True), ("no_prefix_cache", False)):
        server, web, thread, base = _start(model, tokenizer, template, ctx, 1, prefix_cache=on)
        try:
            asyncio.run(_chat_replay(base, 1, 2))  # warm-up
            result[name] = asyncio.run(_chat_replay(base, turns, tokens))
            result[name]["prefix_tokens_reused"] = server.scheduler.stats.prefix_tokens  # type: ignore[union-attr]
        finally:
            web.should_exit = True
            thread.join(timeout=120)
    on, off = result["prefix_cache"], result["no_prefix_cache"]
    result["answers_identical"] = on["answers"] == off["answers"]
    if turns > 1:
        result["ttft_ratio_on_off"] = round(on["ttft_median_turns_2_on_s"] / off["ttft_median_turns_2_on_s"], 4)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.server_bench", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--url", help="measure the OpenAI-compatible server at this address (no model loaded)")
    source.add_argument("--model", type=Path)
    source.add_argument("--synth", help="synthetic model SHAPE:TYPE, e.g. 70b:q4_k_m (written if missing)")
    parser.add_argument("--synth-dir", type=Path, default=Path("/tmp/nvmedirect-synth"))
    parser.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    parser.add_argument("--streaming", action="store_true")
    parser.add_argument("--exact", action="store_true", help="CPU: float64 sums (answers independent of batching)")
    parser.add_argument("--vram-budget")
    parser.add_argument("--ram-budget")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--chat-turns", type=int, default=0,
                        help="replay a chat of this many turns (each resending the history) instead; TTFT per turn")
    parser.add_argument("--vocab-size", type=int, default=32000, help="with --url: prompt ids are drawn below it")
    parser.add_argument("--api-key", help="with --url: sent as Authorization: Bearer KEY")
    parser.add_argument("--prompt-file", type=Path, help="with --url: text prompts, one a line (the first --clients "
                        "of them; fewer lines are reused), instead of random ids; the replies are kept")
    parser.add_argument("--prompt-set", choices=["humaneval"],
                        help="with --url, instead of --prompt-file: HumanEval's prompts as raw text to "
                        "/v1/completions (code completion, as bench.spec_bench e2e sends them); the replies are kept")
    parser.add_argument("--chat", action="store_true", help="with --prompt-file: each line a user message to "
                        "/v1/chat/completions")
    parser.add_argument("--stop-at-eos", action="store_true",
                        help="with --url: no ignore_eos, each reply ends at the model's end of generation (or --tokens)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with --url: this many waves of --clients clients one after another, each on the next "
                        "prompts; aggregate tok/s over all of them (a wave of 8 x 128 tokens lasts about a second "
                        "on a GPU: too short to tell two servers apart alone)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.prompt_set and (args.prompt_file or args.chat or not args.url):
        parser.error("--prompt-set goes with --url, without --prompt-file and --chat")
    if args.rounds < 1 or (args.rounds > 1 and (not args.url or args.chat_turns)):
        parser.error("--rounds takes a count >= 1, with --url and without --chat-turns")
    if args.stop_at_eos and (not args.url or args.chat_turns):
        parser.error("--stop-at-eos goes with --url, without --chat-turns")
    args.ctx = args.prompt_tokens + args.tokens + 8
    command = " ".join(["python -m bench.server_bench", *(argv or sys.argv[1:])])
    if args.chat_turns:  # the history grows by a question and an answer per turn
        args.ctx, args.clients = 64 + args.chat_turns * (args.tokens + 32), 1
    if args.url:
        return _measure_url(args, command)
    model, tokenizer, close = load(args)
    if args.chat_turns:
        return _measure_chat(args, command, model, tokenizer, close)
    try:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, model.args.vocab_size, args.prompt_tokens).tolist() for _ in range(args.clients)]
        result: dict[str, Any] = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        result["offline"] = offline(model, prompts, args.tokens, args.ctx)
        print(json.dumps(result["offline"]), file=sys.stderr)
        result["server"] = online(model, tokenizer, prompts, args.tokens, args.ctx)
        result["server_vs_offline"] = round(result["server"]["aggregate_tok_s"] / result["offline"]["aggregate_tok_s"], 3)
        result["server_vs_offline_decode"] = round(result["server"]["aggregate_tok_s"]
                                                   / result["offline"]["decode_tok_s"], 3)
    finally:
        close()
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


def _measure_chat(args: argparse.Namespace, command: str, model: Any, tokenizer: Any, close: Any) -> int:
    from infer.chat import ChatTemplate
    from infer.gguf_file import GGUFModel

    path = args.model or _synth(args.synth, args.synth_dir)
    template = ChatTemplate.from_gguf(GGUFModel(path).metadata, tokenizer)
    result: dict[str, Any] = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    try:
        result |= chat_replay(model, tokenizer, template, args.chat_turns, args.tokens, args.ctx)
    finally:
        close()
    return _report(args, result)


def _report(args: argparse.Namespace, result: dict[str, Any]) -> int:
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


def _measure_url(args: argparse.Namespace, command: str) -> int:
    if args.chat_turns:
        result = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "url": args.url}
        return _report(args, result | asyncio.run(_chat_replay(args.url, args.chat_turns, args.tokens, args.api_key)))
    def prompts_of(seed: int) -> list[list[int]] | list[str]:
        if args.prompt_file or args.prompt_set:  # the warm-up (seed 1) takes the prompts after the measured ones
            if args.prompt_set:
                from bench.spec_bench import humaneval_prompts

                lines = humaneval_prompts((args.rounds + 1) * args.clients)
            else:
                lines = [line for line in args.prompt_file.read_text().splitlines() if line.strip()]
            first = seed * args.clients
            return [lines[(first + i) % len(lines)] for i in range(args.clients)]
        rng = np.random.default_rng(seed)
        return [rng.integers(3, args.vocab_size, args.prompt_tokens).tolist() for _ in range(args.clients)]

    result: dict[str, Any] = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "url": args.url}
    # warm-up with the same load on other prompts (those after the measured ones): the passes of
    # that shape are compiled and captured, and no prefix of a measured prompt is cached by it
    asyncio.run(_clients(args.url, prompts_of(args.rounds), 8, args.api_key, args.chat))
    waves = [asyncio.run(_clients(args.url, prompts_of(r), args.tokens, args.api_key, args.chat, not args.stop_at_eos))
             for r in range(args.rounds)]
    result["server"] = waves[0] if args.rounds == 1 else _combined(waves)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
