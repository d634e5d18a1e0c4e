"""GPU backend: CUDA kernels through CuPy. CuPy is imported lazily, so this package imports (and
its NumPy parts run) on machines without it."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

# cuBLAS sizes its workspace from this when its handle is made: a fixed, counted amount of the VRAM
# budget (infer.gpu.memory.CUBLAS_WORKSPACE_BYTES) rather than whatever the library picks.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

if TYPE_CHECKING:
    from infer.gguf_file import GGUFModel
    from infer.gpu.model import GpuTransformer


def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def resolve_device(device: str) -> str:
    """'auto' -> 'gpu' when CuPy sees a GPU, else 'cpu'; 'gpu' without one is a one-line ValueError."""
    if device not in ("auto", "cpu", "gpu"):
        raise ValueError(f"unknown device '{device}' (known: auto, cpu, gpu)")
    if device == "cpu":
        return "cpu"
    if gpu_available():
        return "gpu"
    if device == "gpu":
        raise ValueError("--device gpu: no CUDA GPU is visible to CuPy (install cupy-cuda13x, check the driver)")
    return "cpu"


def load_gpu_transformer(model: GGUFModel, max_context: int | None = None, vram_budget: str | int | None = None,
                         prefill_chunk: int = 512, match_llama_cpp: bool = True, int8_dot: bool = True,
                         batch: int = 1, enforce_budget: bool = False,
                         planned: dict[str, int] | None = None, half_copies: bool = True) -> GpuTransformer:
    """The model checked as infer.model.load_transformer checks it, its weights resident on the
    current GPU, planned against the VRAM budget (`vram_budget`, default the free memory less a
    margin): weights, the KV cache of `batch` sequences of `max_context` positions (default the
    model's, at most 4096), activations of prompt chunks of `prefill_chunk` rows; float16 copies of
    the matrices for prompts only as far as the budget has room. A model that does not fit raises
    VramBudgetError (one line, what each part takes, a hint to use --streaming). enforce_budget: cap
    CuPy's memory pool at the budget (process-wide). planned: device memory already taken in the same
    budget (e.g. {"draft model": bytes}), shown in the plan. half_copies: False keeps no float16
    copies (a draft model leaves the room to its target). match_llama_cpp: round the inputs of matrix
    products as llama.cpp's CPU does (the CPU engine's default), else keep them float32. int8_dot:
    decode GEMVs with integer dot products on those rounded inputs (the same numbers). The decode
    kernels sum in double: their logits are those of load_transformer(..., exact=True) (docs/GPU.md)."""
    import cupy

    from infer.arch import check_model, rope_freq_factors
    from infer.errors import UnsupportedModelError
    from infer.gpu import memory
    from infer.gpu.layout import format_of
    from infer.gpu.model import GpuTransformer
    from infer.gpu.weights import ResidentWeights
    from infer.tiers.budget import activation_nbytes, attention_work_nbytes, kv_cache_nbytes
    from infer.tiers.plan import planner_tensors

    args = check_model(model)
    for info in model.tensors.values():
        if len(info.shape) == 2:
            try:
                format_of(info.ggml_type)
            except ValueError as err:
                raise UnsupportedModelError(model.path, str(err), f"tensor {info.name}") from None
    context = max_context or min(args.context_length, 4096)
    account = memory.new_account(vram_budget, f"{model.path.name} on the GPU")
    tensors = planner_tensors(model, "gpu")
    account.plan("weights", sum(t.device_nbytes for t in tensors))
    account.plan("KV cache", batch * (kv_cache_nbytes(args, context, 1) + attention_work_nbytes(args, context)))
    account.plan("activations", activation_nbytes(args, prefill_chunk, context, batch)
                 + 8 * context * (args.rope_dim // 2))  # + the rotary tables
    for name, nbytes in (planned or {}).items():
        account.plan(name, nbytes)
    account.check(": run with --streaming (or lower -c/--ctx-size)")
    halves = sum(2 * t.shape[0] * t.shape[1] for t in tensors  # f16 matrices are used as they are
                 if t.layer is not None and len(t.shape) == 2 and format_of(t.ggml_type) != "f16")
    copies = min(halves, account.room) if half_copies else 0  # float16 copies for prompts: as far as there is room
    account.plan("float16 copies for prompts", copies)
    if enforce_budget:
        memory.enforce(account)
    weights = ResidentWeights(model, args, match_llama_cpp)
    cupy.cuda.Device().synchronize()
    cupy.get_default_memory_pool().free_all_blocks()  # the uploads' temporaries
    gpu = GpuTransformer(args, weights, rope_freq_factors(model, args), context, prefill_chunk=prefill_chunk,
                         int8_dot=int8_dot, half_copies=copies)
    gpu.account = account
    return gpu
