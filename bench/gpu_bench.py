"""GPU benchmark entry: a GGUF model (or a synthetic one, written if missing) on the GPU; prints
prompt and decode speed, bytes per token against the copy bandwidth, VRAM (peak, and the budget it
was planned in) and per-kernel timings (infer.gpu.benchmark, the code `ntransformer --benchmark`
runs).

    python -m bench.gpu_bench --synth 8b:q4_k_m --pp 512 --tg 128 [--json] [--out result.json]
    python -m bench.gpu_bench --model file.gguf [--vram-budget 8GB] [--streaming] [--ctx 4096]
    python -m bench.gpu_bench --synth 8b:q4_k_m --batch 32 --batch-prompt 128 --batch-new 64

--batch N also decodes N sequences together (prompts of --batch-prompt tokens, --batch-new new
tokens each: aggregate tok/s) and each alone, comparing their tokens.

--streaming loads the model through the streaming engine (everything that fits the budget stays
resident, the rest streams from RAM) and measures the same figures on it; with --cpu-tier auto (or N)
the layers held in RAM are computed by the CPU in passes of few tokens (infer.tiers.cpu_tier).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from infer.tiers.cpu_tier import CpuExperts


def bench_model(path: Path, pp: int, tg: int, with_kernels: bool = True, vram_budget: str | None = None,
                streaming: bool = False, ctx: int | None = None, batch: int = 0, batch_prompt: int = 128,
                batch_new: int = 64, depth: int = 0, cpu_tier: str | int = "off",
                experts: str | int = "auto", expert_stream: str | int = "auto") -> dict[str, object]:
    from infer.gguf_file import GGUFModel
    from infer.gpu import load_gpu_transformer
    from infer.gpu.benchmark import measure
    from infer.gpu.memory import PeakMonitor

    context = ctx or max(depth + pp + tg + 16, batch_prompt + batch_new + 1 if batch else 0)
    session = None
    with PeakMonitor() as peak:  # load and measurement: the peak the budget must hold
        started = time.perf_counter()
        if streaming:
            from infer.tiers.session import StreamingConfig, build_streaming_engine

            config = StreamingConfig(enabled=True, vram_budget=vram_budget or "24GB", ram_budget="64GB",
                                     batch=max(1, batch), cpu_tier=cpu_tier)
            session = build_streaming_engine(GGUFModel(path), config, context, device="gpu", enforce_budget=True)
            gpu = session.engine.model
        else:
            # the KV caches: the prompt/decode run's, the batch's and the check of each alone
            kv = context + (2 * batch * (batch_prompt + batch_new + 1) if batch else 0)
            gpu = load_gpu_transformer(GGUFModel(path), context, vram_budget, enforce_budget=True,
                                       batch=max(1, 2 * batch), kv_positions=kv, experts=experts,
                                       expert_stream=expert_stream)
        load_seconds = round(time.perf_counter() - started, 2)
        result = measure(gpu, pp, tg, with_kernels and not streaming, batch, batch_prompt, batch_new, depth=depth)
    result["peak_vram_bytes"] = peak.peak
    cpu = getattr(gpu, "cpu_experts", None)
    if cpu is not None and cpu.row_calls:
        result["cpu_experts_decode"] = cpu_share(cpu, float(result["step_us"]))  # type: ignore[arg-type]
    placed = getattr(gpu, "gpu_experts", None) or getattr(gpu, "cpu_experts", None)
    if placed is not None:
        result["experts"] = placed.describe()
        stream = getattr(getattr(gpu, "gpu_experts", None), "stream", None)
        if stream is not None:
            result["expert_stream_bytes"] = stream.streamed_bytes  # over the link, every measured pass
    if session is not None:
        result["streamed_bytes_per_pass"] = session.plan.streamed_nbytes
        result["plan_notes"] = session.plan.notes
        session.close()
    return {"model": str(path), "gguf_bytes": path.stat().st_size, "load_seconds": load_seconds,
            "engine": "streaming" if streaming else "resident", "context": context, **result}


def cpu_share(cpu: CpuExperts, step_us: float) -> dict[str, object]:
    """The CPU's part of a decode step whose blocks of experts it computes (infer.tiers.cpu_tier's
    CpuExperts, timed in its one-row calls) against the RAM's read roofline measured now with the
    same threads: the bytes it must read a token (routers, the routed experts' share of the stacks,
    shared experts) at that bandwidth."""
    from bench.cpu_kernels import read_bandwidth_gbs
    from infer import cpu_kernels

    per_block = cpu.row_seconds / cpu.row_calls
    token_s, nbytes = per_block * len(cpu.layers), cpu.row_bytes()
    threads = cpu.blocks.threads or cpu_kernels.default_threads()
    ram = read_bandwidth_gbs(threads)
    return {"blocks": len(cpu.layers), "threads": threads, "us_per_block": round(per_block * 1e6, 1),
            "ms_per_token": round(token_s * 1e3, 3), "share_of_step": round(token_s * 1e6 / step_us, 3),
            "bytes_per_token": nbytes, "achieved_GBps": round(nbytes / token_s / 1e9, 1),
            "ram_read_GBps": round(ram, 1), "roofline_ms_per_token": round(nbytes / ram / 1e6, 3)}


def synth_path(spec: str, directory: Path) -> Path:
    """'8b:q4_k_m' -> a synthetic model file in `directory`, written if missing."""
    from infer.synth import SHAPES, write_model

    shape, _, kind = spec.partition(":")
    if shape not in SHAPES or not kind:
        raise ValueError(f"--synth wants SHAPE:TYPE with SHAPE in {sorted(SHAPES)}, not '{spec}'")
    path = directory / f"synth-{shape}-{kind}.gguf"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        write_model(path.with_suffix(".part"), SHAPES[shape], kind)
        path.with_suffix(".part").rename(path)
        print(f"wrote {path} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_bench", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", type=Path, help="GGUF file")
    source.add_argument("--synth", help="synthetic model SHAPE:TYPE, e.g. 8b:q4_k_m (written if missing)")
    parser.add_argument("--synth-dir", type=Path, default=Path("/tmp/nvmedirect-synth"))
    parser.add_argument("--pp", type=int, default=512)
    parser.add_argument("--tg", type=int, default=128)
    parser.add_argument("--no-kernels", action="store_true", help="skip the per-kernel timings")
    parser.add_argument("--vram-budget", help="device memory the engine may use, e.g. 8GB (default: free less a margin)")
    parser.add_argument("--streaming", action="store_true", help="load through the streaming engine")
    parser.add_argument("--cpu-tier", default="off",
                        help="--streaming: auto, off or N (passes of at most N tokens compute the RAM layers on the CPU)")
    parser.add_argument("--experts", default="auto",
                        help="a mixture of experts: its experts in VRAM (gpu), in RAM for the CPU (cpu), N: the first "
                             "N blocks' on the CPU, the rest in VRAM; auto: in VRAM as many as fit")
    parser.add_argument("--expert-stream", default="auto",
                        help="a mixture of experts with blocks on the CPU: stream their experts to the GPU for passes "
                             "of many prompt rows (auto), from N prompt rows, or never (off)")
    parser.add_argument("--ctx", type=int, help="context (KV cache) to plan for (default: depth + pp + tg + 16)")
    parser.add_argument("--depth", type=int, default=0,
                        help="positions already in the cache when the prompt and the decode are timed (llama-bench -d)")
    parser.add_argument("--batch", type=int, default=0, help="also decode this many sequences together")
    parser.add_argument("--batch-prompt", type=int, default=128, help="prompt tokens of each batched sequence")
    parser.add_argument("--batch-new", type=int, default=64, help="new tokens of each batched sequence")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--out", type=Path, help="also write the JSON result here")
    args = parser.parse_args(argv)
    try:
        from infer.tiers.config import parse_cpu_tier

        cpu_tier = parse_cpu_tier(args.cpu_tier)
        path = args.model or synth_path(args.synth, args.synth_dir)
        result = bench_model(path, args.pp, args.tg, not args.no_kernels, args.vram_budget, args.streaming, args.ctx,
                             args.batch, args.batch_prompt, args.batch_new, args.depth, cpu_tier,
                             int(args.experts) if args.experts.isdigit() else args.experts,
                             int(args.expert_stream) if args.expert_stream.isdigit() else args.expert_stream)
        result["command"] = " ".join(["python3 -m bench.gpu_bench", *(argv if argv is not None else sys.argv[1:])])
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    from infer.gpu.benchmark import render

    print(json.dumps(result) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
