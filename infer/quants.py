"""Dequantization of GGML tensor types to float32 (or exactly, to float64), vectorized over blocks with NumPy.

Each quantized type stores a row as a sequence of fixed-size blocks. The block layouts below are the
public GGML formats (ggml-common.h); every function takes an (n_blocks, type_size) uint8 array and a
float dtype and returns (n_blocks, block_size) values computed in that dtype: float32 rounds as
llama.cpp's dequantization does, float64 gives every GGML weight exactly (the CPU engine's exact
matrices). `dequantize` splits a tensor into row chunks so the temporaries stay small even for a
150k-row embedding matrix.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from infer.errors import UnsupportedTensorTypeError

QK_K = 256  # elements per K-quant super-block


def _f16(blocks: np.ndarray, offset: int, dtype: type = np.float32) -> np.ndarray:
    """The float16 field at byte `offset` of each block, as an (n, 1) column of `dtype`."""
    return blocks[:, offset : offset + 2].copy().view(np.float16).astype(dtype)


def _low_high_nibbles(packed: np.ndarray) -> np.ndarray:
    """(n, 16) bytes -> (n, 32) values: the 16 low nibbles first, then the 16 high nibbles."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=1)


def _fifth_bits(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The 32-bit little-endian `qh` field as (n, 32) bits: bit j belongs to element j."""
    qh = blocks[:, offset : offset + 4].copy().view("<u4")
    return ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _dequant_q8_0(blocks: np.ndarray, dtype: type) -> np.ndarray:
    # d: f16 | qs: 32 x int8
    return _f16(blocks, 0, dtype) * blocks[:, 2:34].view(np.int8).astype(dtype)


def _dequant_q4_0(blocks: np.ndarray, dtype: type) -> np.ndarray:
    # d: f16 | qs: 16 bytes of nibbles, value = (q - 8) * d
    q = _low_high_nibbles(blocks[:, 2:18]).astype(dtype) - 8.0
    return _f16(blocks, 0, dtype) * q


def _dequant_q4_1(blocks: np.ndarray, dtype: type) -> np.ndarray:
    # d: f16 | m: f16 | qs: 16 bytes of nibbles, value = q * d + m
    q = _low_high_nibbles(blocks[:, 4:20]).astype(dtype)
    return _f16(blocks, 0, dtype) * q + _f16(blocks, 2, dtype)


def _dequant_q5_0(blocks: np.ndarray, dtype: type) -> np.ndarray:
    # d: f16 | qh: u32 fifth bits | qs: 16 bytes of nibbles, value = (q - 16) * d
    q = _low_high_nibbles(blocks[:, 6:22]) | (_fifth_bits(blocks, 2) << 4)
    return _f16(blocks, 0, dtype) * (q.astype(dtype) - 16.0)


def _dequant_q5_1(blocks: np.ndarray, dtype: type) -> np.ndarray:
    # d: f16 | m: f16 | qh: u32 fifth bits | qs: 16 bytes of nibbles, value = q * d + m
    q = _low_high_nibbles(blocks[:, 8:24]) | (_fifth_bits(blocks, 4) << 4)
    return _f16(blocks, 0, dtype) * q.astype(dtype) + _f16(blocks, 2, dtype)


def _k_scales_mins(packed: np.ndarray, dtype: type) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes -> eight 6-bit scales and eight 6-bit mins (Q4_K/Q5_K), each (n, 8) of `dtype`.

    Bytes 0-3 hold scales 0-3 (low 6 bits), bytes 4-7 mins 0-3; bytes 8-11 hold the low 4 bits of
    scales/mins 4-7, whose top 2 bits sit in the spare top bits of bytes 0-7.
    """
    low, mid, high = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([low & 63, (high & 0x0F) | ((low >> 6) << 4)], axis=1)
    mins = np.concatenate([mid & 63, (high >> 4) | ((mid >> 6) << 4)], axis=1)
    return scales.astype(dtype), mins.astype(dtype)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 128) bytes -> (n, 8, 32): each 32-byte group gives a low-nibble and a high-nibble sub-block."""
    groups = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([groups & 0x0F, groups >> 4], axis=2).reshape(-1, 8, 32)


def _dequant_q4_k(blocks: np.ndarray, dtype: type) -> np.ndarray:
    # d: f16 | dmin: f16 | scales: 12 bytes | qs: 128 bytes; 8 sub-blocks of 32
    scales, mins = _k_scales_mins(blocks[:, 4:16], dtype)
    q = _k_nibbles(blocks[:, 16:144]).astype(dtype)
    d, dmin = _f16(blocks, 0, dtype), _f16(blocks, 2, dtype)
    out = (d * scales)[:, :, None] * q - (dmin * mins)[:, :, None]
    return out.reshape(-1, QK_K)


def _dequant_q5_k(blocks: np.ndarray, dtype: type) -> np.ndarray:
    # d: f16 | dmin: f16 | scales: 12 | qh: 32 | qs: 128; bit k of qh[l] is the 5th bit of sub-block k
    scales, mins = _k_scales_mins(blocks[:, 4:16], dtype)
    qh = blocks[:, 16:48]
    fifth = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    q = (_k_nibbles(blocks[:, 48:176]) | (fifth << 4)).astype(dtype)
    d, dmin = _f16(blocks, 0, dtype), _f16(blocks, 2, dtype)
    out = (d * scales)[:, :, None] * q - (dmin * mins)[:, :, None]
    return out.reshape(-1, QK_K)


def _dequant_q6_k(blocks: np.ndarray, dtype: type) -> np.ndarray:
    # ql: 128 | qh: 64 | scales: 16 x int8 | d: f16; two halves of 128 elements, 16 elements per scale
    ql = blocks[:, 0:128].reshape(-1, 2, 64)
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)
    nibbles = np.stack(
        [ql[:, :, 0:32] & 0x0F, ql[:, :, 32:64] & 0x0F, ql[:, :, 0:32] >> 4, ql[:, :, 32:64] >> 4], axis=2
    )  # (n, 2, 4, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3
    q = (nibbles | (high << 4)).astype(dtype).reshape(-1, 16, 16) - 32.0
    scales = blocks[:, 192:208].view(np.int8).astype(dtype)
    out = (_f16(blocks, 208, dtype) * scales)[:, :, None] * q
    return out.reshape(-1, QK_K)


# MXFP4's 4-bit codes (E2M1 values, doubled: the scale below is halved to match)
_FP4_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


def _dequant_mxfp4(blocks: np.ndarray, dtype: type) -> np.ndarray:
    # e: u8 E8M0 exponent | qs: 16 bytes of nibbles (low nibbles first), value = fp4[q] * 2^(e - 128);
    # every value is exact in float32 (a small integer times a power of two, subnormal for e < 2)
    scale = np.ldexp(1.0, blocks[:, :1].astype(np.int32) - 128).astype(dtype)
    return _FP4_DOUBLED[_low_high_nibbles(blocks[:, 1:17])].astype(dtype) * scale


def _dequant_f16(blocks: np.ndarray, dtype: type) -> np.ndarray:
    return blocks.view(np.float16).astype(dtype)


def _dequant_bf16(blocks: np.ndarray, dtype: type) -> np.ndarray:
    # bfloat16 is the top half of a float32
    return (blocks.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(dtype, copy=False)


def _dequant_f32(blocks: np.ndarray, dtype: type) -> np.ndarray:
    return blocks.view(np.float32).astype(dtype)


T = GGMLQuantizationType
_DEQUANTIZERS: dict[GGMLQuantizationType, Callable[[np.ndarray, type], np.ndarray]] = {
    T.F32: _dequant_f32,
    T.F16: _dequant_f16,
    T.BF16: _dequant_bf16,
    T.Q8_0: _dequant_q8_0,
    T.Q4_0: _dequant_q4_0,
    T.Q4_1: _dequant_q4_1,
    T.Q5_0: _dequant_q5_0,
    T.Q5_1: _dequant_q5_1,
    T.Q4_K: _dequant_q4_k,
    T.Q5_K: _dequant_q5_k,
    T.Q6_K: _dequant_q6_k,
    T.MXFP4: _dequant_mxfp4,  # gpt-oss's experts
}
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_DEQUANTIZERS)

# Rows are dequantized this many elements at a time, bounding the temporaries (~10 x 4 bytes each).
_CHUNK_ELEMENTS = 1 << 21


def type_name(ggml_type: int) -> str:
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type id {ggml_type}"


def block_layout(ggml_type: int) -> tuple[int, int]:
    """(elements per block, bytes per block) of a supported type."""
    check_supported(ggml_type)
    return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]


def check_supported(ggml_type: int) -> None:
    try:
        known = GGMLQuantizationType(ggml_type)
    except ValueError:
        raise UnsupportedTensorTypeError(f"unknown tensor type id {ggml_type}") from None
    if known not in _DEQUANTIZERS:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise UnsupportedTensorTypeError(f"tensor type {known.name} is not supported (supported: {supported})")


def row_nbytes(ggml_type: int, n_cols: int) -> int:
    """Bytes of one row of `n_cols` elements; rows must hold whole blocks."""
    block_size, type_size = block_layout(ggml_type)
    if n_cols % block_size:
        raise UnsupportedTensorTypeError(
            f"row length {n_cols} is not a multiple of the {type_name(ggml_type)} block size {block_size}"
        )
    return n_cols // block_size * type_size


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...], dtype: type = np.float32) -> np.ndarray:
    """Raw tensor bytes (any uint8 array, e.g. a view into a memory map) -> array of `shape`:
    float32 as llama.cpp rounds it, or with dtype=np.float64 every weight exactly.

    `shape` is in NumPy order: the last axis is the contiguous row (GGUF's first dimension).
    """
    n_cols = int(shape[-1])
    n_rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    row_bytes = row_nbytes(ggml_type, n_cols)
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    rows = np.asarray(raw, dtype=np.uint8).reshape(-1)
    if rows.size != n_rows * row_bytes:
        raise ValueError(f"{rows.size} bytes given for {n_rows}x{n_cols} {type_name(ggml_type)} values")
    rows = rows.reshape(n_rows, row_bytes)
    func = _DEQUANTIZERS[GGMLQuantizationType(ggml_type)]
    out = np.empty((n_rows, n_cols), dtype=dtype)
    step = max(1, _CHUNK_ELEMENTS // n_cols)
    for start in range(0, n_rows, step):
        chunk = np.ascontiguousarray(rows[start : start + step]).reshape(-1, type_size)
        out[start : start + step] = func(chunk, dtype).reshape(-1, n_cols)
    return out.reshape(shape)


def dequantize_rows(raw: np.ndarray, ggml_type: int, n_cols: int, row_ids: np.ndarray) -> np.ndarray:
    """Only the rows `row_ids` of a 2-D tensor (an embedding lookup), as (len(row_ids), n_cols) float32."""
    row_bytes = row_nbytes(ggml_type, n_cols)
    rows = np.asarray(raw, dtype=np.uint8).reshape(-1, row_bytes)[np.asarray(row_ids, dtype=np.int64)]
    return dequantize(rows, ggml_type, (len(row_ids), n_cols))


# llama.cpp's CPU matrix products do not multiply float32 activations with the weights directly:
# each weight type names a "vec_dot" type the activations are converted to first (f16 for F16
# weights, 8-bit blocks of 32 with an f16 scale for Q4_0..Q8_0, 8-bit blocks of 256 with an f32
# scale for the K-quants). Rounding our activations the same way keeps our logits within float
# rounding of llama.cpp's instead of within quantization noise.
_ACTIVATION_FORMAT: dict[GGMLQuantizationType, str] = {
    T.F32: "f32", T.F16: "f16", T.BF16: "bf16",
    T.Q8_0: "q8_0", T.Q4_0: "q8_0", T.Q4_1: "q8_0", T.Q5_0: "q8_0", T.Q5_1: "q8_0",
    T.Q4_K: "q8_k", T.Q5_K: "q8_k", T.Q6_K: "q8_k", T.MXFP4: "q8_0",
}


def activation_format(ggml_type: int) -> str:
    """The format llama.cpp converts activations to before multiplying them with this weight type."""
    check_supported(ggml_type)
    return _ACTIVATION_FORMAT[GGMLQuantizationType(ggml_type)]


def round_activations(x: np.ndarray, fmt: str, exact: bool = False) -> np.ndarray:
    """x (..., n) float32 -> the values llama.cpp would see after converting x to `fmt`: float32
    as llama.cpp's CPU would, or with `exact` as float64 holding each value exactly (an 8-bit value
    times a float32 scale needs up to 32 bits)."""
    out_type = np.float64 if exact else np.float32
    if fmt == "f32":
        return x.astype(out_type, copy=False)
    if fmt == "f16":
        return x.astype(np.float16).astype(out_type)
    if fmt == "bf16":
        bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16  # round to nearest even
        return rounded.astype(np.uint32).view(np.float32).astype(out_type, copy=False)
    block = 32 if fmt == "q8_0" else QK_K
    blocks = x.reshape(-1, block)
    if fmt == "q8_0":
        amax = np.abs(blocks).max(axis=1, keepdims=True)
        with np.errstate(divide="ignore"):
            inv = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0))
        scale = (amax / np.float32(127.0)).astype(np.float16).astype(np.float32)  # stored as f16
        q = np.rint(blocks * inv)
    elif fmt == "q8_k":
        # the scale comes from the signed value of largest magnitude and stays float32
        extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)
        with np.errstate(divide="ignore"):
            inv = np.where(extreme != 0, np.float32(-127.0) / extreme, np.float32(0.0))
            scale = np.where(extreme != 0, np.float32(1.0) / inv, np.float32(0.0))
        q = np.minimum(np.rint(blocks * inv), np.float32(127.0))
    else:
        raise ValueError(f"unknown activation format {fmt!r}")
    return (q.astype(out_type) * scale.astype(out_type)).reshape(x.shape)
