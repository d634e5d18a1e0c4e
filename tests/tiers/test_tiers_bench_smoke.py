"""bench/streaming_bench.py end to end on the CPU simulation (tiny model): every section runs,
including the tier C child process, and its results carry the figures the H200 run records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_streaming_bench_runs_on_the_cpu_simulation(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "bench.streaming_bench", "--device", "cpu", "--shape", "tiny",
           "--model", str(tmp_path / "tiny.gguf"), "--out", str(tmp_path), "--vram-budget", "38.8MB",
           "--tierc-vram-budget", "16.7MB", "--tierc-ram-budget", "1MB", "--no-cgroup", "--decode-steps", "2",
           "--batch-steps", "2", "--mmap-seconds", "5", "--deadline", "300",
           "--slots", "4"]  # budgets sized for a 4-slot ring of the tiny model and its activation reserve
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    stream, tierc = results["stream"], results["tierc"]
    assert "error" not in stream and "error" not in tierc, (stream, tierc)
    assert stream["streamed_bytes_per_pass"] > 0 and stream["decode_tok_s"] > 0 and stream["pp512_tok_s"] > 0
    assert stream["bytes_moved_per_pass"]["B"] >= stream["tier_b_bytes"]
    assert tierc["tier_c_bytes_per_pass"] > 0 and tierc["dd_GBps"] > 0 and tierc["mmap_read_GBps"] > 0
    assert tierc["child_exit"] == 0
    # each file run records whether its reads bypassed the page cache and how the cache was dropped
    assert all(isinstance(r["o_direct"], bool) and r["page_cache_drop"] for r in tierc["file_runs"])
    assert tierc["file_o_direct"] == all(r["o_direct"] for r in tierc["file_runs"])
    assert (tmp_path / "plan_stream.txt").read_text().startswith("budgets:")
