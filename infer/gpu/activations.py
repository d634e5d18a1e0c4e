"""The inputs of the matrix products of a pass, rounded as llama.cpp rounds them for each weight type
(f32, f16, bf16; q8_0, q8_k with their 8-bit form: infer.quants.activation_format), for up to
`rows` rows. Every buffer is allocated before any CUDA graph capture."""

from __future__ import annotations

import cupy

from infer.arch import ModelArgs
from infer.gpu import ops
from infer.gpu.ops import EIGHT_BIT, Int8Act, NormOutputs, norm_fits_one_pass
from infer.gpu.products import Input
from infer.gpu.weights import MatrixFormat

F32 = cupy.float32
# inputs normalised from the hidden state: a float32 copy of each format (the norm writes one, the
# others are rounded from it); "ff" and "att" come from kernels that write the 8-bit form directly
NORMED = ("attn", "ffn", "out")
# inputs the prompt rows' products also take as float16 (infer/kernels/pmm.cu), before any rounding
HALVES = ("attn", "ffn", "att", "ff")


def layer_inputs(args: ModelArgs, f: dict[str, MatrixFormat]) -> list[tuple[str, str, int]]:
    """(input, activation format, values per row) of a layer's products."""
    a = args
    ffn = [("ffn", f[k].act, a.dim) for k in ("ffn_gate", "ffn_up")] + [("ff", f["ffn_down"].act, a.ffn_dim)] \
        if "ffn_down" in f else []  # a block of experts: the CPU's (infer.tiers.cpu_tier.CpuExperts)
    return [("attn", f[k].act, a.dim) for k in ("attn_q", "attn_k", "attn_v")] + ffn + \
        [("att", f["attn_output"].act, a.q_dim)]


def _buffers(wanted: list[tuple[str, str, int]]) -> dict[tuple[str, str, str], int]:
    """(input, format, "float" | "int8") -> values per row, for the inputs `wanted`."""
    out: dict[tuple[str, str, str], int] = {}
    for key, act, n in wanted:
        if act in EIGHT_BIT:
            out[(key, act, "int8")] = n
        if key in NORMED or act not in EIGHT_BIT:
            out[(key, act, "float")] = n
        if key in NORMED:
            out[(key, "f32", "float")] = n
    return out


def _nbytes(kind: str, act: str, rows: int, n: int) -> int:
    if kind == "float":
        return 4 * rows * n
    group = 32 if act == "q8_0" else 256
    return rows * n + 4 * rows * n // group + 4 * rows * n // 32


def _halves(wanted: list[tuple[str, str, int]]) -> dict[str, int]:
    """Input -> values per row, of the float16 copies the prompt products take."""
    return {key: n for key, _act, n in wanted if key in HALVES}


class Inputs:
    """Inputs "attn" (the attention norm's output), "ffn" (the FFN norm's), "att" (attention's
    output: its 8-bit form; the floats are the pass's attention buffer), "ff" (SwiGLU's) and "out"
    (the final norm's), each in the formats its matrices want."""

    def __init__(self, args: ModelArgs, rows: int, wanted: list[tuple[str, str, int]]) -> None:
        self.args, self.rows = args, rows
        self.floats: dict[tuple[str, str], cupy.ndarray] = {}
        self.int8: dict[tuple[str, str], Int8Act] = {}
        for (key, act, kind), n in _buffers(wanted).items():
            if kind == "float":
                self.floats[(key, act)] = cupy.zeros((rows, n), F32)
            else:
                self.int8[(key, act)] = Int8Act.zeros(rows, n, act)
        self.halves = {key: cupy.zeros((rows, n), cupy.float16) for key, n in _halves(wanted).items()}

    @staticmethod
    def planned_nbytes(rows: int, wanted: list[tuple[str, str, int]]) -> int:
        return (sum(_nbytes(kind, act, rows, n) for (_key, act, kind), n in _buffers(wanted).items())
                + sum(2 * rows * n for n in _halves(wanted).values()))

    @property
    def nbytes(self) -> int:
        return (sum(int(b.nbytes) for b in self.floats.values()) + sum(b.nbytes for b in self.int8.values())
                + sum(int(b.nbytes) for b in self.halves.values()))

    def half(self, key: str) -> cupy.ndarray:
        """The float16 copy of input `key` (rows, values): the prompt products' input."""
        return self.halves[key]

    def get(self, key: str, act: str) -> Input:
        """Input `key` in format `act`: its 8-bit form for q8_0/q8_k, else the float32 rows."""
        return self.int8[(key, act)] if act in EIGHT_BIT else self.floats[(key, act)]

    def norm_outputs(self, key: str, acts: list[str], half: bool = False) -> NormOutputs | None:
        """Where one rmsnorm8 launch writes input `key` normalised for the formats `acts` (and, with
        `half`, its float16 copy), or None where that takes more than one launch."""
        a, unique = self.args, sorted(set(acts))
        y16 = self.halves[key] if half else None
        rounded = [act for act in unique if act != "f32"]
        act = unique[0] if len(unique) == 1 else rounded[0] if len(rounded) == 1 else None
        if act is None or not norm_fits_one_pass(a.dim, act):
            return None
        return NormOutputs(act, y=self.floats[(key, act)], y16=y16, int8=self.int8.get((key, act)),
                           y_unrounded=self.floats[(key, "f32")] if len(unique) == 2 else None)

    def normed(self, src: cupy.ndarray, weight: cupy.ndarray, key: str, acts: list[str], n: int,
               src_rows: cupy.ndarray | None = None, half: bool = False, written: bool = False) -> dict[str, Input]:
        """RMSNorm(row) * weight for n rows (src's first n, or rows src_rows[i]), rounded to each
        activation format in `acts` (one launch for one format); with `half` also its float16 copy
        before rounding (self.half(key)). `written`: a kernel before wrote them (norm_outputs)."""
        a, unique = self.args, sorted(set(acts))
        one = self.norm_outputs(key, acts, half)
        if written:
            assert one is not None, "only a row one launch normalises is written ahead"
            return {act: self.get(key, act) for act in unique}
        if one is not None:
            ops.rmsnorm(src, weight, a.norm_eps, n, a.dim, y=one.y, y16=one.y16, act=one.act, int8=one.int8,
                        src_rows=src_rows, y_unrounded=one.y_unrounded)
            return {act: self.get(key, act) for act in unique}
        y16 = self.halves[key] if half else None
        if len(unique) == 1:  # the two-pass kernel, rounding in place
            act = unique[0]
            ops.rmsnorm(src, weight, a.norm_eps, n, a.dim, y=self.floats[(key, act)], y16=y16, act=act,
                        int8=self.int8.get((key, act)), src_rows=src_rows)
            return {act: self.get(key, act)}
        base = self.floats[(key, "f32")]
        ops.rmsnorm(src, weight, a.norm_eps, n, a.dim, y=base, y16=y16, src_rows=src_rows)
        for act in unique:
            if act != "f32":
                ops.round_act(base, self.floats[(key, act)], n, a.dim, act, int8=self.int8.get((key, act)))
        return {act: self.get(key, act) for act in unique}
