"""bench.cpu_decode end to end on SmolLM2 Q8_0 (a few tokens): both engines run in processes of their
own, report load, RSS, prompt and decode speed, and decode the same greedy text from the same ids;
a bad engine name or a missing file is one line from argparse. Speeds here prove nothing (the
benchmark's job); the figures are in docs/PERFORMANCE.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.oracle.assets import smollm2_path

pytest.importorskip("llama_cpp")


def test_both_engines_report_and_agree(tmp_path: Path) -> None:
    from bench.cpu_decode import main

    path = smollm2_path("Q8_0")
    if not path.exists():
        pytest.skip("SmolLM2 Q8_0 missing: run scripts/fetch-models.sh")
    out = tmp_path / "r.json"
    assert main(["--model", str(path), "--pp", "16", "--tg", "6", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    for engine in ("native", "llama.cpp"):
        r = row[engine]
        assert "error" not in r, r
        assert r["tg_tok_s"] > 0 and r["pp_tok_s"] > 0 and r["load_seconds"] > 0
        assert r["peak_rss_bytes"] > path.stat().st_size // 4 and len(r["tokens"]) == 6
    assert row["same_tokens"] >= 3  # the same greedy start from the same ids (near-ties may part later)
    assert row["decode_vs_llama_cpp"] > 0


def test_bad_arguments_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench.cpu_decode import main

    with pytest.raises(SystemExit) as err:
        main(["--model", str(tmp_path / "none.gguf")])
    assert err.value.code == 2 and "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:
        main(["--model", str(tmp_path / "none.gguf"), "--engines", "tvm"])
    assert err.value.code == 2 and "unknown engine 'tvm'" in capsys.readouterr().err
