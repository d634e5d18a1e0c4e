"""GPU benchmark entry: a GGUF model (or a synthetic one, written if missing) on the GPU; prints
prompt and decode speed, bytes per token against the copy bandwidth, VRAM and per-kernel timings
(infer.gpu.benchmark).

    python -m bench.gpu_bench --synth 8b:q4_k_m --pp 512 --tg 128 [--json] [--out result.json]
    python -m bench.gpu_bench --model file.gguf
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def bench_model(path: Path, pp: int, tg: int, with_kernels: bool = True) -> dict[str, object]:
    from infer.gguf_file import GGUFModel
    from infer.gpu import load_gpu_transformer
    from infer.gpu.benchmark import measure

    started = time.perf_counter()
    gpu = load_gpu_transformer(GGUFModel(path))
    load_seconds = round(time.perf_counter() - started, 2)
    result = measure(gpu, pp, tg, with_kernels)
    return {"model": str(path), "gguf_bytes": path.stat().st_size, "load_seconds": load_seconds, **result}


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
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--out", type=Path, help="also write the JSON result here")
    args = parser.parse_args(argv)
    try:
        path = args.model or synth_path(args.synth, args.synth_dir)
        result = bench_model(path, args.pp, args.tg, with_kernels=not args.no_kernels)
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
