"""`ntransformer`'s rough edges on a tiny synthetic model (issue 29): Ctrl-C in --chat, a progress
bar for a long load, a context longer than the model was trained for, the driver's notices as one
line, and tokens streamed as they come on the streaming engine."""

from __future__ import annotations

import io
import sys
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

from infer import cli
from infer.cli import main
from infer.synth import SHAPES, Shape, write_model

INTERRUPT = object()  # a Ctrl-C at the prompt


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("edges") / "tiny3-q8_0.gguf"
    write_model(path, Shape(**{**SHAPES["tiny"].__dict__, "n_layers": 3}), "q8_0", seed=8)
    return path


class ScriptedStdin(io.RawIOBase):
    """stdin that hands out one scripted line per read and raises KeyboardInterrupt where the
    script says INTERRUPT, as Ctrl-C at the `> ` prompt does."""

    def __init__(self, script: list[object]) -> None:
        self.script = list(script)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # noqa: ANN001
        if not self.script or len(buffer) == 0:  # click probes the stream with read(0)
            return 0
        item = self.script.pop(0)
        if item is INTERRUPT:
            raise KeyboardInterrupt
        data = str(item).encode()
        buffer[: len(data)] = data
        return len(data)


def test_ctrl_c_stops_the_reply_not_the_conversation(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C during a reply stops that reply and returns to the prompt (the partial reply stays in
    the history); Ctrl-C twice in a row at the prompt leaves with exit code 0."""
    from infer import api

    real = api.LLM.generate_ids
    calls = {"n": 0}

    def interrupted_first_reply(self, *args, **kwargs):  # noqa: ANN001, ANN202
        calls["n"] += 1
        for i, token in enumerate(real(self, *args, **kwargs)):
            if calls["n"] == 1 and i == 3:
                raise KeyboardInterrupt  # Ctrl-C while the first reply is being generated
            yield token

    monkeypatch.setattr(api.LLM, "generate_ids", interrupted_first_reply)
    chats: list[api.Chat] = []
    real_chat = api.LLM.chat
    monkeypatch.setattr(api.LLM, "chat", lambda self, system=None: chats.append(real_chat(self, system)) or chats[-1])
    stdin = ScriptedStdin(["hello\n", "again\n", INTERRUPT, INTERRUPT, "never read\n"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the synthetic model has no chat template (ChatML is used)
        result = CliRunner().invoke(main, ["-m", str(tiny), "--chat", "-n", "6", "-t", "0", "--device", "cpu"],
                                    input=stdin)
    assert result.exit_code == 0, (result.output, result.exception)
    assert "Aborted" not in result.output
    assert "(reply stopped; Ctrl-C again, Ctrl-D or /exit leaves)" in result.stderr
    assert calls["n"] == 2  # the second message was answered
    messages = chats[0].messages
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[2]["content"] == "again"
    assert stdin.script == ["never read\n"]


def test_chat_help_names_the_ways_out() -> None:
    text = CliRunner().invoke(main, ["--help"]).output
    assert "/exit" in text and "Ctrl-C" in text


@pytest.mark.parametrize(("flags", "unit"), [([], "layer"), (["--streaming"], "tensor")])
def test_a_long_load_shows_a_progress_bar(tiny: Path, monkeypatch: pytest.MonkeyPatch, flags: list[str],
                                          unit: str) -> None:
    """The resident CPU engine's layers, or the streamed one's tier A tensors, dequantized before
    the first pass: a bar on stderr once that takes PROGRESS_DELAY_S (Qwen 0.5B: 11 s resident)."""
    monkeypatch.setattr(cli, "PROGRESS_DELAY_S", 0.0)  # "long": from the first step here
    result = CliRunner().invoke(main, ["-m", str(tiny), "-p", "hi", "-n", "2", "-t", "0", "--device", "cpu",
                                       *flags])
    assert result.exit_code == 0, result.output
    assert f"loading {tiny.name}" in result.stderr and f"{unit}/s" in result.stderr, result.stderr
    monkeypatch.setattr(cli, "PROGRESS_DELAY_S", 2.0)  # the default: this load takes far less
    quiet = CliRunner().invoke(main, ["-m", str(tiny), "-p", "hi", "-n", "2", "-t", "0", "--device", "cpu", *flags])
    assert "loading" not in quiet.stderr  # under the delay: no bar at all


def test_a_context_past_the_trained_length_is_a_warning(tiny: Path) -> None:
    result = CliRunner().invoke(main, ["-m", str(tiny), "-p", "hi", "-n", "2", "-t", "0", "--device", "cpu",
                                       "-c", "8192"])
    assert result.exit_code == 0, result.output
    warned = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1, result.stderr
    assert "8192 tokens exceeds the 2048" in warned[0] and "4.00x" in warned[0]
    quiet = CliRunner().invoke(main, ["-m", str(tiny), "-p", "hi", "-n", "2", "-t", "0", "--device", "cpu",
                                      "-c", "2048"])
    assert "warning:" not in quiet.stderr


def test_the_drivers_notices_are_one_line(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29: FewerQueuePairs came out as Python's warning, with the file, line and source line."""
    from infer.tiers import tier_c
    from nvmedirect.reader.nvme_backend import FewerQueuePairs

    real = tier_c.FileSource.__init__

    def init(self, *args, **kwargs):  # noqa: ANN001, ANN202
        warnings.warn(FewerQueuePairs("0000:01:00.0 nsid 1: the controller grants 1 I/O queue pair(s), 2 were "
                                      "asked for: reading with 1"), stacklevel=2)
        real(self, *args, **kwargs)

    monkeypatch.setattr(tier_c.FileSource, "__init__", init)
    result = CliRunner().invoke(main, ["-m", str(tiny), "-p", "hi", "-n", "2", "-t", "0", "--device", "cpu",
                                       "--streaming"])
    assert result.exit_code == 0, result.output
    said = [line for line in result.stderr.splitlines() if "grants 1 I/O queue pair" in line]
    assert said == ["note: 0000:01:00.0 nsid 1: the controller grants 1 I/O queue pair(s), 2 were asked for: "
                    "reading with 1"], result.stderr
    assert ".py:" not in result.stderr


def test_the_streaming_engine_prints_tokens_as_they_come(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29: --streaming printed the text only at exit. Each pass after the first must find
    the text of the tokens before it already on stdout."""
    from infer.scheduler import Scheduler

    seen: list[int] = []
    real = Scheduler._pass

    def spy(self, requests):  # noqa: ANN001, ANN202
        seen.append(len(sys.stdout.getvalue() if hasattr(sys.stdout, "getvalue") else
                        sys.stdout.buffer.getvalue()))  # type: ignore[attr-defined]
        return real(self, requests)

    monkeypatch.setattr(Scheduler, "_pass", spy)
    result = CliRunner().invoke(main, ["-m", str(tiny), "-p", "w1 w2 w3", "-n", "12", "-t", "0", "--device",
                                       "cpu", "--streaming", "--ignore-eos"] if False else
                                ["-m", str(tiny), "-p", "w1 w2 w3", "-n", "12", "-t", "0", "--device", "cpu",
                                 "--streaming"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip()
    decode = seen[1:]  # the first pass is the prompt's
    assert decode and decode[-1] > 0, seen  # text was on stdout before the last pass
    assert decode == sorted(decode) and len(set(decode)) > 1, seen


def test_a_long_gpu_load_shows_a_progress_bar(tiny: Path, monkeypatch: pytest.MonkeyPatch, fake_cupy: object) -> None:
    """The resident GPU engine's uploads, layer by layer (8B Q4_K_M: ~5 s on the H200), on the NumPy
    stand-in for CuPy: the same bar as the CPU's dequantization."""
    import tqdm

    from infer.arch import ModelArgs
    from infer.gguf_file import GGUFModel

    class Eager(tqdm.tqdm):  # every update drawn: the stand-in's load is too fast for tqdm's 0.1 s
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **{**kwargs, "mininterval": 0, "miniters": 1})

    monkeypatch.setattr(tqdm, "tqdm", Eager)
    monkeypatch.setattr(cli, "PROGRESS_DELAY_S", 0.0)
    steps = ModelArgs.from_gguf(GGUFModel(tiny)).n_layers + 1  # the embedding and output, then each layer
    result = CliRunner().invoke(main, ["-m", str(tiny), "-p", "hi", "-n", "2", "-t", "0", "--device", "gpu"])
    assert result.exit_code == 0, result.output
    assert "on the GPU" in result.stderr
    assert f"loading {tiny.name}" in result.stderr and f"{steps}/{steps}" in result.stderr, result.stderr
