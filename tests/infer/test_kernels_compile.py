"""Every CUDA source of infer/kernels compiles for sm_90 exactly as the GPU loader hands it to the
compiler (defines prepended, local headers inlined), so a syntax error fails CI on machines without
a GPU. Also guards the resource use the speed depends on: the GEMV, dequantization and repack
kernels must not spill registers."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from infer.gpu import kernels

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed: CUDA sources not compiled")


def _compile(tmp_path: Path, name: str, *flags: str, defines: dict[str, int] | None = None) -> str:
    src = tmp_path / f"{name}.cu"
    src.write_text(kernels.source_text(name, defines))
    out = subprocess.run([NVCC, "-arch=sm_90", *kernels.OPTIONS, *flags, str(src), "-o", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{name}.cu does not compile:\n{out.stderr[-4000:]}"
    return out.stderr


@pytest.mark.parametrize("name", kernels.SOURCES)
def test_source_compiles(tmp_path: Path, name: str) -> None:
    _compile(tmp_path, name, "--ptx")


@pytest.mark.parametrize(("name", "variant"), [("gemv", None), ("gemv", "swiglu"), ("dequant", None),
                                               ("repack", None), ("ops", None),
                                               ("attention", None)])
def test_hot_kernels_do_not_spill(tmp_path: Path, name: str, variant: str | None) -> None:
    """Each module as the decode step compiles it (the SwiGLU GEMV with its own unrolling too)."""
    defines = kernels.SWIGLU_DEFINES if variant == "swiglu" else None
    report = _compile(tmp_path, name, "-cubin", "-Xptxas", "-v", defines=defines)
    functions = re.findall(r"Function properties for (\w+)\n\s+(\d+) bytes stack frame, (\d+) bytes spill stores",
                           report)
    assert functions, report
    spilling = [fn for fn, stack, spill in functions if int(spill) or int(stack)]
    assert not spilling, f"register spills in {spilling}"


def test_every_cu_file_is_a_loadable_module() -> None:
    files = {p.stem for p in Path(kernels.KERNEL_DIR).glob("*.cu")}
    assert files == set(kernels.SOURCES)
