"""The C library's single-precision math functions (cosf, sinf, powf, logf, ...), which llama.cpp's
CPU code calls: NumPy's float32 functions differ from them in the last bit for some inputs, and the
engine rounds as llama.cpp does where that decides a float16 or 8-bit rounding."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _libm() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    except OSError:
        return None


def c_float_function(name: str, nargs: int = 1) -> Callable[..., float] | None:
    """The C library's float function `name` taking `nargs` floats, or None without a C library."""
    lib = _libm()
    fn = getattr(lib, name, None) if lib is not None else None
    if fn is None:
        return None
    fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float] * nargs
    return fn
