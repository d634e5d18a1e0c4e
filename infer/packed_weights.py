"""The CPU weights left packed in the mapped GGUF file and multiplied by the native kernels
(infer.cpu_kernels): nothing is dequantized at load, the process holds the file's pages instead of a
float32 copy, and each product rounds its input once to the 8-bit blocks llama.cpp uses.

Opt-in while the oracle tests are checked against it (issue 28): NVMEDIRECT_CPU_PRODUCTS=native, or
`load_transformer(..., packed=True)`. Exact numerics (float64) never take it.
"""

from __future__ import annotations

import os

import numpy as np

from infer import cpu_kernels
from infer.arch import ModelArgs
from infer.cpu_layers import NativeLayers
from infer.gguf_file import GGUFModel
from infer.model import DequantizedWeights, Linear


def native_products_requested() -> bool:
    """NVMEDIRECT_CPU_PRODUCTS=native asks for the packed weights and native products."""
    return os.environ.get("NVMEDIRECT_CPU_PRODUCTS", "") == "native"


class PackedLinear(cpu_kernels.FusedProduct):
    """y = x @ W.T for W made of GGUF tensors stacked row-wise (Q, K, V or gate, up), each left in its
    packed bytes: one native call (cpu_kernels.FusedProduct) rounds x once per activation format,
    shares it among the parts that take it and writes every part's outputs side by side."""

    def __init__(self, parts: list[tuple[np.ndarray, int, int, int]], threads: int | None = None) -> None:
        super().__init__(parts, threads)
        self.parts = parts  # (raw uint8 bytes, GGML type, rows, cols)

    @property
    def nbytes(self) -> int:
        return 0  # pages of the mapped file, not memory this process allocated


class PackedWeights(DequantizedWeights):
    """DequantizedWeights whose matrices stay packed (PackedLinear) when the native kernels take their
    types; vectors and the embedding rows are dequantized as before."""

    def __init__(self, model: GGUFModel, args: ModelArgs, budget_bytes: int = 8 << 30,
                 match_llama_cpp: bool = True, exact: bool = False, threads: int | None = None) -> None:
        super().__init__(model, args, budget_bytes, match_llama_cpp, exact)
        if not cpu_kernels.available():
            raise RuntimeError("NVMEDIRECT_CPU_PRODUCTS=native needs the native CPU kernels: run "
                               "`bash scripts/bootstrap.sh` (or `python native/build_cpu_kernels.py`)")
        self.threads = threads
        self.native_layers = NativeLayers(threads)  # norms, rope and attention (infer.model.Transformer)
        cpu_kernels.single_threaded_blas()  # the cores are the products' (see there why)

    def _linear(self, *names: str) -> Linear | PackedLinear:  # type: ignore[override]
        infos = [self.model.tensor(name) for name in names]
        if self.exact or not self.match_llama_cpp or \
                any(info.ggml_type not in cpu_kernels.SUPPORTED_TYPES for info in infos):
            return super()._linear(*names)
        return PackedLinear([(info.data, info.ggml_type, info.shape[0], info.shape[1]) for info in infos],
                            self.threads)
