# ruff: noqa
"""A NumPy stand-in for the parts of CuPy that infer.gpu uses, with the CUDA kernels emulated in
NumPy, to exercise the Python orchestration without a GPU. Not a test of the CUDA code.

    PYTHONPATH=tests/gpu/numpy_cupy:. python -m pytest tests/gpu/test_model.py tests/gpu/test_kernels.py

runs the GPU tests' Python paths (model wiring, buffers, graph capture, test logic) on the CPU; the
kernels' numbers come from infer.quants/infer.model, so it shows wiring and test mistakes, not kernel
bugs. Dense by design (ruff is off here): one line per emulated kernel."""
import ctypes, time, types
import numpy as np
from gguf.constants import GGMLQuantizationType as T

float16, float32, float64, int32, uint8, uint16, int64, int8, uint32, uint64 = np.float16, np.float32, np.float64, np.int32, np.uint8, np.uint16, np.int64, np.int8, np.uint32, np.uint64

class _Data:
    def __init__(self, a): self.ptr = a.ctypes.data
class ndarray(np.ndarray):
    @property
    def data(self): return _Data(self)
    def __setitem__(self, key, value):  # inside a graph capture: a copy kernel, run at each replay
        if _capturing and isinstance(value, np.ndarray): _capturing[-1]._rec.append((_Copy(self, key, value), None, None, None)); return
        np.ndarray.__setitem__(self, key, value)
    def set(self, arr, stream=None): self[...] = np.asarray(arr).reshape(self.shape)
def _w(r): return r.view(ndarray) if isinstance(r, np.ndarray) else r
def asarray(x, dtype=None): return _w(np.array(x, dtype=dtype, copy=True))
def asnumpy(a, stream=None, out=None):
    if out is None: return np.array(a, copy=True).view(np.ndarray)
    out[...] = a; return out
def argsort(a, axis=-1): return _w(np.argsort(np.asarray(a), axis=axis, kind="stable"))
for _n in ["zeros", "empty", "full", "arange", "concatenate", "stack", "where", "exp", "log", "subtract", "take_along_axis", "matmul", "ascontiguousarray", "empty_like"]:
    globals()[_n] = (lambda f: (lambda *a, **k: _w(f(*a, **k))))(getattr(np, _n))
def empty(shape, dtype=np.float32): return _w(np.full(shape, np.nan if np.dtype(dtype).kind == 'f' else 0x5A, dtype))
random = types.SimpleNamespace(random=lambda n, dtype=np.float64: _w(np.random.random(n).astype(dtype)))
linalg = types.SimpleNamespace(norm=lambda a: np.linalg.norm(np.asarray(a)))
class OutOfMemoryError(MemoryError): pass
class _Pool:
    limit = 0
    def total_bytes(self): return 0
    def used_bytes(self): return 0
    def free_all_blocks(self, stream=None): pass
    def set_limit(self, size=None, fraction=None): _Pool.limit = size or 0
    def get_limit(self): return _Pool.limit
    def malloc(self, n): raise RuntimeError("no device allocations in the fake")
_POOL = _Pool()
class _OwnPool(_Pool):  # cupy.cuda.MemoryPool(): a limit of its own
    def set_limit(self, size=None, fraction=None): self.limit = size or 0
class _Nothing:
    def __enter__(self): return self
    def __exit__(self, *e): return False
def get_default_memory_pool(): return _POOL
def get_default_pinned_memory_pool(): return _POOL

_capturing = []
class _Copy:
    def __init__(self, dst, key, src): self.dst, self.key, self.src = dst, key, src
    def _run(self, grid, block, args): np.ndarray.__setitem__(self.dst, self.key, self.src)
class _Memmove:  # a host<->device copy queued inside a capture: made at each replay, as a graph's copy node
    def __init__(self, d, s, n): self.d, self.s, self.n = d, s, n
    def _run(self, grid, block, args): ctypes.memmove(self.d, self.s, self.n)
def _memcpy_async(d, s, n, kind, stream):
    if _capturing: _capturing[-1]._rec.append((_Memmove(d, s, n), None, None, None)); return
    ctypes.memmove(d, s, n)
class _Graph:
    def __init__(self, calls): self.calls = calls
    def launch(self, stream=None):
        for k, g, b, a in self.calls: k._run(g, b, a)
class Stream:
    def __init__(self, non_blocking=False): self.ptr = 0; self._rec = None
    def __enter__(self): _current.append(self); return self
    def __exit__(self, *e): _current.pop(); return False
    def wait_event(self, event): pass
    def record(self, event=None): return event or Event()
    def begin_capture(self): self._rec = []; _capturing.append(self)
    def end_capture(self): _capturing.remove(self); g = _Graph(self._rec); self._rec = None; return g
    def synchronize(self): pass
