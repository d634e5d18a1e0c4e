"""NumPy references of the GPU's canonical numerics (infer/kernels/canon.cuh), bit for bit.

`canonical_product` computes what every GPU product kernel (qgemv, qmm, fgemv) must return: the
same float32 operations in the same order, so tests compare with `np.array_equal`, not with a
tolerance. `attention_reference` is the exact (float64) attention the float32 kernels approximate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from infer.gpu.layout import FLOAT_FORMATS, K_FORMATS, plane_layout

TILE = 4  # sub-blocks per tile of the 32-value formats (canon.cuh CANON_TILE)
GROUP = 1024  # values per group (canon.cuh CANON_GROUP)
F32 = np.float32


@dataclass
class PlanarInts:
    """A planar matrix as integers and scales: q (rows, nsb, 32) in the form the kernels multiply
    (q8 signed, Q6_K as q - 32, the others unsigned) and the per-sub-block / per-super-block scales."""

    q: np.ndarray
    s: np.ndarray | None = None  # q8: sw; g4/g5: s  (rows, nsb) float32
    m: np.ndarray | None = None  # g4/g5 offset (rows, nsb) float32
    sc: np.ndarray | None = None  # k4/k5 6-bit scale, k6 (rows, nsb, 2) signed per half
    mn: np.ndarray | None = None  # k4/k5 6-bit min (rows, nsb)
    d: np.ndarray | None = None  # K-quants (rows, nsb // 8) float32
    dmin: np.ndarray | None = None


def planar_ints(planar: bytes | np.ndarray, fmt: str, rows: int, cols: int) -> PlanarInts:
    """The integers and scales of a planar matrix (the bytes infer.gpu.layout.repack produces)."""
    layout = plane_layout(fmt, rows, cols)
    buf = np.frombuffer(planar, np.uint8) if isinstance(planar, bytes) else planar.view(np.uint8).reshape(-1)
    (o_qs, o_hi, o_sm, o_dm), (s_qs, s_hi, s_sm, s_dm) = layout.offsets, layout.sizes
    n, nsb = layout.n_subblocks, cols // 32
    f16 = lambda raw: raw.view(np.float16).astype(F32)  # noqa: E731
    if fmt == "q8":
        q = buf[o_qs : o_qs + s_qs].view(np.int8).reshape(rows, nsb, 32).astype(np.int64)
        return PlanarInts(q, s=f16(buf[o_sm : o_sm + s_sm]).reshape(rows, nsb))
    packed = buf[o_qs : o_qs + s_qs].reshape(n, 16)
    q = np.concatenate([packed & 0xF, packed >> 4], axis=1).astype(np.int64)
    shifts = np.arange(32, dtype=np.uint32)
    if fmt in ("g5", "k5"):
        hi = buf[o_hi : o_hi + s_hi].view("<u4")
        q |= (((hi[:, None] >> shifts) & 1) << 4).astype(np.int64)
    if fmt == "k6":
        hi = buf[o_hi : o_hi + s_hi].view("<u4").reshape(n, 2)
        two = (hi[:, :, None] >> (2 * shifts[:16])) & 3
        q |= (two.reshape(n, 32) << 4).astype(np.int64)
        q -= 32
    q = q.reshape(rows, nsb, 32)
    if fmt in ("g4", "g5"):
        sm = f16(buf[o_sm : o_sm + s_sm]).reshape(rows, nsb, 2)
        return PlanarInts(q, s=sm[..., 0], m=sm[..., 1])
    dm = f16(buf[o_dm : o_dm + s_dm]).reshape(rows, nsb // 8, 2)
    sm = buf[o_sm : o_sm + s_sm].reshape(rows, nsb, 2)
    if fmt == "k6":
        return PlanarInts(q, sc=sm.view(np.int8).astype(np.int64), d=dm[..., 0])
    return PlanarInts(q, sc=sm[..., 0].astype(np.int64), mn=sm[..., 1].astype(np.int64), d=dm[..., 0],
                      dmin=dm[..., 1])


def _i2f(v: np.ndarray) -> np.ndarray:
    return v.astype(F32)  # int32-range integers to the nearest float32, as __int2float_rn


def _accumulate(tiles: np.ndarray, tile_values: int) -> np.ndarray:
    """The tiles (last axis, `tile_values` values of K each) summed in order within each group of
    GROUP values, from 0, and the groups' sums added in order to acc = 0."""
    per_group = GROUP // tile_values
    acc = np.zeros(tiles.shape[:-1], F32)
    for g0 in range(0, tiles.shape[-1], per_group):
        group = np.zeros(tiles.shape[:-1], F32)
        for t in range(g0, min(g0 + per_group, tiles.shape[-1])):
            group = group + tiles[..., t]
        acc = acc + group
    return acc


def _tiles_of_terms(terms: np.ndarray) -> np.ndarray:
    """(..., nsb) float32 terms -> (..., ntiles) tiles (t0 + t1) + (t2 + t3); absent terms are +0."""
    nsb = terms.shape[-1]
    pad = (-nsb) % TILE
    if pad:
        terms = np.concatenate([terms, np.zeros((*terms.shape[:-1], pad), F32)], axis=-1)
    t = terms.reshape(*terms.shape[:-1], -1, TILE)
    return (t[..., 0] + t[..., 1]) + (t[..., 2] + t[..., 3])


def _epilogue(acc: np.ndarray, bias: np.ndarray | None, residual: np.ndarray | None) -> np.ndarray:
    if bias is not None:
        acc = acc + bias.astype(F32)[None, :]
    if residual is not None:
        acc = acc + residual.astype(F32)
    return acc


