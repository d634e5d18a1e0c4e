"""The planar GPU weight formats (see infer/kernels/formats.cuh), in NumPy: which format each GGML
type becomes, how big each plane is, and a reference repack and reconstruction. The GPU repacks with
repack.cu; the tests check that kernel byte for byte against `repack`, and `reconstruct(repack(x))`
against infer.quants.dequantize(x).

A matrix of rows x K has rows*K/32 sub-blocks of 32 weights, numbered row-major; each plane is an
array indexed by sub-block number.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType

# GGML type -> planar format
FORMAT_OF: dict[int, str] = {
    T.F32: "f32", T.F16: "f16", T.BF16: "bf16", T.Q8_0: "q8",
    T.Q4_0: "g4", T.Q4_1: "g4", T.Q5_0: "g5", T.Q5_1: "g5",
    T.Q4_K: "k4", T.Q5_K: "k5", T.Q6_K: "k6",
}
FLOAT_FORMATS = ("f32", "f16", "bf16")
K_FORMATS = ("k4", "k5", "k6")
FLOAT_ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2}
# bytes per sub-block of the planes (qs, hi, sm); K formats add dm: 4 bytes per 8 sub-blocks
PLANE_BYTES: dict[str, tuple[int, int, int]] = {
    "q8": (32, 0, 2), "g4": (16, 0, 4), "g5": (16, 4, 4), "k4": (16, 0, 2), "k5": (16, 4, 2), "k6": (16, 8, 2),
}
PLANE_ALIGN = 256


def format_of(ggml_type: int) -> str:
    try:
        return FORMAT_OF[int(ggml_type)]
    except KeyError:
        raise ValueError(f"tensor type {T(ggml_type).name} has no GPU format") from None


@dataclass(frozen=True)
class PlaneLayout:
    """Byte offsets and sizes of the planes of one rows x K matrix in one allocation."""

    fmt: str
    rows: int
    cols: int
    offsets: tuple[int, int, int, int]  # qs, hi, sm, dm (0 and empty where the format has no such plane)
    sizes: tuple[int, int, int, int]

    @property
    def nbytes(self) -> int:
        last = max(i for i in range(4) if self.sizes[i])
        return self.offsets[last] + self.sizes[last]

    @property
    def n_subblocks(self) -> int:
        return self.rows * self.cols // 32


def plane_layout(fmt: str, rows: int, cols: int) -> PlaneLayout:
    if fmt in FLOAT_FORMATS:
        return PlaneLayout(fmt, rows, cols, (0, 0, 0, 0), (rows * cols * FLOAT_ITEMSIZE[fmt], 0, 0, 0))
    if cols % (256 if fmt in K_FORMATS else 32):
        raise ValueError(f"row length {cols} is not a multiple of the {fmt} block")
    n = rows * cols // 32
    sizes = tuple(n * b for b in PLANE_BYTES[fmt]) + ((n // 8) * 4 if fmt in K_FORMATS else 0,)
    offsets, at = [], 0
    for size in sizes:
        offsets.append(at if size else 0)
        at += -(-size // PLANE_ALIGN) * PLANE_ALIGN
    return PlaneLayout(fmt, rows, cols, tuple(offsets), sizes)  # type: ignore[arg-type]


def _blocks(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    _, type_size = GGML_QUANT_SIZES[T(ggml_type)]
    return np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, type_size)


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    return b[:, at : at + 2].copy().view(np.float16).astype(np.float32)[:, 0]


def _k_scale_min(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(n, 12) packed K-quant scales -> (n, 8) 6-bit scales and mins."""
    sc = sc.astype(np.int32)
    lo, mid, hi = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scale = np.concatenate([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], axis=1)
    mins = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return scale, mins


