"""Access to the compiled cffi module, with an error that says how to build it."""

from nvmedirect.errors import NvmeDirectError

try:
    from nvmedirect._vfio_cffi import ffi, lib
except ImportError as exc:  # pragma: no cover - only on a broken install
    raise NvmeDirectError(
        "the compiled VFIO bindings (nvmedirect._vfio_cffi) are missing; "
        "reinstall with `pip install -e .` (needs gcc and the Linux UAPI headers)"
    ) from exc

__all__ = ["ffi", "lib"]
