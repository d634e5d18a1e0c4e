"""`--tier-c nvme --gpu-doorbells` without a GPU+NVMe machine: the flag, the refused combinations
(exit 2, one line), and the fallback: the probe names its blocker once (in the plan's notes, printed
with the plan) and tier C reads with CPU doorbells, the model stored on raw LBAs of an image file as
tests/tiers/test_tiers_nvme_source.py stores it. The GPU-initiated reads themselves run against the
emulator: tests/reader/test_gpu_doorbell_backend_emu.py (CPU submitter), tests/gpu/ (GPU)."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from infer.cli_options import streaming_options
from infer.engine import greedy
from infer.gguf_file import GGUFModel
from infer.tiers.session import StreamingConfig, build_streaming_engine
from nvmedirect.gpu.probe import gpu_blocker
from tests.tiers.test_tiers_nvme_source import write_to_image

CTX = 64
FALLBACK = "GPU doorbells unavailable ("


@pytest.fixture(scope="module")
def image(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gpu-doorbells") / "nvme.img"
    write_to_image(tiny_model, path, lba=64)
    return path


def test_the_flag_reaches_the_config() -> None:
    seen: list[StreamingConfig] = []

    @click.command()
    @streaming_options
    def cmd(streaming: StreamingConfig) -> None:
        seen.append(streaming)

    result = CliRunner().invoke(cmd, ["--streaming", "--tier-c", "nvme", "--nvme-device", "0000:01:00.0", "--gpu-doorbells"])
    assert result.exit_code == 0, result.output
    assert seen[-1].gpu_doorbells and seen[-1].tier_c == "nvme"
    CliRunner().invoke(cmd, ["--streaming", "--tier-c", "nvme"])
    assert not seen[-1].gpu_doorbells


@pytest.mark.parametrize("args, words", [
    (["--streaming", "--gpu-doorbells"], "add --tier-c nvme"),
    (["--streaming", "--tier-c", "mmap", "--gpu-doorbells"], "not mmap"),
    (["--streaming", "--tier-c", "nvme", "--nvme-device", "x.img", "--gpu-doorbells", "--device", "cpu"],
     "drop --device cpu"),
])
def test_bad_combinations_exit_2_with_one_line(tiny_model: Path, args: list[str], words: str) -> None:
    from infer.cli import main

    result = CliRunner().invoke(main, ["-m", str(tiny_model), "-p", "hello", "-n", "2", *args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: --gpu-doorbells") and words in lines[0], result.output


def test_the_probes_answer_falls_back_to_cpu_doorbells_said_once(tiny_model: Path, image: Path) -> None:
    """This machine's real probe answer: no GPU here (no CuPy); with a GPU, the image is no
    controller on vfio-pci. Either way tier C reads the stored model with CPU doorbells."""
    config = StreamingConfig(enabled=True, tier_c="nvme", nvme_device=str(image), nvme_lba=64, gpu_doorbells=True)
    session = build_streaming_engine(str(tiny_model), config, CTX, device="cpu", measure=False)
    try:
        notes = [n for n in session.plan.notes if "GPU doorbells" in n]
        blocker = "no GPU" if gpu_blocker() else "no vfio-bound controller"
        assert len(notes) == 1 and notes[0].startswith(f"{FALLBACK}{blocker}: "), notes
        assert notes[0].endswith("): tier C reads with CPU doorbells")
        assert session.report().count(FALLBACK) == 1
        assert "staged read (nvme)" in set(session.paths.values())
        out = session.engine.generate([[1, 5, 300]], 3, greedy)
    finally:
        session.close()
    plain = build_streaming_engine(str(tiny_model), StreamingConfig(enabled=True, tier_c="nvme",
                                   nvme_device=str(image), nvme_lba=64), CTX, device="cpu", measure=False)
    try:
        assert not [n for n in plain.plan.notes if "GPU doorbells" in n]
        assert plain.engine.generate([[1, 5, 300]], 3, greedy) == out
    finally:
        plain.close()


def test_the_cli_on_a_gpu_streams_with_cpu_doorbells_and_says_why_once(tiny_model: Path, image: Path,
                                                                      fake_cupy: object) -> None:
    """`ntransformer --device gpu --streaming --tier-c nvme --gpu-doorbells` on the NumPy stand-in
    for CuPy (a GPU as far as the probe can tell): the image is no controller on vfio-pci, so one
    line says so and the text equals the run without the flag."""
    from infer.cli import main

    base = ["-m", str(tiny_model), "-p", "hello", "-n", "3", "-t", "0", "--device", "gpu", "--streaming",
            "--tier-c", "nvme", "--nvme-device", str(image), "--nvme-lba", "64"]
    runner = CliRunner()
    with_flag = runner.invoke(main, [*base, "--gpu-doorbells"])
    without = runner.invoke(main, base)
    assert with_flag.exit_code == 0 and without.exit_code == 0, with_flag.output + without.output
    said = [line for line in with_flag.stderr.splitlines() if FALLBACK in line]
    assert len(said) == 1 and "(no vfio-bound controller: " in said[0] and "read through the kernel" in said[0]
    assert FALLBACK not in without.stderr
    assert with_flag.stdout == without.stdout


def test_a_passing_probe_on_a_controller_that_will_not_open_falls_back_too(tiny_model: Path, monkeypatch) -> None:
    """The probe's positive answer stubbed (no GPU+NVMe here); opening the controller for the GPU
    queue pair is real and fails here (no such device): one line, then the CPU path's own error."""
    from infer.tiers.plan import planner_tensors
    from infer.tiers.tier_c import open_source
    from nvmedirect.gpu import vfio_doorbells
    from nvmedirect.gpu.probe import ProbeResult

    monkeypatch.setattr(vfio_doorbells, "probe_device", lambda device: ProbeResult(device, True, "", "stubbed"))
    notes: list[str] = []
    tensors = planner_tensors(GGUFModel(tiny_model), "cpu")
    with pytest.raises(Exception) as info:  # noqa: PT011 - whatever the CPU path says about a missing device
        open_source("nvme", tiny_model, tensors, "0000:ff:1f.7", gpu_doorbells=True, notes=notes)
    assert len(notes) == 1 and notes[0].startswith(f"{FALLBACK}opening 0000:ff:1f.7 failed: "), notes
    assert "Traceback" not in str(info.value)
