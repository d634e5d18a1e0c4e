"""The command-line side: the click decorator, --streaming without budgets on a model that fits
(every tier exercised), the refusal without --streaming, the prompts file, and the printed plan."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from infer.cli import main
from infer.cli_options import streaming_options
from infer.engine import greedy
from infer.gguf_file import GGUFModel
from infer.streaming import read_prompts_file
from infer.tiers.plan import Tier
from infer.tiers.session import StreamingConfig, build_streaming_engine


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
                                    batch=3, prompts_file=str(prompts), cpu_tier="auto")]
    CliRunner().invoke(cmd, ["--streaming", "--tier-c", "nvme", "--nvme-device", "0000:01:00.0", "--nvme-lba", "2048"])
    assert (seen[-1].nvme_device, seen[-1].nvme_lba) == ("0000:01:00.0", 2048)
    assert read_prompts_file(str(prompts)) == ["one", "two\nlines"]
    bad = CliRunner().invoke(cmd, ["--tier-c", "tape"])
    assert bad.exit_code == 2 and "tape" in bad.output
    CliRunner().invoke(cmd, ["--streaming", "--cpu-tier", "4"])
    assert seen[-1].cpu_tier == 4
    bad = CliRunner().invoke(cmd, ["--streaming", "--cpu-tier", "sometimes"])
    assert bad.exit_code == 2 and "--cpu-tier takes auto, off or a number" in bad.output
    bad = CliRunner().invoke(cmd, ["--cpu-tier", "off"])  # a streaming flag without --streaming
    assert bad.exit_code != 0 and "--cpu-tier" in bad.output

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


def test_model_that_does_not_fit_suggests_streaming(tiny_model: Path, fake_cupy: object) -> None:
    """The resident GPU engine plans every allocation against the VRAM budget before uploading: one
    byte short of its plan is a one-line VramBudgetError naming each part and suggesting --streaming
    (run on the NumPy stand-in for CuPy; the real device runs the same in tests/gpu/test_budget.py)."""
    from infer.gpu import load_gpu_transformer
    from infer.tiers.budget import VramBudgetError

    model = GGUFModel(tiny_model)
    fits = load_gpu_transformer(model, 64, vram_budget="1GB")
    account = fits.account
    assert account is not None and account.room >= 0
    need = account.budget - account.room
    load_gpu_transformer(model, 64, vram_budget=need)
    with pytest.raises(VramBudgetError, match="run with --streaming") as info:
        load_gpu_transformer(model, 64, vram_budget=need - 1)
    message = str(info.value)
    assert "\n" not in message and "weights" in message and "KV cache" in message and "pass buffers" in message
    assert "CUDA context" in message


def test_over_budget_requests_exit_2_with_one_line(tiny_model: Path, fake_cupy: object) -> None:
    """`ntransformer` turns a VRAM budget the run cannot hold into exit code 2 and one line on stderr:
    the resident GPU engine (on the NumPy stand-in for CuPy) and the streaming CPU simulation."""
    from infer.cli import main

    runner = CliRunner()
    for args in (["--device", "gpu", "--vram-budget", "50MB"],
                 ["--device", "cpu", "--streaming", "--vram-budget", "100KB", "--ram-budget", "1MB"]):
        result = runner.invoke(main, ["-m", str(tiny_model), "-p", "hello", "-n", "2", *args])
        lines = [line for line in result.stderr.splitlines() if line.startswith("Error")]
        assert result.exit_code == 2, (args, result.output)
        assert len(lines) == 1 and "VRAM" in lines[0] and "Traceback" not in result.output, result.output


@pytest.mark.parametrize(("flags", "says"), [
    (["--vram-budget", "banana"], "--vram-budget: cannot read 'banana' as a size"),
    (["--streaming", "--ram-budget", "lots"], "--ram-budget: cannot read 'lots' as a size"),
    (["--tier-c", "nvme"], "--tier-c sets the streaming engine's tiers: add --streaming"),
    (["--nvme-device", "0000:01:00.0", "--slots", "4"], "--nvme-device, --slots set the streaming engine's tiers"),
    (["--draft-tree", "3"], "--draft-tree sizes the tree of --draft-model or --lookup: add one of them"),
    (["--self-spec", "--draft-tree", "3"], "(the self-draft's depth is --draft-k)"),
])
def test_a_flag_the_run_would_ignore_is_exit_2_with_one_line(tiny_model: Path, flags: list[str], says: str) -> None:
    """Issue 29: these ran with exit code 0, the flag silently ignored."""
    result = CliRunner().invoke(main, ["-m", str(tiny_model), "-p", "hi", "-n", "2", "--device", "cpu", *flags])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and says in lines[0], lines


def test_a_flag_meant_for_another_device_is_a_warning(tiny_model: Path) -> None:
    """--vram-budget means something on the GPU (and with --streaming), not on the CPU's resident
    engine: the run goes on and says so once."""
    result = CliRunner().invoke(main, ["-m", str(tiny_model), "-p", "hi", "-n", "2", "--device", "cpu", "-t", "0",
                                       "--vram-budget", "8GB"])
    assert result.exit_code == 0, result.output
    warned = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and "--vram-budget" in warned[0] and "CPU" in warned[0], result.stderr


def test_serve_does_not_offer_the_batch_flags() -> None:
    """A server batches the requests it receives: --batch/--prompts are not in its help (issue 29)."""
    text = CliRunner().invoke(main, ["serve", "--help"]).output
    assert "--max-batch" in text and "--streaming" in text
    assert "--batch " not in text and "--prompts" not in text
    refused = CliRunner().invoke(main, ["serve", "--batch", "2"])
    assert refused.exit_code == 2 and "No such option '--batch'" in refused.output


def test_cpu_tier_is_refused_on_the_cpu_device() -> None:
    @click.command()
    @click.option("--device", default="gpu")
    @streaming_options
    def cmd(device: str, streaming: StreamingConfig) -> None:
        pass

    bad = CliRunner().invoke(cmd, ["--device", "cpu", "--streaming", "--cpu-tier", "2"])
    assert bad.exit_code != 0 and "with --device cpu every layer is computed by the CPU" in bad.output
    assert CliRunner().invoke(cmd, ["--device", "cpu", "--streaming"]).exit_code == 0  # the default is no choice
    assert CliRunner().invoke(cmd, ["--device", "gpu", "--streaming", "--cpu-tier", "2"]).exit_code == 0
