"""`nvmedirect bench --file`: rows, the dd comparison, and that the measured reads are the right bytes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from nvmedirect.cli import main
from nvmedirect.cli.bench import parse_size
from nvmedirect.cli.common import EXIT_USAGE
from nvmedirect.reader import FileBackend, aligned_empty
from nvmedirect.reader.bandwidth import measure, measure_dd


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    path = tmp_path_factory.mktemp("bench") / "data.bin"
    data = np.random.default_rng(3).integers(0, 256, 80 << 20, dtype=np.uint8)
    data.tofile(path)
    return path, data


def test_measure_reads_the_requested_bytes(data_file) -> None:
    path, data = data_file
    windows = [aligned_empty(8 << 20), aligned_empty(8 << 20)]
    with FileBackend(path, queue_depth=4, io_size=1 << 20) as backend:
        row = measure(backend, windows, nbytes=40 << 20, io_size=1 << 20, path="kernel", queue_depth=4,
                      start=4 << 20)
    assert row.nbytes == 40 << 20 and row.seconds > 0 and row.cpu_seconds >= 0
    assert row.iops == pytest.approx(row.gb_s * 1e9 / (1 << 20))
    # Five 8 MiB windows from byte 4 MiB: the last one (index 4) went to buffer 0, the one before to 1.
    assert np.array_equal(windows[0], data[(4 + 32) << 20:(4 + 40) << 20])
    assert np.array_equal(windows[1], data[(4 + 24) << 20:(4 + 32) << 20])


def test_bench_file_with_dd_rows(data_file) -> None:
    path, _ = data_file
    result = CliRunner().invoke(main, ["bench", "--file", str(path), "--size", "64M", "--qd", "1,4",
                                       "--io-size", "256K,1M", "--no-gpu", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    rows = report["rows"]
    assert [r["path"] for r in rows] == ["dd", "kernel", "kernel", "kernel", "kernel", "dd"]
    assert {(r["queue_depth"], r["io_size"]) for r in rows if r["path"] == "kernel"} == {
        (1, 256 << 10), (1, 1 << 20), (4, 256 << 10), (4, 1 << 20)}
    assert all(r["nbytes"] == 64 << 20 and r["gb_s"] > 0 for r in rows)
    summary = report["summary"]
    best = max(r["gb_s"] for r in rows if r["path"] == "kernel")
    dd_mean = (rows[0]["gb_s"] + rows[-1]["gb_s"]) / 2
    assert summary["reader_vs_dd"] == pytest.approx(best / dd_mean, rel=1e-3)
    text = CliRunner().invoke(main, ["bench", "--file", str(path), "--size", "16M", "--qd", "2",
                                     "--io-size", "1M", "--no-gpu"], catch_exceptions=False).output
    assert "% of dd" in text


def test_dd_output_is_parsed() -> None:
    def fake_dd(argv, **kw):
        assert "iflag=direct" in argv and f"bs={64 << 20}" in argv and "count=2" in argv
        return subprocess.CompletedProcess(argv, 0, "", "2+0 records in\n2+0 records out\n"
                                           "134217728 bytes (134 MB, 128 MiB) copied, 0.25 s, 537 MB/s\n")

    row = measure_dd("/dev/null", 128 << 20, runner=fake_dd)
    assert row.nbytes == 134217728 and row.seconds == 0.25 and row.gb_s == pytest.approx(0.536870912)


def test_bad_arguments(data_file, tmp_path: Path) -> None:
    path, _ = data_file
    runner = CliRunner()
    assert runner.invoke(main, ["bench"]).exit_code == EXIT_USAGE
    assert runner.invoke(main, ["bench", "--device", str(path)]).exit_code == EXIT_USAGE
    assert runner.invoke(main, ["bench", "--file", str(path), "--qd", "0"]).exit_code == EXIT_USAGE
    assert runner.invoke(main, ["bench", "--file", str(path), "--size", "lots"]).exit_code == EXIT_USAGE
    assert parse_size("256K") == 256 << 10 and parse_size("2G") == 2 << 30 and parse_size("4096") == 4096
