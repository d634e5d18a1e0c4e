"""GPU backend: CUDA kernels through CuPy (imported lazily: this package imports without CuPy)."""
