"""The CPU weights left packed in the mapped GGUF file and multiplied by the native kernels
(infer.cpu_kernels): nothing is dequantized at load, the process holds the file's pages instead of a
float32 copy, and each product rounds its input once to the 8-bit blocks llama.cpp uses.

The CPU engine's default when the extension is built (issue 28): NVMEDIRECT_CPU_PRODUCTS=numpy (or
`load_transformer(..., packed=False)`) takes the dequantized NumPy engine instead, =native insists on
this one. Exact numerics (float64, `--exact`) never take it.
"""

from __future__ import annotations

import os

import numpy as np

from infer import cpu_kernels
from infer.arch import ModelArgs, check_model
from infer.cpu_layers import NativeLayers
from infer.gguf_file import GGUFModel
from infer.model import DequantizedWeights, Linear

CHOICES = ("native", "numpy")


def native_products_requested() -> bool:
    """Whether the CPU engine takes the packed weights and native products: NVMEDIRECT_CPU_PRODUCTS
    unset (or empty) means yes when the extension is built, =native yes (PackedWeights raises if it is
    not built), =numpy no."""
    choice = os.environ.get("NVMEDIRECT_CPU_PRODUCTS", "")
    if choice and choice not in CHOICES:
        raise ValueError(f"NVMEDIRECT_CPU_PRODUCTS={choice!r}: use one of {', '.join(CHOICES)} (or leave it unset)")
    return choice == "native" or (not choice and cpu_kernels.available())


def batch_invariant(model: GGUFModel) -> bool:
    """Whether load_transformer's default engine gives this file's rows the same logits in any pass (a
    prompt at once or token by token, a tree node or its path decoded, beside other sequences or
    alone): the packed engine with every matrix in a type the native kernels take (their sums run in
    a fixed order per output, infer.cpu_layers' too) and no experts (infer.moe groups tokens by
    expert through NumPy). Speculation on the CPU needs it, or --exact."""
    return native_products_requested() and packs_invariantly(model, check_model(model))


def packs_invariantly(model: GGUFModel, args: ModelArgs) -> bool:
    """Every matrix of the file in a type the native kernels take, and no experts (batch_invariant)."""
    return not args.n_experts and all(info.ggml_type in cpu_kernels.SUPPORTED_TYPES
                                      for info in model.tensors.values() if len(info.shape) == 2)


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
            raise RuntimeError("the packed CPU engine needs the native CPU kernels: run `bash scripts/bootstrap.sh` "
                               "(or `python native/build_cpu_kernels.py`), or set NVMEDIRECT_CPU_PRODUCTS=numpy")
        self.threads = threads
        # a row's logits do not depend on its pass (infer.cache_pool.split_invariant, speculation)
        self.batch_invariant = match_llama_cpp and not exact and packs_invariantly(model, args)
        self.native_layers = NativeLayers(threads)  # norms, rope and attention (infer.model.Transformer)
        cpu_kernels.single_threaded_blas()  # the cores are the products' (see there why)

    def _linear(self, *names: str) -> Linear | PackedLinear:  # type: ignore[override]
        infos = [self.model.tensor(name) for name in names]
        if self.exact or not self.match_llama_cpp or \
                any(info.ggml_type not in cpu_kernels.SUPPORTED_TYPES for info in infos):
            return super()._linear(*names)
        return PackedLinear([(info.data, info.ggml_type, info.shape[0], info.shape[1]) for info in infos],
                            self.threads)
