"""`ntransformer --benchmark`: prompt (pp) and decode (tg) speed of a loaded model, warmed up first,
in one table. On the GPU it is infer.gpu.benchmark.measure (the code bench/gpu_bench.py runs:
CUDA-graph decode, the copy roofline of the same run, peak device memory); on the CPU the same
two figures from the NumPy engine, with the process's peak resident memory.
"""

from __future__ import annotations

import resource
import time
from typing import Any

import numpy as np

from infer.engine import Model

CPU_PROMPT_TOKENS = 128  # the CPU engine's pp (512 would take a while on a small machine)
GPU_PROMPT_TOKENS = 512


def measure(model: Model, tg: int, pp: int | None = None, with_kernels: bool = False) -> dict[str, Any]:
    """pp tokens of prompt and tg decoded tokens, each from an empty cache after a warm-up run."""
    if model.device == "gpu":
        from infer.gpu.benchmark import measure as measure_gpu

        return measure_gpu(model, pp or GPU_PROMPT_TOKENS, tg, with_kernels)
    return measure_cpu(model, pp or CPU_PROMPT_TOKENS, tg)


def measure_cpu(model: Model, pp: int, tg: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    a = model.args
    prompt = rng.integers(3, a.vocab_size, pp)
    model.forward(prompt[:8], model.new_cache(16))  # warm-up: dequantized weights, BLAS threads
    cache = model.new_cache(pp + tg + 1)
    began = time.perf_counter()
    logits = model.forward(prompt, cache)
    pp_s = time.perf_counter() - began
    began = time.perf_counter()
    for _ in range(tg):
        logits = model.forward(np.array([int(np.argmax(logits))]), cache)
    tg_s = time.perf_counter() - began
    return {"device": "cpu", "pp_tokens": pp, "pp_tok_s": round(pp / pp_s, 2), "tg_tokens": tg,
            "tg_tok_s": round(tg / tg_s, 2), "step_us": round(1e6 * tg_s / tg, 1),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def render(result: dict[str, Any]) -> str:
    if result["device"] != "cpu":
        from infer.gpu.benchmark import render as render_gpu

        return render_gpu(result)
    return (f"{result.get('model', 'model')} on the CPU\n"
            f"  pp{result['pp_tokens']}: {result['pp_tok_s']} tok/s   tg{result['tg_tokens']}: {result['tg_tok_s']} "
            f"tok/s ({result['step_us']} us/token)\n"
            f"  peak resident memory {result['peak_rss_bytes'] / 2**30:.2f} GiB")