def canonical_product(planar: bytes | np.ndarray, fmt: str, rows: int, cols: int, xq: np.ndarray | None = None,
                      xs: np.ndarray | None = None, xsum: np.ndarray | None = None, x: np.ndarray | None = None,
                      bias: np.ndarray | None = None, residual: np.ndarray | None = None) -> np.ndarray:
    """Y (N, rows) float32 of a planar matrix and N activation rows, bit for bit as the kernels: for
    quantized formats the 8-bit form (xq (N, cols) int8, xs (N, cols / 32 or / 256) float32, xsum
    (N, cols / 32) int32), for float formats x (N, cols) float32."""
    nsb = cols // 32
    if fmt in FLOAT_FORMATS:
        from infer.gpu.layout import reconstruct

        w = reconstruct(planar, fmt, rows, cols).reshape(rows, nsb, 32)
        xv = np.asarray(x, F32).reshape(-1, nsb, 32)
        terms = np.zeros((xv.shape[0], rows, nsb), F32)
        for i in range(32):  # products added one by one, in order
            terms = terms + w[None, :, :, i] * xv[:, None, :, i]
        return _epilogue(_accumulate(_tiles_of_terms(terms), 32 * TILE), bias, residual)
    p = planar_ints(planar, fmt, rows, cols)
    xq3 = np.asarray(xq, np.int64).reshape(-1, nsb, 32)
    n = xq3.shape[0]
    xs = np.asarray(xs, F32).reshape(n, -1)
    xsum = np.asarray(xsum, np.int64).reshape(n, nsb)
    if fmt == "k6":
        lo = np.einsum("rjk,njk->nrj", p.q[..., :16], xq3[..., :16])
        hi = np.einsum("rjk,njk->nrj", p.q[..., 16:], xq3[..., 16:])
        parts = p.sc[None, ..., 0] * lo + p.sc[None, ..., 1] * hi  # (n, rows, nsb)
        isum = parts.reshape(n, rows, nsb // 8, 8).sum(-1)
        tiles = (p.d[None] * xs[:, None, :]) * _i2f(isum)
        return _epilogue(_accumulate(tiles, 256), bias, residual)
    idot = np.einsum("rjk,njk->nrj", p.q, xq3)
    if fmt in K_FORMATS:  # k4, k5
        isum = (p.sc[None] * idot).reshape(n, rows, nsb // 8, 8).sum(-1)
        msum = (p.mn[None] * xsum[:, None, :]).reshape(n, rows, nsb // 8, 8).sum(-1)
        tiles = xs[:, None, :] * ((p.d[None] * _i2f(isum)) - (p.dmin[None] * _i2f(msum)))
        return _epilogue(_accumulate(tiles, 256), bias, residual)
    if fmt == "q8":
        terms = (p.s[None] * xs[:, None, :]) * _i2f(idot)
    else:  # g4, g5
        terms = xs[:, None, :] * ((p.s[None] * _i2f(idot)) + (p.m[None] * _i2f(xsum)[:, None, :]))
    return _epilogue(_accumulate(_tiles_of_terms(terms.astype(F32)), 32 * TILE), bias, residual)


def prompt_weights(planar: bytes | np.ndarray, fmt: str, rows: int, cols: int) -> np.ndarray:
    """The float16 weights (rows, cols) the prompt products (infer/kernels/pmm.cu) multiply, bit for
    bit: each formula computed exactly (float64) and rounded to float16 once, as the kernel's
    float16 multiply or fused multiply-add does (its float32 scale products are exact)."""
    p = planar_ints(planar, fmt, rows, cols)
    q = p.q.astype(np.float64)
    if fmt == "q8":
        w = q * p.s[..., None]
    elif fmt in ("g4", "g5"):
        w = q * p.s[..., None] + p.m[..., None]
    elif fmt == "k6":
        d = np.repeat(p.d.astype(np.float64), 8, axis=1)[..., None]  # (rows, nsb, 1)
        s16 = (d * p.sc).astype(np.float16).astype(np.float64)  # (rows, nsb, 2): per 16 weights
        w = q * np.repeat(s16, 16, axis=2)
    else:  # k4, k5
        d = np.repeat(p.d.astype(np.float64), 8, axis=1)
        dmin = np.repeat(p.dmin.astype(np.float64), 8, axis=1)
        s16 = (d * p.sc).astype(np.float16).astype(np.float64)
        m16 = (-(dmin * p.mn)).astype(np.float16).astype(np.float64)
        w = q * s16[..., None] + m16[..., None]
    return w.astype(np.float16).reshape(rows, cols)


def prompt_product(planar: bytes | np.ndarray, fmt: str, rows: int, cols: int, x16: np.ndarray,
                   bias: np.ndarray | None = None, residual: np.ndarray | None = None) -> np.ndarray:
    """Y (N, rows) of the prompt products in float64 from their float16 operands: the kernels sum in
    float32 on the tensor cores, so tests compare with a tolerance (and their invariance bit for bit)."""
    w = prompt_weights(planar, fmt, rows, cols).astype(np.float64)
    y = np.asarray(x16, np.float16).astype(np.float64).reshape(-1, cols) @ w.T
    if bias is not None:
        y = y + bias.astype(np.float64)[None, :]
    if residual is not None:
        y = y + residual.astype(np.float64)
    return y


def attention_reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float) -> np.ndarray:
    """Softmax attention of one query row over its span in float64: q (n_heads, D), keys and values
    (n_kv_heads, T, D) (the span's positions in order); grouped heads share a KV head."""
    n_heads, n_kv = q.shape[0], keys.shape[0]
    group = n_heads // n_kv
    out = np.empty(q.shape, np.float64)
    for h in range(n_heads):
        k, v = keys[h // group].astype(np.float64), values[h // group].astype(np.float64)
        s = (k @ q[h].astype(np.float64)) * scale
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ v
    return out
