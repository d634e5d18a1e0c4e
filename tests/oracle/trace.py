"""llama.cpp's intermediate tensors, captured through its eval callback (`cb_eval` in the context
parameters), for comparing our arithmetic with llama.cpp's one operation at a time.

`trace(path, ids)` evaluates `ids` as one batch from an empty context and returns every named
tensor of the graph the callback saw ("attn_norm-3", "Qcur-3", "ffn_out-3", "result_output", ...)
as float32 NumPy arrays in row-major order (tokens first): llama.cpp's [ne0, ne1, ...] becomes
shape (..., ne1, ne0). A name the graph gives to several tensors (Qcur after the product, after the
bias, after rope) keeps every one, in evaluation order.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tests.oracle.reference import _quiet_stderr

GGML_TYPE_F32, GGML_TYPE_F16 = 0, 1


class _TensorHead(ctypes.Structure):
    """The leading fields of ggml.h's `struct ggml_tensor` (GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64,
    GGML_MAX_SRC 10, GGML_MAX_NAME 64), enough to read a computed tensor."""

    _fields_ = [
        ("type", ctypes.c_int), ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4), ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16), ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p), ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
    ]


def _read(t: _TensorHead) -> np.ndarray:
    """The tensor's values (CPU memory), honouring its strides (views are not contiguous); float32."""
    dtype = np.dtype({GGML_TYPE_F32: np.float32, GGML_TYPE_F16: np.float16}[t.type])
    dims = max([i + 1 for i in range(4) if t.ne[i] > 1] or [1])
    span = sum((t.ne[i] - 1) * t.nb[i] for i in range(4)) + dtype.itemsize
    memory = (ctypes.c_uint8 * span).from_address(t.data)
    view = np.ndarray(tuple(reversed(t.ne[:dims])), dtype, buffer=memory, strides=tuple(reversed(t.nb[:dims])))
    return view.astype(np.float32)


def trace(path: Path, ids: Sequence[int], n_ctx: int = 512, n_threads: int = 2,
          names: Sequence[str] | None = None) -> dict[str, list[np.ndarray]]:
    """Evaluates `ids` (one batch, empty context) in llama.cpp and returns the named tensors it
    computed (only those whose name, before the "-layer" suffix, is in `names`, if given), plus
    "logits": the (T, vocab) logits of every position."""
    import llama_cpp

    wanted = set(names) if names is not None else None
    seen: dict[str, list[np.ndarray]] = {}

    def keep(name: str) -> bool:
        return wanted is None or name.rsplit("-", 1)[0] in wanted or name in wanted

    @llama_cpp.ggml_backend_sched_eval_callback
    def callback(tensor: int, ask: bool, _user: int) -> bool:
        t = _TensorHead.from_address(tensor)
        name = t.name.decode(errors="replace")
        if ask:
            return bool(name) and keep(name) and t.type in (GGML_TYPE_F32, GGML_TYPE_F16)
        seen.setdefault(name, []).append(_read(t))
        return True

    with _quiet_stderr():
        llama_cpp.llama_backend_init()
        mparams = llama_cpp.llama_model_default_params()
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
        if not model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = n_ctx
        cparams.n_threads = cparams.n_threads_batch = n_threads
        cparams.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cparams.cb_eval = callback
        cparams.cb_eval_user_data = None
        ctx = llama_cpp.llama_init_from_model(model, cparams)
    try:
        n = len(ids)
        batch = llama_cpp.llama_batch_init(n, 0, 1)
        try:
            for i, token in enumerate(ids):
                batch.token[i] = token
                batch.pos[i] = i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = True
            batch.n_tokens = n
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
        finally:
            llama_cpp.llama_batch_free(batch)
        vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(ctx), shape=(n, vocab)).copy()
    finally:
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    seen["logits"] = [logits]
    return seen
