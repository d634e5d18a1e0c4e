"""The CPU engine against llama.cpp on the same files, threads and prompt (issue 28): load time, peak
RSS, prompt tok/s and decode tok/s, each engine in a process of its own (so RSS and load are its own).

    python -m bench.cpu_decode --model ~/.cache/nvmedirect/models/SmolLM2-135M-Instruct.Q8_0.gguf \\
        --model ~/.cache/nvmedirect/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --pp 128 --tg 64 --out r.json

Engines: `native` (our engine, matrices packed in the mapped file through the native kernels:
NVMEDIRECT_CPU_PRODUCTS=native), `numpy` (our default engine: matrices dequantized to float32 at
load), `tiered` (a mixture of experts: `native` with its experts in the tiered RAM cache of
infer.tiers.experts, every expert read into it before the clock starts: the cache's own cost),
`llama.cpp` (llama-cpp-python, flash attention off, its own sampler at top-k 1). Every engine
gets the same prompt ids (our tokenizer's) and decodes greedily; decode tok/s counts the tokens after
the first. The machine's copy bandwidth is printed beside them (decode reads every weight once a
token, so bytes a token / copy bandwidth bounds it), and each run's 1-minute load average as it
started. `--repeat N` runs each engine N times, alternating, and keeps the best prompt and decode
rates of each (every run is in the JSON): on a machine shared with other jobs a single run measures
their load as much as the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ENGINES = ("native", "numpy", "tiered", "llama.cpp")
PASSAGE = ("The river rose through the night, and by morning the lower fields were under water. The farmers "
           "moved their animals to the hill behind the church and waited. Nobody in the village could remember "
           "a flood like it, though the oldest stories spoke of one, long ago, that had carried away the mill. ")


def prompt_ids(path: Path, n: int) -> list[int]:
    """n token ids of a passage of prose (repeated as needed), by our tokenizer of `path`."""
    from infer.gguf_file import GGUFModel
    from infer.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(GGUFModel(path).metadata)
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(PASSAGE, add_bos=False)
    return ids[:n]


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_ours(path: Path, ids: list[int], tg: int, packed: bool, tiered: bool = False) -> dict[str, Any]:
    """Our CPU engine (its products use the physical cores: infer.cpu_kernels.default_threads).
    tiered: a mixture of experts with its experts in the tiered cache (infer.tiers.experts) of a
    budget of every expert, read from the file as first routed to: the cost of the cache against
    `native` with every expert held (read before the clock starts; load_seconds includes it)."""
    from infer.engine import Engine, greedy
    from infer.gguf_file import GGUFModel
    from infer.model import Transformer, load_transformer

    began = time.perf_counter()
    gguf = GGUFModel(path)
    extra: dict[str, Any] = {}
    if tiered:
        from infer.arch import check_model, rope_freq_factors
        from infer.tiers.experts import ExpertSlices, tiered_weights
        from infer.tiers.tier_c import FileSource

        args = check_model(gguf)
        # the cache's unit is its largest expert (Q4_K_M's down stacks differ between blocks)
        every = max(ExpertSlices.of_layer(gguf, i).expert_nbytes for i in range(args.n_layers)) * \
            args.n_layers * args.n_experts
        weights = tiered_weights(gguf, args, FileSource(path), every)
        model: Any = Transformer(args, weights, rope_freq_factors(gguf, args))
        cache = weights.expert_cache
        for layer in range(args.n_layers):  # every expert held before the clock: the cache's own cost
            cache.ensure(layer, range(args.n_experts))
        cache.stats = type(cache.stats)()
    else:
        model = load_transformer(gguf, packed=packed)
    load_s = time.perf_counter() - began
    engine = Engine(model, len(ids) + tg + 8)
    began = time.perf_counter()
    engine.prefill(ids[:-1], logits=False)
    pp_s = time.perf_counter() - began
    logits = engine.decode_one(ids[-1])
    first = time.perf_counter()
    tokens = []
    for _ in range(tg):
        token = int(greedy(logits, engine.tokens))
        tokens.append(token)
        logits = engine.decode_one(token)
    end = time.perf_counter()
    if tiered:
        stats = weights.expert_cache.stats
        extra = {"expert_hits": stats.hits, "expert_misses": stats.misses}
    return {"load_seconds": round(load_s, 3), "pp_tok_s": round((len(ids) - 1) / pp_s, 2),
            "tg_tok_s": round(tg / (end - first), 2), "peak_rss_bytes": peak_rss_bytes(), "tokens": tokens, **extra}


def run_llama(path: Path, ids: list[int], tg: int, threads: int | None) -> dict[str, Any]:
    import llama_cpp

    n = threads or 1
    began = time.perf_counter()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(ids) + tg + 8, n_batch=512, n_threads=n,
                          n_threads_batch=n, flash_attn=False, verbose=False)
    load_s = time.perf_counter() - began
    began = time.perf_counter()
    llm.eval(ids[:-1])
    pp_s = time.perf_counter() - began
    vocab = llm.n_vocab()

    def last_logits() -> Any:  # the batch's last row (llama.cpp keeps only it without logits_all)
        import numpy as np

        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))

    llm.eval([ids[-1]])
    first = time.perf_counter()
    tokens = []
    for _ in range(tg):  # the arg-max of the last row, as our greedy chooser takes it
        token = int(last_logits().argmax())
        tokens.append(token)
        llm.eval([token])
    end = time.perf_counter()
    llm.close()
    return {"load_seconds": round(load_s, 3), "pp_tok_s": round((len(ids) - 1) / pp_s, 2),
            "tg_tok_s": round(tg / (end - first), 2), "peak_rss_bytes": peak_rss_bytes(), "tokens": tokens}


def one(args: argparse.Namespace) -> int:
    ids = prompt_ids(args.model[0], args.pp)
    if args.one == "llama.cpp":
        result = run_llama(args.model[0], ids, args.tg, args.threads)
    else:
        result = run_ours(args.model[0], ids, args.tg, args.one in ("native", "tiered"), args.one == "tiered")
    print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_decode", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, action="append", required=True, help="a GGUF file (repeatable)")
    parser.add_argument("--engines", default="native,llama.cpp", help=f"comma-separated, of {', '.join(ENGINES)}")
    parser.add_argument("--pp", type=int, default=128, help="prompt tokens")
    parser.add_argument("--tg", type=int, default=64, help="decoded tokens")
    parser.add_argument("--threads", type=int, default=None,
                        help="llama.cpp's threads (default: the physical cores, which our products use)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs of each engine, alternating; the best prompt and decode rates are kept "
                             "(a shared machine's load comes and goes)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--one", choices=ENGINES, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    if args.one:
        return one(args)
    from bench.cpu_kernels import copy_bandwidth_gbs
    from infer.cpu_kernels import default_threads

    threads = args.threads or default_threads()
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        parser.error(f"unknown engine {bad[0]!r}: one of {', '.join(ENGINES)}")
    rows = []
    for path in args.model:
        if not path.exists():
            parser.error(f"{path}: no such file")
        row: dict[str, Any] = {"model": path.name, "file_bytes": path.stat().st_size}
        for _ in range(max(1, args.repeat)):
            for engine in engines:
                cmd = [sys.executable, "-m", "bench.cpu_decode", "--one", engine, "--model", str(path), "--pp",
                       str(args.pp), "--tg", str(args.tg), "--threads", str(threads)]
                load = os.getloadavg()[0]
                done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
                if done.returncode != 0:
                    run = {"error": (done.stderr.strip().splitlines() or ["?"])[-1]}
                else:
                    run = json.loads(done.stdout.strip().splitlines()[-1])
                run["loadavg_1min_before"] = round(load, 2)  # the machine's load as the run started
                print(f"{path.name:<45} {engine:<10} {json.dumps({k: v for k, v in run.items() if k != 'tokens'})}",
                      file=sys.stderr, flush=True)
                row.setdefault("runs", {}).setdefault(engine, []).append(run)
        for engine, runs in row.pop("runs").items():
            good = [r for r in runs if "error" not in r]
            if not good:
                row[engine] = runs[-1]
                continue
            best = dict(max(good, key=lambda r: r["tg_tok_s"]))
            best["pp_tok_s"] = max(r["pp_tok_s"] for r in good)
            best["runs"] = [{k: v for k, v in r.items() if k != "tokens"} for r in runs] if len(runs) > 1 else None
            row[engine] = {k: v for k, v in best.items() if v is not None}
        ours, ref = row.get("native") or row.get("numpy"), row.get("llama.cpp")
        if ours and ref and "error" not in ours and "error" not in ref:
            row["decode_vs_llama_cpp"] = round(ours["tg_tok_s"] / ref["tg_tok_s"], 3)
            row["prompt_vs_llama_cpp"] = round(ours["pp_tok_s"] / ref["pp_tok_s"], 3)
            row["same_tokens"] = next((i for i, (a, b) in enumerate(zip(ours["tokens"], ref["tokens"], strict=False))
                                       if a != b), min(len(ours["tokens"]), len(ref["tokens"])))
        rows.append(row)
    result = {"threads": threads, "pp": args.pp, "tg": args.tg, "copy_GBps": round(copy_bandwidth_gbs(), 2),
              "loadavg_1min_end": round(os.getloadavg()[0], 2), "rows": rows, "command": " ".join(["python -m bench.cpu_decode", *(argv or sys.argv[1:])])}
    for row in rows:
        print(f"{row['model']:<45} decode {row.get('decode_vs_llama_cpp')}x llama.cpp, prompt "
              f"{row.get('prompt_vs_llama_cpp')}x, the first {row.get('same_tokens')} of {args.tg} greedy tokens the same")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