def integer_form(raw: np.ndarray, ggml_type: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantized tensor -> (q, scale, offset) per sub-block of 32: q (n, 32) int32 in natural order,
    scale (n, 2) and offset (n,) float32 with w[i] = scale[i // 16] * q[i] + offset (float32 math,
    before the GPU's float16 rounding). Q8_0 q is signed; Q6_K q is 0..63 with offset -32*scale
    folded into q (q - 32 is returned)."""
    b = _blocks(raw, ggml_type)
    t = T(ggml_type)
    nib = lambda packed: np.concatenate([packed & 0xF, packed >> 4], axis=1).astype(np.int32)  # noqa: E731
    if t == T.Q8_0:
        d = _f16(b, 0)
        return b[:, 2:34].view(np.int8).astype(np.int32), np.stack([d, d], 1), np.zeros_like(d)
    if t in (T.Q4_0, T.Q4_1):
        d = _f16(b, 0)
        m = -8 * d if t == T.Q4_0 else _f16(b, 2)
        return nib(b[:, 2:18] if t == T.Q4_0 else b[:, 4:20]), np.stack([d, d], 1), m
    if t in (T.Q5_0, T.Q5_1):
        d = _f16(b, 0)
        at = 2 if t == T.Q5_0 else 4
        qh = b[:, at : at + 4].copy().view("<u4")
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int32)
        m = -16 * d if t == T.Q5_0 else _f16(b, 2)
        return nib(b[:, at + 4 : at + 20]) | (high << 4), np.stack([d, d], 1), m
    if t in (T.Q4_K, T.Q5_K):
        n = b.shape[0]
        d, dmin = _f16(b, 0), _f16(b, 2)
        sc, mn = _k_scale_min(b[:, 4:16])
        qoff = 16 if t == T.Q4_K else 48
        qs = b[:, qoff : qoff + 128].reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        q = (qs & 0xF).reshape(n, 8, 32).astype(np.int32)
        if t == T.Q5_K:
            qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            q |= (qh & 1).astype(np.int32) << 4
        scale = (d[:, None] * sc.astype(np.float32)).reshape(-1)
        offset = (-(dmin[:, None] * mn.astype(np.float32))).reshape(-1)
        return q.reshape(-1, 32), np.stack([scale, scale], 1), offset
    if t == T.Q6_K:
        n = b.shape[0]
        ql = b[:, 0:128].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        ql = (ql & 0xF).reshape(n, 8, 32)
        qh = b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        qh = (qh & 3).reshape(n, 8, 32)
        q = (ql.astype(np.int32) | (qh.astype(np.int32) << 4)) - 32
        scale = _f16(b, 208)[:, None] * b[:, 192:208].view(np.int8).astype(np.float32)  # (n, 16)
        return q.reshape(-1, 32), scale.reshape(-1, 2), np.zeros(n * 8, np.float32)
    raise ValueError(f"tensor type {t.name} is not a quantized type with a planar form")


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """(n, 32) values -> (n, 16) bytes, byte j = q[j] & 15 | (q[j+16] & 15) << 4."""
    q = q.astype(np.uint8)
    return (q[:, :16] & 0xF) | ((q[:, 16:] & 0xF) << 4)


def _bits_to_u32(bits: np.ndarray) -> np.ndarray:
    """(n, k) small fields -> (n,) uint32 with field i at bits width*i (caller shifts)."""
    return np.bitwise_or.reduce(bits.astype(np.uint32), axis=1)


def repack(raw: np.ndarray, ggml_type: int, rows: int, cols: int) -> bytes:
    """The bytes the GPU holds for this tensor (what repack.cu must produce)."""
    fmt = format_of(ggml_type)
    layout = plane_layout(fmt, rows, cols)
    out = np.zeros(layout.nbytes, np.uint8)
    if fmt in FLOAT_FORMATS:
        out[:] = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
        return out.tobytes()
    q, scale, offset = integer_form(raw, ggml_type)
    n = q.shape[0]
    (o_qs, o_hi, o_sm, o_dm), (s_qs, s_hi, s_sm, s_dm) = layout.offsets, layout.sizes
    if fmt in K_FORMATS:
        b = _blocks(raw, ggml_type)
        if fmt == "k6":
            q = q + 32
            sc = b[:, 192:208].reshape(-1, 2)  # int8 pairs, one pair per sub-block
            dm = np.concatenate([b[:, 208:210], np.zeros((len(b), 2), np.uint8)], axis=1)
        else:
            s6, m6 = _k_scale_min(b[:, 4:16])
            sc = np.stack([s6.reshape(-1), m6.reshape(-1)], 1).astype(np.uint8)
            dm = b[:, 0:4]
        out[o_sm : o_sm + s_sm] = np.ascontiguousarray(sc).reshape(-1)
        out[o_dm : o_dm + s_dm] = np.ascontiguousarray(dm).reshape(-1)
        fmt_bits = {"k4": "g4", "k5": "g5", "k6": "g6"}[fmt]
    else:
        fmt_bits = fmt
    if fmt == "q8":
        out[o_qs : o_qs + s_qs] = q.astype(np.int8).view(np.uint8).reshape(-1)
        out[o_sm : o_sm + s_sm] = scale[:, 0].astype(np.float16).view(np.uint8)
        return out.tobytes()
    out[o_qs : o_qs + s_qs] = _pack_nibbles(q).reshape(-1)
    shifts = np.arange(32, dtype=np.uint32)
    if fmt_bits == "g5":
        hi = _bits_to_u32(((q >> 4) & 1).astype(np.uint32) << shifts)
        out[o_hi : o_hi + s_hi] = hi.view(np.uint8)
    if fmt_bits == "g6":
        two = ((q >> 4) & 3).astype(np.uint32)
        w0 = _bits_to_u32(two[:, :16] << (2 * shifts[:16]))
        w1 = _bits_to_u32(two[:, 16:] << (2 * shifts[:16]))
        out[o_hi : o_hi + s_hi] = np.stack([w0, w1], 1).view(np.uint8).reshape(-1)
    if fmt not in K_FORMATS:
        sm = np.stack([scale[:, 0], offset], 1)
        out[o_sm : o_sm + s_sm] = sm.astype(np.float16).view(np.uint8).reshape(-1)
    assert n == layout.n_subblocks
    return out.tobytes()


def reconstruct(planar: bytes | np.ndarray, fmt: str, rows: int, cols: int) -> np.ndarray:
    """The float32 weights (rows, cols) that the GPU kernels compute with, from planar bytes."""
    layout = plane_layout(fmt, rows, cols)
    buf = np.frombuffer(planar, np.uint8) if isinstance(planar, bytes) else planar.view(np.uint8).reshape(-1)
    if fmt in FLOAT_FORMATS:
        if fmt == "bf16":
            return (buf.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(rows, cols)
        return buf.view(np.float16 if fmt == "f16" else np.float32).astype(np.float32).reshape(rows, cols)
    (o_qs, o_hi, o_sm, o_dm), (s_qs, s_hi, s_sm, s_dm) = layout.offsets, layout.sizes
    n = layout.n_subblocks
    if fmt == "q8":
        q = buf[o_qs : o_qs + s_qs].view(np.int8).reshape(n, 32).astype(np.float32)
        s = buf[o_sm : o_sm + s_sm].view(np.float16).astype(np.float32)
        return (q * s[:, None]).reshape(rows, cols)
    packed = buf[o_qs : o_qs + s_qs].reshape(n, 16)
    q = np.concatenate([packed & 0xF, packed >> 4], axis=1).astype(np.int32)
    shifts = np.arange(32, dtype=np.uint32)
    if fmt in ("g5", "k5"):
        hi = buf[o_hi : o_hi + s_hi].view("<u4")
        q |= (((hi[:, None] >> shifts) & 1) << 4).astype(np.int32)
    if fmt == "k6":
        hi = buf[o_hi : o_hi + s_hi].view("<u4").reshape(n, 2)
        two = (hi[:, :, None] >> (2 * shifts[:16])) & 3  # (n, 2, 16)
        q |= (two.reshape(n, 32) << 4).astype(np.int32)
    if fmt in K_FORMATS:  # float32 products as the GPU (and infer.quants) form them
        dm = np.repeat(buf[o_dm : o_dm + s_dm].view(np.float16).astype(np.float32).reshape(-1, 2), 8, axis=0)
        sc = buf[o_sm : o_sm + s_sm].reshape(n, 2)
        if fmt == "k6":
            scale = np.repeat(dm[:, :1] * sc.view(np.int8).astype(np.float32), 16, axis=1)
            return (scale * (q - 32).astype(np.float32)).reshape(rows, cols)
        scale, offset = dm[:, :1] * sc[:, :1].astype(np.float32), dm[:, 1:] * sc[:, 1:].astype(np.float32)
        return (scale * q.astype(np.float32) - offset).reshape(rows, cols)
    sm = buf[o_sm : o_sm + s_sm].view(np.float16).astype(np.float32).reshape(n, 2)
    return (sm[:, :1] * q.astype(np.float32) + sm[:, 1:]).reshape(rows, cols)
