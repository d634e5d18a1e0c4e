"""A stand-in GPU for CI: just enough of CuPy (arrays in host memory, streams and events that are
always complete, copies by memmove) and of infer.gpu.ops (NumPy versions of the kernels, working
on the planar formats through infer.gpu.layout's reference repack/reconstruct) to run the GPU
streaming glue — plan, ring, slots, repack into the scratch, the batched forward — on a machine
without a GPU. Ordering between streams is not exercised (the CPU simulation does that); what is
checked is that the GPU code calls what exists with the right shapes and computes the right thing.
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys
import types
from typing import Any

import numpy as np
from gguf.constants import GGMLQuantizationType

from infer.gpu import layout
from infer.model import rms_norm
from infer.quants import round_activations


class _Pointer:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class FakeArray(np.ndarray):
    """A NumPy array with CuPy's `.data.ptr` and `.set()`."""

    @property
    def data(self) -> _Pointer:  # type: ignore[override]
        return _Pointer(int(self.__array_interface__["data"][0]))

    def set(self, array: Any, stream: Any = None) -> None:
        self[...] = np.asarray(array).reshape(self.shape)


def _fake(a: np.ndarray) -> FakeArray:
    return a.view(FakeArray)


def _at(ptr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


class _Stream:
    ptr = 0

    def __init__(self, non_blocking: bool = False) -> None:
        pass

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Event:
    def __init__(self, block: bool = False, disable_timing: bool = False) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _memcpy(dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
    ctypes.memmove(dst, src, nbytes)


class _Pool:
    def free_all_blocks(self) -> None:
        pass

    def used_bytes(self) -> int:
        return 0

    def total_bytes(self) -> int:
        return 0


def make_cupy() -> types.SimpleNamespace:
    runtime = types.SimpleNamespace(memcpyAsync=_memcpy, memcpyHostToDevice=1, hostRegister=lambda *a: None,
                                    hostUnregister=lambda *a: None)
    cuda = types.SimpleNamespace(Stream=_Stream, Event=_Event, runtime=runtime, get_current_stream=_Stream,
                                 Device=lambda *a: types.SimpleNamespace(synchronize=lambda: None, id=0))
    return types.SimpleNamespace(
        ndarray=FakeArray, float16=np.float16, float32=np.float32, float64=np.float64, int32=np.int32, uint8=np.uint8, cuda=cuda,
        empty=lambda shape, dtype=np.float64: _fake(np.empty(shape, dtype)),
        zeros=lambda shape, dtype=np.float64: _fake(np.zeros(shape, dtype)),
        empty_like=lambda a: _fake(np.empty_like(a)),
        asarray=lambda a, dtype=None: _fake(np.array(a, dtype=dtype)),
        arange=lambda *a, dtype=None: _fake(np.arange(*a, dtype=dtype)),
        where=lambda *a: _fake(np.where(*a)), exp=lambda a: _fake(np.exp(a)),
        matmul=lambda a, b: _fake(np.matmul(a, b)), concatenate=lambda a, axis=0: _fake(np.concatenate(a, axis)),
        ascontiguousarray=lambda a: _fake(np.ascontiguousarray(a)),
        asnumpy=lambda a, stream=None: np.array(a).view(np.ndarray),
        get_default_memory_pool=_Pool,
    )


# ------------------------------------------------------------------------------ kernels
def _fake_repack(name: str) -> Any:
    ggml_type = GGMLQuantizationType[name.removeprefix("repack_").upper()]

    def launch(grid: Any, block: Any, args: tuple) -> None:
        raw, n_sb, *planes = args
        n_sb = int(n_sb)
        fmt = layout.format_of(ggml_type)
        packed = np.frombuffer(layout.repack(np.asarray(raw), ggml_type, 1, n_sb * 32), np.uint8)
        lay = layout.plane_layout(fmt, 1, n_sb * 32)
        for ptr, offset, size in zip(planes, lay.offsets, lay.sizes, strict=True):
            if size:
                _at(int(ptr), size)[:] = packed[offset: offset + size]

    return launch


def fake_kernel_function(module: str, name: str, defines: Any = None) -> Any:
    if module == "repack":
        return _fake_repack(name)
    raise NotImplementedError(f"fake GPU has no kernel {module}.{name}")


def _weights(m: Any) -> np.ndarray:
    return layout.reconstruct(np.asarray(m.buffer).view(np.uint8).reshape(-1), m.fmt, m.rows, m.cols)


def _gemv(m: Any, x: Any, y: Any, bias: Any = None, residual: Any = None, defines: Any = None) -> None:
    r = _weights(m) @ np.asarray(x, np.float32).reshape(-1)
    if bias is not None:
        r = r + bias
    if residual is not None:
        r = r + np.asarray(residual).reshape(-1)
    y[...] = r.reshape(y.shape)


def _gemv_swiglu(gate: Any, up: Any, x: Any, y: Any, defines: Any = None) -> None:
    g, u = _weights(gate) @ np.asarray(x).reshape(-1), _weights(up) @ np.asarray(x).reshape(-1)
    y[...] = (g / (1.0 + np.exp(-g)) * u).reshape(y.shape)


def _dequantize(m: Any, out: Any) -> None:
    out[...] = _weights(m).reshape(-1).astype(np.float16)


def _embed(m: Any, ids: Any, n: int, out: Any) -> None:
    out.reshape(-1, m.cols)[:n] = _weights(m)[np.asarray(ids)[:n]]


def _rmsnorm(x: Any, weight: Any, eps: float, rows: int, n: int, y: Any = None, y16: Any = None,
             act: str = "f32") -> None:
    r = round_activations(rms_norm(np.asarray(x, np.float32).reshape(rows, n), np.asarray(weight), eps), act)
    if y is not None:
        y.reshape(rows, n)[...] = r
    if y16 is not None:
        y16.reshape(rows, n)[...] = r.astype(np.float16)


def _round_act(x: Any, y: Any, rows: int, n: int, act: str, y16: Any = None) -> None:
    r = round_activations(np.asarray(x, np.float32).reshape(rows, n), act)
    y.reshape(rows, n)[...] = r
    if y16 is not None:
        y16.reshape(rows, n)[...] = r.astype(np.float16)


def _rope_store(q: Any, k: Any, v: Any, cos: Any, sin: Any, pos: Any, n_tokens: int, n_heads: int, n_kv_heads: int,
                head_dim: int, n_pairs: int, neox: bool, k_cache: Any, v_cache: Any, max_ctx: int) -> None:
    p = np.asarray(pos)[:n_tokens]
    c, s = np.asarray(cos)[p][:, None, :], np.asarray(sin)[p][:, None, :]

    def rotate(x: np.ndarray, heads: int) -> np.ndarray:
        x = x.reshape(n_tokens, heads, head_dim)
        out = x.copy()
        if neox:
            a, b = x[..., :n_pairs], x[..., n_pairs: 2 * n_pairs]
            out[..., :n_pairs], out[..., n_pairs: 2 * n_pairs] = a * c - b * s, a * s + b * c
        else:
            a, b = x[..., 0: 2 * n_pairs: 2], x[..., 1: 2 * n_pairs: 2]
            out[..., 0: 2 * n_pairs: 2], out[..., 1: 2 * n_pairs: 2] = a * c - b * s, a * s + b * c
        return out

    q[...] = rotate(np.asarray(q), n_heads).reshape(q.shape)
    k_cache[:, p, :] = rotate(np.asarray(k), n_kv_heads).transpose(1, 0, 2).astype(np.float16)
    v_cache[:, p, :] = np.asarray(v).reshape(n_tokens, n_kv_heads, head_dim).transpose(1, 0, 2).astype(np.float16)


def _attention_decode(q: Any, k_cache: Any, v_cache: Any, pos: Any, n_heads: int, n_kv_heads: int, head_dim: int,
                      max_ctx: int, n_splits: int, scores: Any, part_o: Any, part_ml: Any, out: Any) -> None:
    end = int(np.asarray(pos)[0]) + 1
    group = n_heads // n_kv_heads
    qq = np.asarray(q).astype(np.float16).astype(np.float32).reshape(n_kv_heads, group, head_dim)
    keys = np.asarray(k_cache)[:, :end].astype(np.float32)  # (kv, S, hd)
    values = np.asarray(v_cache)[:, :end].astype(np.float32)
    sc = qq @ keys.transpose(0, 2, 1) / np.float32(np.sqrt(head_dim))
    sc -= sc.max(axis=-1, keepdims=True)
    probs = np.exp(sc)
    probs /= probs.sum(axis=-1, keepdims=True)
    out[...] = (probs.astype(np.float16).astype(np.float32) @ values).reshape(out.shape)


def _matmul_f16(x16: Any, w16: Any, out: Any, accumulate: bool = False) -> None:
    r = np.asarray(x16, np.float32) @ np.asarray(w16, np.float32).T
    out[...] = r + (np.asarray(out) if accumulate else 0)


def _swiglu(gate: Any, up: Any, out: Any, n: int) -> None:
    g = np.asarray(gate)
    out[...] = g / (1.0 + np.exp(-g)) * np.asarray(up)


def make_ops() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        gemv=_gemv, gemv_swiglu=_gemv_swiglu, dequantize=_dequantize, embed=_embed, rmsnorm=_rmsnorm,
        round_act=_round_act, rope_store=_rope_store, attention_decode=_attention_decode, matmul_f16=_matmul_f16,
        swiglu=_swiglu)


def install(monkeypatch: Any) -> None:
    """Points the GPU modules at the fake device for the duration of a test."""
    fake_cupy = make_cupy()
    if importlib.util.find_spec("cupy") is None:
        # Without CuPy (CI) the GPU modules' top-level `import cupy` must find the stand-in.
        monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    import infer.gpu.ops as real_ops
    import infer.tiers.gpu_forward as gpu_forward
    import infer.tiers.pipeline as pipeline

    for module in (real_ops, pipeline, gpu_forward):
        monkeypatch.setattr(module, "cupy", fake_cupy)
    monkeypatch.setattr(real_ops.kernels, "function", fake_kernel_function)
    monkeypatch.setattr(pipeline.kernels, "function", fake_kernel_function)
    fake_ops = make_ops()
    fake_ops.attention_splits = real_ops.attention_splits  # buffer sizing is the real kernels' rule
    fake_ops.attention_work = real_ops.attention_work
    monkeypatch.setattr(gpu_forward, "ops", fake_ops)
    monkeypatch.setattr(gpu_forward, "F32", np.float32)
    monkeypatch.setattr(gpu_forward, "F16", np.float16)