_current = []
class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False): self.t = 0.0
    def record(self, stream=None): self.t = time.perf_counter()
    def synchronize(self): pass
class _Device:
    def __init__(self, i=0): self.id = 0
    def __enter__(self): return self
    def __exit__(self, *e): return False
    def synchronize(self): pass
    def use(self): pass
def _no_cublas(): raise RuntimeError("no cuBLAS in the fake")
def _no_attributes(ptr): raise RuntimeError("no pointer attributes in the fake")
MEM_INFO = ((16 << 30) - (512 << 20), 16 << 30)  # (free, total): a 16 GiB card with a context; tests may change it
LIMITS = {0: 1024}  # cudaLimitStackSize: the driver's default 1 KiB per thread
def _set_limit(limit, value): LIMITS[limit] = int(value)
class CompileException(Exception): pass
cuda = types.SimpleNamespace(
    Stream=Stream, Event=Event, Device=_Device, get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3,
    get_current_stream=lambda: _current[-1] if _current else Stream(), device=types.SimpleNamespace(get_cublas_handle=_no_cublas),
    alloc_pinned_memory=lambda n: bytearray(n), MemoryPool=_OwnPool, using_allocator=lambda allocator=None: _Nothing(),
    memory=types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError),
    compiler=types.SimpleNamespace(CompileException=CompileException),
    runtime=types.SimpleNamespace(getDeviceCount=lambda: 1, memGetInfo=lambda: MEM_INFO, memcpyDeviceToDevice=3,
                                  cudaLimitStackSize=0, deviceGetLimit=lambda limit: LIMITS[limit],
                                  deviceSetLimit=_set_limit,
                                  memcpyHostToDevice=1, hostRegister=lambda *a: None, hostUnregister=lambda *a: None,
                                  CUDARuntimeError=type("CUDARuntimeError", (RuntimeError,), {}),
                                  pointerGetAttributes=_no_attributes,
                                  memcpyAsync=_memcpy_async,
                                  memcpy=lambda d, s, n, k: ctypes.memmove(d, s, n), memcpyDeviceToHost=2,
                                  getDeviceProperties=lambda i: {"name": b"FakeGPU", "major": 9, "minor": 0,
                                                                 "multiProcessorCount": 1, "l2CacheSize": 1}))

# ---------------------------------------------------------------- kernels in NumPy
def _arr(ptr, dtype, n):
    ptr = int(ptr.ctypes.data) if isinstance(ptr, np.ndarray) else int(ptr)
    assert ptr != 0, "null pointer dereferenced"
    dt = np.dtype(dtype)
    buf = (ctypes.c_uint8 * (n * dt.itemsize)).from_address(ptr)
    return np.frombuffer(buf, dtype=dt, count=n)
def _ptr(p): return int(p.ctypes.data) if isinstance(p, np.ndarray) else int(p)

def _weights(fmt, qs, hi, sm, dm, rows, K):
    from infer.gpu import layout
    lay = layout.plane_layout(fmt, rows, K)
    if fmt in layout.FLOAT_FORMATS:
        return layout.reconstruct(_arr(qs, np.uint8, lay.sizes[0]).copy(), fmt, rows, K)
    buf = np.zeros(lay.nbytes, np.uint8)
    for p, o, s in zip((qs, hi, sm, dm), lay.offsets, lay.sizes):
        if s: buf[o:o+s] = _arr(p, np.uint8, s)
    return layout.reconstruct(buf, fmt, rows, K)

def _planar(fmt, qs, hi, sm, dm, rows, K):
    from infer.gpu import layout
    lay = layout.plane_layout(fmt, rows, K)
    buf = np.zeros(lay.nbytes, np.uint8)
    for p, o, s in zip((qs, hi, sm, dm), lay.offsets, lay.sizes):
        if s: buf[o:o+s] = _arr(p, np.uint8, s)
    return buf

def _store_rows(y, res, out, ldy):
    N, M = out.shape
    Y = _arr(y, np.float32, (N - 1) * ldy + M)
    R = _arr(res, np.float32, (N - 1) * ldy + M).copy() if _ptr(res) else None
    for v in range(N):
        Y[v * ldy : v * ldy + M] = out[v] + (R[v * ldy : v * ldy + M] if R is not None else np.float32(0))

def _layer_cache(ptr, layer, Hkv, cap, D):
    return _arr(int(ptr) + 2 * layer * Hkv * cap * D, np.float16, Hkv * cap * D).reshape(Hkv, cap, D)

