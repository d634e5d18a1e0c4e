"""A model's weights on the GPU, as the forward pass asks for them: `layer(i)` returns a GpuLayer
(matrices in their planar quantized formats, norms and biases as float32 vectors).

Two providers implement the same calls:
- ResidentWeights (here): every tensor uploaded once; Q, K and V stacked into one matrix where
  their types allow one GEMV.
- StreamedWeights (infer/tiers/pipeline.py): tier A tensors uploaded once the same way, tier B/C
  ones copied through the ring and repacked into a layer scratch each pass.
`is_resident(i)` tells the forward pass which layers can sit inside a captured CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import cupy
import numpy as np

from infer.arch import OUTPUT_NORM, QKV_KINDS, TOKEN_EMBD, ModelArgs, has_qkv_bias, output_name, tensor_name
from infer.gguf_file import GGUFModel, TensorInfo
from infer.gpu import ops
from infer.gpu.ops import GpuMatrix, upload_stacked
from infer.quants import activation_format

MATRIX_KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@dataclass
class GpuLayer:
    attn_norm: cupy.ndarray
    # Q, K and V rows in as few matrices as their types and tiers allow: (matrix, first row in the
    # q_dim + 2*kv_dim output); one GEMV launch each
    qkv: list[tuple[GpuMatrix, int]]
    bqkv: cupy.ndarray | None  # (q_dim + 2*kv_dim,) or None
    wo: GpuMatrix
    ffn_norm: cupy.ndarray
    w_gate: GpuMatrix
    w_up: GpuMatrix
    w_down: GpuMatrix

    def matrices(self) -> list[GpuMatrix]:
        return [m for m, _ in self.qkv] + [self.wo, self.w_gate, self.w_up, self.w_down]


@dataclass(frozen=True)
class MatrixFormat:
    """What the forward pass must know of a matrix before it exists (buffers are allocated before
    any CUDA graph capture): its planar format and the activation format of its input."""

    fmt: str
    act: str


class GpuWeightSource(Protocol):
    """The provider the GPU forward pass reads its weights from."""

    token_embd: GpuMatrix
    output: GpuMatrix
    output_norm: cupy.ndarray

    def layer(self, index: int) -> GpuLayer:
        """Layer `index`; for a streamed layer valid until the next call (call in layer order)."""

    def is_resident(self, index: int) -> bool:
        """Whether every tensor of the layer stays in VRAM (its kernels may be captured in a graph)."""

    def formats(self, index: int) -> dict[str, MatrixFormat]:
        """Per matrix kind of the layer its format, known without fetching the layer."""

    def bytes_per_token(self) -> tuple[int, int]:
        """(VRAM bytes, GGUF bytes) of the weights one decode step reads."""


def matrix_format(info: TensorInfo, match_llama_cpp: bool) -> MatrixFormat:
    from infer.gpu.layout import format_of

    return MatrixFormat(format_of(info.ggml_type), activation_format(info.ggml_type) if match_llama_cpp else "f32")


def upload_vector(model: GGUFModel, name: str) -> cupy.ndarray:
    return cupy.asarray(model.tensor(name).dequantize().astype(np.float32).reshape(-1))


def upload_matrices(model: GGUFModel, names: list[str], match_llama_cpp: bool) -> GpuMatrix:
    """The GGUF tensors `names` (one type and row length) as one matrix of their rows in order."""
    infos = [model.tensor(n) for n in names]
    m = upload_stacked([(info.data, info.shape[0]) for info in infos], infos[0].ggml_type, infos[0].shape[1])
    if not match_llama_cpp:
        m.act = "f32"
    return m


def qkv_groups(model: GGUFModel, layer: int, kinds: tuple[str, ...] = QKV_KINDS) -> list[list[str]]:
    """Names of Q, K and V grouped into runs of one type: each run becomes one stacked matrix."""
    groups: list[list[str]] = []
    for kind in kinds:
        name = tensor_name(layer, kind)
        if groups and model.tensor(groups[-1][0]).ggml_type == model.tensor(name).ggml_type:
            groups[-1].append(name)
        else:
            groups.append([name])
    return groups


def qkv_bias(model: GGUFModel, args: ModelArgs, layer: int) -> cupy.ndarray | None:
    """The Q, K and V biases as one (q_dim + 2*kv_dim) vector (zeros for a missing one), or None."""
    if not has_qkv_bias(model, layer):
        return None
    parts = []
    for kind, n in zip(("attn_q.bias", "attn_k.bias", "attn_v.bias"), (args.q_dim, args.kv_dim, args.kv_dim),
                       strict=True):
        name = tensor_name(layer, kind)
        parts.append(model.tensor(name).dequantize().reshape(-1) if name in model.tensors else np.zeros(n, np.float32))
    return cupy.asarray(np.concatenate(parts).astype(np.float32))


def stacked_rows(parts: list[GpuMatrix]) -> list[tuple[GpuMatrix, int]]:
    """(matrix, first output row) for matrices whose rows follow each other."""
    out, row = [], 0
    for m in parts:
        out.append((m, row))
        row += m.rows
    return out


def layer_bytes(layers: list[GpuLayer], output: GpuMatrix) -> tuple[int, int]:
    mats = [m for layer in layers for m in layer.matrices()] + [output]
    return sum(m.nbytes for m in mats), sum(m.source_nbytes for m in mats)


class ResidentWeights:
    """All weights of a checked model on the current device. match_llama_cpp: inputs of each matrix
    product are rounded as llama.cpp's CPU rounds them (as infer.model does by default); else float32."""

    def __init__(self, model: GGUFModel, args: ModelArgs, match_llama_cpp: bool = True) -> None:
        self.args = args
        self.match_llama_cpp = match_llama_cpp
        self.token_embd = upload_matrices(model, [TOKEN_EMBD], match_llama_cpp)
        self.output_norm = upload_vector(model, OUTPUT_NORM)
        name = output_name(model)  # SmolLM2: the output reuses the embeddings
        self.output = self.token_embd if name == TOKEN_EMBD else upload_matrices(model, [name], match_llama_cpp)
        self.layers = [self._layer(model, i) for i in range(args.n_layers)]
        self._formats = [{kind: matrix_format(model.tensor(tensor_name(i, kind)), match_llama_cpp)
                          for kind in MATRIX_KINDS} for i in range(args.n_layers)]

    def _layer(self, model: GGUFModel, i: int) -> GpuLayer:
        def matrix(kind: str) -> GpuMatrix:
            return upload_matrices(model, [tensor_name(i, kind)], self.match_llama_cpp)

        qkv = [upload_matrices(model, group, self.match_llama_cpp) for group in qkv_groups(model, i)]
        return GpuLayer(attn_norm=upload_vector(model, tensor_name(i, "attn_norm")), qkv=stacked_rows(qkv),
                        bqkv=qkv_bias(model, self.args, i), wo=matrix("attn_output"),
                        ffn_norm=upload_vector(model, tensor_name(i, "ffn_norm")), w_gate=matrix("ffn_gate"),
                        w_up=matrix("ffn_up"), w_down=matrix("ffn_down"))

    def layer(self, index: int) -> GpuLayer:
        return self.layers[index]

    def is_resident(self, index: int) -> bool:
        return True

    def formats(self, index: int) -> dict[str, MatrixFormat]:
        return self._formats[index]

    def bytes_per_token(self) -> tuple[int, int]:
        return layer_bytes(self.layers, self.output)


