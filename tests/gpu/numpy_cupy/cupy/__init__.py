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

float16, float32, float64, int32, uint8, uint16, int64, int8 = np.float16, np.float32, np.float64, np.int32, np.uint8, np.uint16, np.int64, np.int8

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
def asnumpy(a, stream=None): return np.array(a, copy=True).view(np.ndarray)
def argsort(a, axis=-1): return _w(np.argsort(np.asarray(a), axis=axis, kind="stable"))
for _n in ["zeros", "empty", "full", "arange", "concatenate", "stack", "where", "exp", "matmul", "ascontiguousarray", "empty_like"]:
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
_POOL = _Pool()
def get_default_memory_pool(): return _POOL
def get_default_pinned_memory_pool(): return _POOL

_capturing = []
class _Copy:
    def __init__(self, dst, key, src): self.dst, self.key, self.src = dst, key, src
    def _run(self, grid, block, args): np.ndarray.__setitem__(self.dst, self.key, self.src)
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
def _no_cublas(): raise RuntimeError("no cuBLAS in the fake")
def _no_attributes(ptr): raise RuntimeError("no pointer attributes in the fake")
MEM_INFO = ((16 << 30) - (512 << 20), 16 << 30)  # (free, total): a 16 GiB card with a context; tests may change it
class CompileException(Exception): pass
cuda = types.SimpleNamespace(
    Stream=Stream, Event=Event, Device=_Device, get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3,
    get_current_stream=lambda: _current[-1] if _current else Stream(), device=types.SimpleNamespace(get_cublas_handle=_no_cublas),
    memory=types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError),
    compiler=types.SimpleNamespace(CompileException=CompileException),
    runtime=types.SimpleNamespace(getDeviceCount=lambda: 1, memGetInfo=lambda: MEM_INFO, memcpyDeviceToDevice=3,
                                  memcpyHostToDevice=1, hostRegister=lambda *a: None, hostUnregister=lambda *a: None,
                                  pointerGetAttributes=_no_attributes,
                                  memcpyAsync=lambda d, s, n, k, st: ctypes.memmove(d, s, n),
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
    q = q.astype(np.int32).reshape(-1)
    return q.astype(np.int8), scale.reshape(-1).astype(np.float32), q.reshape(-1, 32).sum(1).astype(np.int32)

def _write_int8(xq, xs, xsum, v, act):
    if not _ptr(xq): return
    q, sc, qs = _int8_form(v, act)
    _arr(xq, np.int8, q.size)[:] = q; _arr(xs, np.float32, sc.size)[:] = sc; _arr(xsum, np.int32, qs.size)[:] = qs

ACTS = ["f32", "f16", "bf16", "q8_0", "q8_k"]

def _chunk(): return __import__('infer.gpu.kernels', fromlist=['x']).DEFAULT_DEFINES['ATTN_CHUNK']
def _rotate(x, c, s, npairs, neox):
    out = x.copy()
    if neox: a, b = x[..., :npairs], x[..., npairs:2*npairs]; out[..., :npairs] = a*c - b*s; out[..., npairs:2*npairs] = a*s + b*c
    else: a, b = x[..., 0:2*npairs:2], x[..., 1:2*npairs:2]; out[..., 0:2*npairs:2] = a*c - b*s; out[..., 1:2*npairs:2] = a*s + b*c
    return out
def _probabilities(scores):
    """float16-rounded softmax of float32 scores, with float64 exponentials and sums (the kernels')."""
    e = np.exp(scores.astype(np.float64) - scores.max(1, keepdims=True))
    return (e / e.sum(1, keepdims=True)).astype(np.float32).astype(np.float16).astype(np.float64)
def _softmax_values(scores, VC, G, L):
    p = _probabilities(scores)
    return np.stack([p[h] @ VC[h // G, :L].astype(np.float64) for h in range(p.shape[0])]).astype(np.float32)

class RawKernel:
    def __init__(self, name): self.name = name
    def __call__(self, grid, block, args, shared_mem=0):
        if _capturing: _capturing[-1]._rec.append((self, grid, block, args)); return
        self._run(grid, block, args)
    def _run(self, grid, block, args):
        n = self.name
        from infer.gpu import layout
        if n.startswith("repack_"):
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
        elif n.startswith("gemv"):  # the last argument: vectors; vector v reads x + v*K, writes y + v*ldy
            V = int(args[-1])
            eight, swiglu = n.startswith("gemv8_"), "_swiglu_" in n
            fmt = n.split("_")[-1]
            planes_g, rest = args[:4], args[4:]
            planes_u, rest = (rest[:4], rest[4:]) if swiglu else (None, rest)
            rows, K = int(rest[0]), int(rest[1])
            rest = rest[2:]
            sh = 256 if fmt in layout.K_FORMATS else 32
            if eight:
                xq, xs8, xsum, y, *tail = rest
                q = _arr(xq, np.int8, V * K).reshape(V, K)
                assert (_arr(xsum, np.int32, V * K // 32).reshape(V, -1) == q.astype(np.int32).reshape(V, -1, 32).sum(2)).all()
                xv = (q.astype(np.float64).reshape(V, -1, sh) * _arr(xs8, np.float32, V * K // sh).reshape(V, -1)[:, :, None]).reshape(V, K)
            else:
                x, y, *tail = rest
                xv = _arr(x, np.float32, V * K).reshape(V, K).astype(np.float64)
            bias, res, ldy = (None, None, int(tail[0])) if swiglu else (tail[0], tail[1], int(tail[2]))
            assert len(tail) == (2 if swiglu else 4)
            W = _weights(fmt, *planes_g, rows, K)
            per_vector = lambda M: np.stack([M @ xv[v] for v in range(V)])  # noqa: E731 - as the kernel: each alone
            if swiglu:
                g = per_vector(W); u = per_vector(_weights(fmt, *planes_u, rows, K))
                out = g / (1 + np.exp(-g)) * u
            else:
                out = per_vector(W)
                if _ptr(bias): out += _arr(bias, np.float32, rows)
            Y = _arr(y, np.float32, (V - 1) * ldy + rows)
            R = _arr(res, np.float32, (V - 1) * ldy + rows) if not swiglu and _ptr(res) else None
            for v in range(V):
                row = out[v] + (R[v * ldy : v * ldy + rows] if R is not None else 0)
                Y[v * ldy : v * ldy + rows] = row
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
            qs, hi, sm, dm, rows, K, ids, cnt, out = args
            rows, K, cnt = int(rows), int(K), int(cnt)
            W = _weights(fmt, qs, hi, sm, dm, rows, K)
            o = _arr(out, np.float32, cnt * K).reshape(cnt, K)
            for i, r in enumerate(_arr(ids, np.int32, cnt)):
                o[i] = W[r] if 0 <= r < rows else 0
        elif n in ("rmsnorm", "rmsnorm8"):
            x, w, y, y16, nn, eps, act, xq, xs8, xsum = args
            rows, nn = grid[0], int(nn)
            xv = _arr(x, np.float32, rows * nn).reshape(rows, nn)
            from infer.model import rms_norm
            from infer.quants import round_activations
            v = rms_norm(xv.copy(), _arr(w, np.float32, nn).copy(), float(eps), exact=True)
            if _ptr(y):
                v = round_activations(v, ["f32", "f16", "bf16", "q8_0", "q8_k"][int(act)])
                _arr(y, np.float32, rows * nn)[:] = v.reshape(-1)
                if _ptr(xq): _write_int8(xq, xs8, xsum, rms_norm(xv.copy(), _arr(w, np.float32, nn).copy(), float(eps), exact=True).reshape(-1), ACTS[int(act)])
            if _ptr(y16): _arr(y16, np.float16, rows * nn)[:] = v.reshape(-1).astype(np.float16)
        elif n == "round_act":
            x, y, y16, nn, act, xq, xs8, xsum = args
            rows, nn = grid[1], int(nn)
            if _ptr(xq): _write_int8(xq, xs8, xsum, _arr(x, np.float32, rows * nn).copy(), ACTS[int(act)])
            from infer.quants import round_activations
            v = round_activations(_arr(x, np.float32, rows * nn).reshape(rows, nn).copy(), ["f32", "f16", "bf16", "q8_0", "q8_k"][int(act)])
            _arr(y, np.float32, rows * nn)[:] = v.reshape(-1)
            if _ptr(y16): _arr(y16, np.float16, rows * nn)[:] = v.reshape(-1).astype(np.float16)
        elif n == "rope_store":
            q, k, v, cos, sin, pos, slot, H, Hkv, D, npairs, neox, kc, vc, max_ctx = args
            Tn = grid[0]; H, Hkv, D, npairs, neox, max_ctx = map(int, (H, Hkv, D, npairs, neox, max_ctx))
            P = _arr(pos, np.int32, Tn); SL = _arr(slot, np.int32, Tn) if _ptr(slot) else P
            C = _arr(cos, np.float32, (P.max() + 1) * npairs).reshape(-1, npairs); S = _arr(sin, np.float32, (P.max() + 1) * npairs).reshape(-1, npairs)
            Q = _arr(q, np.float32, Tn * H * D).reshape(Tn, H, D); Kk = _arr(k, np.float32, Tn * Hkv * D).reshape(Tn, Hkv, D)
            V = _arr(v, np.float32, Tn * Hkv * D).reshape(Tn, Hkv, D)
            KC = _arr(kc, np.float16, Hkv * max_ctx * D).reshape(Hkv, max_ctx, D); VC = _arr(vc, np.float16, Hkv * max_ctx * D).reshape(Hkv, max_ctx, D)
            for t in range(Tn):
                c, s = C[P[t]], S[P[t]]
                Q[t] = _rotate(Q[t], c, s, npairs, neox)
                KC[:, SL[t]] = _rotate(Kk[t], c, s, npairs, neox).astype(np.float16); VC[:, SL[t]] = V[t].astype(np.float16)
        elif n.startswith("attention_"):  # grid z (attention_sum: y) = node of a token tree, 1 for decode
            axis = 1 if n == "attention_sum" else 2
            nodes = grid[axis] if len(grid) > axis else 1
            for node in range(int(nodes)):
                self._attention(n, grid, args, node)
        elif n == "swiglu_f32":
            g, u, o, nn = args; nn = int(nn); gv = _arr(g, np.float32, nn).astype(np.float64)
            _arr(o, np.float32, nn)[:] = gv / (1 + np.exp(-gv)) * _arr(u, np.float32, nn)  # in double, as the kernel
        elif n == "argmax_rows":
            from infer.sampler import argmax_rows
            lg, vocab, ids, maxima, bad = args
            rows, vocab = int(grid[0]), int(vocab)
            got = argmax_rows(_arr(lg, np.float32, rows * vocab).reshape(rows, vocab))
            for out, dtype, values in zip((ids, maxima, bad), (np.int32, np.float32, np.int32), got):
                _arr(out, dtype, rows)[:] = values
        elif n == "sample_token":
            lg, vocab, temp, seed, tok, pos, tokens = args
            p = int(_arr(pos, np.int32, 1)[0]); v = _arr(lg, np.float32, int(vocab)).astype(np.float64)
            if float(temp) > 0:
                r = np.random.default_rng([int(seed), p]).random(v.size); v = v / float(temp) - np.log(-np.log(r))
            nxt = int(np.argmax(v))
            _arr(tok, np.int32, 1)[0] = nxt; _arr(tokens, np.int32, p + 2)[p + 1] = nxt; _arr(pos, np.int32, 1)[0] = p + 1
        else:
            raise NotImplementedError(n)

def _span(pos, anc, stride, node):
    """The cache slots of a node's attention span (decode: 0 .. pos); a tree node's row starts
    with the root's slot, the cache's length (the kernels' base)."""
    L = int(_arr(pos, np.int32, node + 1)[node]) + 1
    if not _ptr(anc):
        return L, np.arange(L)
    row = _arr(anc, np.int32, (node + 1) * int(stride))[node * int(stride):]
    base = int(row[0])
    return L, np.concatenate([np.arange(base), row[: L - base]]).astype(np.int64)

def _attention(self, n, grid, args, node):
    if n.startswith("attention_scores_g") or n.startswith("attention_fused_g"):
        fused = n.startswith("attention_fused_g")
        if fused:
            q, kc, vc, pos, G, D, max_ctx, scale, out, act, xq, xs8, xsum, kn, vn, cos, sin, npairs, neox, anc, stride = args
        else:
            q, kc, pos, G, D, max_ctx, scale, n_splits, sc, pml, kn, vn, cos, sin, npairs, neox, vc, anc, stride = args
        Hkv = grid[0]; G, D, max_ctx = map(int, (G, D, max_ctx)); H = Hkv * G
        L, idx = _span(pos, anc, stride, node)
        Q = _arr(q, np.float32, (node + 1) * H * D)[node * H * D:].reshape(H, D).copy()
        KC = _arr(kc, np.float16, Hkv * max_ctx * D).reshape(Hkv, max_ctx, D)
        VC = _arr(vc, np.float16, Hkv * max_ctx * D).reshape(Hkv, max_ctx, D) if _ptr(vc) else None
        if _ptr(kn):  # rope fused: rotate q, rotate and store the new k, store v
            npairs, neox, P = int(npairs), int(neox), L - 1
            C = _arr(cos, np.float32, L * npairs).reshape(L, npairs)[P]; S = _arr(sin, np.float32, L * npairs).reshape(L, npairs)[P]
            Q = _rotate(Q, C, S, npairs, neox)
            KC[:, P] = _rotate(_arr(kn, np.float32, Hkv * D).reshape(Hkv, D), C, S, npairs, neox).astype(np.float16)
            VC[:, P] = _arr(vn, np.float32, Hkv * D).reshape(Hkv, D).astype(np.float16)
        q64 = Q.astype(np.float16).astype(np.float64)
        scores = np.stack([(KC[h // G, idx].astype(np.float64) @ q64[h]).astype(np.float32) * np.float32(scale)
                           for h in range(H)])  # (H, L) float32, as the CPU's exact numerics
        if fused:
            o = _softmax_values(scores, VC[:, idx], G, L)
            from infer.quants import round_activations
            act = ACTS[int(act)]
            _arr(out, np.float32, (node + 1) * o.size)[node * o.size:] = round_activations(o.reshape(1, -1), act).reshape(-1)
            if _ptr(xq):
                group = 32 if act == "q8_0" else 256
                _write_int8(_off(xq, node * o.size), _off(xs8, 4 * node * o.size // group), _off(xsum, 4 * node * o.size // 32), o.reshape(-1), act)
        else:
            n_splits = int(n_splits); CH = _chunk()
            assert grid[1] == n_splits
            SC = _arr(sc, np.float32, (node + 1) * H * max_ctx)[node * H * max_ctx:].reshape(H, max_ctx); SC[:, :L] = scores
            PML = _arr(pml, np.float64, (node + 1) * H * n_splits * 2)[node * H * n_splits * 2:].reshape(H, n_splits, 2)
            for sp in range(n_splits):
                a_, b_ = sp * CH, min((sp + 1) * CH, L)
                if b_ <= a_: PML[:, sp] = (-np.inf, 0); continue
                m = scores[:, a_:b_].max(1); PML[:, sp, 0] = m; PML[:, sp, 1] = np.exp(scores[:, a_:b_].astype(np.float64) - m[:, None]).sum(1)
    elif n.startswith("attention_values_g"):
        vc, pos, G, D, max_ctx, n_splits, sc, pml, po, anc, stride = args
        Hkv = grid[0]; G, D, max_ctx, n_splits = map(int, (G, D, max_ctx, n_splits)); CH = _chunk(); H = Hkv * G
        L, idx = _span(pos, anc, stride, node)
        VC = _arr(vc, np.float16, Hkv * max_ctx * D).reshape(Hkv, max_ctx, D)[:, idx]
        SC = _arr(sc, np.float32, (node + 1) * H * max_ctx)[node * H * max_ctx:].reshape(H, max_ctx)
        PO = _arr(po, np.float64, (node + 1) * H * n_splits * D)[node * H * n_splits * D:].reshape(H, n_splits, D)
        probs = _probabilities(SC[:, :L])
        for sp in range(n_splits):
            a_, b_ = sp * CH, min((sp + 1) * CH, L)
            PO[:, sp] = 0
            if b_ > a_:
                for h in range(H): PO[h, sp] = probs[h, a_:b_] @ VC[h // G, a_:b_].astype(np.float64)
    elif n == "attention_sum":
        po, pos, n_splits, nn, D, out, act, xq, xs8, xsum = args
        n_splits, nn, D = int(n_splits), int(nn), int(D); H = nn // D
        from infer.quants import round_activations
        act = ACTS[int(act)]
        v = _arr(po, np.float64, (node + 1) * H * n_splits * D)[node * H * n_splits * D:].reshape(H, n_splits, D).sum(1).astype(np.float32).reshape(1, -1)
        _arr(out, np.float32, (node + 1) * nn)[node * nn:] = round_activations(v, act).reshape(-1)
        if _ptr(xq):
            group = 32 if act == "q8_0" else 256
            _write_int8(_off(xq, node * nn), _off(xs8, 4 * node * nn // group), _off(xsum, 4 * node * nn // 32), v, act)
    else:
        raise NotImplementedError(n)

def _off(p, nbytes): return np.uint64(_ptr(p) + nbytes)

RawKernel._attention = _attention

class RawModule:
    def __init__(self, code=None, options=(), backend="nvrtc"): self.backend = backend
    def compile(self): pass
    def get_function(self, name): return RawKernel(name)
