"""A GGUF model's weights in VRAM: matrices repacked into their planar formats (Q, K and V stacked
where their types allow one GEMV), norms and biases as float32 vectors."""

from __future__ import annotations

from dataclasses import dataclass

import cupy
import numpy as np

from infer.gguf_file import GGUFModel, TensorInfo
from infer.gpu.ops import GpuMatrix, upload_stacked
from infer.model import ModelArgs


@dataclass
class GpuLayer:
    attn_norm: cupy.ndarray
    # Q, K and V rows stacked into as few matrices as their types allow: (matrix, first row in the
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


def _upload(model: GGUFModel, infos: list[TensorInfo], match_llama_cpp: bool) -> GpuMatrix:
    for info in infos:
        model.check_tensor_supported(info)
    m = upload_stacked([(info.data, info.shape[0]) for info in infos], infos[0].ggml_type, infos[0].shape[1])
    if not match_llama_cpp:
        m.act = "f32"
    return m


def _vector(model: GGUFModel, name: str) -> cupy.ndarray:
    return cupy.asarray(model.tensor(name).dequantize().astype(np.float32).reshape(-1))


class GpuWeights:
    """All weights of a model on the current device. match_llama_cpp: inputs of each matrix product
    are rounded as llama.cpp's CPU rounds them (as infer.model does by default); else float32."""

    def __init__(self, model: GGUFModel, args: ModelArgs, match_llama_cpp: bool = True) -> None:
        self.args = args
        self.match_llama_cpp = match_llama_cpp
        self.token_embd = self.matrix(model, "token_embd.weight")
        self.output_norm = _vector(model, "output_norm.weight")
        tied = "output.weight" not in model.tensors  # SmolLM2: the output reuses the embeddings
        self.output = self.token_embd if tied else self.matrix(model, "output.weight")
        self.layers = [self._layer(model, i) for i in range(args.n_layers)]

    def matrix(self, model: GGUFModel, name: str) -> GpuMatrix:
        return _upload(model, [model.tensor(name)], self.match_llama_cpp)

    def _stacked_qkv(self, model: GGUFModel, p: str) -> list[tuple[GpuMatrix, int]]:
        groups: list[list[TensorInfo]] = []
        for info in (model.tensor(p + f"attn_{x}.weight") for x in "qkv"):
            if groups and groups[-1][0].ggml_type == info.ggml_type:  # consecutive, same type: one matrix
                groups[-1].append(info)
            else:
                groups.append([info])
        out, row = [], 0
        for group in groups:
            m = _upload(model, group, self.match_llama_cpp)
            out.append((m, row))
            row += m.rows
        return out

    def _layer(self, model: GGUFModel, i: int) -> GpuLayer:
        p, a = f"blk.{i}.", self.args
        bqkv = None
        names = [p + f"attn_{x}.bias" for x in "qkv"]
        if any(name in model.tensors for name in names):
            bqkv = cupy.asarray(np.concatenate([
                model.tensor(name).dequantize().reshape(-1) if name in model.tensors else np.zeros(n, np.float32)
                for name, n in zip(names, (a.q_dim, a.kv_dim, a.kv_dim), strict=True)]).astype(np.float32))
        return GpuLayer(
            attn_norm=_vector(model, p + "attn_norm.weight"), qkv=self._stacked_qkv(model, p), bqkv=bqkv,
            wo=self.matrix(model, p + "attn_output.weight"), ffn_norm=_vector(model, p + "ffn_norm.weight"),
            w_gate=self.matrix(model, p + "ffn_gate.weight"), w_up=self.matrix(model, p + "ffn_up.weight"),
            w_down=self.matrix(model, p + "ffn_down.weight"),
        )

    def bytes_per_token(self) -> tuple[int, int]:
        """(VRAM bytes, GGUF bytes) of the weights one decode step reads: every layer matrix and the
        output matrix."""
        mats = [m for layer in self.layers for m in layer.matrices()] + [self.output]
        return sum(m.nbytes for m in mats), sum(m.source_nbytes for m in mats)
