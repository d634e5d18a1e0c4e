"""Times the kernels of a pass on the 8B's shapes (random weights, no model file) and their tuning
variants, to choose infer.gpu.products.QMM_TUNING / QGEMV_TUNING and to see where a pass's time goes:

- products (qgemv at 1-4 rows, qmm at 5-512) of each Q4_K_M matrix of an 8B layer and the output,
  for each variant (qmm: warps of 16 rows x pipeline stages; qgemv: warps x loads in flight): us,
  GB/s of weights, integer TOPS; every variant's outputs checked equal to the default's (the
  canonical sum does not depend on the variant);
- attention (rope, chunks, merge) for 1 row at several cache lengths and for a 512-row prompt;
- norms and SwiGLU at 1 and 512 rows.

    python -m bench.kernel_sweep [--rows 1,8,16,32,64,128,256,512] [--out sweep.json]

Each figure is the median of event-timed replays of a CUDA graph that cycles through several copies
of the weights (more than the L2 holds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

QMM_VARIANTS = [(2, 2), (2, 3), (2, 4), (4, 2), (4, 3), (4, 4), (8, 3)]
QGEMV_VARIANTS = [(4, 2), (4, 4), (8, 2), (2, 4), (8, 4)]
DIM, FFN, KV, VOCAB = 4096, 14336, 1024, 128256


def _events_ms(stream, run, reps: int = 7) -> float:  # noqa: ANN001
    import cupy

    times = []
    for _ in range(reps):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        run()
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def _graph(stream, launches):  # noqa: ANN001, ANN202
    with stream:
        launches()
        stream.synchronize()
        stream.begin_capture()
        launches()
        return stream.end_capture()


def _timed(stream, launches, per: int) -> float:  # noqa: ANN001
    """Microseconds per launch of a graph of `per` launches."""
    graph = _graph(stream, launches)
    return _events_ms(stream, lambda: graph.launch(stream)) * 1e3 / per


def _matrix(rng: np.random.Generator, ggml_type: int, rows: int, cols: int):  # noqa: ANN202
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    from infer.gpu import ops
    from infer.synth import random_blocks

    block, _ = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    raw = random_blocks(ggml_type, rows * cols // block, rng, 1.0 / np.sqrt(cols)).reshape(-1)
    return ops.upload_matrix(raw, ggml_type, rows, cols)


def products(rows_list: list[int], copies: int = 3, matrices: list[str] | None = None,
             default_only: bool = False) -> list[dict[str, object]]:
    import cupy
    from gguf.constants import GGMLQuantizationType as T

    from infer.gpu import ops, products

    rng = np.random.default_rng(0)
    shapes = {"qkv": [(T.Q4_K, DIM, DIM), (T.Q4_K, KV, DIM), (T.Q4_K, KV, DIM)], "wo": [(T.Q4_K, DIM, DIM)],
              "gate_up": [(T.Q4_K, FFN, DIM), (T.Q4_K, FFN, DIM)], "down_k4": [(T.Q4_K, DIM, FFN)],
              "down_k6": [(T.Q6_K, DIM, FFN)], "output": [(T.Q6_K, VOCAB, DIM)]}
    stream = cupy.cuda.Stream(non_blocking=True)
    big = max(rows_list)
    ys = cupy.zeros(big * max(2 * FFN, VOCAB), cupy.float32)
    acts: dict[tuple[str, int], ops.Int8Act] = {}
    out: list[dict[str, object]] = []
    for name, parts in shapes.items():
        if matrices and name not in matrices:
            continue
        n_copies = 1 if name == "output" else copies
        mats = [[_matrix(rng, t, r, c) for t, r, c in parts] for _ in range(n_copies)]
        m0 = mats[0][0]
        key = (m0.act, m0.cols)
        if key not in acts:
            x = cupy.asarray(rng.standard_normal((big, m0.cols)).astype(np.float32))
            acts[key] = ops.Int8Act.zeros(big, m0.cols, m0.act)
            ops.round_act(x, x, big, m0.cols, m0.act, int8=acts[key])
        x8 = acts[key]
        nbytes = sum(m.nbytes for m in mats[0])
        macs = sum(m.rows * m.cols for m in mats[0])
        for n in rows_list:
            qmm = products.uses_qmm(m0.fmt, m0.cols, n)
            variants = QMM_VARIANTS if qmm else QGEMV_VARIANTS
            if default_only:
                variants = [None]
            want = None
            for tuning in variants:
                try:
                    with stream:
                        products.product(mats[0], x8, ys, n, tuning=tuning)
                        got = cupy.asnumpy(ys[: n * sum(m.rows for m in mats[0])], stream=stream)
                    if want is None:
                        want = got
                    same = bool(np.array_equal(got, want))
                    us = _timed(stream, lambda tuning=tuning, n=n, mats=mats, x8=x8: [
                        products.product(m, x8, ys, n, tuning=tuning) for m in mats], n_copies)
                except Exception as err:  # noqa: BLE001 - a variant that does not launch: say so, go on
                    out.append({"matrix": name, "rows": n, "tuning": list(tuning or ()), "error": f"{type(err).__name__}: {err}"})
                    continue
                out.append({"matrix": name, "rows": n, "kernel": "qmm" if qmm else "qgemv", "tuning": list(tuning or ()),
                            "us": round(us, 2), "GBps": round(nbytes / (us * 1e-6) / 1e9, 1),
                            "TOPS": round(2 * n * macs / (us * 1e-6) / 1e12, 1), "same_bits": same})
                print(json.dumps(out[-1]), flush=True)
        mats.clear()
        cupy.get_default_memory_pool().free_all_blocks()
    return out


def attention_and_friends() -> list[dict[str, object]]:
    import cupy

    from infer.gpu import attention, ops
    from infer.gpu.activations import Inputs

    rng = np.random.default_rng(1)
    stream = cupy.cuda.Stream(non_blocking=True)
    shape = attention.AttentionShape(32, 8, 128, 64, False)
    out: list[dict[str, object]] = []
    max_ctx = 4096
    caches = [cupy.asarray((rng.standard_normal((1, 8, max_ctx, 128)) * 0.5).astype(np.float16)) for _ in range(2)]
    cos = cupy.asarray(rng.random((max_ctx, 64)).astype(np.float32))
    sin = cupy.asarray(rng.random((max_ctx, 64)).astype(np.float32))

    def fields(positions: list[int]) -> attention.RowFields:
        n = len(positions)
        i32 = lambda v: cupy.asarray(np.array(v, np.int32))  # noqa: E731
        u64 = lambda v: cupy.asarray(np.array(v, np.uint64))  # noqa: E731
        return attention.RowFields(i32(positions), i32(positions), i32([p + 1 for p in positions]), i32([-1] * n), i32([0]),
                             u64([caches[0].data.ptr] * n), u64([caches[1].data.ptr] * n), i32([max_ctx] * n))

    for n, positions in ((1, [127]), (1, [511]), (1, [2047]), (32, [191] * 32), (512, list(range(512)))):
        rows = fields(positions)
        qkv = cupy.asarray(rng.standard_normal((n, shape.width)).astype(np.float32))
        work_rows = min(n, max(1, (32 << 20) // attention.attention_work_nbytes(shape, 1, max_ctx)))
        work = cupy.zeros(attention.attention_work_nbytes(shape, work_rows, max_ctx) // 4, cupy.float32)
        att = cupy.zeros((n, 4096), cupy.float32)
        int8 = ops.Int8Act.zeros(n, 4096, "q8_k")
        tag = f"{n} rows at position {positions[-1]}"
        us = _timed(stream, lambda rows=rows, qkv=qkv, n=n: attention.rope_rows(qkv, shape, cos, sin, 0, rows, n), 1)
        out.append({"kernel": "rope_rows", "case": tag, "us": round(us, 2)})
        us = _timed(stream, lambda rows=rows, qkv=qkv, n=n, work=work, att=att, int8=int8, wr=work_rows: attention.attention(
            qkv, shape, 0, rows, n, max_ctx, work, wr, att, "q8_k", int8), 1)
        out.append({"kernel": "attention (chunks + merge)", "case": tag, "us": round(us, 2)})
        print(json.dumps(out[-2]), json.dumps(out[-1]), flush=True)
    out += _head_splits(rng, stream)
    from infer.arch import ModelArgs

    args = ModelArgs(arch="llama", n_layers=1, dim=DIM, ffn_dim=FFN, n_heads=32, n_kv_heads=8, head_dim=128,
                     vocab_size=VOCAB, context_length=4096, norm_eps=1e-5, rope_base=1e4, rope_dim=128,
                     rope_neox=False)
    for n in (1, 32, 512):
        inputs = Inputs(args, n, [("attn", "q8_k", DIM)])
        x = cupy.asarray(rng.standard_normal((n, DIM)).astype(np.float32))
        w = cupy.asarray(rng.standard_normal(DIM).astype(np.float32))
        us = _timed(stream, lambda inputs=inputs, x=x, n=n, w=w: inputs.normed(x, w, "attn", ["q8_k"], n), 1)
        out.append({"kernel": "rmsnorm + q8_k", "case": f"{n} rows", "us": round(us, 2)})
        gu = cupy.asarray(rng.standard_normal((n, 2 * FFN)).astype(np.float32))
        ff = ops.Int8Act.zeros(n, FFN, "q8_k")
        us = _timed(stream, lambda gu=gu, ff=ff, n=n: ops.glu_round(gu, FFN, n, "q8_k", int8=ff), 1)
        out.append({"kernel": "swiglu + q8_k", "case": f"{n} rows", "us": round(us, 2)})
        print(json.dumps(out[-2]), json.dumps(out[-1]), flush=True)
    return out


def _head_splits(rng: np.random.Generator, stream) -> list[dict[str, object]]:  # noqa: ANN001
    """A decode step's attention with each KV head's query heads split over every count of
    attention.HEAD_SPLITS that divides the group (attention.head_splits), the cache sized to the
    position (as a bench's max_ctx), for the 30B-A3B (32 query heads over 4 KV heads of 128) and
    the Qwen2.5-Coder pair (0.5B: 14 over 2 of 64; 1.5B: 12 over 2 of 128)."""
    import os

    import cupy

    from infer.gpu import attention, ops

    out: list[dict[str, object]] = []
    for name, n_heads, n_kv, hd in (("30B-A3B", 32, 4, 128), ("Qwen2.5 0.5B", 14, 2, 64), ("Qwen2.5 1.5B", 12, 2, 128)):
        shape = attention.AttentionShape(n_heads, n_kv, hd, hd // 2, True)
        group, q_values = n_heads // n_kv, n_heads * hd
        for position in (63, 575, 2047):
            max_ctx = position + 1
            caches = [cupy.asarray((rng.standard_normal((1, n_kv, max_ctx, hd)) * 0.5).astype(np.float16))
                      for _ in range(2)]
            i32 = lambda v: cupy.asarray(np.array(v, np.int32))  # noqa: E731
            rows = attention.RowFields(i32([position]), i32([position]), i32([position + 1]), i32([-1]), i32([0]),
                                       cupy.asarray(np.array([caches[0].data.ptr], np.uint64)),
                                       cupy.asarray(np.array([caches[1].data.ptr], np.uint64)), i32([max_ctx]))
            qkv = cupy.asarray(rng.standard_normal((1, shape.width)).astype(np.float32))
            work = cupy.zeros(attention.attention_work_nbytes(shape, 1, max_ctx) // 4, cupy.float32)
            att = cupy.zeros((1, q_values), cupy.float32)
            act = "q8_k" if q_values % 256 == 0 else "q8_0"
            int8 = ops.Int8Act.zeros(1, q_values, act)
            default = attention.head_splits(group, n_kv * attention.attention_blocks(max_ctx), hd)
            for splits in attention.HEAD_SPLITS[hd]:
                if group % splits:
                    continue
                os.environ["NVMEDIRECT_ATTN_SPLITS"] = str(splits)
                us = _timed(stream, lambda rows=rows, qkv=qkv, work=work, att=att, int8=int8, m=max_ctx, shape=shape,
                            act=act: [attention.attention(qkv, shape, 0, rows, 1, m, work, 1, att, act, int8)
                                      for _ in range(20)], 20)
                out.append({"kernel": f"attention {n_heads}/{n_kv} heads of {hd} (chunks + merge, {name})",
                            "case": f"position {position}", "splits": splits, "default": splits == default,
                            "us": round(us, 2)})
                print(json.dumps(out[-1]), flush=True)
            os.environ.pop("NVMEDIRECT_ATTN_SPLITS")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kernel_sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512")
    parser.add_argument("--skip-products", action="store_true")
    parser.add_argument("--skip-others", action="store_true", help="products only (no attention, norms)")
    parser.add_argument("--matrices", help="comma-separated products to time (qkv, wo, gate_up, down_k4, down_k6, "
                        "output); all by default")
    parser.add_argument("--default-only", action="store_true", help="only the tuned variant of each kernel")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    import cupy

    began = time.perf_counter()
    result: dict[str, object] = {"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                                 "command": " ".join(["python3 -m bench.kernel_sweep", *(argv or sys.argv[1:])])}
    if not args.skip_others:
        result["others"] = attention_and_friends()
    if not args.skip_products:
        result["products"] = products([int(v) for v in args.rows.split(",")],
                                      matrices=args.matrices.split(",") if args.matrices else None,
                                      default_only=args.default_only)
    result["seconds"] = round(time.perf_counter() - began, 1)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    best: dict[tuple[str, int], dict] = {}
    for row in result.get("products", []):  # type: ignore[union-attr]
        if "us" in row and ((row["matrix"], row["rows"]) not in best or row["us"] < best[(row["matrix"], row["rows"])]["us"]):
            best[(row["matrix"], row["rows"])] = row
    for (name, n), row in sorted(best.items()):
        print(f"best {name:<8} x{n:<4} {row['kernel']:<5} {row['tuning']}  {row['us']:>8} us  {row['GBps']:>7} GB/s  "
              f"{row['TOPS']:>6} TOPS")
    bad = [r for r in result.get("products", []) if r.get("same_bits") is False]  # type: ignore[union-attr]
    print(f"variants with other bits than the default: {len(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
