"""The shared SQE/PRP header compiles as strict C and, inlined into the GPU kernels exactly as
nvmedirect/gpu/doorbell.py hands it to the compiler, as CUDA for sm_90: a kernel that does not build
fails CI on machines without a GPU (nvcc needs no driver)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from nvmedirect.gpu import doorbell

NVCC, GCC = shutil.which("nvcc"), shutil.which("gcc")


@pytest.mark.skipif(GCC is None, reason="gcc is not installed")
def test_the_header_is_strict_c(tmp_path: Path) -> None:
    src = tmp_path / "use.c"
    src.write_text('#include "nvme_ring.h"\nint use(struct nvd_ring *r, struct nvd_work *w, struct nvd_sqe *s)\n'
                   "{ return nvd_ring_build_read(r, w, 0, 1, s); }\n")
    out = subprocess.run([GCC, "-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic", f"-I{doorbell.NATIVE}", "-c",
                          str(src), "-o", str(tmp_path / "use.o")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed: CUDA sources not compiled")
def test_the_doorbell_kernels_compile_for_sm90(tmp_path: Path) -> None:
    src = tmp_path / "doorbell.cu"
    src.write_text(doorbell.source_text())
    out = subprocess.run([NVCC, "-arch=sm_90", *doorbell.OPTIONS, "--ptx", str(src), "-o", str(tmp_path / "k.ptx")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    ptx = (tmp_path / "k.ptx").read_text()
    for kernel in ("nvd_drive_queues", "nvd_build_sqes", "nvd_read_registers"):
        assert f".entry {kernel}" in ptx
    assert "membar.sys" in ptx or "fence.sc.sys" in ptx, "the doorbell path lost its system-scope fences"
