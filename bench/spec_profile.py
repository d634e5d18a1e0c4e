"""Where a speculative pass's time goes on the GPU, for the e2e setting of bench.spec_bench (target
streamed with about half its layer bytes in tier B, draft resident): the draft's chain per step,
the target's exact verify pass per tree size, a plain decode step, and the same verify passes with
the target wholly resident (no copies). Each is timed bare, then traced once with torch.profiler's
CUDA activity (every kernel and copy of the process, CuPy's included): GPU busy time, idle gaps,
copy time and the kernels that take the most, per traced call.

    python -m bench.spec_profile --target qwen15b.gguf --draft qwen05b.gguf --out DIR
    python -m bench.spec_profile --synth --out DIR   # the pair's shapes (infer.synth q15b, q05b), random weights

Writes DIR/spec-profile.json and DIR/trace-*.json.gz (chrome://tracing, Perfetto).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def _median_seconds(run: Callable[[], object], reps: int) -> float:
    run()  # warm-up: kernels, graphs and buffers of this shape
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def _kernel_name(name: str) -> str:
    return re.sub(r"<.*", "", name.split("(")[0]).strip()


def trace_summary(trace: dict[str, Any], top: int = 14) -> dict[str, Any]:
    """GPU time of one traced call from a chrome trace: span, kernel busy time (union), copies, idle
    gaps and the kernels taking the most time."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        return {"gpu_events": 0}
    kernels = sorted((e for e in gpu if e["cat"] == "kernel"), key=lambda e: e["ts"])
    copies = [e for e in gpu if e["cat"] != "kernel"]
    start = min(e["ts"] for e in gpu)
    end = max(e["ts"] + e["dur"] for e in gpu)
    busy, cursor, gaps = 0.0, None, []
    for e in kernels:  # union of kernel intervals (streams may overlap)
        s, f = e["ts"], e["ts"] + e["dur"]
        if cursor is None or s > cursor:
            if cursor is not None:
                gaps.append(s - cursor)
            busy += f - s
            cursor = f
        elif f > cursor:
            busy += f - cursor
            cursor = f
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        by_name[_kernel_name(e["name"])].append(e["dur"])
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    copy_bytes = sum(int(e.get("args", {}).get("bytes", 0)) for e in copies)
    gaps.sort(reverse=True)
    return {"gpu_span_ms": round((end - start) / 1e3, 3), "kernel_busy_ms": round(busy / 1e3, 3),
            "kernels": len(kernels), "kernel_sum_ms": round(sum(e["dur"] for e in kernels) / 1e3, 3),
            "mean_kernel_us": round(sum(e["dur"] for e in kernels) / max(len(kernels), 1), 2),
            "idle_gaps_ms": round(sum(gaps) / 1e3, 3), "gaps_over_20us": sum(g > 20 for g in gaps),
            "largest_gaps_us": [round(g, 1) for g in gaps[:8]],
            "copies": len(copies), "copy_ms": round(sum(e["dur"] for e in copies) / 1e3, 3), "copy_bytes": copy_bytes,
            "top_kernels": [{"name": n, "count": len(d), "total_ms": round(sum(d) / 1e3, 3),
                             "mean_us": round(sum(d) / len(d), 2)} for n, d in ranked[:top]]}


