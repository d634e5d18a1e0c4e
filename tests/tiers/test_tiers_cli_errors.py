"""`ntransformer --streaming` when tier C fails: a device that cannot be opened, a read that fails
while generating. Each is one line and an exit code, never a traceback (issue 29, defects 1 and 9)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from infer.cli import main
from infer.tiers import tier_c
from nvmedirect.reader.base import ReadError

BASE = ["--streaming", "--device", "cpu", "-p", "hello", "-t", "0"]


def one_line_error(result) -> str:  # noqa: ANN001 - click's Result
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("device", ["0000:fe:1f.7", "/dev/nvme97n1"])
def test_an_nvme_device_that_cannot_be_opened_is_one_line_and_exit_4(tiny_model: Path, device: str) -> None:
    result = CliRunner().invoke(main, ["-m", str(tiny_model), *BASE, "-n", "4", "--tier-c", "nvme",
                                       "--nvme-device", device])
    line = one_line_error(result)
    assert result.exit_code == 4, result.output
    assert line.startswith("Error: --tier-c nvme: no such device or image file: ") and device in line, line


def test_a_read_that_fails_while_generating_is_one_line_and_exit_1(tiny_model: Path, monkeypatch) -> None:
    """The tenth tier C read fails as the NVMe reader reports a media error; the reads before it
    (the start-up measurement, the first passes) succeed, so the failure comes mid-generation."""
    reads = {"n": 0}
    real = tier_c.FileSource.read_async
    closed = []

    def failing(self, ranges, buffers):  # noqa: ANN001, ANN202
        reads["n"] += 1
        if reads["n"] >= 10:
            raise ReadError("0000:01:00.0 nsid 1: NVMe read of LBAs 8..15 (bytes 4096..8192) failed: "
                            "ERROR status: 02/81 Unrecovered Read Error (read, cid 3)")
        return real(self, ranges, buffers)

    monkeypatch.setattr(tier_c.FileSource, "read_async", failing)
    monkeypatch.setattr(tier_c.FileSource, "close", lambda self: closed.append(self) or self.backend.close())
    result = CliRunner().invoke(main, ["-m", str(tiny_model), *BASE, "-n", "200"])
    line = one_line_error(result)
    assert result.exit_code == 1, result.output
    assert line == ("Error: tier C read failed: 0000:01:00.0 nsid 1: NVMe read of LBAs 8..15 (bytes 4096..8192) "
                    "failed: ERROR status: 02/81 Unrecovered Read Error (read, cid 3)")
    assert len(closed) == 1  # the source (the device) was released before the line was printed
