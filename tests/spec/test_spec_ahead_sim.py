"""bench.spec_ahead_sim's rounds (pure Python): which rounds find their chain drafted ahead, and what
the rounds cost."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.spec_ahead_sim import main, simulate


def test_a_draft_always_right_has_every_chain_but_the_first_ready() -> None:
    # 2-deep chains over 9 tokens: three rounds of 3 tokens; the 2nd and 3rd find their 2 steps drafted
    got = simulate([[0] * 9], 2, 2, 0, 3, verify_ms=1.0, round_ms=0.0, step_ms=1.0)
    assert got == {"tokens_per_round": 3.0, "ms_per_round": 5 / 3, "ready_share": pytest.approx(2 / 3),
                   "tokens_per_ms": 9 / 5}
    assert simulate([[0] * 9], 2, 2, 0, 2, 1.0, 0.0, 1.0)["ms_per_round"] == pytest.approx(7 / 3)  # 1 step of 2


def test_a_walk_that_ends_at_a_leaf_is_a_branch_only_up_to_the_leaf_rank() -> None:
    # the chain's 2nd token is the draft's runner-up (a leaf), then the draft is right again
    ranks = [[0, 1, 0, 0, 0, 0]]
    with_leaves = simulate(ranks, 3, 2, 1, 4, 1.0, 0.0, 1.0)
    without = simulate(ranks, 3, 2, 0, 4, 1.0, 0.0, 1.0)
    assert with_leaves["tokens_per_round"] == without["tokens_per_round"] == 3.0  # the same walk
    assert with_leaves["ready_share"] == 0.5 and without["ready_share"] == 0.0
    assert with_leaves["ms_per_round"] < without["ms_per_round"]


def test_the_command_reads_a_curve_with_its_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ranks = tmp_path / "curve.json"
    ranks.write_text(json.dumps({"ranks": [[0, 0, 3, 0, 1, 0, 0, 0]]}))
    assert main(["--ranks", str(ranks), "--shapes", "2x2,4x4", "--steps", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["shapes"]) == {"2x2", "4x4"} and out["texts"] == 1
    assert all(r["speedup_drafting_ahead"] >= r["speedup"] for r in out["shapes"].values())
