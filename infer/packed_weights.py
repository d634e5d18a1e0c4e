"""The CPU weights left packed as the GGUF file stores them and multiplied by the native kernels
(infer.cpu_kernels): nothing is dequantized at load, the process holds the file's bytes (its mapped
pages, or a copy on huge pages where infer.host_memory allows: faster to stream) instead of a float32
copy, and each product rounds its input once to the 8-bit blocks llama.cpp uses.

The CPU engine's default when the extension is built (issue 28): NVMEDIRECT_CPU_PRODUCTS=numpy (or
`load_transformer(..., packed=False)`) takes the dequantized NumPy engine instead, =native insists on
this one. Exact numerics (float64, `--exact`) never take it.
"""

from __future__ import annotations

import os

import numpy as np

from infer import cpu_kernels, host_memory
from infer.arch import TOKEN_EMBD, ModelArgs, check_model, output_name, tensor_name
from infer.cpu_layers import NativeLayers
from infer.gguf_file import GGUFModel, TensorInfo
from infer.host_memory import HugePageCopy
from infer.model import DequantizedWeights, Linear
from infer.moe import MixtureOfExperts

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
    alone): the packed engine with every matrix and expert stack in a type the native kernels take
    (their sums run in a fixed order per output, infer.cpu_layers' too; infer.moe's routing and
    weighted sum work row by row). Speculation on the CPU needs it, or --exact."""
    return native_products_requested() and packs_invariantly(model, check_model(model))


def packs_invariantly(model: GGUFModel, args: ModelArgs) -> bool:
    """Every matrix and expert stack of the file in a type the native kernels take (batch_invariant)."""
    return all(info.ggml_type in cpu_kernels.SUPPORTED_TYPES for info in model.tensors.values()
               if len(info.shape) in (2, 3))


class PackedLinear(cpu_kernels.FusedProduct):
    """y = x @ W.T for W made of GGUF tensors stacked row-wise (Q, K, V or gate, up), each left in its
    packed bytes: one native call (cpu_kernels.FusedProduct) rounds x once per activation format,
    shares it among the parts that take it and writes every part's outputs side by side."""

    def __init__(self, parts: list[tuple[np.ndarray, int, int, int]], threads: int | None = None) -> None:
        super().__init__(parts, threads)
        self.parts = parts  # (raw uint8 bytes, GGML type, rows, cols)

    @property
    def nbytes(self) -> int:
        return 0  # the mapped file's pages, or the huge-page copy made once at load: no layer budget


class PackedWeights(DequantizedWeights):
    """DequantizedWeights whose matrices stay packed (PackedLinear) when the native kernels take their
    types; vectors and the embedding rows are dequantized as before."""

    copies_experts = True  # whether the huge-page copy takes the expert stacks (a tier's own: no)
    copies_to_huge_pages = True  # whether its matrices are copied to huge pages at load (a tier's own: no)

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
        self.huge_pages = None if exact or not match_llama_cpp or not self.copies_to_huge_pages else \
            _copy_to_huge_pages(model, threads or cpu_kernels.default_threads(), self.copies_experts)

    def _experts(self, i: int) -> MixtureOfExperts:
        """Block i's experts as packed products, each a slice of its stacks in the mapped file (the
        dequantized float32 stacks of a 30B-A3B model would need ~120 GB), where the kernels take
        every stack's type; else the parent's dequantized stacks."""
        names = [tensor_name(i, kind) for kind in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")]
        infos = [self.model.tensor(name) for name in names]
        if self.exact or not self.match_llama_cpp or \
                any(info.ggml_type not in cpu_kernels.SUPPORTED_TYPES for info in infos):
            return super()._experts(i)
        gate, up, down = ([(self._bytes(info).reshape(info.shape[0], -1)[e], info.ggml_type, info.shape[1], info.shape[2])
                           for e in range(info.shape[0])] for info in infos)
        # a decode row's experts in one call, where the block's gated activation is the native SwiGLU
        row = cpu_kernels.RoutedExperts(gate, up, down, self.threads) \
            if self.args.arch_table.activation == "silu" and self.args.n_experts_used <= cpu_kernels.MAX_SLOTS else None
        return MixtureOfExperts(self._linear(tensor_name(i, "ffn_gate_inp")),
                                [PackedLinear([g, u], self.threads) for g, u in zip(gate, up, strict=True)],
                                [PackedLinear([d], self.threads) for d in down],
                                self.args.n_experts_used, self.args.expert_weights_norm, self._shared_expert(i),
                                row_experts=row, row_sum=row.weighted_sum if row is not None else None,
                                **self._expert_biases(i))  # type: ignore[arg-type]

    def _linear(self, *names: str) -> Linear | PackedLinear:  # type: ignore[override]
        infos = [self.model.tensor(name) for name in names]
        if self.exact or not self.match_llama_cpp or \
                any(info.ggml_type not in cpu_kernels.SUPPORTED_TYPES for info in infos):
            return super()._linear(*names)
        shapes = [(1, info.shape[0]) if len(info.shape) == 1 else info.shape for info in infos]  # a vector: one row
        return PackedLinear([(self._bytes(info), info.ggml_type, *shape) for info, shape in zip(infos, shapes, strict=True)],
                            self.threads)

    def _bytes(self, info: TensorInfo) -> np.ndarray:
        """A matrix's packed bytes: in the huge-page copy where there is one, else the mapped file's."""
        if self.huge_pages is None or len(info.shape) == 1:  # the copy takes matrices only
            return info.data
        return self.huge_pages.view(info.offset, info.nbytes)


def _copy_to_huge_pages(model: GGUFModel, threads: int, experts: bool) -> HugePageCopy | None:
    """The packed matrices of the file (its expert stacks too unless `experts` is false: a tier keeps
    those) in huge pages where infer.host_memory allows it, else None."""
    embeddings_only = output_name(model) != TOKEN_EMBD  # then the engine reads rows of it, never multiplies
    packed = [info for info in model.tensors.values()
              if len(info.shape) in (2, 3) and info.ggml_type in cpu_kernels.SUPPORTED_TYPES
              and (experts or not info.name.endswith("_exps.weight"))
              and not (embeddings_only and info.name == TOKEN_EMBD)]
    nbytes = sum(info.nbytes for info in packed)
    if not host_memory.should_copy(nbytes):
        return None
    return HugePageCopy(model.path, [(info.offset, info.nbytes) for info in packed], threads)
