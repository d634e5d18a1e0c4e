"""A mixture-of-experts model resident on a real GPU, its experts in VRAM (infer.gpu.experts) or
computed by the CPU (infer.tiers.cpu_tier.CpuExperts): the checks of tests/infer/test_gpu_moe.py
(which run them on the NumPy stand-in for CuPy in CI) on the device, and those of
tests/infer/test_gpu_moe_tiered.py (--streaming: the CPU's experts from a cache over tier C). The
kernels alone: tests/gpu/test_moe_kernels.py.

Run on the GPU machine:  python -m pytest -v tests/gpu/test_moe_gpu.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.infer.test_gpu_moe import (  # noqa: F401
    check_follows_the_cpu,
    check_pass_independence,
    check_split,
    check_stages,
    check_streaming,
    moe_dir,
    moe_path,
    place,
    placed,
    quantized_moe,
)
from tests.infer.test_gpu_moe_tiered import (
    DRAFTERS,
    HELD,
    PLACES,
    check_speculation,
    check_tiered_against_resident,
)

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


def test_the_experts_follow_the_cpu_engine(moe_path: Path, place: str) -> None:  # noqa: F811
    check_follows_the_cpu(moe_path, placed(moe_path, place))


def test_a_row_does_not_depend_on_its_pass_on_the_gpu(moe_path: Path, place: str) -> None:  # noqa: F811
    check_pass_independence(moe_path, placed(moe_path, place))


@pytest.mark.parametrize("where", ["cpu", 1], ids=lambda p: f"experts-{p}")
def test_long_prompts_stream_the_cpus_experts_on_the_gpu(moe_dir: Path, where: str | int) -> None:  # noqa: F811
    check_streaming(moe_dir, where)


@pytest.mark.parametrize("slots", [1, 3])
def test_the_cpus_blocks_share_their_picks_with_the_gpu_on_the_gpu(moe_dir: Path, slots: int,  # noqa: F811
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NVMEDIRECT_EXPERT_GPU_SLOTS", str(slots))
    check_split(moe_dir, slots)


def test_a_split_across_gpus_places_each_stages_experts_on_the_gpu(quantized_moe: Path,  # noqa: F811
                                                                    place: str | int) -> None:  # noqa: F811
    check_stages(quantized_moe, place)


@PLACES
@HELD
def test_the_cpu_blocks_take_their_experts_from_the_tiered_cache_on_the_gpu(moe_dir: Path, place: str | int,  # noqa: F811
                                                                            held: str, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NVMEDIRECT_CACHE", str(tmp_path / "cache"))
    check_tiered_against_resident(moe_dir, place, held)


@DRAFTERS
def test_speculation_on_the_tiered_experts_gives_the_plain_text_on_the_gpu(moe_dir: Path, drafter: str,  # noqa: F811
                                                                           tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NVMEDIRECT_CACHE", str(tmp_path / "cache"))
    check_speculation(moe_dir, drafter)
