"""The inputs of the matrix products, rounded as llama.cpp's CPU rounds them for each weight type
(f32, f16, bf16, q8_0, q8_k: infer.quants.activation_format).

- decode (one row): `RoundedInputs` holds per (input, format) a float32 buffer and, for q8_0/q8_k
  with the integer kernels on, its 8-bit form (int8 values, scales, sums), all allocated before
  any CUDA graph capture; `gemv` picks the integer kernel where that form exists.
- many rows: `normed16` / `rounded16` give float16 matrices for cuBLAS.
"""

from __future__ import annotations

import cupy

from infer.arch import ModelArgs
from infer.gpu import ops
from infer.gpu.ops import GpuMatrix
from infer.gpu.weights import MatrixFormat

F32, F16 = cupy.float32, cupy.float16
EIGHT_BIT = ("q8_0", "q8_k")


class RoundedInputs:
    """Inputs "attn" (the attention norm's output), "ffn" (the FFN norm's), "att" (attention's
    output), "ff" (SwiGLU's) and "out" (the final norm's), each in the formats its matrices want;
    for `rows` rows at once (a token tree's nodes, each with the decode step's numbers)."""

    def __init__(self, args: ModelArgs, int8_dot: bool, rows: int = 1) -> None:
        self.args = args
        self.int8_dot = int8_dot
        self.rows = rows
        self.buffers: dict[tuple[str, str], cupy.ndarray] = {}  # (input, activation format) -> float32
        self.int8: dict[tuple[str, str], ops.Int8Act] = {}  # the same inputs' 8-bit forms

    def plan_layer(self, f: dict[str, MatrixFormat]) -> None:
        a = self.args
        self.plan("attn", [f[k].act for k in ("attn_q", "attn_k", "attn_v")], a.dim)
        self.plan("ffn", [f["ffn_gate"].act, f["ffn_up"].act], a.dim)
        self.plan("ff", [f["ffn_down"].act], a.ffn_dim)
        self.plan("att", [f["attn_output"].act], a.q_dim)  # only its 8-bit form is used (att holds the floats)

    def plan(self, key: str, acts: list[str], n: int) -> None:
        """Buffers for input `key` (n values) in each format; with several, a float32 one to round from."""
        for act in set(acts) | ({"f32"} if len(set(acts)) > 1 else set()):
            if (key, act) not in self.buffers:
                self.buffers[(key, act)] = cupy.zeros(self.rows * n, F32)
                if self.int8_dot and act in EIGHT_BIT:
                    self.int8[(key, act)] = ops.int8_buffers(self.rows * n, act)

    def set_int8(self, enabled: bool) -> None:
        """Integer kernels on or off; buffers stay allocated once made (captured graphs may refer to them)."""
        self.int8_dot = enabled
        if enabled:
            for key, act in list(self.buffers):
                if act in EIGHT_BIT and (key, act) not in self.int8:
                    self.int8[(key, act)] = ops.int8_buffers(self.buffers[(key, act)].size, act)

    def int8_of(self, key: str, act: str) -> ops.Int8Act | None:
        """The 8-bit form buffers of input `key` in format `act`, when the integer kernels are on."""
        return self.int8.get((key, act)) if self.int8_dot else None

    def normed(self, src: cupy.ndarray, weight: cupy.ndarray, key: str, acts: list[str],
               rows: int | None = None) -> dict[str, cupy.ndarray]:
        """RMSNorm(src) * weight per row (the first `rows`, default all), rounded to each activation
        format in `acts` (one launch for one)."""
        a, unique, rows = self.args, sorted(set(acts)), self.rows if rows is None else rows
        if len(unique) == 1:
            y = self.buffers[(key, unique[0])]
            ops.rmsnorm(src, weight, a.norm_eps, rows, a.dim, y=y, act=unique[0], int8=self.int8_of(key, unique[0]))
            return {unique[0]: y}
        base = self.buffers[(key, "f32")]
        ops.rmsnorm(src, weight, a.norm_eps, rows, a.dim, y=base)
        out = {"f32": base}
        for act in unique:
            if act != "f32":
                out[act] = self.buffers[(key, act)]
                ops.round_act(base, out[act], rows, a.dim, act, int8=self.int8_of(key, act))
        return out

    def rounded(self, x: cupy.ndarray, key: str, act: str, rows: int | None = None) -> cupy.ndarray:
        """x (the first `rows` rows, default all) rounded to `act` in input `key`'s buffer."""
        if act == "f32":
            return x
        rows = self.rows if rows is None else rows
        y = self.buffers[(key, act)]
        ops.round_act(x, y, rows, x.size // rows, act, int8=self.int8_of(key, act))
        return y

    def gemv(self, m: GpuMatrix, key: str, x: cupy.ndarray, y: cupy.ndarray, bias: cupy.ndarray | None = None,
             residual: cupy.ndarray | None = None, rows: int | None = None, ldy: int | None = None) -> None:
        """y = W x (+bias, +residual) where x is input `key` rounded for m: the integer kernel when
        its 8-bit form exists, else the float one. Rows: the first `rows` (default all), row v's
        output at y[v * ldy] (default m.rows apart)."""
        rows = self.rows if rows is None else rows
        int8 = self.int8_of(key, m.act) if m.fmt in ops.INT8_FORMATS else None
        if int8 is not None:
            ops.gemv8(m, int8, y, bias=bias, residual=residual, vectors=rows, ldy=ldy)
        else:
            ops.gemv(m, x, y, bias=bias, residual=residual, vectors=rows, ldy=ldy)


def normed16(a: ModelArgs, h: cupy.ndarray, weight: cupy.ndarray, acts: list[str]) -> dict[str, cupy.ndarray]:
    """Per row RMSNorm(h) * weight, rounded to each activation format, as float16 (R, dim)."""
    n, unique = h.shape[0], sorted(set(acts))
    base = cupy.empty((n, a.dim), F32)
    if len(unique) == 1:
        y16 = cupy.empty((n, a.dim), F16)
        ops.rmsnorm(h, weight, a.norm_eps, n, a.dim, y=base, y16=y16, act=unique[0])
        return {unique[0]: y16}
    ops.rmsnorm(h, weight, a.norm_eps, n, a.dim, y=base)
    return {act: rounded16(base, act) for act in unique}


def rounded16(x: cupy.ndarray, act: str) -> cupy.ndarray:
    """(R, n) float32 -> rounded to `act`, as float16."""
    y16 = cupy.empty(x.shape, F16)
    ops.round_act(x, cupy.empty_like(x), x.shape[0], x.shape[1], act, y16=y16)
    return y16
