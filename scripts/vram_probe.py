"""Where device memory outside the engine's pool goes: loads a model inside a VRAM budget as the
benchmark does and prints, after each phase, the device-wide use (total - free), the pool's bytes and
the rest; then every compiled kernel's local memory, registers and static shared memory, and the
stack-size limit (the driver reserves local memory for every resident thread from these).

    python scripts/vram_probe.py MODEL.gguf --vram-budget 6GB --ctx 1024
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path, nargs="?", help="(none: the phases before loading a model only)")
    parser.add_argument("--vram-budget", default="6GB")
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--stack", type=int, help="cudaLimitStackSize to set first (bytes per thread)")
    args = parser.parse_args()
    import cupy

    from infer.gguf_file import GGUFModel
    from infer.gpu import kernels, load_gpu_transformer

    pool = cupy.get_default_memory_pool()
    rows = []

    def phase(name: str) -> None:
        cupy.cuda.Device().synchronize()
        free, total = cupy.cuda.runtime.memGetInfo()
        used = total - free
        rows.append((name, used, pool.total_bytes()))
        print(f"{name:<28} used {used / 2**20:9.1f} MiB  pool {pool.total_bytes() / 2**20:9.1f} MiB  "
              f"outside the pool {(used - pool.total_bytes()) / 2**20:8.1f} MiB", flush=True)

    cupy.zeros(1)
    phase("context")
    rt = cupy.cuda.runtime
    if args.stack is not None:
        rt.deviceSetLimit(rt.cudaLimitStackSize, args.stack)
        phase(f"stack limit set to {args.stack}")
    from infer.gpu import attention, ops, products

    for name in kernels.SOURCES:
        if name != "qmm":
            kernels.module(name)
    phase("modules but qmm loaded")
    products.prepare_kernels({"k4", "k6"})
    attention.prepare(attention.AttentionShape(32, 8, 128, 64, False))
    phase("qmm modules loaded")
    work = cupy.zeros(32 * 8 * 130, cupy.float32)
    out = cupy.zeros(4096, cupy.float32)
    pos = cupy.zeros(1, cupy.int32)
    kernels.function("attention", "attn_merge")((1, 16), (256,), (work, np.int32(8), np.int32(32), np.int32(128), pos,
                                                              out, np.int32(0), np.uint64(0), np.uint64(0), np.uint64(0)))
    phase("attn_merge launched once")
    del work, out, pos
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType.Q4_K]
    raw = np.zeros(4096 * 4096 // block * size, np.uint8)
    kept = [ops.upload_matrix(raw, int(GGMLQuantizationType.Q4_K), 4096, 4096)]
    phase("one 9 MB Q4_K upload")
    kept += [ops.upload_matrix(raw, int(GGMLQuantizationType.Q4_K), 4096, 4096) for _ in range(8)]
    phase("eight more")
    big = np.zeros(14336 * 4096 // block * size, np.uint8)
    kept += [ops.upload_matrix(big, int(GGMLQuantizationType.Q4_K), 14336, 4096)]
    phase("one 33 MB upload")
    del kept
    pool.free_all_blocks()
    phase("uploads freed")
    pinned = cupy.cuda.alloc_pinned_memory(281 << 20)
    phase("281 MiB of pinned host memory")
    del pinned
    phase("pinned memory freed")
    if args.model is None:
        return 0
    from infer.gpu.weights import upload_embedding

    embedding = upload_embedding(GGUFModel(args.model))
    phase("embedding in mapped host memory")
    del embedding
    phase("embedding freed")
    gpu = load_gpu_transformer(GGUFModel(args.model), args.ctx, args.vram_budget, enforce_budget=True,
                               kv_positions=args.ctx)
    phase("loaded")
    cache = gpu.new_cache(args.ctx)
    phase("cache")
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, gpu.args.vocab_size, 512)
    gpu.forward(prompt, cache)
    phase("prompt 512 (graphs)")
    gpu.forward(prompt[:1], cache)
    phase("one decode row")
    cache.length = 0
    gpu.queue_steps(cache, 5, 16)
    gpu.stream.synchronize()
    phase("16 device steps")
    if gpu.account is not None:
        print("plan:", {k: round(v / 2**20, 1) for k, v in {**gpu.account.planned, **gpu.account.reserved}.items()})
    try:
        print("stack limit per thread:", rt.deviceGetLimit(rt.cudaLimitStackSize))
    except Exception as err:  # noqa: BLE001
        print("stack limit: n/a", err)
    seen = kernels.compiled()
    print(f"{len(seen)} modules compiled")
    for name, defines, module in seen:
        for fn_name in _kernel_names(name, defines):
            try:
                fn = module.get_function(fn_name)
            except Exception:  # noqa: BLE001, S112 - not in this variant
                continue
            local = getattr(fn, "local_size_bytes", None)
            if local:
                print(f"  local {local:>6} B  regs {getattr(fn, 'num_regs', '?'):>4}  {name} {fn_name} {dict(defines)}")
    return 0


def _kernel_names(name: str, defines: tuple) -> list[str]:
    """Every kernel name the module may hold: its plain `extern "C"` kernels, and every name its
    instantiating macros can make (absent ones are skipped by the caller)."""
    import re

    from infer.gpu import kernels

    text = kernels.source_text(name, dict(defines))
    names = set(re.findall(r'extern "C" __global__ void(?: __launch_bounds__\([^)]*\))?\s+(\w+)\(', text))
    names |= {f"qgemv_{fmt}_v{v}" for fmt in FORMATS for v in (1, 2, 4)}
    names |= {f"qmm_{fmt}_n{nt}" for fmt in FORMATS for nt in (1, 2, 4, 8)}
    names |= {f"attn_chunks_d{d}" for d in (64, 128, 256)} | {f"attn_chunks_s{s}_d{d}" for s in (2, 4, 8) for d in (128, 256)}
    return sorted(names)


FORMATS = ("q8", "g4", "g5", "k4", "k5", "k6")


if __name__ == "__main__":
    raise SystemExit(main())