class HalfCopies:
    """float16 copies of resident matrices for cuBLAS, made at first use while their bytes fit
    `allowance` (the VRAM budget's room; None or 0: none); a matrix without a copy is dequantized
    into one scratch each time it is used (streamed matrices always are)."""

    def __init__(self, allowance: int | None) -> None:
        self.allowance = allowance
        self.kept_bytes = 0
        self._copies: dict[int, tuple[GpuMatrix, cupy.ndarray]] = {}  # the matrix is held: ids stay unique
        self._scratch: cupy.ndarray | None = None

    def get(self, m: GpuMatrix, scratch_elems: int) -> cupy.ndarray:
        half = m.as_half()
        if half is not None:
            return half
        kept = self._copies.get(id(m))
        if kept is not None:
            return kept[1]
        n = m.rows * m.cols
        if not m.streamed and self.allowance and self.kept_bytes + 2 * n <= self.allowance:
            copy = cupy.empty(n, cupy.float16)
            ops.dequantize(m, copy)
            self._copies[id(m)] = (m, copy.reshape(m.rows, m.cols))
            self.kept_bytes += 2 * n
            return self._copies[id(m)][1]
        if self._scratch is None:
            self._scratch = cupy.empty(max(n, scratch_elems), cupy.float16)
        out = self._scratch[:n]
        ops.dequantize(m, out)
        return out.reshape(m.rows, m.cols)
