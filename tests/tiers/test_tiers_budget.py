"""Budget strings, the KV cache size, deductions, and the cgroup v2 limit."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from infer.model import ModelArgs
from infer.tiers.budget import (
    BudgetError,
    cgroup_memory_available,
    compute_budgets,
    kv_cache_nbytes,
    parse_size,
)

ARGS_70B = ModelArgs(arch="llama", n_layers=80, dim=8192, ffn_dim=28672, n_heads=64, n_kv_heads=8, head_dim=128,
                     vocab_size=128256, context_length=8192, norm_eps=1e-5, rope_base=5e5, rope_dim=128,
                     rope_neox=False)


@pytest.mark.parametrize(("text", "value"), [
    ("24GB", 24 * 10**9), ("512MiB", 512 << 20), ("8G", 8 << 30), ("1000", 1000), ("1.5 GiB", 3 << 29),
    ("64kb", 64000), ("2T", 2 << 40), ("7b", 7),
])
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "GB", "12 parsecs", "-3GB", "1e9", "3 GBs"])
def test_parse_size_refuses_with_one_line(text: str) -> None:
    with pytest.raises(BudgetError) as info:
        parse_size(text)
    assert "\n" not in str(info.value)


def test_kv_cache_of_70b() -> None:
    # 80 layers x (K and V) x 1024 kv dims x 2 bytes = 320 KiB per position
    assert kv_cache_nbytes(ARGS_70B, 4096, 1, 512) == 4096 * 80 * 2 * 1024 * 2
    assert kv_cache_nbytes(ARGS_70B, 512, 32, 512) == 32 * kv_cache_nbytes(ARGS_70B, 512, 1, 512)


def test_kv_cache_of_local_layers_is_a_ring_of_window_and_pass() -> None:
    """Gemma 3 27B's shape: 62 layers, 52 of them local with a 1024-token window. At 32k positions
    and passes of 512 rows a local layer keeps 1536 positions; a context inside its window and a
    pass keeps them all; a file without a window keeps the whole context everywhere."""
    local = tuple(i % 6 < 5 for i in range(62))
    gemma = replace(ARGS_70B, arch="gemma3", n_layers=62, n_kv_heads=16, sliding_window=1024, local_layers=local)
    per_position = 2 * 16 * 128 * 2  # K and V of one layer
    assert sum(local) == 52 and gemma.kv_ring(32768, 512) == 1536
    assert kv_cache_nbytes(gemma, 32768, 1, 512) == (10 * 32768 + 52 * 1536) * per_position
    assert kv_cache_nbytes(gemma, 1200, 2, 512) == 2 * 62 * 1200 * per_position
    assert kv_cache_nbytes(replace(gemma, sliding_window=0, local_layers=()), 32768, 1, 512) == 62 * 32768 * per_position
    # several sequences: a ring each; fewer positions in all than sequences x context (the GPU plan's
    # kv_positions): the global layers hold those, a local layer no more than them either
    assert gemma.kv_cache_nbytes(32768, 512, sequences=4) == 4 * gemma.kv_cache_nbytes(32768, 512)
    assert gemma.kv_cache_nbytes(32768, 512, sequences=4, positions=5000) == (10 * 5000 + 52 * 5000) * per_position
    assert gemma.kv_cache_nbytes(32768, 512, sequences=4, positions=40000) == (10 * 40000 + 52 * 4 * 1536) * per_position


def test_budgets_deduct_kv_activations_and_staging() -> None:
    b = compute_budgets(ARGS_70B, 2048, 1, 512, 1 << 30, "24GB", "8GiB", device=True)
    assert b.vram_total == 24 * 10**9 and b.vram_source == "--vram-budget"
    assert b.vram_for_weights == b.vram_total - b.kv_cache - b.activations - (768 << 20)
    assert b.ram_for_weights == (8 << 30) - (1 << 30)
    assert 0 < b.activations < 2 * 10**9


def test_budget_below_kv_cache_gives_the_minimum() -> None:
    with pytest.raises(BudgetError, match="cannot hold the KV cache .* give more than"):
        compute_budgets(ARGS_70B, 8192, 32, 512, 0, "24GB", "1GB")


def test_cpu_simulation_needs_an_explicit_vram_budget() -> None:
    with pytest.raises(BudgetError, match="explicit VRAM budget"):
        compute_budgets(ARGS_70B, 64, 1, 8, 0, None, "1GB", device=False)


def test_cgroup_limit_is_read_from_the_process_group(tmp_path: Path) -> None:
    group = tmp_path / "bench"
    group.mkdir()
    (group / "memory.max").write_text("4294967296\n")
    (group / "memory.current").write_text("1073741824\n")
    membership = tmp_path / "cgroup"
    membership.write_text("0::/bench\n")
    assert cgroup_memory_available(tmp_path, membership) == 3 << 30
    (group / "memory.max").write_text("max\n")
    assert cgroup_memory_available(tmp_path, membership) is None
    assert cgroup_memory_available(tmp_path, tmp_path / "missing") is None
