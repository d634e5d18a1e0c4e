"""GPU backend: CUDA kernels through CuPy. CuPy is imported lazily, so this package imports (and
its NumPy parts run) on machines without it."""

from __future__ import annotations

from typing import TYPE_CHECKING

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


def load_gpu_transformer(model: GGUFModel, prefill_chunk: int = 512, match_llama_cpp: bool = True,
                         int8_dot: bool = True) -> GpuTransformer:
    """ModelArgs and checks as infer.model.load_transformer, weights uploaded to the current GPU.
    The result has the CPU Transformer's calls (new_cache, forward), so infer.engine.Engine runs it.
    match_llama_cpp: round the inputs of matrix products as llama.cpp's CPU does (the CPU engine's
    default), else keep them float32. int8_dot: decode GEMVs with integer dot products on those
    rounded inputs (the same numbers; False: the float kernels). The decode kernels sum in double:
    their logits are those of load_transformer(..., exact=True) (docs/GPU.md)."""
    from infer.errors import UnsupportedModelError
    from infer.gpu.layout import format_of
    from infer.gpu.model import GpuTransformer
    from infer.model import DequantizedWeights, ModelArgs

    args = ModelArgs.from_gguf(model)
    DequantizedWeights(model, args, budget_bytes=0)  # presence, shape and type of every tensor
    for info in model.tensors.values():
        if len(info.shape) == 2:
            try:
                format_of(info.ggml_type)
            except ValueError as err:
                raise UnsupportedModelError(model.path, str(err), f"tensor {info.name}") from None
    factors = model.tensor("rope_freqs.weight").dequantize() if "rope_freqs.weight" in model.tensors else None
    return GpuTransformer(model, args, factors, prefill_chunk=prefill_chunk, match_llama_cpp=match_llama_cpp,
                          int8_dot=int8_dot)
