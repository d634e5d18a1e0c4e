"""The prompt products (infer/kernels/pmm.cu) in every variant on the 8B's prompt shapes, against the
canonical qmm of the same matrix: microseconds per launch (CUDA graphs of repeated launches), TFLOP/s,
and whether every variant gives the same bits (they must).

    python -m bench.pmm_sweep [--rows 512] [--out sweep.json]
    ncu --clock-control none -k regex:pmm -c 4 python -m bench.pmm_sweep --once   # one launch each, for ncu
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

# (name, GGML type, rows, cols): the 8B Q4_K_M's gate/up (stacked), down (Q6_K) and attention output
SHAPES = [("gate_up", "Q4_K", 28672, 4096), ("down", "Q6_K", 4096, 14336), ("wo", "Q4_K", 4096, 4096)]
TILES = (32, 64, 128)


def _launches(products, m, x16, x8, ys, n: int) -> dict:  # noqa: ANN001
    """label -> a launch of that variant of the product of m with the n rows into ys."""
    import cupy

    scratch = cupy.zeros(products.SPLIT_SCRATCH_BYTES // 4, cupy.float32)
    out = {f"pmm t{tile} m{rows}": (lambda tile=tile, rows=rows: products.prompt_product(
        [m], x16, ys, n, tile=tile, block_rows=rows)) for tile in TILES for rows in (128, 64)}
    out["qmm (canonical)"] = lambda: products.product([m], x8, ys, n, scratch=scratch)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512, help="activation rows (prompt tokens) a product takes")
    parser.add_argument("--reps", type=int, default=20, help="launches per timed graph")
    parser.add_argument("--once", action="store_true", help="one launch of each variant, untimed (for ncu)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    import cupy
    from gguf.constants import GGMLQuantizationType

    from infer.gpu import ops, products
    from infer.gpu.benchmark import _events_ms, _graph
    from infer.quants import activation_format
    from infer.synth import random_blocks

    rng = np.random.default_rng(0)
    stream = cupy.cuda.Stream(non_blocking=True)
    n, rows_out = args.rows, []
    for name, type_name, rows, cols in SHAPES:
        t = GGMLQuantizationType[type_name]
        m = ops.upload_matrix(random_blocks(t, rows * cols // 256, rng, 1.0 / np.sqrt(cols)).reshape(-1), t, rows, cols)
        x16 = cupy.asarray(rng.standard_normal((n, cols)).astype(np.float16))
        act = activation_format(t)
        x8 = ops.Int8Act.zeros(n, cols, act)
        ops.round_act(x16.astype(cupy.float32), cupy.empty((n, cols), cupy.float32), n, cols, act, int8=x8)
        flop = 2.0 * rows * cols * n
        bits = None
        with stream:
            ys = cupy.zeros((n, rows), cupy.float32)
            for label, launch in _launches(products, m, x16, x8, ys, n).items():
                launch()  # compile, opt in to the shared memory
                stream.synchronize()
                if args.once:
                    continue
                got = cupy.asnumpy(ys)
                same = None
                if label.startswith("pmm"):
                    bits = got if bits is None else bits
                    same = bool(np.array_equal(got, bits))
                graph = _graph(stream, lambda launch=launch: [launch() for _ in range(args.reps)])
                ms = min(_events_ms(stream, lambda graph=graph: graph.launch(stream)) for _ in range(3)) / args.reps
                row = {"matrix": name, "type": type_name, "rows": rows, "cols": cols, "n": n, "kernel": label,
                       "us": round(ms * 1e3, 1), "TFLOPS": round(flop / (ms * 1e-3) / 1e12, 1), "same_bits": same}
                rows_out.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows_out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
