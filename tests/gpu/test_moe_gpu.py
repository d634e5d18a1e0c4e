"""A mixture-of-experts model resident on a real GPU with its experts computed by the CPU
(infer.tiers.cpu_tier.CpuExperts): the checks of tests/infer/test_gpu_moe.py (which run them on the
NumPy stand-in for CuPy in CI) on the device.

Run on the GPU machine:  python -m pytest -v tests/gpu/test_moe_gpu.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.infer.test_gpu_moe import check_follows_the_cpu, check_pass_independence, moe_dir, moe_path  # noqa: F401

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


def test_experts_on_the_cpu_follow_the_cpu_engine(moe_path: Path) -> None:  # noqa: F811
    check_follows_the_cpu(moe_path)


def test_a_row_does_not_depend_on_its_pass_on_the_gpu(moe_path: Path) -> None:  # noqa: F811
    check_pass_independence(moe_path)
