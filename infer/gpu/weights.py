"""A model's weights on the GPU, as the forward pass asks for them: `layer(i)` returns a GpuLayer
(matrices in their planar quantized formats, norms and biases as float32 vectors).

Two providers implement the same calls:
- ResidentWeights (here): every tensor uploaded once;
- StreamedWeights (infer/tiers/pipeline.py): tier A tensors uploaded once the same way, tier B/C
  ones copied through the ring and repacked into a layer scratch each pass.
`is_resident(i)` tells the forward pass which layers can sit inside a captured CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import cupy
import numpy as np

from infer.arch import OUTPUT_NORM, TOKEN_EMBD, ModelArgs, output_name, tensor_name
from infer.gguf_file import GGUFModel, TensorInfo
from infer.gpu.layout import FLOAT_FORMATS
from infer.gpu.memory import transient_pool
from infer.gpu.ops import GpuMatrix, upload_stacked
from infer.quants import activation_format

MATRIX_KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")

Run = tuple[list[GpuMatrix], int]  # matrices whose outputs are consecutive rows, and the first row


def runs(matrices: list[GpuMatrix]) -> list[Run]:
    """Consecutive matrices of one format, row length and input format grouped (at most three, float
    formats alone): each group is one product launch."""
    out: list[Run] = []
    row = 0
    for m in matrices:
        last = out[-1][0] if out else None
        if last and len(last) < 3 and m.fmt not in FLOAT_FORMATS and (last[0].fmt, last[0].cols, last[0].act) == \
                (m.fmt, m.cols, m.act):
            last.append(m)
        else:
            out.append(([m], row))
        row += m.rows
    return out


@dataclass
class GpuLayer:
    """One block on the GPU: its matrices by their kinds in the architecture table (infer.arch, the
    names the CPU engine's LayerWeights uses too), its vectors as infer.arch.layer_vectors names them."""

    attn_norm: cupy.ndarray
    attn_q: GpuMatrix
    attn_k: GpuMatrix
    attn_v: GpuMatrix
    bqkv: cupy.ndarray | None  # (q_dim + 2*kv_dim,) or None
    attn_output: GpuMatrix
    ffn_norm: cupy.ndarray
    ffn_gate: GpuMatrix | None  # None in a block of experts: its feed-forward is the CPU's (CpuExperts)
    ffn_up: GpuMatrix | None
    ffn_down: GpuMatrix | None
    q_norm: cupy.ndarray | None = None  # (head_dim,): Qwen3's RMSNorm of each query head before rope
    k_norm: cupy.ndarray | None = None
    post_attn_norm: cupy.ndarray | None = None  # (dim,): Gemma's RMSNorm of the attention output
    post_ffn_norm: cupy.ndarray | None = None  # and of the FFN output

    def matrices(self) -> list[GpuMatrix]:
        return [m for m in (getattr(self, kind) for kind in MATRIX_KINDS) if m is not None]

    def attn_qkv(self) -> list[Run]:
        """Q, K and V as product launches into the (q_dim + 2*kv_dim) output."""
        return runs([self.attn_q, self.attn_k, self.attn_v])

    def ffn_gate_up(self) -> list[Run]:
        """Gate and up as product launches into the (2 * ffn_dim) output [gate | up]."""
        return runs([self.ffn_gate, self.ffn_up])  # type: ignore[list-item]

    def addresses(self) -> tuple[int, ...]:
        """The device addresses the layer's kernels read (a captured graph of them is valid while
        these stay: a streamed layer's scratch)."""
        arrays = [self.attn_norm, self.ffn_norm, self.bqkv, self.q_norm, self.k_norm, self.post_attn_norm,
                  self.post_ffn_norm, *(m.buffer for m in self.matrices())]
        return tuple(0 if b is None else int(b.data.ptr) for b in arrays)


@dataclass(frozen=True)
class MatrixFormat:
    """What the forward pass must know of a matrix before it exists (buffers are allocated and
    kernels compiled before any CUDA graph capture): its planar format, the activation format of
    its input, and its row length."""

    fmt: str
    act: str
    cols: int


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


def matrix_format(info: TensorInfo) -> MatrixFormat:
    from infer.gpu.layout import format_of

    return MatrixFormat(format_of(info.ggml_type), activation_format(info.ggml_type), int(info.shape[-1]))


def layer_formats(model: GGUFModel, layer: int) -> dict[str, MatrixFormat]:
    """The formats of layer `layer`'s matrices on the device (a block of experts has no FFN ones)."""
    return {kind: matrix_format(model.tensor(tensor_name(layer, kind))) for kind in MATRIX_KINDS
            if tensor_name(layer, kind) in model.tensors}


def upload_vector(model: GGUFModel, name: str) -> cupy.ndarray:
    return cupy.asarray(model.tensor(name).dequantize().astype(np.float32).reshape(-1))


def upload_tensor(model: GGUFModel, name: str) -> GpuMatrix:
    """One GGUF matrix in its planar format on the device."""
    info = model.tensor(name)
    return upload_stacked([(info.data, info.shape[0])], info.ggml_type, info.shape[1])


class _MappedHost:
    """Page-locked host memory the GPU reads directly (unified addressing: the pointer is valid in
    kernels), with the two attributes a GpuMatrix's buffer needs."""

    def __init__(self, nbytes: int) -> None:
        self.memory = cupy.cuda.alloc_pinned_memory(nbytes)
        self.array = np.frombuffer(self.memory, np.uint8, nbytes)
        self.nbytes = nbytes
        self.data = self  # .data.ptr, as a cupy array has it

    @property
    def ptr(self) -> int:
        return int(self.array.ctypes.data)


def upload_embedding(model: GGUFModel) -> GpuMatrix:
    """The token embedding, repacked on the device and kept in mapped host memory: a pass reads only
    its rows' few kilobytes across the link (as llama.cpp keeps it on the CPU), and the VRAM goes to
    the layers. The device copy is a transient (memory.transient_pool)."""
    with transient_pool():
        m = upload_tensor(model, TOKEN_EMBD)
        host = _MappedHost(m.nbytes)
        cupy.cuda.runtime.memcpy(host.ptr, m.buffer.data.ptr, m.nbytes, cupy.cuda.runtime.memcpyDeviceToHost)
        matrix = GpuMatrix(m.fmt, m.rows, m.cols, m.layout, host, m.source_nbytes, m.act)  # type: ignore[arg-type]
        del m
    return matrix


def embedding_on_host(model: GGUFModel) -> bool:
    """Whether the token embedding lives in host memory (not when the output reuses it)."""
    return output_name(model) != TOKEN_EMBD


def assemble_layer(vectors: dict[str, cupy.ndarray | None], matrices: dict[str, GpuMatrix]) -> GpuLayer:
    """A GpuLayer from its vectors (layer_vectors) and its matrices by kind."""
    m, v = matrices, vectors
    return GpuLayer(attn_norm=v["attn_norm"], bqkv=v["bqkv"], ffn_norm=v["ffn_norm"],  # type: ignore[arg-type]
                    **{kind: m.get(kind) for kind in MATRIX_KINDS}, q_norm=v["q_norm"], k_norm=v["k_norm"],
                    post_attn_norm=v.get("post_attn_norm"), post_ffn_norm=v.get("post_ffn_norm"))


def layer_vectors(model: GGUFModel, args: ModelArgs, i: int) -> dict[str, cupy.ndarray | None]:
    """The block's vectors (arch.layer_vectors) on the device."""
    from infer.arch import layer_vector_kinds
    from infer.arch import layer_vectors as host_vectors

    names = {kind: tensor_name(i, kind) for kind in layer_vector_kinds(args)}
    host = host_vectors(args, i, {kind: model.tensor(name).dequantize() for kind, name in names.items()
                                  if name in model.tensors})
    return {kind: None if v is None else cupy.asarray(v) for kind, v in host.items()}


def layer_bytes(layers: list[GpuLayer], output: GpuMatrix | None) -> tuple[int, int]:
    mats = [m for layer in layers for m in layer.matrices()] + ([output] if output is not None else [])
    return sum(m.nbytes for m in mats), sum(m.source_nbytes for m in mats)


class ResidentWeights:
    """The weights of a checked model on the current device (`layers`: only those blocks, a stage
    of a pipeline across GPUs, infer.gpu.stages: the embedding with the first block, the output
    with the last); the inputs of each matrix product are rounded as llama.cpp rounds them (8-bit
    forms for quantized weights)."""

    def __init__(self, model: GGUFModel, args: ModelArgs,
                 progress: Callable[[int, int], None] | None = None, layers: Sequence[int] | None = None) -> None:
        """progress(done, total): after the embedding and output, then after each layer."""
        self.args = args
        self.stage = tuple(range(args.n_layers)) if layers is None else tuple(sorted(layers))
        first, last = 0 in self.stage, args.n_layers - 1 in self.stage
        total = len(self.stage) + 1
        host = embedding_on_host(model)  # SmolLM2: the output reuses the embeddings, which stay on the device
        self.token_embd: GpuMatrix | None = None
        self.output_norm: cupy.ndarray | None = None
        self.output: GpuMatrix | None = None
        if first or (last and not host):
            self.token_embd = upload_embedding(model) if host else upload_tensor(model, TOKEN_EMBD)
        if last:
            self.output_norm = upload_vector(model, OUTPUT_NORM)
            self.output = upload_tensor(model, output_name(model)) if host else self.token_embd
        if progress is not None:
            progress(1, total)
        self.layers: dict[int, GpuLayer] = {}
        for k, i in enumerate(self.stage):
            matrices = {kind: upload_tensor(model, tensor_name(i, kind)) for kind in MATRIX_KINDS
                        if tensor_name(i, kind) in model.tensors}
            self.layers[i] = assemble_layer(layer_vectors(model, args, i), matrices)
            if progress is not None:
                progress(k + 2, total)
        self._formats = {i: layer_formats(model, i) for i in self.stage}

    def layer(self, index: int) -> GpuLayer:
        return self.layers[index]

    def is_resident(self, index: int) -> bool:
        return True

    def formats(self, index: int) -> dict[str, MatrixFormat]:
        return self._formats[index]

    def bytes_per_token(self) -> tuple[int, int]:
        return layer_bytes(list(self.layers.values()), self.output)
