"""Times the native quantized CPU products (infer/cpu_kernels.py) on an 8B model's shapes against the
NumPy path they replace (dequantize to float32, then multiply), with the machine's memory copy
bandwidth as the roofline for the weights' reads:

    python -m bench.cpu_kernels [--threads N] [--tokens 1,64] [--impl avx512,avx2] [--json]

Weights are random bytes with valid scales (timing does not depend on the values). Each case cycles
through enough copies of the matrix to exceed the last-level cache, so one-token figures are reads
from memory, not cache. Times are the median and the best of several runs; GB/s (weight bytes read),
GOP/s and the speedup over NumPy (its best of two) use the best. --impl times each listed code path
of the kernels (avx512, avx2, portable; "all": those this CPU runs) one after another, on the same
weights, for a before/after comparison in one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from infer import cpu_kernels, quants

T = GGMLQuantizationType
SHAPES = [(4096, 4096), (14336, 4096)]
TYPES = [T.Q4_K, T.Q6_K, T.Q8_0]
SCALE_OFFSETS = {T.Q4_K: (0, 2), T.Q6_K: (208,), T.Q8_0: (0,)}  # float16 scale fields in a block
CYCLE_BYTES = 160 << 20  # more than this machine's last-level cache
# native/cpu_qdot.h's QDOT_IMPL_* codes: set through the library itself, since infer.cpu_kernels'
# set_implementation names only "avx2" and "portable"
IMPL_CODES = {"portable": 0, "avx2": 1, "avx512": 2}


def implementation_name() -> str:
    code = cpu_kernels._lib().qdot_implementation()
    return next((name for name, c in IMPL_CODES.items() if c == code), str(code))


def available_implementations() -> list[str]:
    lib = cpu_kernels._lib()
    has = {"avx512": getattr(lib, "qdot_cpu_has_avx512", lambda: 0)(), "avx2": lib.qdot_cpu_has_avx2(), "portable": 1}
    return [name for name in ("avx512", "avx2", "portable") if has[name]]


def set_implementation(name: str) -> None:
    if name not in IMPL_CODES or cpu_kernels._lib().qdot_set_implementation(IMPL_CODES[name]) < 0:
        raise SystemExit(f"this build or CPU cannot run the {name} kernels (available: {available_implementations()})")


def _random_weights(rng: np.random.Generator, ggml_type: int, rows: int, cols: int) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[T(ggml_type)]
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[T(ggml_type)]:  # no NaN/subnormal scales: keep the float paths honest
        blocks[:, offset : offset + 2] = np.array([np.float16(0.01)]).view(np.uint8)
    return blocks.reshape(-1)


def _timings(run, reps: int) -> tuple[float, float]:  # noqa: ANN001
    """(median, best) seconds of `reps` calls: the best shows the kernel, the median also the
    scheduling noise of other work on the machine (a parallel product waits for its slowest thread)."""
    times = []
    for i in range(reps):
        start = time.perf_counter()
        run(i)
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def copy_bandwidth_gbs(nbytes: int = 256 << 20) -> float:
    """np.copyto of a large array, one thread: GB/s of memory traffic (bytes read + bytes written)."""
    src = np.ones(nbytes // 8)
    dst = np.empty_like(src)
    _, seconds = _timings(lambda _: np.copyto(dst, src), 5)
    return 2 * nbytes / seconds / 1e9


def read_bandwidth_gbs(threads: int, nbytes: int = 1 << 30) -> float:
    """GB/s read from memory by `threads` threads at once, each summing its share of an array larger
    than the caches (NumPy's reductions release the GIL): the RAM's roofline for kernels that read
    each weight once. The best of five."""
    import threading

    data = np.ones(nbytes // 8)  # written now: no page faults in the timed reads
    parts = np.array_split(data, max(1, threads))

    def once(_: int) -> None:
        workers = [threading.Thread(target=np.add.reduce, args=(part,)) for part in parts]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()

    _, seconds = _timings(once, 5)
    return data.nbytes / seconds / 1e9


def bench_case(rng: np.random.Generator, ggml_type: int, rows: int, cols: int, n_tokens: int, threads: int,
               baseline: bool) -> dict:
    raw = _random_weights(rng, ggml_type, rows, cols)
    copies = [raw] + [raw.copy() for _ in range(max(0, -(-CYCLE_BYTES // raw.nbytes) - 1))]
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
    cpu_kernels.matmul(raw, ggml_type, rows, cols, x, threads)  # warm up the thread pool
    reps = max(5, len(copies))
    seconds, best = _timings(lambda i: cpu_kernels.matmul(copies[i % len(copies)], ggml_type, rows, cols, x, threads),
                             reps)
    result = {"type": T(ggml_type).name, "rows": rows, "cols": cols, "tokens": n_tokens, "threads": threads,
              "implementation": implementation_name(), "us": seconds * 1e6, "best_us": best * 1e6,
              "weight_gbs": raw.nbytes / best / 1e9, "gops": 2 * rows * cols * n_tokens / best / 1e9}
    if baseline:
        def numpy_product(_: int) -> None:
            w = quants.dequantize(raw, ggml_type, (rows, cols))
            x @ w.T

        _, base = _timings(numpy_product, 2)
        result.update(numpy_us=base * 1e6, speedup=base / best)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="default: the physical cores")
    parser.add_argument("--tokens", default="1,64", help="comma-separated token counts")
    parser.add_argument("--no-baseline", action="store_true", help="skip the (slow) NumPy baseline")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--shapes", default=None,
                        help="comma-separated ROWSxCOLS matrices instead of the 8B's (e.g. 17920x1536,6720x4096: "
                             "the same bytes in short and long rows)")
    parser.add_argument("--impl", default=None,
                        help="comma-separated code paths to time in turn (avx512, avx2, portable) or 'all'; "
                             "default: the one in use")
    args = parser.parse_args(argv)
    try:
        shapes = [tuple(int(v) for v in shape.lower().split("x")) for shape in args.shapes.split(",")] \
            if args.shapes else SHAPES
        if any(len(shape) != 2 or min(shape) < 1 for shape in shapes):
            raise ValueError
    except ValueError:
        parser.error(f"--shapes takes ROWSxCOLS[,ROWSxCOLS...], not {args.shapes!r}")
    if not cpu_kernels.available():
        print("CPU kernels not built: python native/build_cpu_kernels.py", file=sys.stderr)
        return 1
    impls = (available_implementations() if args.impl == "all" else
             args.impl.split(",") if args.impl else [implementation_name()])
    threads = args.threads or cpu_kernels.default_threads()
    roofline = copy_bandwidth_gbs()
    cases = []
    for rows, cols in shapes:
        for t in TYPES:
            for n in args.tokens.split(","):
                for impl in impls:  # the same weights and activations for each path (same seed)
                    set_implementation(impl)
                    rng = np.random.default_rng([rows, t, int(n)])
                    cases.append(bench_case(rng, t, rows, cols, int(n), threads, not args.no_baseline))
    if args.json:
        print(json.dumps({"copy_gbs": roofline, "threads": threads, "cases": cases}, indent=1))
        return 0
    print(f"memory copy bandwidth (np.copyto, read + write traffic): {roofline:.1f} GB/s; "
          f"threads {threads}; {', '.join(impls)}")
    print(f"{'type':6} {'rows x cols':>12} {'tok':>4} {'impl':>8} {'median us':>10} {'best us':>9} {'GB/s':>7} "
          f"{'GOP/s':>7} {'numpy us':>11} {'speedup':>8}")
    for c in cases:
        base = f"{c['numpy_us']:11.0f} {c['speedup']:7.1f}x" if "numpy_us" in c else ""
        print(f"{c['type']:6} {c['rows']:>6}x{c['cols']:<5} {c['tokens']:>4} {c['implementation']:>8} {c['us']:10.0f} "
              f"{c['best_us']:9.0f} {c['weight_gbs']:7.2f} {c['gops']:7.1f} {base}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
