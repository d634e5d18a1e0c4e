"""The command-line side: the click decorator, --streaming without budgets on a model that fits
(every tier exercised), the refusal without --streaming, the prompts file, and the printed plan."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from infer.engine import greedy
from infer.gguf_file import GGUFModel
from infer.streaming import read_prompts_file
from infer.tiers.flags import streaming_options
from infer.tiers.options import (
    StreamingConfig,
    build_streaming_engine,
    require_resident_fit,
)
from infer.tiers.plan import Tier


def test_decorator_collects_the_options(tmp_path: Path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("one\n\ntwo\\nlines\n")
    seen: list[StreamingConfig] = []

    @click.command()
    @click.option("-m", "--model")
    @streaming_options
    def cmd(model: str, streaming: StreamingConfig) -> None:
        seen.append(streaming)

    result = CliRunner().invoke(cmd, ["-m", "x", "--streaming", "--vram-budget", "24GB", "--ram-budget", "8GiB",
                                      "--tier-c", "mmap", "--batch", "3", "--prompts", str(prompts)])
    assert result.exit_code == 0, result.output
    assert seen == [StreamingConfig(enabled=True, vram_budget="24GB", ram_budget="8GiB", tier_c="mmap",
                                    batch=3, prompts_file=str(prompts))]
    CliRunner().invoke(cmd, ["--tier-c", "nvme", "--nvme-device", "0000:01:00.0", "--nvme-lba", "2048"])
    assert (seen[-1].nvme_device, seen[-1].nvme_lba) == ("0000:01:00.0", 2048)
    assert read_prompts_file(str(prompts)) == ["one", "two\nlines"]
    bad = CliRunner().invoke(cmd, ["--tier-c", "tape"])
    assert bad.exit_code == 2 and "tape" in bad.output
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        read_prompts_file(str(tmp_path / "empty.txt"))


def test_streaming_without_budgets_exercises_every_tier(tiny_model: Path) -> None:
    session = build_streaming_engine(str(tiny_model), StreamingConfig(enabled=True), 64, device="cpu")
    try:
        layer_tiers = {session.plan.tier[t.name] for t in session.plan.tensors if t.layer is not None}
        assert layer_tiers == {Tier.VRAM, Tier.RAM, Tier.STORAGE}
        out = session.engine.generate([[1, 2, 3]], 3, greedy)
        assert len(out[0]) == 3
        text = session.report()
        assert "demo" in text and "predicted pass time" in text and "staged read (file)" in text
        assert "tier C" in session.moved_report()
    finally:
        session.close()


def test_model_that_does_not_fit_suggests_streaming(tiny_model: Path) -> None:
    from infer.model import ModelArgs
    from infer.tiers.budget import compute_budgets
    from infer.tiers.options import planner_tensors

    model = GGUFModel(tiny_model)
    weights = sum(t.device_nbytes for t in planner_tensors(model, "gpu"))
    b = compute_budgets(ModelArgs.from_gguf(model), 64, 1, 64, 0, 10**15, "0")
    need = weights + b.vram_total - b.vram_for_weights
    with pytest.raises(click.ClickException, match="run with --streaming") as info:
        require_resident_fit(model, 64, 1, vram_budget=str(need - 1))
    assert "\n" not in info.value.message
    require_resident_fit(model, 64, 1, vram_budget=str(need))
    with pytest.raises(click.ClickException, match="cannot hold the KV cache"):
        require_resident_fit(model, 64, 1, vram_budget="10MB")
