"""Where a pass's time goes, kernel by kernel: the CUDA activity (CUPTI, through PyTorch's profiler)
of decode steps, of one prompt pass as generation runs it (prompt rows, the last canonical) and of the
same prompt with every row canonical, of a loaded model, replayed from their CUDA graphs as the
benchmark runs them. Per kernel name: launches and device microseconds per pass; per pass: the span
from the first kernel's start to the last one's end, and the idle time between kernels inside it.

    python -m bench.pass_profile --synth 8b:q4_k_m --vram-budget 8GB [--pp 512] [--position 64]
        [--steps 8] [--out profile.json] [--trace trace.json]

Needs PyTorch on the machine (only for its profiler; the engine does not use it).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np


def _kernel_events(prof) -> list[tuple[str, float, float]]:  # noqa: ANN001
    """(name, start us, duration us) of every device kernel the profiler saw, by start time."""
    out = []
    for e in prof.events():
        kind = str(getattr(e, "device_type", ""))
        if "CUDA" not in kind or getattr(e, "device_resource_id", None) is None:
            continue
        start = e.time_range.start
        dur = e.time_range.elapsed_us()
        if dur <= 0 or e.name.startswith(("Memcpy", "Memset", "cudaMem")):
            continue
        out.append((e.name, float(start), float(dur)))
    out.sort(key=lambda t: t[1])
    return out


def summarise(events: list[tuple[str, float, float]], passes: int) -> dict[str, object]:
    if not events:
        return {"kernels": 0}
    by: dict[str, list[float]] = defaultdict(list)
    for name, _, dur in events:
        by[name].append(dur)
    span = events[-1][1] + events[-1][2] - events[0][1]
    busy = sum(d for _, _, d in events)
    rows = sorted(((sum(v) / passes, len(v) / passes, name) for name, v in by.items()), reverse=True)
    return {"passes": passes, "span_us_per_pass": round(span / passes, 1), "busy_us_per_pass": round(busy / passes, 1),
            "idle_us_per_pass": round((span - busy) / passes, 1), "launches_per_pass": len(events) / passes,
            "by_kernel": [{"kernel": n, "us_per_pass": round(t, 1), "launches_per_pass": c,
                           "us_each": round(t / c, 2)} for t, c, n in rows]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pass_profile", description=__doc__.splitlines()[0])
    parser.add_argument("--synth", default="8b:q4_k_m", help="synthetic model SHAPE:TYPE (bench.gpu_bench)")
    parser.add_argument("--model", type=Path, help="a GGUF file instead of --synth")
    parser.add_argument("--synth-dir", type=Path, default=Path("/tmp/nvmedirect-synth"))
    parser.add_argument("--vram-budget", default="8GB")
    parser.add_argument("--pp", type=int, default=512, help="prompt pass rows")
    parser.add_argument("--position", type=int, default=64, help="cache length where the decode steps start")
    parser.add_argument("--steps", type=int, default=8, help="decode steps profiled")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--trace", type=Path, help="also write the Chrome trace here")
    args = parser.parse_args(argv)
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        print("error: bench.pass_profile needs PyTorch (its profiler)", file=sys.stderr)
        return 2
    import cupy

    from bench.gpu_bench import synth_path
    from infer.gguf_file import GGUFModel
    from infer.gpu import load_gpu_transformer

    torch.cuda.init()
    path = args.model or synth_path(args.synth, args.synth_dir)
    ctx = max(args.pp, args.position + args.steps) + 16
    gpu = load_gpu_transformer(GGUFModel(path), ctx, args.vram_budget, enforce_budget=True, kv_positions=ctx)
    rng = np.random.default_rng(0)
    cache = gpu.new_cache(ctx)
    prompt = rng.integers(3, gpu.args.vocab_size, args.pp)

    def prefill(canonical: bool = False) -> None:  # as generation runs a prompt: prompt rows, the last canonical
        cache.length = 0
        gpu.forward(prompt, cache, prompt=not canonical)

    def prefill_canonical() -> None:
        prefill(canonical=True)

    def decode() -> None:
        cache.length = args.position
        gpu.queue_steps(cache, int(prompt[0]), args.steps)
        gpu.stream.synchronize()

    prefill()
    prefill_canonical()
    decode()  # graphs captured, kernels compiled
    report: dict[str, object] = {"model": str(path), "vram_budget": args.vram_budget}
    for name, run, passes in (("decode", decode, args.steps), ("prompt", prefill, 1),
                              ("prompt_canonical", prefill_canonical, 1)):
        cupy.cuda.Device().synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            cupy.cuda.Device().synchronize()
        report[name] = summarise(_kernel_events(prof), passes)
        if args.trace:
            prof.export_chrome_trace(str(args.trace.with_suffix(f".{name}.json")))
    for name in ("decode", "prompt", "prompt_canonical"):
        r = report[name]
        print(f"{name}: span {r.get('span_us_per_pass')} us/pass, busy {r.get('busy_us_per_pass')}, idle "
              f"{r.get('idle_us_per_pass')}, launches {r.get('launches_per_pass')}")
        for row in r.get("by_kernel", [])[:25]:  # type: ignore[union-attr]
            print(f"  {row['us_per_pass']:>10} us  x{row['launches_per_pass']:<6} {row['us_each']:>8} us each  "
                  f"{row['kernel'][:90]}")
    from infer.gpu.benchmark import pass_fp64

    report.update(pass_fp64(gpu))
    print("fp64:", {k: report.get(k) for k in ("fp64_ops_per_pass", "fp64_instructions", "fp64_error")})
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
