"""bench/plots.py draws every figure of docs/PERFORMANCE.md from the committed raw JSON (issue 29),
and the document shows each one."""

from __future__ import annotations

from pathlib import Path

from bench import plots

REPO = Path(__file__).resolve().parents[2]


def test_every_figure_is_drawn_from_committed_json(tmp_path: Path) -> None:
    for _draw, _columns, _size, sources in plots.FIGURES.values():
        for source in sources:
            assert (plots.RESULTS / source).is_file(), source
    written = plots.draw(tmp_path)
    assert [p.name for p in written] == [f"{name}.png" for name in plots.FIGURES]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000, path


def test_the_performance_doc_shows_the_committed_pictures() -> None:
    doc = (REPO / "docs" / "PERFORMANCE.md").read_text()
    for name in plots.FIGURES:
        assert f"(results/plots/{name}.png)" in doc, name
        assert (plots.RESULTS / "plots" / f"{name}.png").is_file(), name