def _int8_form(v, act):
    v = np.asarray(v, np.float32).reshape(-1)
    g = 32 if act == "q8_0" else 256
    b = v.reshape(-1, g)
    if act == "q8_0":
        amax = np.abs(b).max(1, keepdims=True)
        with np.errstate(divide="ignore"):
            inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0))
        scale = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
        q = np.rint(b * inv)
    else:
        ext = np.take_along_axis(b, np.abs(b).argmax(1)[:, None], 1)
        with np.errstate(divide="ignore"):
            inv = np.where(ext != 0, np.float32(-127) / ext, np.float32(0)); scale = np.where(ext != 0, np.float32(1) / inv, np.float32(0))
        q = np.minimum(np.rint(b * inv), 127)
    q = np.where(np.isnan(q), 0, q).astype(np.int32).reshape(-1)  # act.cuh's round_int8: NaN -> 0 (its scale is NaN)
    return q.astype(np.int8), scale.reshape(-1).astype(np.float32), q.reshape(-1, 32).sum(1).astype(np.int32)

def _write_int8(xq, xs, xsum, v, act):
    if not _ptr(xq): return
    q, sc, qs = _int8_form(v, act)
    _arr(xq, np.int8, q.size)[:] = q; _arr(xs, np.float32, sc.size)[:] = sc; _arr(xsum, np.int32, qs.size)[:] = qs

ACTS = ["f32", "f16", "bf16", "q8_0", "q8_k"]

def _rotate(x, c, s, npairs, neox):
    out = x.copy()
    if neox: a, b = x[..., :npairs], x[..., npairs:2*npairs]; out[..., :npairs] = a*c - b*s; out[..., npairs:2*npairs] = a*s + b*c
    else: a, b = x[..., 0:2*npairs:2], x[..., 1:2*npairs:2]; out[..., 0:2*npairs:2] = a*c - b*s; out[..., 1:2*npairs:2] = a*s + b*c
    return out
