"""`ntransformer --gpus`: the layers split across GPUs (infer.gpu.stages). What a machine without
the GPUs asked for, or a flag the split does not serve yet, gets: one line and an exit code; and
on the NumPy stand-in for CuPy (one device) the run itself, whose tokens are the one-GPU run's."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from infer.cli import main
from infer.synth import SHAPES, Shape, write_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gpus") / "tiny3-q8_0.gguf"
    write_model(path, Shape(**{**SHAPES["tiny"].__dict__, "n_layers": 3}), "q8_0", seed=8)
    return path


def run(tiny: Path, *flags: str):
    return CliRunner().invoke(main, ["-m", str(tiny), "-p", "hi", "-n", "4", "-t", "0", *flags])


@pytest.mark.parametrize(("flags", "says"), [
    (["--gpus", "0,0"], "distinct device numbers"),
    (["--gpus", "zero"], "device numbers separated by commas"),
    (["--gpus", "0,1", "--vram-budget", "1GB,2GB,3GB"], "3 sizes for 2 GPUs"),
    (["--vram-budget", "1GB,2GB"], "needs --gpus"),
    (["--gpus", "0", "--streaming", "--tier-c", "nvme"], "cannot be combined with --tier-c nvme"),
    (["--gpus", "0", "--device", "cpu"], "cannot be combined with --device cpu"),
    (["--gpus", "0", "--exact"], "cannot be combined with --exact"),
    (["--gpus", "0", "--benchmark"], "cannot be combined with --benchmark"),
    (["--gpus", "0", "--batch", "2"], "cannot be combined with --batch/--prompts without --streaming"),
    (["--gpus", "0", "--streaming", "--tier-b", "registered"], "cannot be combined with --tier-b registered"),
])
def test_flags_the_split_cannot_take_are_one_line(tiny: Path, flags: list[str], says: str) -> None:
    result = run(tiny, *flags)
    assert result.exit_code == 2, result.output
    assert says in result.stderr and "Traceback" not in result.output


def test_no_gpu_or_a_missing_one_is_not_available(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import infer.gpu

    monkeypatch.setattr(infer.gpu, "gpu_available", lambda: False)
    result = run(tiny, "--gpus", "0")
    assert result.exit_code == 4 and "no CUDA GPU is visible" in result.stderr, result.output


def test_a_gpu_that_is_not_there(tiny: Path, fake_cupy: object) -> None:
    result = run(tiny, "--gpus", "0,1")  # the stand-in has one device
    assert result.exit_code == 4 and "GPU 1 is not there (1 GPU visible" in result.stderr, result.output


def test_one_stage_gives_the_one_gpu_tokens(tiny: Path, fake_cupy: object) -> None:
    staged, whole = run(tiny, "--gpus", "0", "--vram-budget", "10GB"), run(tiny, "--device", "gpu")
    assert staged.exit_code == 0 and whole.exit_code == 0, staged.output + whole.output
    assert staged.stdout == whole.stdout and staged.stdout.strip()
    assert "on the GPU" in staged.stderr  # one stage: the whole model, planned as one


def test_a_draft_model_beside_a_split_target(tiny: Path, fake_cupy: object) -> None:
    """--draft-model with --gpus: the draft on the first GPU, the target's trees verified across its
    stages; the text is plain decoding's."""
    staged = run(tiny, "--gpus", "0", "--vram-budget", "10GB", "--draft-model", str(tiny), "--draft-tree", "5")
    whole = run(tiny, "--device", "gpu")
    assert staged.exit_code == 0, staged.output
    assert staged.stdout == whole.stdout and "speculation" in staged.stderr


def test_serve_takes_gpus_and_says_what_it_cannot(tiny: Path, fake_cupy: object) -> None:
    from infer.gpu.stages import PipelineTransformer
    from infer.server.run import loader
    from infer.tiers.config import StreamingConfig

    result = CliRunner().invoke(main, ["serve", "-m", str(tiny), "--gpus", "0,0"])
    assert result.exit_code == 2 and "distinct device numbers" in result.stderr, result.output
    result = CliRunner().invoke(main, ["serve", "-m", str(tiny), "--gpus", "0", "--exact"])
    assert result.exit_code == 2 and "cannot be combined with --exact" in result.stderr, result.output
    loaded = loader(str(tiny), "gpu", 64, 2, StreamingConfig(vram_budget="10GB"), gpus=[0])()
    assert isinstance(loaded.model, PipelineTransformer)


def test_streaming_across_gpus_gives_the_one_gpu_tokens(tiny: Path, fake_cupy: object) -> None:
    """--streaming --gpus: the stages' plans reported, the resident run's tokens."""
    staged = run(tiny, "--gpus", "0", "--streaming", "--vram-budget", "10GB", "--ram-budget", "1GB")
    whole = run(tiny, "--device", "gpu")
    assert staged.exit_code == 0, staged.output
    assert staged.stdout == whole.stdout and "1 stage: GPU 0 layers 0-2" in staged.stderr
    missing = run(tiny, "--gpus", "0", "--streaming")
    assert missing.exit_code == 2 and "needs --vram-budget" in missing.stderr, missing.output


@pytest.mark.parametrize("where", [["--device", "gpu"], ["--gpus", "0"]], ids=["one-gpu", "stages"])
def test_a_gpt_oss_file_on_the_gpu_is_one_line_naming_the_cpu(where: list[str], tmp_path: Path,
                                                              fake_cupy: object) -> None:
    """gpt-oss's sinks, expert biases and MXFP4 experts have no GPU kernels yet: the GPU engines
    refuse it in one line (exit 2) that says which engine runs it."""
    path = tmp_path / "gpt-oss.gguf"
    write_model(path, SHAPES["tiny-gpt-oss"], "q8_0", seed=1)
    result = run(path, *where)
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.output
    assert "'gpt-oss' runs on the CPU engines only, not the GPU engine yet" in lines[0], lines[0]
