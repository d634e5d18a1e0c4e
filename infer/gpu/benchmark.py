"""Measuring the GPU backend: prompt (pp) and decode (tg) speed of a loaded GpuTransformer against
the device-to-device copy bandwidth measured in the same run, bytes per token, VRAM, and per-kernel
timings that explain where a decode step's time goes (used by bench/gpu_bench.py and the
`ntransformer --benchmark` GPU path).

Decode is timed on the captured CUDA graph (one replay per token, sampling included, one sync at
the end), like llama-bench's tg from an empty context. Kernels are timed in graphs of repeated
launches that cycle through the matrices of several layers, so their weights are not served from L2.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np


def _events_ms(stream, run: Callable[[], None], reps: int = 5) -> float:  # noqa: ANN001
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


COPY_PROBE_BYTES = 256 << 20  # several times the H200's 60 MiB L2
COPY_PROBE_MIN = 64 << 20


def copy_bandwidth(nbytes: int = COPY_PROBE_BYTES) -> float | None:
    """Device-to-device copy in GB/s, bytes read plus bytes written, of two buffers of `nbytes`, or
    less when a capped memory pool (a VRAM budget) has not that much room left: the probe stays
    inside the budget and is freed afterwards. None when not even COPY_PROBE_MIN fits."""
    import cupy

    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    if pool.get_limit():  # two buffers in a third of the room each: slack for the pool's rounding
        nbytes = min(nbytes, (pool.get_limit() - pool.total_bytes()) // 3 >> 20 << 20)
        if nbytes < COPY_PROBE_MIN:
            return None
    ms = _copy_ms(nbytes)
    pool.free_all_blocks()
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _copy_ms(nbytes: int) -> float:
    import cupy

    src = cupy.empty(nbytes // 4, dtype=cupy.float32)
    src[...] = 0.5  # not zeros (METHOD.md), and no temporaries beyond the two buffers
    dst = cupy.empty_like(src)
    stream = cupy.cuda.Stream(non_blocking=True)
    rt = cupy.cuda.runtime

    def copy() -> None:
        rt.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, rt.memcpyDeviceToDevice, stream.ptr)

    copy()
    return _events_ms(stream, copy, reps=10)


def _graph(stream, launches: Callable[[], None]):  # noqa: ANN001, ANN202
    with stream:
        launches()  # compiles and warms up outside the capture
        stream.begin_capture()
        launches()
        return stream.end_capture()


def kernel_timings(gpu, n_layers_cycle: int = 8) -> list[dict[str, object]]:  # noqa: ANN001
    """Median time per launch of each decode kernel on this model's shapes."""
    import cupy

    from infer.gpu import ops

    a, stream, rows = gpu.args, gpu.stream, []
    layers = gpu.layers[:n_layers_cycle]
    x = cupy.random.random(max(a.dim, a.ffn_dim, a.q_dim), dtype=cupy.float32) - 0.5
    outs = cupy.empty(max(a.ffn_dim, a.q_dim, a.dim, a.vocab_size), cupy.float32)

    def add(name: str, count_per_token: int, nbytes: int, launches: list[Callable[[], None]]) -> None:
        graph = _graph(stream, lambda: [f() for f in launches])
        ms = _events_ms(stream, lambda: graph.launch(stream)) / len(launches)
        rows.append({"kernel": name, "per_token": count_per_token, "us": round(ms * 1e3, 2),
                     "GBps": round(nbytes / (ms * 1e-3) / 1e9, 1) if nbytes else None})

    # the kernels the decode graph runs: integer (dp4a) GEMVs where the step uses them, else float
    from infer.gpu.ops import INT8_FORMATS, int8_buffers

    eights: dict[tuple[int, str], object] = {}

    def x8(n: int, act: str) -> object:
        if (n, act) not in eights:
            eights[(n, act)] = int8_buffers(n, act)
        return eights[(n, act)]

    def integer(m) -> bool:  # noqa: ANN001
        return gpu.int8_dot and m.fmt in INT8_FORMATS and m.act in ("q8_0", "q8_k")

    def gemv(m) -> Callable[[], None]:  # noqa: ANN001
        if integer(m):
            return lambda: ops.gemv8(m, x8(m.cols, m.act), outs[: m.rows])
        return lambda: ops.gemv(m, x[: m.cols], outs[: m.rows])

    def label(mats: list) -> str:
        fmts = "/".join(sorted({m.fmt for m in mats}))
        return f"{fmts} {'int8' if integer(mats[0]) else 'float'}"

    for j in range(len(layers[0].qkv)):
        mats = [L.qkv[j][0] for L in layers if len(L.qkv) > j]
        add(f"gemv qkv[{j}] {label(mats)} {mats[0].rows}x{mats[0].cols}", a.n_layers,
            sum(m.nbytes for m in mats) // len(mats), [gemv(m) for m in mats])
    for attr in ("wo", "w_down"):
        mats = [getattr(L, attr) for L in layers]
        add(f"gemv {attr} {label(mats)} {mats[0].rows}x{mats[0].cols}", a.n_layers,
            sum(m.nbytes for m in mats) // len(mats), [gemv(m) for m in mats])
    g0 = layers[0].w_gate
    if integer(g0):
        add(f"gemv_swiglu {g0.fmt} int8 2x{g0.rows}x{g0.cols}", a.n_layers, 2 * g0.nbytes,
            [lambda L=L: ops.gemv8_swiglu(L.w_gate, L.w_up, x8(a.dim, g0.act), outs[: a.ffn_dim]) for L in layers])
    else:
        add(f"gemv_swiglu {g0.fmt} float 2x{g0.rows}x{g0.cols}", a.n_layers, 2 * g0.nbytes,
            [lambda L=L: ops.gemv_swiglu(L.w_gate, L.w_up, x[: a.dim], outs[: a.ffn_dim]) for L in layers])
    out = gpu.output
    add(f"gemv output {label([out])} {out.rows}x{out.cols}", 1, out.nbytes, [gemv(out)])
    # for comparison (per_token 0: not in the sum): the float kernels on the two largest matrices,
    # and tuning variants of the GEMV module
    if integer(g0):
        add(f"  float gemv_swiglu {g0.fmt}", 0, 2 * g0.nbytes,
            [lambda L=L: ops.gemv_swiglu(L.w_gate, L.w_up, x[: a.dim], outs[: a.ffn_dim]) for L in layers])
        d0 = layers[0].w_down
        add(f"  float gemv w_down {d0.fmt}", 0, d0.nbytes, [lambda: ops.gemv(d0, x[: a.ffn_dim], outs[: a.dim])])
        for warps, unroll in ((2, 2), (4, 4), (4, 8), (8, 2), (8, 4)):
            d = {"GEMV_WARPS": warps, "GEMV_UNROLL": unroll}
            add(f"  variant warps={warps} unroll={unroll}: int8 swiglu", 0, 2 * g0.nbytes,
                [lambda L=L, d=d: ops.gemv8_swiglu(L.w_gate, L.w_up, x8(a.dim, g0.act), outs[: a.ffn_dim], defines=d)
                 for L in layers])
            downs = [L.w_down for L in layers if integer(L.w_down)]
            add(f"  variant warps={warps} unroll={unroll}: int8 down", 0,
                sum(m.nbytes for m in downs) // max(1, len(downs)),
                [lambda m=m, d=d: ops.gemv8(m, x8(m.cols, m.act), outs[: a.dim], defines=d) for m in downs])
    embed_cache = gpu.new_cache(1)
    add("embed", 1, 0, [lambda: ops.embed(gpu.token_embd, embed_cache.tok, 1, outs[: a.dim])])
    act_n, act_w, act_f = layers[0].w_gate.act, layers[0].wo.act, layers[0].w_down.act
    eight = gpu.int8_dot and act_n in ("q8_0", "q8_k")
    add(f"rmsnorm+round ({act_n}{', int8' if eight else ''})", 2 * a.n_layers + 1, 0,
        [lambda: ops.rmsnorm(x[: a.dim], layers[0].attn_norm, a.norm_eps, 1, a.dim, y=outs[: a.dim], act=act_n,
                             int8=x8(a.dim, act_n) if eight else None)])
    for ctx in sorted({min(128, gpu.max_context), min(4096, gpu.max_context)}):
        cache = gpu.new_cache(ctx)
        cache.pos.set(np.array([ctx - 1], np.int32), stream=stream)
        rope = (x[: a.kv_dim], x[: a.kv_dim], gpu._rope_tables[0], gpu._rope_tables[1], gpu.rope.n_pairs, a.rope_neox)
        att8 = x8(a.q_dim, act_w) if integer(layers[0].wo) else None
        kind = "one kernel" if ops.attention_fused_fits(a.n_heads, a.n_kv_heads, a.head_dim, ctx, act_w) else \
            "scores+values+sum"
        add(f"attention ({kind}, rope fused) ctx={ctx}", a.n_layers if ctx == 128 else 0, 0,
            [lambda c=cache, rope=rope, att8=att8: ops.attention_decode(
                x[: a.q_dim], c.keys[0], c.values[0], c.pos, a.n_heads, a.n_kv_heads, a.head_dim, c.max_tokens,
                c.n_splits, c.scores, c.part_o, c.part_ml, outs[: a.q_dim], act=act_w, rope=rope, int8=att8)])
        del cache
    cache = gpu.new_cache(256)
    if act_f != "f32":  # an f32 input is used as it is
        eight_f = integer(layers[0].w_down)
        add(f"round_act ffn ({act_f}{', int8' if eight_f else ''})", a.n_layers, 0,
            [lambda: ops.round_act(x[: a.ffn_dim], outs[: a.ffn_dim], 1, a.ffn_dim, act_f,
                                   int8=x8(a.ffn_dim, act_f) if eight_f else None)])
    add("sample (argmax)", 1, 0,
        [lambda: ops.sample_token(outs[: a.vocab_size], a.vocab_size, 0.0, 0, cache.tok, cache.pos, cache.tokens)])
    return rows


def measure(gpu, pp: int = 512, tg: int = 128, with_kernels: bool = True) -> dict[str, object]:  # noqa: ANN001
    """Prompt (pp tokens) and decode (tg tokens) speed of a loaded GpuTransformer (resident or
    streamed weights), each warmed up first, against the copy bandwidth of this device; bytes per
    token, VRAM; per-kernel timings with `with_kernels` (resident models). Decode runs the CUDA-graph
    step on the device (sampling included), like llama-bench's tg from an empty context."""
    import cupy

    result: dict[str, object] = {"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()}
    copy = copy_bandwidth()
    result["copy_GBps"] = round(copy, 1) if copy else None
    a, stream = gpu.args, gpu.stream
    rng = np.random.default_rng(0)
    cache = gpu.new_cache(pp + tg + 16)

    # prompt processing: pp tokens from an empty cache
    prompt = rng.integers(3, a.vocab_size, pp)

    def prefill() -> None:
        cache.length = 0
        gpu.forward(prompt, cache)

    prefill()  # warm-up: compiles, cuBLAS handles, scratch buffers, float16 copies
    pp_s = min(_host_seconds(prefill) for _ in range(3))
    result["pp_tokens"] = pp
    result["pp_tok_s"] = round(pp / pp_s, 1)

    # decode: tg tokens from an empty cache, one step per token on the device; float GEMVs and,
    # where the formats have them, integer (dp4a) GEMVs; the faster is reported as tg
    def decode_ms(int8: bool) -> tuple[float, list[int]]:
        gpu.set_int8_dot(int8)

        def decode() -> None:
            cache.length = 0
            gpu.queue_steps(cache, int(prompt[0]), tg)

        with stream:
            decode()  # warm-up: captures the graphs
            ms = _events_ms(stream, decode, reps=3)
        tokens = cupy.asnumpy(cache.tokens[1 : tg + 1], stream=stream).tolist()
        return ms, tokens

    float_ms, float_tokens = decode_ms(False)
    int8_ms, int8_tokens = decode_ms(True)
    result["tg_float_tok_s"] = round(tg / (float_ms * 1e-3), 1)
    result["tg_int8_tok_s"] = round(tg / (int8_ms * 1e-3), 1)
    # the two kernels compute the same numbers (both sum in double)
    result["tg_int8_same_tokens"] = float(np.mean(np.array(float_tokens) == np.array(int8_tokens)))
    tg_ms = min(float_ms, int8_ms)
    gpu.set_int8_dot(int8_ms < float_ms)
    result["tg_kernels"] = "int8" if int8_ms < float_ms else "float"
    tok_s = tg / (tg_ms * 1e-3)
    result["tg_tokens"] = tg
    result["tg_tok_s"] = round(tok_s, 1)
    result["step_us"] = round(tg_ms * 1e3 / tg, 1)
    src, vram = gpu.source_bytes_per_token(), gpu.weight_bytes_per_token()
    result["gguf_bytes_per_token"] = src
    result["vram_bytes_per_token"] = vram
    result["achieved_GBps"] = round(vram * tok_s / 1e9, 1)  # bytes the kernels actually read
    result["achieved_gguf_GBps"] = round(src * tok_s / 1e9, 1)  # as llama.cpp would count
    result["fraction_of_copy"] = round(vram * tok_s / 1e9 / copy, 3) if copy else None
    free, total = cupy.cuda.runtime.memGetInfo()
    result["vram_used_bytes"] = int(total - free)
    result["vram_pool_bytes"] = int(cupy.get_default_memory_pool().total_bytes())
    if gpu.account is not None:
        result["vram_budget_bytes"] = gpu.account.budget
        result["vram_budget_source"] = gpu.account.source
        result["vram_plan"] = {**gpu.account.planned, **gpu.account.reserved}
    if with_kernels and all(gpu.weights.is_resident(i) for i in range(a.n_layers)):
        rows = kernel_timings(gpu)
        result["kernels"] = rows
        result["kernel_sum_us"] = round(sum(r["us"] * r["per_token"] for r in rows), 1)  # type: ignore[operator]
    return result


def _host_seconds(run: Callable[[], None]) -> float:
    began = time.perf_counter()
    run()  # returns with the logits on the host: the device work is done
    return time.perf_counter() - began


def render(result: dict[str, object]) -> str:
    """The result as a short human-readable report (kernel table included when measured)."""
    lines = [f"{result.get('model', 'model')} on {result['device']}",
             f"  pp{result['pp_tokens']}: {result['pp_tok_s']} tok/s   tg{result['tg_tokens']}: {result['tg_tok_s']} tok/s "
             f"({result['step_us']} us/token; float GEMVs {result['tg_float_tok_s']}, int8 {result['tg_int8_tok_s']}, "
             f"same tokens {result['tg_int8_same_tokens']:.0%})",
             f"  weights read per token: {result['vram_bytes_per_token'] / 1e9:.2f} GB (GGUF "  # type: ignore[operator]
             f"{result['gguf_bytes_per_token'] / 1e9:.2f} GB) -> {result['achieved_GBps']} GB/s"  # type: ignore[operator]
             + (f" = {result['fraction_of_copy']:.0%} of the {result['copy_GBps']} GB/s copy" if result["copy_GBps"]
                else " (no room in the budget to measure the copy bandwidth)"),
             f"  VRAM used {result['vram_used_bytes'] / 2**30:.2f} GiB"  # type: ignore[operator]
             + (f", peak {result['peak_vram_bytes'] / 2**30:.2f} GiB" if "peak_vram_bytes" in result else "")  # type: ignore[operator]
             + (f" of the {result['vram_budget_bytes'] / 2**30:.2f} GiB budget ({result['vram_budget_source']})"  # type: ignore[operator]
                if "vram_budget_bytes" in result else "")
             + (f", load {result['load_seconds']} s" if "load_seconds" in result else "")]
    for row in result.get("kernels", []):  # type: ignore[union-attr]
        bw = f"{row['GBps']} GB/s" if row["GBps"] else ""
        lines.append(f"    {row['kernel']:<56} x{row['per_token']:<4} {row['us']:>9} us  {bw}")
    if "kernel_sum_us" in result:
        lines.append(f"  kernels sum {result['kernel_sum_us']} us per token vs {result['step_us']} us measured")
    return "\n".join(lines)