class RawKernel:
    max_threads_per_block = 1024  # the stand-in has no registers to run out of
    def __init__(self, name): self.name = name
    def __call__(self, grid, block, args, shared_mem=0):
        if _capturing: _capturing[-1]._rec.append((self, grid, block, args)); return
        self._run(grid, block, args)
    def _run(self, grid, block, args):
        n = self.name
        from infer.gpu import layout
        if n == "copy_words_from_host":  # infer/gpu/uploads.py: pinned host words into device memory
            src, dst, words = args
            ctypes.memmove(_ptr(dst), _ptr(src), 4 * int(words))
        elif n.startswith("repack_"):
            src, n_sb, qs, hi, sm, dm = args
            t = T[n[7:].upper()]
            bs, ts = layout.GGML_QUANT_SIZES[t]
            raw = _arr(src, np.uint8, int(n_sb) * 32 // bs * ts).copy()
            fmt = layout.format_of(t)
            r_, c_ = (int(n_sb) // 8, 256) if fmt in layout.K_FORMATS else (int(n_sb), 32)
            planar = np.frombuffer(layout.repack(raw, t, r_, c_), np.uint8)
            lay = layout.plane_layout(fmt, r_, c_)
            for p, o, s in zip((qs, hi, sm, dm), lay.offsets, lay.sizes):
                if s: _arr(p, np.uint8, s)[:] = planar[o:o+s]
        elif n == "moe_combine_norm":  # moe_combine, then rmsnorm8 of the rows
            outs, ids, w, k, dim, slot, shared, gate, x, nw, eps, act, y, y16, yf, xq, xs8, xsum = args
            rows = int(grid[0])
            RawKernel("moe_combine")._run((1, rows), None, (outs, ids, w, k, dim, slot, shared, gate, x))
            RawKernel("rmsnorm8")._run((rows,), None, (x, nw, y, y16, dim, eps, act, xq, xs8, xsum, 0, yf))
        elif n.startswith("qgemv_id_"):  # routed experts: each (row, slot) pair by its expert's rows (infer.gpu.experts)
            from infer.gpu.reference import canonical_product
            fmt = n[len("qgemv_id_"):]
            planes = [args[4 * i : 4 * i + 4] for i in range(3)]
            e0, e1, M, K, xq, xs8, xsum, ids, xdiv, y, ldy = args[12:]
            e0, e1, M, K, xdiv, ldy = map(int, (e0, e1, M, K, xdiv, ldy))
            pairs, group = int(grid[1]), (256 if fmt in layout.K_FORMATS else 32)
            I = _arr(ids, np.int32, pairs).copy()
            nx = (pairs - 1) // xdiv + 1
            q = _arr(xq, np.int8, nx * K).reshape(nx, K).copy()
            xsv = _arr(xs8, np.float32, nx * K // group).reshape(nx, -1).copy()
            su = _arr(xsum, np.int32, nx * K // 32).reshape(nx, -1).copy()
            per_sb = (*layout.PLANE_BYTES[fmt], 0.5)  # dm: 4 bytes per 8 sub-blocks
            Y = _arr(y, np.float32, (pairs - 1) * ldy + M)
            for j in range(pairs):
                e, r = int(I[j]), j // xdiv
                if e < 0: continue
                outs = []
                for (lo, hi), pl in zip(((0, e0), (e0, e1), (e1, M)), planes):
                    if hi <= lo: continue
                    sb0 = e * (hi - lo) * K // 32
                    moved = [np.uint64(_ptr(p) + int(sb0 * b)) if _ptr(p) else p for p, b in zip(pl, per_sb)]
                    outs.append(canonical_product(_planar(fmt, *moved, hi - lo, K), fmt, hi - lo, K, q[r:r + 1], xsv[r:r + 1], su[r:r + 1]))
                Y[j * ldy : j * ldy + M] = np.concatenate(outs, axis=1)[0]
        elif n.startswith("qmm_id_"):  # routed experts grouped by expert (moe_group's order): as qgemv_id, pair by pair
            fmt = n.split("_")[2]
            planes = args[:12]
            e0, e1, M, K, xq, xs8, xsum, starts, tiles, E, y, ldy = args[12:]
            E, K = int(E), int(K)
            S = _arr(starts, np.int32, E + 1).copy()
            total = int(S[E])
            ids = np.zeros(max(total, 1), np.int32)
            for e in range(E): ids[S[e]:S[e + 1]] = e
            if total: RawKernel(f"qgemv_id_{fmt}")._run((0, total), None, (*planes, e0, e1, M, K, xq, xs8, xsum, np.uint64(ids.ctypes.data), 1, y, ldy))
        elif n.startswith(("qgemv_", "qmm_")) and n != "qmm_combine":  # canonical products, bit for bit (infer.gpu.reference)
            from infer.gpu.reference import canonical_product
            fmt = n.split("_")[1]
            planes = [args[4 * i : 4 * i + 4] for i in range(3)]
            e0, e1, M, K, xq, xs8, xsum, N, y, ldy, bias, res, partial = args[12:]
            e0, e1, M, K, N, ldy = map(int, (e0, e1, M, K, N, ldy))
            group = 256 if fmt in layout.K_FORMATS else 32
            q = _arr(xq, np.int8, N * K).reshape(N, K).copy()
            xsv = _arr(xs8, np.float32, N * K // group).reshape(N, -1).copy()
            su = _arr(xsum, np.int32, N * K // 32).reshape(N, -1).copy()
            assert (su == q.astype(np.int32).reshape(N, -1, 32).sum(2)).all()
            outs = []
            for (lo, hi), pl in zip(((0, e0), (e0, e1), (e1, M)), planes):
                if hi > lo: outs.append(canonical_product(_planar(fmt, *pl, hi - lo, K), fmt, hi - lo, K, q, xsv, su))
            out = np.concatenate(outs, axis=1)
            if _ptr(partial):  # split K: the whole sum as group 0, the other groups zero (qmm_combine adds them)
                groups = grid[2] if len(grid) > 2 else 1
                P = _arr(partial, np.float32, groups * N * M).reshape(groups, N, M)
                P[...] = 0; P[0] = out
                return
            if _ptr(bias): out = out + _arr(bias, np.float32, M)[None]
            _store_rows(y, res, out, ldy)
        elif n.startswith("pmm_"):  # prompt products: float16 operands, sums in float64 (the GPU's differ in rounding only)
            from infer.gpu.reference import prompt_product
            fmt = n.split("_")[1]
            planes = [args[4 * i : 4 * i + 4] for i in range(3)]
            e0, e1, M, K, x16, N, y, ldy, bias, res = args[12:]
            e0, e1, M, K, N, ldy = map(int, (e0, e1, M, K, N, ldy))
            xv = _arr(x16, np.float16, N * K).reshape(N, K).copy()
            outs = [prompt_product(_planar(fmt, *pl, hi - lo, K), fmt, hi - lo, K, xv)
                    for (lo, hi), pl in zip(((0, e0), (e0, e1), (e1, M)), planes) if hi > lo]
            out = np.concatenate(outs, axis=1).astype(np.float32)
            if _ptr(bias): out = out + _arr(bias, np.float32, M)[None]
            _store_rows(y, res, out, ldy)
        elif n == "qmm_combine":
            partial, groups, M, N, y, ldy, bias, res = args
            groups, M, N, ldy = map(int, (groups, M, N, ldy))
            P = _arr(partial, np.float32, groups * N * M).reshape(groups, N, M)
            out = np.zeros((N, M), np.float32)
            for g in range(groups): out = out + P[g]
            if _ptr(bias): out = out + _arr(bias, np.float32, M)[None]
            _store_rows(y, res, out, ldy)
        elif n.startswith("fgemv_"):
            from infer.gpu.reference import canonical_product
            fmt = n.split("_")[1]
            w, M, K, x, N, y, ldy, bias, res = args
            M, K, N, ldy = map(int, (M, K, N, ldy))
            lay = layout.plane_layout(fmt, M, K)
            out = canonical_product(_arr(w, np.uint8, lay.nbytes).copy(), fmt, M, K, x=_arr(x, np.float32, N * K).reshape(N, K))
            if _ptr(bias): out = out + _arr(bias, np.float32, M)[None]
            _store_rows(y, res, out, ldy)
        elif n.startswith("dequant_"):
            fmt = n[8:]
            qs, hi, sm, dm, cnt, out = args
            cnt = int(cnt)
            if fmt in layout.FLOAT_FORMATS:
                w = _weights(fmt, qs, hi, sm, dm, 1, cnt).reshape(-1)
            else:
                w = _weights(fmt, qs, hi, sm, dm, cnt // 8, 256).reshape(-1) if fmt in layout.K_FORMATS else _weights(fmt, qs, hi, sm, dm, cnt, 32).reshape(-1)
            _arr(out, np.float16, w.size)[:] = w.astype(np.float16)
        elif n.startswith("embed_"):
            fmt = n[6:]
            qs, hi, sm, dm, rows, K, ids, cnt, out, scale = args
            rows, K, cnt = int(rows), int(K), int(cnt)
            W = _weights(fmt, qs, hi, sm, dm, rows, K)
            o = _arr(out, np.float32, cnt * K).reshape(cnt, K)
            for i, r in enumerate(_arr(ids, np.int32, cnt)):
                o[i] = W[r] * np.float32(scale) if 0 <= r < rows else 0
        elif n in ("rmsnorm", "rmsnorm8"):
            x, w, y, y16, nn, eps, act, xq, xs8, xsum, src_rows, *yf = args
            rows, nn = grid[0], int(nn)
            if _ptr(src_rows):
                sel = _arr(src_rows, np.int32, rows).astype(np.int64)
                xv = _arr(x, np.float32, (int(sel.max()) + 1) * nn).reshape(-1, nn)[sel]
            else:
                xv = _arr(x, np.float32, rows * nn).reshape(rows, nn)
            from infer.model import rms_norm
            from infer.quants import round_activations
            v = rms_norm(xv.copy(), _arr(w, np.float32, nn).copy(), float(eps), exact=True)
            if _ptr(y16): _arr(y16, np.float16, rows * nn)[:] = v.reshape(-1).astype(np.float16)  # before rounding
            if yf and _ptr(yf[0]): _arr(yf[0], np.float32, rows * nn)[:] = v.reshape(-1)
            if _ptr(xq): _write_int8(xq, xs8, xsum, v.reshape(-1), ACTS[int(act)])
            if _ptr(y):
                v = round_activations(v, ["f32", "f16", "bf16", "q8_0", "q8_k"][int(act)])
                _arr(y, np.float32, rows * nn)[:] = v.reshape(-1)
        elif n == "round_act":
            x, y, y16, nn, act, xq, xs8, xsum = args
            rows, nn = grid[1], int(nn)
            if _ptr(xq): _write_int8(xq, xs8, xsum, _arr(x, np.float32, rows * nn).copy(), ACTS[int(act)])
            from infer.quants import round_activations
            v = round_activations(_arr(x, np.float32, rows * nn).reshape(rows, nn).copy(), ["f32", "f16", "bf16", "q8_0", "q8_k"][int(act)])
            _arr(y, np.float32, rows * nn)[:] = v.reshape(-1)
            if _ptr(y16): _arr(y16, np.float16, rows * nn)[:] = v.reshape(-1).astype(np.float16)
        elif n == "rope_rows":
            qkv, W, cos, sin, H, Hkv, D, npairs, neox, layer, pos, slot, kptr, vptr, cap, qn, kn, eps = args
            Tn = grid[0]; W, H, Hkv, D, npairs, neox, layer = map(int, (W, H, Hkv, D, npairs, neox, layer))
            P = _arr(pos, np.int32, Tn); SL = _arr(slot, np.int32, Tn); CAP = _arr(cap, np.int32, Tn)
            KP = _arr(kptr, np.uint64, Tn); VP = _arr(vptr, np.uint64, Tn)
            C = _arr(cos, np.float32, (P.max() + 1) * npairs).reshape(-1, npairs); S = _arr(sin, np.float32, (P.max() + 1) * npairs).reshape(-1, npairs)
            X = _arr(qkv, np.float32, Tn * W).reshape(Tn, W)
            for t in range(Tn):
                c, s_ = C[P[t]], S[P[t]]
                q = X[t, : H * D].reshape(H, D); k = X[t, H * D : (H + Hkv) * D].reshape(Hkv, D); v = X[t, (H + Hkv) * D : (H + 2 * Hkv) * D].reshape(Hkv, D)
                from infer.model import rms_norm
                if _ptr(qn): q[...] = rms_norm(q.copy(), _arr(qn, np.float32, D).copy(), float(eps), exact=True)
                if _ptr(kn): k = rms_norm(k.copy(), _arr(kn, np.float32, D).copy(), float(eps), exact=True)
                q[...] = _rotate(q.copy(), c, s_, npairs, neox)
                KC, VC = _layer_cache(KP[t], layer, Hkv, int(CAP[t]), D), _layer_cache(VP[t], layer, Hkv, int(CAP[t]), D)
                sl = SL[t] % CAP[t]  # a local layer's ring: slot s at s % positions
                KC[:, sl] = _rotate(k, c, s_, npairs, neox).astype(np.float16); VC[:, sl] = v.astype(np.float16)
        elif n.startswith("attn_chunks_"):  # the whole attention of each row into its block 0 (m 0, l 1: the merge's o / l)
            qkv, W, H, Hkv, scale, window, layer, pos, base, anc_off, anc, kptr, vptr, cap, work, nb, n_rows, _group = args
            D = int(n.rsplit("_d", 1)[1])
            rows = int(n_rows); W, H, Hkv, layer, nb = map(int, (W, H, Hkv, layer, nb)); G = H // Hkv
            P = _arr(pos, np.int32, rows); B = _arr(base, np.int32, rows); OFF = _arr(anc_off, np.int32, rows)
            CAP = _arr(cap, np.int32, rows); KP = _arr(kptr, np.uint64, rows); VP = _arr(vptr, np.uint64, rows)
            X = _arr(qkv, np.float32, rows * W).reshape(rows, W)
            WK = _arr(work, np.float32, rows * H * nb * (D + 2)).reshape(rows, H, nb, D + 2)
            from infer.gpu.reference import attention_reference
            for r in range(rows):
                L = int(P[r]) + 1
                idx = np.arange(L) if OFF[r] < 0 else np.concatenate([np.arange(B[r]), _arr(anc, np.int32, int(OFF[r]) + L - int(B[r]))[int(OFF[r]):]]).astype(np.int64)
                if int(window) > 0: idx = idx[max(0, L - int(window)):]  # span index = position
                idx = idx % int(CAP[r])
                KC, VC = _layer_cache(KP[r], layer, Hkv, int(CAP[r]), D), _layer_cache(VP[r], layer, Hkv, int(CAP[r]), D)
                q = X[r, : H * D].reshape(H, D).astype(np.float16).astype(np.float32)
                o = attention_reference(q, KC[:, idx], VC[:, idx], float(scale)).astype(np.float32)
                b0 = max(0, L - int(window)) // 128 if int(window) > 0 else 0  # where attn_merge starts
                WK[r, :, :, 1] = 0; WK[r, :, b0, 0] = 0; WK[r, :, b0, 1] = 1; WK[r, :, b0, 2:] = o
        elif n.startswith("attn_prompt_"):  # the prompt rows' attention over slots 0..pos, in float64, as float16
            if n.startswith("attn_prompt_window_d"):  # a local layer's: with its window
                qkv, W, H, Hkv, scale, window, layer, pos, kptr, vptr, cap, n_rows, out16 = args
            else:
                qkv, W, H, Hkv, scale, layer, pos, kptr, vptr, cap, n_rows, out16 = args
                window = 0
            D = int(n.rsplit("_d", 1)[1])
            rows = int(n_rows); W, H, Hkv, layer = map(int, (W, H, Hkv, layer))
            P = _arr(pos, np.int32, rows); CAP = _arr(cap, np.int32, rows)
            KP = _arr(kptr, np.uint64, rows); VP = _arr(vptr, np.uint64, rows)
            X = _arr(qkv, np.float32, rows * W).reshape(rows, W)
            O = _arr(out16, np.float16, rows * H * D).reshape(rows, H * D)
            from infer.gpu.reference import attention_reference
            for r in range(rows):
                idx = np.arange(max(0, int(P[r]) + 1 - int(window)) if int(window) > 0 else 0, int(P[r]) + 1)
                idx = idx % int(CAP[r])  # a local layer's ring: slot s at s % positions
                KC, VC = _layer_cache(KP[r], layer, Hkv, int(CAP[r]), D), _layer_cache(VP[r], layer, Hkv, int(CAP[r]), D)
                q = X[r, : H * D].reshape(H, D).astype(np.float16).astype(np.float32)
                O[r] = attention_reference(q, KC[:, idx], VC[:, idx], float(scale)).reshape(-1).astype(np.float16)
        elif n == "attn_merge":
            work, nb, H, D, pos, window, out, out16, act, xq, xs8, xsum = args
            rows = grid[0]; nb, H, D, window = map(int, (nb, H, D, window)); nn = H * D
            WK = _arr(work, np.float32, rows * H * nb * (D + 2)).reshape(rows, H, nb, D + 2)
            P = _arr(pos, np.int32, rows)
            first = [max(0, int(p) - window + 1) // 128 if window > 0 else 0 for p in P]  # the merge's first block
            assert all(int(p) // 128 < nb for p in P), "a row's position past the attention blocks (max_ctx too small)"
            o = np.stack([WK[r, :, first[r], 2:] / WK[r, :, first[r], 1:2] for r in range(rows)]).reshape(rows, nn)
            if _ptr(out16): _arr(out16, np.float16, rows * nn)[:] = o.reshape(-1).astype(np.float16)
            from infer.quants import round_activations
            act = ACTS[int(act)]
            _arr(out, np.float32, rows * nn)[:] = round_activations(o.copy(), act).reshape(-1)
            if _ptr(xq): _write_int8(xq, xs8, xsum, o.reshape(-1), act)
        elif n == "glu_round":
            gu, nn, y, y16, act, xq, xs8, xsum, gelu = args
            rows, nn = grid[1], int(nn)
            G = _arr(gu, np.float32, rows * 2 * nn).reshape(rows, 2 * nn)
            g, u = G[:, :nn], G[:, nn:]
            if int(gelu):
                from infer.model import geglu
                v = geglu(g.copy(), u.copy(), exact=True)
            else:
                v = (g / (np.float32(1) + np.exp(-g)) * u).astype(np.float32)
            if _ptr(y16): _arr(y16, np.float16, rows * nn)[:] = v.reshape(-1).astype(np.float16)
            act = ACTS[int(act)]
            if _ptr(xq): _write_int8(xq, xs8, xsum, v.reshape(-1), act)
            if _ptr(y):
                from infer.quants import round_activations
                _arr(y, np.float32, rows * nn)[:] = round_activations(v.copy(), act).reshape(-1)
        elif n == "norm_add":
            t, w, x, nn, eps = args
            rows, nn = grid[0], int(nn)
            from infer.model import rms_norm
            X = _arr(x, np.float32, rows * nn).reshape(rows, nn)
            X += rms_norm(_arr(t, np.float32, rows * nn).reshape(rows, nn).copy(), _arr(w, np.float32, nn).copy(), float(eps), exact=True)
        elif n == "argmax_rows":
            from infer.sampler import argmax_rows
            lg, vocab, ids, maxima, bad = args
            rows, vocab = int(grid[0]), int(vocab)
            got = argmax_rows(_arr(lg, np.float32, rows * vocab).reshape(rows, vocab))
            for out, dtype, values in zip((ids, maxima, bad), (np.int32, np.float32, np.int32), got):
                _arr(out, dtype, rows)[:] = values
        elif n == "sample_rows":
            lg, vocab, out_rows, temps, seeds, tok, pos, slot, base, anc_off, hist, advance = args
            rows, vocab = int(grid[0]), int(vocab)
            OR = _arr(out_rows, np.int32, rows); cap = int(OR.max()) + 1
            TP = _arr(temps, np.float32, cap); SD = _arr(seeds, np.uint32, cap); TK = _arr(tok, np.int32, cap)
            PS = _arr(pos, np.int32, cap); SL = _arr(slot, np.int32, cap); BS = _arr(base, np.int32, cap); HS = _arr(hist, np.uint64, cap)
            OF = _arr(anc_off, np.int32, cap)
            L = _arr(lg, np.float32, rows * vocab).reshape(rows, vocab)
            for i in range(rows):
                r = int(OR[i]); p = int(PS[r]); v = L[i].astype(np.float64)
                if float(TP[r]) > 0:
                    rnd = np.random.default_rng([int(SD[r]), p]).random(v.size); v = (L[i] / TP[r]).astype(np.float64) - np.log(-np.log(rnd))  # the division in float32, as the kernel's
                nxt = int(np.argmax(v))
                if int(HS[r]):
                    _arr(int(HS[r]), np.int32, p + 2)[p + 1] = nxt
                    if int(advance):
                        TK[r] = nxt; PS[r] = p + 1; SL[r] += 1
                        if int(OF[r]) < 0: BS[r] = p + 2
        elif n == "moe_route":
            from infer.moe import expert_weights, router_softmax, top_k
            lg, rows, E, k, norm, live, ids, w = args
            rows, E, k = int(rows), int(E), int(k)
            probs = router_softmax(_arr(lg, np.float32, rows * E).reshape(rows, E).copy())
            chosen = top_k(probs, k)
            weights = expert_weights(probs, chosen, bool(int(norm)))
            alive = _arr(live, np.int32, rows) != 0 if _ptr(live) else np.ones(rows, bool)
            _arr(ids, np.int32, rows * k)[:] = np.where(alive[:, None], chosen, -1).reshape(-1)
            _arr(w, np.float32, rows * k)[:] = np.where(alive[:, None], weights, 0).reshape(-1)
        elif n == "moe_group":  # pairs sorted by expert (stable: the device's order within an expert may differ, and nothing depends on it)
            ids, pairs, E, bn, starts, tiles, order, slot = args
            pairs, E, bn = int(pairs), int(E), int(bn)
            I = _arr(ids, np.int32, pairs).copy()
            counts = np.bincount(I[I >= 0], minlength=E)
            S = _arr(starts, np.int32, E + 1); S[0] = 0; S[1:] = np.cumsum(counts)
            TL = _arr(tiles, np.int32, E + 1); TL[0] = 0; TL[1:] = np.cumsum(-(-counts // bn))
            valid = np.flatnonzero(I >= 0)
            srt = valid[np.argsort(I[valid], kind="stable")]
            _arr(order, np.int32, pairs)[: srt.size] = srt
            SL = _arr(slot, np.int32, pairs); SL[:] = -1; SL[srt] = np.arange(srt.size)
        elif n == "moe_gather8":
            xq, xs8, xsum, K, group, order, count, xdiv, oq, os_, osum = args
            K, group, xdiv = int(K), int(group), int(xdiv)
            c = int(_arr(count, np.int32, 1)[0])
            src = _arr(order, np.int32, c).copy() // xdiv
            nx = int(src.max()) + 1 if c else 0
            for a, o, w, dt in ((xq, oq, K, np.int8), (xs8, os_, K // group, np.float32), (xsum, osum, K // 32, np.int32)):
                if c: _arr(o, dt, c * w).reshape(c, w)[:] = _arr(a, dt, nx * w).reshape(nx, w)[src]
        elif n == "moe_combine":
            from infer.moe import SharedExpert, weighted_sum
            outs, ids, w, k, dim, slot, shared, gate, x = args
            rows, k, dim = int(grid[1]), int(k), int(dim)
            if _ptr(slot):  # outputs in moe_group's order: back to pair order
                SL = _arr(slot, np.int32, rows * k).copy()
                src = _arr(outs, np.float32, (int(SL.max()) + 1) * dim).reshape(-1, dim)
                O = np.zeros((rows * k, dim), np.float32); O[SL >= 0] = src[SL[SL >= 0]]; O = O.reshape(rows, k, dim)
            else:
                O = _arr(outs, np.float32, rows * k * dim).reshape(rows, k, dim)
            W = _arr(w, np.float32, rows * k).reshape(rows, k)
            alive = _arr(ids, np.int32, rows * k).reshape(rows, k)[:, 0] >= 0
            t = weighted_sum(O, W)
            if _ptr(shared):
                g = _arr(gate, np.float32, rows).copy()
                with np.errstate(all="ignore"):
                    t = t + _arr(shared, np.float32, rows * dim).reshape(rows, dim) * SharedExpert.scale(g)[:, None]
            X = _arr(x, np.float32, rows * dim).reshape(rows, dim)
            X[alive] = X[alive] + t[alive]
        else:
            raise NotImplementedError(n)

def _off(p, nbytes): return np.uint64(_ptr(p) + nbytes)


class RawModule:
    def __init__(self, code=None, options=(), backend="nvrtc"): self.backend = backend
    def compile(self): pass
    def get_function(self, name): return RawKernel(name)