class Tracer:
    """torch.profiler around one call (None when torch or its CUDA profiler is missing)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        try:
            from torch.profiler import ProfilerActivity, profile  # noqa: F401
            self.ok = True
        except Exception as err:  # noqa: BLE001 - any import problem: bare timings only
            print(f"no torch.profiler ({err}): timings only", file=sys.stderr)
            self.ok = False

    def __call__(self, label: str, run: Callable[[], object]) -> dict[str, Any] | None:
        if not self.ok:
            return None
        from torch.profiler import ProfilerActivity, profile

        run()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            began = time.perf_counter()
            run()
            wall = time.perf_counter() - began
        raw = self.out / f"trace-{label}.json"
        prof.export_chrome_trace(str(raw))
        trace = json.loads(raw.read_text())
        with gzip.open(raw.with_suffix(".json.gz"), "wt") as f:
            json.dump(trace, f)
        raw.unlink()
        summary = {"wall_ms": round(wall * 1e3, 3), **trace_summary(trace)}
        print(f"{label}: {json.dumps(summary)[:600]}", file=sys.stderr, flush=True)
        return summary


def _chain(n: int) -> np.ndarray:
    return np.array([-1, *range(n - 1)], dtype=np.int64)


def profile_pair(args: argparse.Namespace) -> dict[str, Any]:
    import cupy

    from bench.spec_bench import humaneval_prompts, streamed_pair
    from infer.gguf_file import GGUFModel
    from infer.tokenizer import Tokenizer

    if args.synth:
        from bench.gpu_bench import synth_path

        args.target = synth_path("q15b:q4_k_m", args.synth_dir)
        args.draft = synth_path("q05b:q4_k_m", args.synth_dir)
    nodes = [int(n) for n in args.nodes.split(",")]
    gguf = GGUFModel(args.target)
    rng = np.random.default_rng(0)
    if args.synth:
        prompt = rng.integers(3, 1000, args.prompt_tokens)
    else:
        prompt = np.asarray(Tokenizer.from_gguf(gguf.metadata).encode(humaneval_prompts(1)[0]))
    args.out.mkdir(parents=True, exist_ok=True)
    trace = Tracer(args.out)
    draft, session, budget = streamed_pair(args, gguf, max(nodes))
    target, dmodel = session.engine.model, draft.transformer
    result: dict[str, Any] = {"target": str(args.target), "draft": str(args.draft), "vram_budget_bytes": budget,
                              "prompt_tokens": len(prompt), "traces": {}}
    try:
        tcache, dcache = target.new_cache(args.ctx), draft.engine.cache  # the draft plan holds one cache

        def generate(n: int) -> None:
            tcache.length = 0
            target.generate(prompt, tcache, n)

        one, many = _median_seconds(lambda: generate(1), args.reps), _median_seconds(lambda: generate(65), args.reps)
        result["plain_step_ms"] = round((many - one) / 64 * 1e3, 3)
        tcache.length = 0
        target.forward(prompt[:-1], tcache)
        base = tcache.length

        def steps(n: int) -> None:  # n decode steps after the prompt
            tcache.length = base
            target.generate(prompt[-1:], tcache, n)

        result["traces"]["plain-8-steps"] = trace("plain-8-steps", lambda: steps(8))

        dcache.length = 0
        dmodel.forward(prompt[:-1], dcache)
        dbase = dcache.length

        def chain(depth: int) -> None:
            dcache.length = dbase
            dmodel.draft_chain(prompt[-1:], dcache, depth, 1)

        c1, cd = _median_seconds(lambda: chain(1), args.reps), _median_seconds(lambda: chain(args.depth), args.reps)
        result["draft_chain_ms"] = {"1": round(c1 * 1e3, 3), str(args.depth): round(cd * 1e3, 3),
                                    "per_step": round((cd - c1) / (args.depth - 1) * 1e3, 3)}
        result["traces"][f"draft-chain-{args.depth}"] = trace(f"draft-chain-{args.depth}", lambda: chain(args.depth))

        if args.loop:  # the draft phase inside a Speculator loop, against the bare chain above
            from infer.engine import greedy
            from infer.speculative import ModelDrafter, Speculator

            drafter = ModelDrafter(dmodel, args.ctx, args.depth, args.width, cache=dcache, ahead=args.ahead)
            spec = Speculator(target, drafter, 1 + args.depth * args.width, args.ctx)
            list(spec.generate(list(prompt), 8, greedy, cache=tcache))  # warm-up
            run = spec.generate(list(prompt), args.loop, greedy, cache=tcache)
            next(run, None)  # the first pass: the draft's prompt goes through it (counted as draft time)
            first = (spec.stats.draft_seconds, spec.stats.verify_seconds)
            for _ in run:
                pass
            st = spec.stats
            later = max(st.passes - 1, 1)
            result["loop"] = {"passes": st.passes, "tokens_per_pass": round(st.tokens_per_pass, 3),
                              "draft_ms_per_pass": round(1e3 * st.draft_seconds / max(st.passes, 1), 3),
                              "verify_ms_per_pass": round(1e3 * st.verify_seconds / max(st.passes, 1), 3),
                              "first_pass_draft_ms": round(1e3 * first[0], 3),
                              "later_draft_ms_per_pass": round(1e3 * (st.draft_seconds - first[0]) / later, 3),
                              "later_verify_ms_per_pass": round(1e3 * (st.verify_seconds - first[1]) / later, 3),
                              "width": args.width, "drafted_ahead": drafter.ahead.as_dict() if drafter.ahead else None}
            print(f"loop: {result['loop']}", file=sys.stderr, flush=True)
            run = spec.generate(list(prompt), args.loop, greedy, cache=tcache)
            next(run, None)  # prefills and the first pass stay out of the trace

            def four_passes() -> None:
                start = spec.stats.passes
                for _ in run:
                    if spec.stats.passes >= start + 4:
                        break

            result["traces"]["loop-4-passes"] = trace("loop-4-passes", four_passes)
            tcache.length = 0
            target.forward(prompt[:-1], tcache)

        _verify_sweep("streamed", target, tcache, nodes, args, trace, rng, result)
    finally:
        session.close()
    if args.resident:
        from infer.gpu import load_gpu_transformer

        del target, tcache
        cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_memory_pool().set_limit(size=0)
        resident = load_gpu_transformer(gguf, args.ctx)
        rcache = resident.new_cache(args.ctx)
        resident.forward(prompt[:-1], rcache)
        _verify_sweep("resident", resident, rcache, nodes, args, trace, rng, result)
    return result


def _verify_sweep(label: str, model: Any, cache: Any, nodes: list[int], args: argparse.Namespace, trace: Tracer,
                  rng: np.random.Generator, result: dict[str, Any]) -> None:
    """verify_tree over chains of each size in `nodes` (median seconds), then traced at 1 and
    depth + 1 nodes: result["verify_<label>_ms"] and result["traces"]["verify-<label>-N"]."""

    def verify(n: int) -> None:
        model.verify_tree(rng.integers(3, 1000, n), _chain(n), cache)

    times = result[f"verify_{label}_ms"] = {}
    for n in nodes:
        times[str(n)] = round(_median_seconds(lambda n=n: verify(n), args.reps) * 1e3, 3)
        print(f"verify {label} {n}: {times[str(n)]} ms", file=sys.stderr, flush=True)
    for n in (1, args.depth + 1):
        result["traces"][f"verify-{label}-{n}"] = trace(f"verify-{label}-{n}", lambda n=n: verify(n))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.spec_profile", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--target", type=Path, help="target GGUF (with --draft)")
    source.add_argument("--synth", action="store_true", help="synthetic models of the pair's shapes")
    parser.add_argument("--draft", type=Path)
    parser.add_argument("--synth-dir", type=Path, default=Path("/tmp/nvmedirect-synth"))
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--resident-fraction", type=float, default=0.5)
    parser.add_argument("--draft-budget", default=None)
    parser.add_argument("--prompt-tokens", type=int, default=120, help="prompt length with --synth")
    parser.add_argument("--depth", type=int, default=16, help="draft chain depth timed and traced")
    parser.add_argument("--nodes", default="1,2,5,9,17,33", help="verify tree sizes (chains) timed")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--resident", action="store_true", help="also the verify passes with the target resident")
    parser.add_argument("--loop", type=int, default=0,
                        help="also a Speculator loop of this many tokens (trees of --depth x --width)")
    parser.add_argument("--width", type=int, default=1, help="the loop's tree: the chain's runners-up as leaves")
    parser.add_argument("--ahead", action="store_true",
                        help="the loop drafts the next tree during the target's pass (infer/draft_ahead.py): its "
                             "trace shows the branches' passes on the draft's stream beside the verify")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.target is not None and args.draft is None:
        parser.error("--target needs --draft")
    result = profile_pair(args)
    result["command"] = "python -m bench.spec_profile " + " ".join(sys.argv[1:] if argv is None else argv)
    (args.out / "spec-profile.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "traces"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
