"""infer: a streaming GGUF inference engine (NumPy reference on the CPU, CuPy kernels on the GPU)
with a 3-tier weight cache: VRAM, pinned RAM, and NVMe (through nvmedirect) or file."""

__version__ = "0.1.0"
