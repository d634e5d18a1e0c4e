"""Measuring the GPU backend: prompt (pp) and decode (tg) speed of a loaded GpuTransformer against
the device-to-device copy bandwidth measured in the same run, bytes per token, VRAM; a batch of
sequences decoded together (aggregate tok/s, each sequence checked against decoding it alone); the
FP64 instructions of the kernels a pass runs; and per-product timings at 1 row and at a prompt's
rows (used by bench/gpu_bench.py and the `ntransformer --benchmark` GPU path).

Decode is timed on the captured CUDA graphs (one replay per token, sampling included, one sync at
the end), like llama-bench's tg from an empty context. Products are timed in graphs of repeated
launches that cycle through the matrices of several layers, so their weights are not served from L2.
"""

from __future__ import annotations

import re
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


def copy_bandwidth(nbytes: int = COPY_PROBE_BYTES, budget: int | None = None) -> float | None:
    """Device-to-device copy in GB/s, bytes read plus bytes written, of two buffers of `nbytes`, or
    less when a capped memory pool or a VRAM budget (device-wide: total - free, as the peak counts
    it) has not that much room left: the probe stays inside the budget and is freed afterwards.
    None when not even COPY_PROBE_MIN fits."""
    import cupy

    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    rooms = []
    if pool.get_limit():
        rooms.append(pool.get_limit() - pool.total_bytes())
    if budget:
        free, total = cupy.cuda.runtime.memGetInfo()
        rooms.append(budget - (total - free))
    if rooms:  # two buffers in a third of the room each: slack for the pool's rounding
        nbytes = min(nbytes, min(rooms) // 3 >> 20 << 20)
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


# ---------------------------------------------------------------------------- FP64 in a pass
_F64 = re.compile(r"^\s*(?:@%p\d+\s+)?[a-z]+(?:\.[a-z0-9]+)*\.f64\b", re.MULTILINE)


def fp64_in_ptx(ptx: str) -> dict[str, int]:
    """Per kernel (.entry) of a PTX text, its FP64 instructions."""
    out: dict[str, int] = {}
    for entry in re.split(r"\.visible \.entry ", ptx)[1:]:
        name = entry.split("(", 1)[0].strip()
        out[name] = len(_F64.findall(entry))
    return out


def fp64_instructions(module: str, defines: dict[str, int] | None = None) -> dict[str, int]:
    """Per kernel of infer/kernels/<module>.cu (with `defines`), the FP64 instructions of its PTX
    (compiled by NVRTC for the current device, with the include paths CuPy gives its own kernels): 0
    everywhere means a pass runs no FP64 operation."""
    import os

    import cupy
    from cupy_backends.cuda.libs import nvrtc

    from infer.gpu import kernels

    # NVRTC directly: CuPy's compile helpers return a cubin, not PTX, for an architecture they know
    includes = [os.path.join(cupy.cuda.get_cuda_path() or "/usr/local/cuda", "include"),
                os.path.join(os.path.dirname(cupy.__file__), "_core", "include")]
    options = [*kernels.OPTIONS, *(f"-I{d}" for d in includes if os.path.isdir(d)),
               f"-arch=compute_{cupy.cuda.Device().compute_capability}"]
    program = nvrtc.createProgram(kernels.source_text(module, defines), f"{module}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as err:
            raise RuntimeError(f"NVRTC: {err}: {nvrtc.getProgramLog(program)[-1500:]}") from err
        ptx = nvrtc.getPTX(program)
    finally:
        nvrtc.destroyProgram(program)
    return fp64_in_ptx(ptx.decode() if isinstance(ptx, bytes) else ptx)


def pass_fp64(gpu, rows: int = 8) -> dict[str, object]:  # noqa: ANN001
    """The kernels one pass of `rows` rows (a prompt: prompt rows and a canonical last row) launches
    (recorded) and their FP64 instructions."""
    from infer.gpu import kernels

    seen = kernels.record_launches()
    try:
        cache = gpu.new_cache(rows + 1)
        gpu.graphs.drop("run")  # capture again: the recording sees the launches
        gpu.graphs.drop("layer")
        gpu.graphs.drop("head")
        gpu.forward(np.arange(3, 3 + rows) % gpu.args.vocab_size, cache, prompt=True)
    finally:
        kernels.stop_recording()
    counts: dict[str, int] = {}
    for module, defines in {(m, d) for m, _, d in seen}:
        try:
            per = fp64_instructions(module, dict(defines))
        except Exception as err:  # noqa: BLE001 - a report, not a run: say why it is missing
            return {"fp64_error": f"{type(err).__name__}: {err}"}
        counts.update({k: per.get(k, 0) for m, k, d in seen if (m, d) == (module, defines)})
    return {"pass_kernels": sorted(counts), "fp64_instructions": {k: v for k, v in counts.items() if v},
            "fp64_ops_per_pass": 0 if not any(counts.values()) else None}


# ---------------------------------------------------------------------------- products
def _graph(stream, launches: Callable[[], None]):  # noqa: ANN001, ANN202
    with stream:
        launches()  # compiles and warms up outside the capture
        stream.begin_capture()
        launches()
        return stream.end_capture()


def product_timings(gpu, rows_list: tuple[int, ...] = (1, 32, 512), n_layers_cycle: int = 8) -> list[dict[str, object]]:  # noqa: ANN001
    """Median time of each product of a layer (and the output) at each row count: GB/s of weights
    read and integer TOPS."""
    import cupy

    from infer.gpu import ops, products

    a, stream, out_rows = gpu.args, gpu.stream, []
    layers = gpu.layers[:n_layers_cycle]
    big = max(rows_list)
    ys = cupy.zeros(big * max(2 * a.ffn_dim, a.vocab_size, gpu.shape.width), cupy.float32)
    inputs: dict[tuple[str, int], object] = {}

    def x_for(m: ops.GpuMatrix) -> object:
        key = (m.act, m.cols)
        if key not in inputs:
            x = cupy.asarray(np.random.default_rng(0).standard_normal((big, m.cols)).astype(np.float32))
            if m.act in ops.EIGHT_BIT:
                int8 = ops.Int8Act.zeros(big, m.cols, m.act)
                ops.round_act(x, x, big, m.cols, m.act, int8=int8)
                inputs[key] = int8
            else:
                inputs[key] = x
        return inputs[key]

    kinds = [("attn_qkv", lambda L: L.attn_qkv()), ("attn_output", lambda L: [([L.attn_output], 0)]),
             ("ffn_gate_up", lambda L: L.ffn_gate_up()), ("ffn_down", lambda L: [([L.ffn_down], 0)])]
    for n in rows_list:
        for name, runs_of in kinds:
            launches, nbytes, macs = [], 0, 0
            for L in layers:
                for parts, _ in runs_of(L):
                    launches.append(lambda parts=parts, n=n: products.product(parts, x_for(parts[0]), ys, n))
                    nbytes += sum(m.nbytes for m in parts)
                    macs += n * sum(m.rows * m.cols for m in parts)
            graph = _graph(stream, lambda launches=launches: [f() for f in launches])
            ms = _events_ms(stream, lambda graph=graph: graph.launch(stream)) / len(layers)
            per_layer_bytes, per_layer_macs = nbytes / len(layers), macs / len(layers)
            out_rows.append({"product": name, "rows": n, "us": round(ms * 1e3, 2),
                             "kernel": "qmm" if products.uses_qmm(layers[0].attn_output.fmt, layers[0].attn_output.cols, n) else "qgemv",
                             "GBps": round(per_layer_bytes / (ms * 1e-3) / 1e9, 1),
                             "TOPS": round(2 * per_layer_macs / (ms * 1e-3) / 1e12, 1)})
        out = gpu.output
        graph = _graph(stream, lambda out=out, n=n: products.product([out], x_for(out), ys, n))
        ms = _events_ms(stream, lambda graph=graph: graph.launch(stream))
        out_rows.append({"product": "output", "rows": n, "us": round(ms * 1e3, 2),
                         "GBps": round(out.nbytes / (ms * 1e-3) / 1e9, 1),
                         "TOPS": round(2 * n * out.rows * out.cols / (ms * 1e-3) / 1e12, 1)})
    return out_rows


# ---------------------------------------------------------------------------- the run
def measure(gpu, pp: int = 512, tg: int = 128, with_kernels: bool = True, batch: int = 0,  # noqa: ANN001
            batch_prompt: int = 128, batch_new: int = 64, check_alone: bool = True, depth: int = 0) -> dict[str, object]:
    """Prompt (pp tokens) and decode (tg tokens) speed, after `depth` cached positions (llama-bench's
    -d), of a loaded GpuTransformer (resident or
    streamed weights), each warmed up first, against the copy bandwidth of this device; bytes per
    token, VRAM; with `batch`, that many sequences (prompts of batch_prompt tokens) decoded together
    for batch_new tokens each, and (check_alone) each decoded alone to compare tokens; the FP64
    instructions of a pass's kernels; product timings with `with_kernels` (resident models)."""
    import cupy

    from infer.gpu import pdl

    result: dict[str, object] = {"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()}
    copy = copy_bandwidth(budget=gpu.account.budget if gpu.account is not None else None)
    result["copy_GBps"] = round(copy, 1) if copy else None
    a, stream = gpu.args, gpu.stream
    rng = np.random.default_rng(0)
    cache = gpu.new_cache(min(gpu.max_context, depth + pp + tg + 16))
    if depth:  # the cached positions every timed run starts from
        gpu.forward(rng.integers(3, a.vocab_size, depth), cache, prompt=True)
        result["depth"] = depth

    def rewind() -> None:  # to the depth: a local layer's ring still holds the window before it
        if not cache.can_rewind(depth):
            raise RuntimeError(f"the KV cache cannot return to depth {depth} after {cache.length} positions")
        cache.length = depth

    # prompt processing: pp tokens from an empty cache, as generation runs a prompt (every token but
    # the last as a prompt row, the logits of the last); and every row canonical (a scored prompt)
    prompt = rng.integers(3, a.vocab_size, pp)

    def prefill(as_prompt: bool = True) -> None:
        rewind()
        gpu.forward(prompt, cache, prompt=as_prompt)

    for as_prompt, key in ((True, "pp_tok_s"), (False, "pp_canonical_tok_s")):
        prefill(as_prompt)  # warm-up: compiles, captures the graphs of the passes
        pp_s = min(_host_seconds(lambda as_prompt=as_prompt: prefill(as_prompt)) for _ in range(3))
        result[key] = round(pp / pp_s, 1)
    result["pp_tokens"] = pp

    # decode: tg tokens after the depth, one step per token on the device
    def decode() -> None:
        rewind()
        gpu.queue_steps(cache, int(prompt[0]), tg)

    with stream:
        decode()  # warm-up: captures the graphs
        tg_ms = _events_ms(stream, decode, reps=3)
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
    result["programmatic_launch"] = pdl.available()  # the replayed passes' kernels waited on the GPU
    result["programmatic_launch_prefetch"] = pdl.prefetch_enabled()  # resident products loaded weights first
    if batch:
        result["batch"] = batch_decode(gpu, batch, batch_prompt, batch_new, check_alone)
    result.update(pass_fp64(gpu))
    free, total = cupy.cuda.runtime.memGetInfo()
    result["vram_used_bytes"] = int(total - free)
    result["vram_pool_bytes"] = int(cupy.get_default_memory_pool().total_bytes())
    if gpu.account is not None:
        result["vram_budget_bytes"] = gpu.account.budget
        result["vram_budget_source"] = gpu.account.source
        result["vram_plan"] = {**gpu.account.planned, **gpu.account.reserved}
    if with_kernels and all(gpu.weights.is_resident(i) for i in range(a.n_layers)):
        result["products"] = product_timings(gpu, (1, 32, min(pp, gpu.capacity)))
    return result


def batch_decode(gpu, sequences: int, prompt_len: int, new: int, check_alone: bool = True) -> dict[str, object]:  # noqa: ANN001
    """`sequences` prompts of prompt_len random tokens prefilled together, then `new` tokens of each
    decoded together (one pass a step, greedy on the device): aggregate decode tok/s; and each
    sequence decoded alone from its own prompt, its tokens compared."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, gpu.args.vocab_size, prompt_len) for _ in range(sequences)]
    ctx = prompt_len + new + 1
    caches = [gpu.new_cache(ctx) for _ in range(sequences)]

    def run() -> tuple[float, float, list[list[int]]]:
        for c in caches:
            c.length = 0
        started = time.perf_counter()
        gpu.prefill_batch([(p[:-1], c) for p, c in zip(prompts, caches, strict=True)])
        prefilled = time.perf_counter()
        out = gpu.decode_batch([p[-1:] for p in prompts], caches, new, check_every=new)
        return prefilled - started, time.perf_counter() - prefilled, out

    run()  # warm-up: graphs of these row counts
    prefill_s, decode_s, together = min((run() for _ in range(2)), key=lambda r: r[1])
    report: dict[str, object] = {"sequences": sequences, "prompt_tokens": prompt_len, "new_tokens": new,
                                 "prefill_tok_s": round(sequences * (prompt_len - 1) / prefill_s, 1),
                                 "decode_aggregate_tok_s": round(sequences * new / decode_s, 1),
                                 "decode_seconds": round(decode_s, 4)}
    if check_alone:
        same = 0
        for p, want in zip(prompts, together, strict=True):
            cache = gpu.new_cache(ctx)
            gpu.prefill(p[:-1], cache)
            same += int(gpu.decode_batch([p[-1:]], [cache], new, check_every=new)[0] == want)
        report["identical_to_alone"] = f"{same}/{sequences}"
    return report


def _host_seconds(run: Callable[[], None]) -> float:
    began = time.perf_counter()
    run()  # returns with the logits on the host: the device work is done
    return time.perf_counter() - began


def render(result: dict[str, object]) -> str:
    """The result as a short human-readable report (product table included when measured)."""
    depth = f" after {result['depth']} cached positions" if result.get("depth") else ""
    lines = [f"{result.get('model', 'model')} on {result['device']}{depth}",
             f"  pp{result['pp_tokens']}: {result['pp_tok_s']} tok/s (every row canonical: {result['pp_canonical_tok_s']})"
             f"   tg{result['tg_tokens']}: {result['tg_tok_s']} tok/s ({result['step_us']} us/token)",
             f"  weights read per token: {result['vram_bytes_per_token'] / 1e9:.2f} GB (GGUF "  # type: ignore[operator]
             f"{result['gguf_bytes_per_token'] / 1e9:.2f} GB) -> {result['achieved_GBps']} GB/s"  # type: ignore[operator]
             + (f" = {result['fraction_of_copy']:.0%} of the {result['copy_GBps']} GB/s copy" if result["copy_GBps"]
                else " (no room in the budget to measure the copy bandwidth)"),
             f"  VRAM used {result['vram_used_bytes'] / 2**30:.2f} GiB"  # type: ignore[operator]
             + (f", peak {result['peak_vram_bytes'] / 2**30:.2f} GiB" if "peak_vram_bytes" in result else "")  # type: ignore[operator]
             + (f" of the {result['vram_budget_bytes'] / 2**30:.2f} GiB budget ({result['vram_budget_source']})"  # type: ignore[operator]
                if "vram_budget_bytes" in result else "")
             + (f", load {result['load_seconds']} s" if "load_seconds" in result else "")]
    if "fp64_ops_per_pass" in result:
        lines.append(f"  FP64 operations per pass: {result['fp64_ops_per_pass']}"
                     + (f" (kernels with FP64: {result['fp64_instructions']})" if result.get("fp64_instructions") else ""))
    cpu = result.get("cpu_experts_decode")
    if isinstance(cpu, dict):
        lines.append(f"  the CPU's {cpu['blocks']} blocks of experts: {cpu['ms_per_token']} ms of a token "
                     f"({cpu['share_of_step']:.0%} of the step), {cpu['bytes_per_token'] / 1e6:.0f} MB read -> "
                     f"{cpu['achieved_GBps']} GB/s; RAM read {cpu['ram_read_GBps']} GB/s ({cpu['threads']} threads): "
                     f"{cpu['roofline_ms_per_token']} ms at best")
    batch = result.get("batch")
    if isinstance(batch, dict):
        lines.append(f"  {batch['sequences']} sequences x {batch['new_tokens']} new tokens: "
                     f"{batch['decode_aggregate_tok_s']} tok/s aggregate decode, prefill {batch['prefill_tok_s']} tok/s"
                     + (f", identical to alone {batch['identical_to_alone']}" if "identical_to_alone" in batch else ""))
    for row in result.get("products", []):  # type: ignore[union-attr]
        lines.append(f"    {row['product']:<8} x{row['rows']:<4} {row['us']:>9} us  {row['GBps']:>7} GB/s  "
                     f"{row['TOPS']:>6} TOPS  {row.get('kernel', '')}")
    return "\n".join(lines)
